"""Time the paper model's two convolutions by part: forward, filter gradient, input gradient.

    python scripts/benchmark_conv.py [--device cpu|gpu] [--batch-size 100] [--dtype float32,bfloat16]
                                     [--xla none,jit] [--form strided,cropped,space_to_depth]
                                     [--framework tensorflow|torch] [--repeats 5] [--json PATH]

Why: the convolutions are most of a training step's work (94% of the paper model's FLOPs;
on an H100 3.4 of 5.2 busy ms at batch 512 in bfloat16, docs/benchmarks.md), and which
part of them is slow differs by backend: on a CPU, XLA runs PrimaryCaps' strided input
gradient ~70x slower than TensorFlow's kernel. Each part is one tf.function (jit_compile
for xla=jit) called once untimed (tracing, compilation, autotuning), then `--repeats`
times back to back in each of 5 groups, each group waited for at its end; the median
group's mean counts. Shapes: Conv1 9x9, 1 -> 256, stride 1 on
28x28x1; PrimaryCaps 9x9, 256 -> 256, stride 2 on 20x20x256 (its output 6x6).

`--form` says how PrimaryCaps' strided convolution is computed: `strided` as it is,
`cropped` without the input row and column no window reaches (conv_form="strided" under XLA),
`space_to_depth` as a stride-1 5x5 convolution on 2x2 blocks (capsnet/conv.py,
model.primary_caps_conv); `col2im` the same with its input gradient as a matrix product
and a scatter-add of its patches (col2im_input_grad: none of the padded transposed
convolution's zero multiply-adds; a candidate, not a form the model has).
`--framework torch` times the strided rows in PyTorch instead (its own process: cuDNN in
benchmark mode, channels_last, TF32 for float32 as TensorFlow's default): what the same
GPU's best-known kernels do with the same shapes.
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# (name, input NHWC, filter HWIO, stride)
CONVS = [("conv1", (28, 28, 1), (9, 9, 1, 256), 1), ("primary_caps", (20, 20, 256), (9, 9, 256, 256), 2)]
PARTS = ("forward", "filter_grad", "input_grad")
FORMS = ("strided", "cropped", "space_to_depth", "col2im")


def conv_parts(tf, batch, in_shape, filter_shape, stride, dtype, form="strided"):
    """{part: (function of (x, w, dy), those inputs)} for one convolution in `form`."""
    gen = tf.random.Generator.from_seed(0)
    x = tf.cast(gen.normal((batch, *in_shape)), dtype)
    w = tf.cast(gen.normal(filter_shape) * 0.01, dtype)
    out_hw = (in_shape[0] - filter_shape[0]) // stride + 1
    dy = tf.cast(gen.normal((batch, out_hw, out_hw, filter_shape[3])), dtype)
    strides = [1, stride, stride, 1]
    if form == "cropped":
        used = (out_hw - 1) * stride + filter_shape[0]
        x, in_shape = x[:, :used, :used], (used, used, in_shape[2])
    elif form in ("space_to_depth", "col2im"):
        from capsnet.conv import space_to_depth_conv2d

        def gradient(x, w, dy, wrt):
            with tf.GradientTape() as tape:
                tape.watch([x, w])
                y = space_to_depth_conv2d(x, w, (stride, stride))
            return tape.gradient(y, [x, w][wrt], output_gradients=dy)  # the forward is pruned
        return {
            "forward": (lambda x, w, dy: space_to_depth_conv2d(x, w, (stride, stride)), (x, w, dy)),
            "filter_grad": (lambda x, w, dy: gradient(x, w, dy, 1), (x, w, dy)),
            "input_grad": ((lambda x, w, dy: gradient(x, w, dy, 0)) if form == "space_to_depth" else
                           (lambda x, w, dy: col2im_input_grad(tf, x.shape, w, dy, stride)), (x, w, dy)),
        }
    elif form != "strided":
        raise ValueError(f"unknown form {form!r}; choose from {', '.join(FORMS)}")
    return {
        "forward": (lambda x, w, dy: tf.nn.conv2d(x, w, strides, "VALID"), (x, w, dy)),
        "filter_grad": (lambda x, w, dy: tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=list(filter_shape), out_backprop=dy, strides=strides, padding="VALID"), (x, w, dy)),
        "input_grad": (lambda x, w, dy: tf.raw_ops.Conv2DBackpropInput(
            input_sizes=[batch, *in_shape], filter=w, out_backprop=dy, strides=strides, padding="VALID"), (x, w, dy)),
    }


def col2im_input_grad(tf, x_shape, w, dy, stride):
    """The input gradient of the blocks form (space_to_depth) without its zero padding: one
    matrix product gives every output position's patch of the blocks' gradient
    (B, H', W', kh, kw, C), each patch tap is added into the blocks' gradient at its offset,
    and the blocks go back to the (B, H, W, C) map. The padded transposed convolution does
    (kh + H' - 1)(kw + W' - 1) / (H' W') times the product's multiply-adds (PrimaryCaps:
    100/36); this form moves the patches (kh kw C values a position) through memory instead."""
    from capsnet.conv import block_kernel

    kernel = block_kernel(w, (stride, stride))                  # (kh, kw, s·s·C, O)
    kh, kw = int(kernel.shape[0]), int(kernel.shape[1])
    _, oh, ow, _ = dy.shape
    patches = tf.einsum("byxo,ijco->byxijc", dy, kernel)
    blocks = tf.add_n([tf.pad(patches[:, :, :, i, j, :], [[0, 0], [i, kh - 1 - i], [j, kw - 1 - j], [0, 0]])
                       for i in range(kh) for j in range(kw)])  # (B, oh + kh - 1, ow + kw - 1, s·s·C)
    _, bh, bw, _ = blocks.shape
    c = int(x_shape[3])
    image = tf.reshape(tf.transpose(tf.reshape(blocks, (-1, bh, bw, stride, stride, c)), (0, 1, 3, 2, 4, 5)),
                       (-1, bh * stride, bw * stride, c))       # depth_to_space, capsnet.conv's channel order
    return image[:, :x_shape[1], :x_shape[2], :]


def torch_time(batch, in_shape, filter_shape, stride, dtype, part, repeats):
    """Milliseconds (median of `repeats`, CUDA events) PyTorch takes for `part` of the same
    convolution on the GPU: NCHW tensors in channels_last memory (NHWC, as TensorFlow's),
    cuDNN's benchmark mode picking the algorithm in the untimed first calls."""
    import torch

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    h, w_, c = in_shape
    kh, kw, _, o = filter_shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(batch, c, h, w_, device="cuda", generator=gen).to(dtype).contiguous(memory_format=cl)
    w = (torch.randn(o, c, kh, kw, device="cuda", generator=gen) * 0.01).to(dtype).contiguous(memory_format=cl)
    out = (h - kh) // stride + 1
    dy = torch.randn(batch, o, out, out, device="cuda", generator=gen).to(dtype).contiguous(memory_format=cl)
    masks = {"forward": None, "filter_grad": [False, True, False], "input_grad": [True, False, False]}

    def call():
        if part == "forward":
            return torch.nn.functional.conv2d(x, w, stride=stride)
        return torch.ops.aten.convolution_backward(dy, x, w, None, [stride, stride], [0, 0], [1, 1], False, [0, 0], 1,
                                                   masks[part])
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_call(fn, args, repeats, groups=5):
    """Seconds per call: `groups` runs of `repeats` calls queued back to back, each waited
    for once at its end by reading one value of the last output (reading whole outputs, up
    to 200 MiB here, would time the copy to the host); the median group's mean counts."""
    import tensorflow as tf

    def wait(out):
        tf.reshape(out, [-1])[0].numpy()
    wait(fn(*args))  # tracing, compilation, autotuning
    seconds = []
    for _ in range(groups):
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        wait(out)
        seconds.append((time.perf_counter() - start) / repeats)
    return statistics.median(seconds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="gpu")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--dtype", default="float32", help="comma-separated: float32, bfloat16, float16")
    parser.add_argument("--xla", default="none,jit", help="comma-separated: none, jit")
    parser.add_argument("--form", default="strided",
                        help=f"comma-separated, how PrimaryCaps' strided convolution runs: {', '.join(FORMS)}")
    parser.add_argument("--framework", choices=("tensorflow", "torch"), default="tensorflow",
                        help="torch: PyTorch's kernels for the strided rows (--device gpu; no --xla, --form)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    forms = args.form.split(",")
    if any(f not in FORMS for f in forms):
        parser.error(f"--form: choose from {', '.join(FORMS)}, got {args.form!r}")
    use_torch = args.framework == "torch"
    if use_torch and args.device != "gpu":
        parser.error("--framework torch times PyTorch's GPU kernels: it needs --device gpu")
    xlas, forms = (["torch"], ["strided"]) if use_torch else (args.xla.split(","), forms)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if not use_torch:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # capsnet, from a clone
        import tensorflow as tf

        if args.device == "gpu" and not tf.config.list_logical_devices("GPU"):
            sys.exit("benchmark_conv: --device gpu, but TensorFlow sees no GPU (use --device cpu)")
    rows = []
    for dtype in args.dtype.split(","):
        for name, in_shape, filter_shape, stride in CONVS:
            for form in forms if stride > 1 else ["strided"]:
                if not use_torch:
                    parts = conv_parts(tf, args.batch_size, in_shape, filter_shape, stride, tf.as_dtype(dtype), form)
                for part in PARTS:
                    row = {"conv": name, "form": form, "part": part, "dtype": dtype, "batch": args.batch_size}
                    if use_torch:
                        row["ms_torch"] = torch_time(args.batch_size, in_shape, filter_shape, stride, dtype, part,
                                                     args.repeats)
                    for xla in [] if use_torch else xlas:
                        fn, inputs = parts[part]
                        row[f"ms_{xla}"] = 1e3 * time_call(tf.function(fn, jit_compile=xla == "jit"), inputs,
                                                           args.repeats)
                    rows.append(row)
    timing = (f"median of {args.repeats} calls (CUDA events)" if use_torch
              else f"mean of {args.repeats} queued calls, median of 5 such groups")
    print(f"## Convolutions by part, {args.framework}, {args.device}, batch {args.batch_size}, {timing}\n")
    ratio = xlas == ["none", "jit"]
    columns = [f"ms {'xla=' * (not use_torch)}{x}" for x in xlas] + (["jit / none"] if ratio else [])
    print("| conv | form | part | dtype | " + " | ".join(columns) + " |")
    print("|---|---|---|---|" + "---:|" * len(columns))
    for row in rows:
        cells = [f"{row[f'ms_{x}']:.3f}" for x in xlas]
        if ratio:
            cells.append(f"{row['ms_jit'] / row['ms_none']:.2f}x")
        print(f"| {row['conv']} | {row['form']} | {row['part']} | {row['dtype']} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            if use_torch:
                import torch

                version = torch.__version__
            else:
                version = tf.__version__
            json.dump({"device": args.device, args.framework: version, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
