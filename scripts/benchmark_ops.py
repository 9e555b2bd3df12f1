#!/usr/bin/env python3
"""Benchmark of capsule prediction: the compiled op against the TensorFlow paths.

    python scripts/benchmark_ops.py --device gpu            # paper, batch512, large
    python scripts/benchmark_ops.py --device cpu --shapes paper
    python scripts/benchmark_ops.py --device gpu --shapes paper,batch512 --impls none   # routing step only

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

A second table times the whole routing step, u and W to (v_j, c_ij) with
r = --iterations (3) and stop-gradient routing, as DigitCaps computes it, with the
plain softmax or (--leaky) the authors' leaky one, as the CIFAR-10 preset routes
(--routing-impls; `none` skips it):
    fused            capsnet.ops.capsule_routing + squash (backend fused_op: custom_op=true)
    op+routing       the prediction op, then dynamic_routing as TF ops (custom_op=true)
    op+jit_routing   the prediction op, then dynamic_routing compiled by XLA on its own
                     (backend op_xla: model.routing.backend=xla)
    matmul_xla       the matmul path and dynamic_routing as one XLA computation (what
                     train.xla=jit compiles)
for the passes forward (v_j, c_ij) and forward+backward (plus dL/du and dL/dW for a
random dL/dv_j), with the same unrolled-slope timing, and the speed-ups over op+routing
and matmul_xla. u_hat (B·in_caps·out_caps·out_dim floats) is listed: the unfused paths
write and read it, the fused op never does.
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _import_tensorflow():
    """TensorFlow and the capsnet modules as this module's globals, imported once the
    arguments are parsed: `--help` and argument errors answer without the seconds-long import."""
    global np, tf, ops, CapsnetError, _dynamic_routing_xla, dynamic_routing, squash
    import numpy as np
    import tensorflow as tf

    from capsnet import ops
    from capsnet.errors import CapsnetError
    from capsnet.routing import dynamic_routing, squash
    # What a DynamicRouting router with backend op_xla runs (Router._xla_route).
    _dynamic_routing_xla = tf.function(dynamic_routing, jit_compile=True)


SHAPES = {  # name: (batch, in_caps, out_caps, out_dim, in_dim)
    "paper": (128, 1152, 10, 16, 8),
    "batch16": (16, 1152, 10, 16, 8),  # small batches, where per-call costs weigh most
    "batch512": (512, 1152, 10, 16, 8),
    "large": (128, 4608, 32, 16, 8),
    "cifar10": (128, 1024, 10, 16, 8),  # experiment=paper_cifar10's DigitCaps (VALID padding: 4x4x64)
}
IMPLS = ("op", "matmul", "einsum", "matmul_xla")
PASSES = ("forward", "backward", "forward+backward")
ROUTING_IMPLS = ("fused", "op+routing", "op+jit_routing", "matmul_xla")
ROUTING_PASSES = ("forward", "forward+backward")


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


def make_routing_step(impl, pass_name, iterations, leaky=False):
    """A function (u, W, g) -> tuple of result tensors for one routing step; g is dL/dv_j."""

    def route(u, W):
        if impl == "fused":
            s_j, c_ij = ops.capsule_routing(u, W, iterations, leaky=leaky)
            return squash(s_j), c_ij
        if impl == "op+routing":
            return dynamic_routing(ops.capsule_prediction(u, W), iterations, leaky=leaky)
        if impl == "op+jit_routing":
            return _dynamic_routing_xla(ops.capsule_prediction(u, W), iterations, True, None, leaky)
        return dynamic_routing(ops.capsule_prediction_matmul(u, W), iterations, leaky=leaky)  # matmul_xla

    def step(u, W, g):
        if pass_name == "forward":
            return route(u, W)
        with tf.GradientTape() as tape:
            tape.watch([u, W])
            v_j, c_ij = route(u, W)
        grad_u, grad_W = tape.gradient(v_j, [u, W], output_gradients=g)
        return v_j, c_ij, grad_u, grad_W

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


def parse_list(text, known, what):
    """Comma-separated names from `known`; 'none' (or nothing) is the empty list."""
    names = [x.strip() for x in text.split(",") if x.strip() and x.strip() != "none"]
    for x in names:
        if x not in known:
            raise SystemExit(f"benchmark_ops: unknown {what} {x!r} (known: {', '.join(known)}, none)")
    return names


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
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help=f"comma-separated from {', '.join(IMPLS)}, or none (no prediction table)")
    parser.add_argument("--passes", default=",".join(PASSES), help=f"comma-separated from {', '.join(PASSES)}")
    parser.add_argument("--routing-impls", default=",".join(ROUTING_IMPLS),
                        help=f"routing step: comma-separated from {', '.join(ROUTING_IMPLS)}, or none")
    parser.add_argument("--routing-passes", default=",".join(ROUTING_PASSES),
                        help=f"routing step: comma-separated from {', '.join(ROUTING_PASSES)}")
    parser.add_argument("--iterations", type=int, default=3, help="routing iterations r (default 3, the paper's)")
    parser.add_argument("--leaky", action="store_true",
                        help="routing step with leaky routing (model.routing.leaky=true, the CIFAR-10 preset's)")
    parser.add_argument("--iters", type=int, default=None, help="iterations per timed call (default 40 GPU, 8 CPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "float64"), default="float32")
    parser.add_argument("--tf32", choices=("on", "off"), default="on",
                        help="TensorFloat-32 in the matmul/einsum paths on GPU (TensorFlow's default: on)")
    args = parser.parse_args(argv)
    _import_tensorflow()

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
    impls = parse_list(args.impls, IMPLS, "impl")
    passes = parse_list(args.passes, PASSES, "pass")
    routing_impls = parse_list(args.routing_impls, ROUTING_IMPLS, "routing impl")
    routing_passes = parse_list(args.routing_passes, ROUTING_PASSES, "routing pass")
    iters = args.iters or (40 if args.device == "gpu" else 8)
    if iters < 2:
        raise SystemExit("benchmark_ops: --iters must be at least 2")
    if args.iterations < 1:
        raise SystemExit("benchmark_ops: --iterations must be at least 1")
    dtype = tf.as_dtype(args.dtype)
    device = "/GPU:0" if args.device == "gpu" else "/CPU:0"

    with tf.device(device):
        copy_bps = copy_bandwidth(args.device, dtype, iters, args.repeats)
        rows, routing_rows = [], []
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
            # The routing step: dL/dv_j is (B, out_caps, out_dim).
            gv_buf = tf.cast(tf.random.uniform((B + iters, J, D), -1, 1, seed=4), dtype)
            routing_times = {}
            for impl in routing_impls:
                for pass_name in routing_passes:
                    run = make_unrolled(make_routing_step(impl, pass_name, args.iterations, args.leaky), B)
                    routing_times[impl, pass_name] = per_iteration_us(run, (u_buf, W, gv_buf), iters, args.repeats)
            for pass_name in routing_passes:
                for impl in routing_impls:
                    us = routing_times[impl, pass_name]
                    speedups = [routing_times[base, pass_name] / us if (base, pass_name) in routing_times
                                else float("nan") for base in ("op+routing", "matmul_xla")]
                    routing_rows.append((f"{shape_name} {shape}", impl, pass_name, us, B * I * J * D * dtype.size / 1e6,
                                         *speedups))

    dev_name = args.device.upper()
    if args.device == "gpu":
        details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
        dev_name = details.get("device_name", "GPU")
    print(f"device: {dev_name}; dtype {args.dtype}; TF32 {args.tf32 if args.device == 'gpu' else 'n/a'}; "
          f"TensorFlow {tf.__version__}; {iters} iterations per call, median of {args.repeats}; "
          f"copy bandwidth {copy_bps / 1e9:.0f} GB/s (read + write)\n")
    if rows:
        print("| shape (B, I, J, D, K) | impl | pass | µs | GB/s | % of copy BW | × floor | speed-up vs matmul |")
        print("|---|---|---|---:|---:|---:|---:|---:|")
        for shape_s, impl, pass_name, us, gbs, pct, floor_x, speedup in rows:
            print(f"| {shape_s} | {impl} | {pass_name} | {us:.1f} | {gbs:.0f} | {pct:.0f} | {floor_x:.2f} | "
                  f"{speedup:.2f} |")
    if routing_rows:
        print(f"\nRouting step, r = {args.iterations}, stop-gradient{' leaky' if args.leaky else ''} routing "
              "(u, W → v_j, c_ij):\n")
        print("| shape (B, I, J, D, K) | impl | pass | µs | u_hat MB | speed-up vs op+routing | "
              "speed-up vs matmul_xla |")
        print("|---|---|---|---:|---:|---:|---:|")
        for shape_s, impl, pass_name, us, u_hat_mb, vs_op, vs_xla in routing_rows:
            print(f"| {shape_s} | {impl} | {pass_name} | {us:.1f} | {u_hat_mb:.0f} | {vs_op:.2f} | {vs_xla:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
