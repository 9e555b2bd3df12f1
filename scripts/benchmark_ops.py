#!/usr/bin/env python3
"""Benchmark of capsule prediction: the compiled op against the TensorFlow paths.

    python scripts/benchmark_ops.py --device gpu            # paper, batch512, large
    python scripts/benchmark_ops.py --device cpu --shapes paper

For each shape, implementation (op: capsnet.ops.capsule_prediction; matmul: the
transpose/matmul/reshape path; einsum: tf.einsum; matmul_xla: the matmul path
compiled with XLA) and pass (forward, backward, forward+backward) it runs N
iterations unrolled inside one tf.function (distinct, aliased input slices per
iteration so nothing is merged, pruned or hoisted; see make_unrolled), times the
call including the final device sync, and takes the slope between N and N/4
iterations, which removes the call and sync overhead. TensorFlow enqueues the
kernels asynchronously, so the slope is device time as long as the host keeps
ahead (checked: the op's kernel alone measures the same under ncu). The median of --repeats slopes is reported as µs per
iteration, with effective bandwidth (bytes of the inputs and outputs of the pass
moved once), the share of the copy bandwidth measured in the same run (a large
tf.negative, read + write), the multiple of the bandwidth floor (those bytes at
copy bandwidth) and the speed-up over the matmul path. A markdown table goes to
stdout.
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from capsnet import ops  # noqa: E402
from capsnet.errors import CapsnetError  # noqa: E402

SHAPES = {  # name: (batch, in_caps, out_caps, out_dim, in_dim)
    "paper": (128, 1152, 10, 16, 8),
    "batch512": (512, 1152, 10, 16, 8),
    "large": (128, 4608, 32, 16, 8),
}
IMPLS = ("op", "matmul", "einsum", "matmul_xla")
PASSES = ("forward", "backward", "forward+backward")


def einsum_path(u, W):
    return tf.einsum("bik,ijdk->bijd", u, W)  # (B, in_caps, out_caps, out_dim)


def make_step(impl, pass_name):
    """A function (u, W, g) -> tuple of result tensors for one iteration."""
    fn = {"op": ops.capsule_prediction, "matmul": ops.capsule_prediction_matmul,
          "einsum": einsum_path, "matmul_xla": ops.capsule_prediction_matmul}[impl]

    def step(u, W, g):
        if pass_name == "forward":
            return (fn(u, W),)
        with tf.GradientTape() as tape:
            tape.watch([u, W])
            u_hat = fn(u, W)
        grad_u, grad_W = tape.gradient(u_hat, [u, W], output_gradients=g)
        if pass_name == "backward":
            return grad_u, grad_W  # u_hat unused: the forward op is pruned
        return u_hat, grad_u, grad_W

    if impl == "matmul_xla":
        return tf.function(step, jit_compile=True)
    return step


def make_unrolled(step, batch):
    """tf.function(u_buf, W, g_buf, n) running `step` n times, unrolled.

    Iteration i works on the rows [i, i + batch) of u_buf and g_buf: these
    dim-0 slices alias the buffers (no copy), and distinct inputs keep graph
    optimizations from merging the n identical computations. One element of
    every result is summed so nothing is pruned (a one-element slice per result
    is the only harness work on the device). A tf.while_loop would avoid the
    unrolling but costs ~80 µs of host time per iteration in TensorFlow 2.21,
    more than the op itself at the paper shape.
    """

    @tf.function
    def run(u_buf, W, g_buf, n):
        picks = []
        for i in range(n):
            for x in step(u_buf[i:i + batch], W, g_buf[i:i + batch]):
                picks.append(tf.cast(tf.reshape(x, [-1])[0], tf.float32))
        return tf.add_n(picks)

    return run


def time_call(fn, *args):
    start = time.perf_counter()
    fn(*args).numpy()  # .numpy() waits for the device
    return time.perf_counter() - start


def per_iteration_us(run, args, iters, repeats):
    """Median over repeats of (t(iters) - t(iters/4)) / (3/4 iters), in µs."""
    small = max(1, iters // 4)
    run(*args, small).numpy()  # trace, compile, warm up
    run(*args, iters).numpy()
    slopes = []
    for _ in range(repeats):
        t_small = time_call(run, *args, small)
        t_big = time_call(run, *args, iters)
        slopes.append((t_big - t_small) / (iters - small) * 1e6)
    return statistics.median(slopes)


def copy_bandwidth(device, dtype, iters, repeats):
    """Bytes read + written per second by tf.negative on a large tensor."""
    rows, cols = 1024, (256 if device == "gpu" else 32) * 2**20 // 1024 // dtype.size
    x_buf = tf.cast(tf.random.uniform([rows + iters, cols]), dtype)

    @tf.function
    def run(x_buf, n):
        return tf.add_n([tf.cast(tf.negative(x_buf[i:i + rows])[0, 0], tf.float32) for i in range(n)])

    us = per_iteration_us(run, (x_buf,), iters, repeats)
    return 2 * rows * cols * dtype.size / (us * 1e-6)


def pass_bytes(shape, dtype, pass_name):
    B, I, J, D, K = shape
    small = (B * I * K + I * J * D * K) * dtype.size  # u + W
    big = B * I * J * D * dtype.size  # u_hat or its gradient
    fwd = small + big
    bwd = big + 2 * small  # read g, u, W; write grad_u, grad_W
    return {"forward": fwd, "backward": bwd, "forward+backward": fwd + bwd}[pass_name]


def parse_shapes(text):
    shapes = []
    for item in text.split(","):
        item = item.strip()
        if item in SHAPES:
            shapes.append((item, SHAPES[item]))
        else:
            raise SystemExit(f"benchmark_ops: unknown shape {item!r} (known: {', '.join(SHAPES)})")
    return shapes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="gpu")
    parser.add_argument("--shapes", default=None,
                        help=f"comma-separated from {', '.join(SHAPES)} (default: all on GPU, paper on CPU)")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated from {', '.join(IMPLS)}")
    parser.add_argument("--passes", default=",".join(PASSES), help=f"comma-separated from {', '.join(PASSES)}")
    parser.add_argument("--iters", type=int, default=None, help="iterations per timed call (default 40 GPU, 8 CPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "float64"), default="float32")
    parser.add_argument("--tf32", choices=("on", "off"), default="on",
                        help="TensorFloat-32 in the matmul/einsum paths on GPU (TensorFlow's default: on)")
    args = parser.parse_args(argv)

    if args.device == "gpu" and not tf.config.list_physical_devices("GPU"):
        print("benchmark_ops: error: --device gpu but TensorFlow sees no GPU", file=sys.stderr)
        return 2
    try:
        ops.load_op_library()
    except CapsnetError as err:
        print(f"benchmark_ops: error: {err}", file=sys.stderr)
        return 2
    tf.config.experimental.enable_tensor_float_32_execution(args.tf32 == "on")
    shapes = parse_shapes(args.shapes or ("paper,batch512,large" if args.device == "gpu" else "paper"))
    impls = [x.strip() for x in args.impls.split(",")]
    passes = [x.strip() for x in args.passes.split(",")]
    for name, known in (("impl", IMPLS), ("pass", PASSES)):
        for x in impls if name == "impl" else passes:
            if x not in known:
                raise SystemExit(f"benchmark_ops: unknown {name} {x!r} (known: {', '.join(known)})")
    iters = args.iters or (40 if args.device == "gpu" else 8)
    if iters < 2:
        raise SystemExit("benchmark_ops: --iters must be at least 2")
    dtype = tf.as_dtype(args.dtype)
    device = "/GPU:0" if args.device == "gpu" else "/CPU:0"

    with tf.device(device):
        copy_bps = copy_bandwidth(args.device, dtype, iters, args.repeats)
        rows = []
        for shape_name, shape in shapes:
            B, I, J, D, K = shape
            # iters extra batch rows: iteration i reads rows [i, i + B).
            u_buf = tf.cast(tf.random.uniform((B + iters, I, K), -1, 1, seed=1), dtype)
            W = tf.cast(tf.random.uniform((I, J, D, K), -1, 1, seed=2), dtype)
            g_buf = tf.cast(tf.random.uniform((B + iters, I, J, D), -1, 1, seed=3), dtype)
            times = {}
            for impl in impls:
                for pass_name in passes:
                    run = make_unrolled(make_step(impl, pass_name), B)
                    us = per_iteration_us(run, (u_buf, W, g_buf), iters, args.repeats)
                    times[impl, pass_name] = us
            for pass_name in passes:
                for impl in impls:
                    us = times[impl, pass_name]
                    nbytes = pass_bytes(shape, dtype, pass_name)
                    gbs = nbytes / (us * 1e-6) / 1e9
                    floor_us = nbytes / copy_bps * 1e6
                    base = times.get(("matmul", pass_name))
                    rows.append((f"{shape_name} {shape}", impl, pass_name, us, gbs, 100 * gbs * 1e9 / copy_bps,
                                 us / floor_us, base / us if base else float("nan")))

    dev_name = args.device.upper()
    if args.device == "gpu":
        details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
        dev_name = details.get("device_name", "GPU")
    print(f"device: {dev_name}; dtype {args.dtype}; TF32 {args.tf32 if args.device == 'gpu' else 'n/a'}; "
          f"TensorFlow {tf.__version__}; {iters} iterations per call, median of {args.repeats}; "
          f"copy bandwidth {copy_bps / 1e9:.0f} GB/s (read + write)\n")
    print("| shape (B, I, J, D, K) | impl | pass | µs | GB/s | % of copy BW | × floor | speed-up vs matmul |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for shape_s, impl, pass_name, us, gbs, pct, floor_x, speedup in rows:
        print(f"| {shape_s} | {impl} | {pass_name} | {us:.1f} | {gbs:.0f} | {pct:.0f} | {floor_x:.2f} | "
              f"{speedup:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
