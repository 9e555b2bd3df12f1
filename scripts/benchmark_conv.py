"""Time the paper model's two convolutions by part: forward, filter gradient, input gradient.

    python scripts/benchmark_conv.py [--device cpu|gpu] [--batch-size 100] [--dtype float32,bfloat16]
                                     [--xla none,jit] [--repeats 5] [--json PATH]

Why: the convolutions are most of a training step's work (94% of the paper model's FLOPs;
on an H100 3.4 of 5.2 busy ms at batch 512 in bfloat16, docs/benchmarks.md), and which
part of them is slow differs by backend: on a CPU, XLA runs PrimaryCaps' strided input
gradient ~70x slower than TensorFlow's kernel. Each part is one tf.function (jit_compile
for xla=jit) called once untimed (tracing, compilation, autotuning), then `--repeats`
times, each call waited for; the median counts. Shapes: Conv1 9x9, 1 -> 256, stride 1 on
28x28x1; PrimaryCaps 9x9, 256 -> 256, stride 2 on 20x20x256 (its output 6x6, uncropped).
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


def conv_parts(tf, batch, in_shape, filter_shape, stride, dtype):
    """{part: (function of no arguments, its inputs bound)} for one convolution."""
    gen = tf.random.Generator.from_seed(0)
    x = tf.cast(gen.normal((batch, *in_shape)), dtype)
    w = tf.cast(gen.normal(filter_shape) * 0.01, dtype)
    out_hw = (in_shape[0] - filter_shape[0]) // stride + 1
    dy = tf.cast(gen.normal((batch, out_hw, out_hw, filter_shape[3])), dtype)
    strides = [1, stride, stride, 1]
    return {
        "forward": (lambda x, w, dy: tf.nn.conv2d(x, w, strides, "VALID"), (x, w, dy)),
        "filter_grad": (lambda x, w, dy: tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=list(filter_shape), out_backprop=dy, strides=strides, padding="VALID"), (x, w, dy)),
        "input_grad": (lambda x, w, dy: tf.raw_ops.Conv2DBackpropInput(
            input_sizes=[batch, *in_shape], filter=w, out_backprop=dy, strides=strides, padding="VALID"), (x, w, dy)),
    }


def time_call(fn, args, repeats):
    fn(*args).numpy()  # tracing, compilation, autotuning
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).numpy()  # .numpy() waits for the result
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="gpu")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--dtype", default="float32", help="comma-separated: float32, bfloat16, float16")
    parser.add_argument("--xla", default="none,jit", help="comma-separated: none, jit")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import tensorflow as tf

    if args.device == "gpu" and not tf.config.list_logical_devices("GPU"):
        sys.exit("benchmark_conv: --device gpu, but TensorFlow sees no GPU (use --device cpu)")
    rows = []
    for dtype in args.dtype.split(","):
        for name, in_shape, filter_shape, stride in CONVS:
            parts = conv_parts(tf, args.batch_size, in_shape, filter_shape, stride, tf.as_dtype(dtype))
            for part in PARTS:
                fn, inputs = parts[part]
                timed = {xla: time_call(tf.function(fn, jit_compile=xla == "jit"), inputs, args.repeats)
                         for xla in args.xla.split(",")}
                rows.append({"conv": name, "part": part, "dtype": dtype, "batch": args.batch_size,
                             **{f"ms_{xla}": 1e3 * s for xla, s in timed.items()}})
    xlas = args.xla.split(",")
    print(f"## Convolutions by part, {args.device}, batch {args.batch_size}, median of {args.repeats}\n")
    ratio = xlas == ["none", "jit"]
    print("| conv | part | dtype | " + " | ".join(f"ms xla={x}" for x in xlas) + (" | jit / none |" if ratio else " |"))
    print("|---|---|---|" + "---:|" * (len(xlas) + ratio))
    for row in rows:
        cells = [f"{row[f'ms_{x}']:.3f}" for x in xlas]
        if ratio:
            cells.append(f"{row['ms_jit'] / row['ms_none']:.2f}x")
        print(f"| {row['conv']} | {row['part']} | {row['dtype']} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "tensorflow": tf.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
