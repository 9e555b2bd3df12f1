"""Where a training step's GPU time goes: per-kernel times of benchmark_train's steps.

    .venv/bin/python scripts/profile_train.py --variant op+fused --precision mixed_bfloat16 --batch-size 512
    .venv/bin/python scripts/profile_train.py --variant matmul+jit --json profile.json
    .venv/bin/python scripts/profile_train.py --variant op+fused+jit --replicas 2   # MirroredStrategy

Builds the step exactly as scripts/benchmark_train.py times it (its variants, the same
synthetic batch, train()'s loop of --steps-per-execution steps per call), warms up, then
records `--steps` steps with TensorFlow's profiler (CUPTI) and reads the trace itself
(the XPlane protobuf the profiler writes; no TensorBoard plugin needed): every GPU
kernel's time summed by name and by kind (convolution, our op, matmul, XLA fusion,
other elementwise/reductions, copies), per step, and the share of the wall time the GPU
was busy (1 − busy = the time it waited), and what each GPU waited for: its idle gaps
between kernels, each charged to the kernel or copy that ended it (a gap is the GPU
waiting for the host to launch or copy something; NCCL's wait for the other GPU is
inside its kernel, busy time). Prints a markdown table; `--json` also writes it; with
`--trace-dir` the trace stays for TensorBoard's profile tab. GPU only.

--replicas N profiles the distributed step of scripts/benchmark_scale.py instead
(MirroredStrategy over the first N GPUs, --batch-size per GPU, NCCL's kernels their own
kind): kernel times are per step and per GPU (summed over the GPUs ÷ N), and each GPU's
busy time is listed, so the rows compare with a one-GPU profile's.
"""
import argparse
import collections
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import benchmark_train as bt  # noqa: E402  (variants, config, data: the benchmark's own)

# (kind, substrings of a kernel's name), the first match wins; everything else is "other".
KINDS = (
    ("copy", ("memcpy", "memset", "Memcpy", "Memset")),
    ("all-reduce (NCCL)", ("nccl",)),
    ("capsnet op", ("capsnet", "Capsule", "capsule", "routing_", "prediction_")),
    ("convolution", ("conv", "Conv", "xmma", "cudnn", "implicit", "wgrad", "dgrad", "fprop", "sm90_xmma",
                     "nhwc", "nchw")),
    ("matmul", ("gemm", "Gemm", "GEMM", "cutlass", "ampere_", "sm80_", "sm90_")),
    ("XLA fusion", ("fusion", "loop_", "input_", "reduce_", "wrapped_")),
    ("reduction", ("Reduce", "reduce", "Reduction")),
    ("elementwise (Eigen)", ("Eigen", "eigen")),
)


DERIVED_LINES = ("Ops", "Modules", "Steps", "Source", "Launch", "Framework")


def kind_of(name):
    for kind, needles in KINDS:
        if any(n in name for n in needles):
            return kind
    return "other"


def gpu_kernel_times(trace_dir):
    """{kernel name: [total ps, count]} over the trace's GPU planes (one per device; its
    lines are CUDA streams), {device: busy ps}: the union of its kernels' intervals, and
    {device: {kernel name: [idle ps, count]}}: idle_gaps of its kernels (devices that ran
    kernels only)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    # The profiler writes <dir>/plugins/profile/<timestamp>/*.xplane.pb: the newest trace is
    # this run's (a kept --trace-dir may hold earlier ones).
    files = sorted(Path(trace_dir, "plugins", "profile").glob("*/*.xplane.pb"))
    if not files:
        raise SystemExit(f"error: the profiler wrote no .xplane.pb under {trace_dir}")
    space = xplane_pb2.XSpace()
    space.ParseFromString(files[-1].read_bytes())
    totals = collections.defaultdict(lambda: [0, 0])
    busy, waits = {}, {}
    for plane in space.planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        names = {key: m.name for key, m in plane.event_metadata.items()}
        intervals = []
        for line in plane.lines:
            # A processed trace adds derived lines ("XLA Ops", "TensorFlow Ops", "Steps", ...)
            # that repeat the kernels' time; the raw lines are the CUDA streams.
            if any(word in line.name for word in DERIVED_LINES):
                continue
            base = line.timestamp_ns * 1000
            for event in line.events:
                start = base + event.offset_ps
                end = start + event.duration_ps
                name = names.get(event.metadata_id, "?")
                totals[name][0] += event.duration_ps
                totals[name][1] += 1
                intervals.append((start, end, name))
        if intervals:  # a GPU no replica ran on is not idle time of the step
            gpu = plane.name.removeprefix("/device:")
            busy[gpu] = union_length([(start, end) for start, end, _ in intervals])
            waits[gpu] = idle_gaps(intervals)
    return dict(totals), busy, waits


def union_length(intervals):
    """The length of the union of (start, end) intervals: a GPU's busy time, however
    many of its streams ran kernels at once."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def idle_gaps(kernels):
    """{name: [idle ps, count]}: each gap in which no kernel of (start, end, name) ran,
    between the first kernel's start and the last one's end, charged to the kernel that
    started when the gap ended (what the GPU was waiting to run)."""
    gaps = collections.defaultdict(lambda: [0, 0])
    reach = None
    for start, end, name in sorted(kernels):
        if reach is not None and start > reach:
            gaps[name][0] += start - reach
            gaps[name][1] += 1
        reach = end if reach is None else max(reach, end)
    return dict(gaps)


def profile(args, cfg):
    from capsnet import cli

    cli.import_tensorflow_quietly()
    import keras
    import tensorflow as tf

    from capsnet.losses import loss_params
    from capsnet.training.model_setup import build_capsnet
    from capsnet.training.optimizer import build_optimizer
    from capsnet.precision import set_tensor_float_32
    from capsnet.training.steps import make_train_loop, make_train_step
    from capsnet.training.xla_flags import set_autoclustering

    custom_op, xla = bt.VARIANTS[args.variant]
    set_autoclustering(xla == "autocluster")
    set_tensor_float_32(cfg["train"]["tf32"])  # train.tf32 (default on), as train.py sets it
    gpus = len(tf.config.list_physical_devices("GPU"))
    if gpus < args.replicas:
        raise SystemExit(f"error: {args.replicas} GPU(s) needed, TensorFlow sees {gpus} (profile_train.py profiles "
                         "the GPU's kernels)")
    batch, per_call = args.batch_size, args.steps_per_execution
    if args.replicas > 1:
        import benchmark_scale

        for key, value in benchmark_scale.NVLS_OFF.items():  # before NCCL starts (its first all-reduce)
            os.environ.setdefault(key, value)
        spec = {"variant": args.variant, "custom_op": custom_op, "xla": xla, "precision": args.precision,
                "input": args.input, **cfg}
        run, _, _ = benchmark_scale.mirrored_runner(spec, batch, [f"/gpu:{i}" for i in range(args.replicas)],
                                                 args.all_reduce, per_call)
    else:
        model_cfg = bt.variant_model_cfg(args.variant, cfg["model"])
        train_cfg = {**cfg["train"], "precision": args.precision}
        keras.utils.set_random_seed(cfg["seed"])
        with tf.device("/GPU:0"):
            model = build_capsnet(model_cfg, custom_op, args.precision)
            optimizer, _ = build_optimizer(train_cfg, math.ceil(bt.MNIST_TRAIN_EXAMPLES / batch), model)
            step = make_train_step(model, optimizer, input_shape=tuple(model_cfg["input_shape"]),
                                   losses=loss_params(train_cfg), xla=xla)
            input_shape, num_classes = tuple(model_cfg["input_shape"]), int(model_cfg["num_classes"])
            if args.input == "on_device":  # train.data_on_device=true's loop: a call's steps one XLA program
                train_steps, iterator = bt.device_train_loop(cfg, step, batch, input_shape, num_classes, per_call,
                                                             "/GPU:0")
            else:
                train_steps = make_train_loop(step)
                iterator = bt.step_input({"input": args.input}, bt.synthetic_batches({"seed": cfg["seed"]}, batch,
                                                                                     input_shape, num_classes),
                                         device="/GPU:0")
            run = bt.runner(train_steps, iterator, batch, per_call)
    steps = max(1, args.steps // per_call) * per_call
    run(args.warmup * per_call)  # reading its loss waits for the warm-up's steps
    trace_place = contextlib.nullcontext(str(args.trace_dir)) if args.trace_dir else tempfile.TemporaryDirectory()
    with trace_place as trace_dir:
        tf.profiler.experimental.start(trace_dir)
        start = time.perf_counter()
        run(steps)
        wall = time.perf_counter() - start
        tf.profiler.experimental.stop()
        totals, busy_ps, waits_ps = gpu_kernel_times(trace_dir)
    per_gpu_step = 1e9 * steps * args.replicas  # ps over every GPU → ms a step and a GPU
    kernels = sorted(({"kernel": name, "kind": kind_of(name), "ms_per_step": ps / per_gpu_step,
                       "launches_per_step": count * 1e9 / per_gpu_step} for name, (ps, count) in totals.items()),
                     key=lambda k: -k["ms_per_step"])
    by_kind = collections.defaultdict(float)
    for k in kernels:
        by_kind[k["kind"]] += k["ms_per_step"]
    busy_by_gpu = {gpu: ps / 1e9 / steps for gpu, ps in sorted(busy_ps.items())}
    # Per GPU, the kernels it waited longest to start (ms a step, gaps a step).
    waited_for = {gpu: [{"kernel": name, "kind": kind_of(name), "idle_ms_per_step": ps / 1e9 / steps,
                         "gaps_per_step": count / steps}
                        for name, (ps, count) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:5]]
                  for gpu, gaps in sorted(waits_ps.items())}
    idle_by_gpu = {gpu: sum(ps for ps, _ in gaps.values()) / 1e9 / steps for gpu, gaps in sorted(waits_ps.items())}
    return {
        "variant": args.variant, "label": bt.label(args.variant), "precision": args.precision, "batch_size": batch,
        "replicas": args.replicas, "steps_per_execution": per_call, "steps": steps, "input": args.input,
        "wall_ms_per_step": 1000 * wall / steps, "images_per_sec_while_profiled": steps * batch * args.replicas / wall,
        "gpu_busy_ms_per_step": statistics.mean(busy_by_gpu.values()) if busy_by_gpu else 0.0,
        "gpu_busy_ms_per_step_by_gpu": busy_by_gpu,
        "gpu_idle_between_kernels_ms_per_step_by_gpu": idle_by_gpu, "waited_for": waited_for,
        "kernel_ms_per_step": sum(k["ms_per_step"] for k in kernels),
        "launches_per_step": sum(k["launches_per_step"] for k in kernels),
        "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])), "kernels": kernels[:args.top],
    }


def format_report(report):
    replicas = report["replicas"]
    where = f" per GPU · mirrored ×{replicas}" if replicas > 1 else ""
    busy = ", ".join(f"{gpu} {ms:.2f}" for gpu, ms in report["gpu_busy_ms_per_step_by_gpu"].items())
    source = {"device": " · input: one batch on the device (--input device)",
              "on_device": " · input: the training set on the device, a call's steps one XLA program "
                           "(--input on_device)"}.get(report["input"], "")
    lines = [f"### {report['label']} · {report['precision']} · batch {report['batch_size']}{where}{source}",
             "",
             f"wall {report['wall_ms_per_step']:.2f} ms/step (profiler on: "
             f"{report['images_per_sec_while_profiled']:,.0f} images/s), GPU busy "
             f"{report['gpu_busy_ms_per_step']:.2f} ms/step "
             f"({report['gpu_busy_ms_per_step'] / report['wall_ms_per_step']:.0%}"
             f"{f'; {busy}' if replicas > 1 else ''}), "
             f"{report['launches_per_step']:.0f} kernel launches/step{' a GPU' if replicas > 1 else ''}",
             "",
             f"| kind | ms/step{' a GPU' if replicas > 1 else ''} | share of kernel time |", "|---|---:|---:|"]
    total = report["kernel_ms_per_step"] or 1.0
    for kind, ms in report["by_kind"].items():
        lines.append(f"| {kind} | {ms:.3f} | {ms / total:.0%} |")
    lines += ["", "| kernel | kind | ms/step | launches/step |", "|---|---|---:|---:|"]
    for k in report["kernels"]:
        name = k["kernel"] if len(k["kernel"]) <= 90 else k["kernel"][:87] + "..."
        lines.append(f"| `{name}` | {k['kind']} | {k['ms_per_step']:.3f} | {k['launches_per_step']:.1f} |")
    lines += ["", "| GPU | idle between kernels, ms/step | waited longest before (idle ms/step, gaps/step) |",
              "|---|---:|---|"]
    for gpu, idle in report["gpu_idle_between_kernels_ms_per_step_by_gpu"].items():
        waited = "; ".join(f"`{w['kernel'][:60]}` ({w['kind']}) {w['idle_ms_per_step']:.3f}, {w['gaps_per_step']:.1f}"
                           for w in report["waited_for"][gpu])
        lines.append(f"| {gpu} | {idle:.3f} | {waited} |")
    return "\n".join(lines)


def main(argv=None):
    from capsnet.config import ALL_REDUCE

    parser = argparse.ArgumentParser(description="Per-kernel GPU time of one benchmark_train variant's steps.")
    parser.add_argument("--variant", choices=list(bt.VARIANTS), default="op+fused")
    parser.add_argument("--precision", type=bt._precisions, default=["float32"],
                        help="one train.precision (default float32)")
    parser.add_argument("--batch-size", type=bt._positive_int, default=512, help="per GPU (default 512)")
    parser.add_argument("--replicas", type=bt._positive_int, default=1,
                        help="GPUs: > 1 profiles benchmark_scale.py's MirroredStrategy step (NCCL all-reduce)")
    parser.add_argument("--all-reduce", choices=ALL_REDUCE["mirrored"], default=None,
                        help="distribute.all_reduce, with --replicas > 1 (default auto)")
    parser.add_argument("--steps-per-execution", type=bt._positive_int, default=50)
    parser.add_argument("--steps", type=bt._positive_int, default=100, help="profiled steps (default 100)")
    parser.add_argument("--warmup", type=bt._positive_int, default=3, help="untimed calls first (default 3)")
    parser.add_argument("--top", type=bt._positive_int, default=15, help="kernels listed (default 15)")
    parser.add_argument("--input", choices=bt.TRAIN_INPUTS, default="pipeline",
                        help="as benchmark_train.py's: pipeline (default, as train()), device (no copy a step) or "
                             "on_device (train.data_on_device=true's loop; one GPU, the +jit variants)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    parser.add_argument("--trace-dir", type=Path, default=None, metavar="DIR",
                        help="keep the profiler's trace here (TensorBoard's profile tab reads it; default: a temporary "
                             "directory, removed)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="Hydra overrides of configs/train.yaml")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if len(args.precision) != 1:
        parser.error("--precision: one value")
    args.precision = args.precision[0]
    if args.all_reduce is not None and args.replicas == 1:
        parser.error("--all-reduce: with --replicas > 1 only (one device has no all-reduce)")
    args.all_reduce = args.all_reduce or "auto"
    if args.input == "on_device" and (args.replicas > 1 or bt.VARIANTS[args.variant][1] != "jit"):
        parser.error("--input on_device (train.data_on_device=true) profiles one GPU and a +jit variant")
    bt.reject_reserved_overrides(parser, args.overrides, bt.RESERVED_KEYS, "the arguments")
    cfg = bt.compose_config(args.overrides)
    bt.augmentation_set(cfg["data"], args.input)  # none applies here: a set option fails
    report = profile(args, cfg)
    print(format_report(report))
    if args.json is not None:
        bt.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
