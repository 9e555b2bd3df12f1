"""Multi-GPU scaling of CapsNet training: images/s on one GPU and on N GPUs (MirroredStrategy).

    .venv/bin/python scripts/benchmark_scale.py                            # GPU: 1 and all GPUs, op and matmul
    .venv/bin/python scripts/benchmark_scale.py --replicas 2 --batch-sizes 512 --all-reduce auto,one_device
    .venv/bin/python scripts/benchmark_scale.py --device cpu --replicas 1,2 --batch-sizes 8 --steps 3 --repeats 1

What it measures: training images/s of the model in configs/ (Hydra overrides
as in benchmark_train.py), per capsule-prediction path (--variants, benchmark_train's
names: op = custom_op=true, matmul = custom_op=false, ...), for

    1 device     the one-device step (distribute=none), timed by benchmark_train.time_training
                 itself: the baseline of the scaling column
    mirrored ×N  tf.distribute.MirroredStrategy over the first N devices with the step
                 train() runs under distribute=mirrored (make_train_step(strategy=...)),
                 for each N of --replicas and each gradient all-reduce of --all-reduce

--batch-sizes are PER-GPU batches b: mirrored ×N trains on global batches of N·b (b on
each replica), the way one adds GPUs to go faster at the same per-GPU work ("weak
scaling"; train.batch_size in a config is the global batch, so this is
`train.batch_size=N·b`). scaling = images/s of mirrored ×N ÷ images/s of 1 device at
the same b; ideal = N. mirrored ×1 shows what the strategy itself costs.

How (as benchmark_train, from which the timing protocol and helpers come):
- One subprocess per variant, all its configurations in it, one after the other: XLA
  flags are process-wide, and the logical CPU devices of --device cpu must be set up
  before TensorFlow starts. Its environment switches NVLink multicast off
  (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1)
  unless already set.
- The data and the timing are benchmark_train's (synthetic_batches, time_steps): one
  synthetic batch of b, repeated by tf.data; under mirrored ×N the global batch is that
  batch N times over, split over the replicas as train() splits its batches
  (input_iterator), so every replica trains on the 1-device row's batch from its
  weights: the same gradients, so the same losses step by step (up to the order of
  the sums); the steps run in train()'s loop,
  `--steps-per-execution` steps per compiled call (each value of the list measured;
  `--input device`: each replica's slice on its device once, no input pipeline a step;
  `--input on_device`: train.data_on_device=true's loop over benchmark_train's synthetic
  training set, each replica gathering its slice of every global batch, so a mirrored
  row trains on other examples than its 1-device row and its losses follow that row's
  only roughly; scaling compares the same value). `--warmup` untimed steps, at least 1 + `--steps`
  (tracing, compiling, autotuning, NCCL setup; benchmark_train's time_steps), then
  `--repeats` × `--steps` steps with one device sync per repeat; the median counts.

Prints a markdown table (stdout; progress on stderr) and with `--json PATH` writes JSON.
Every mirrored configuration first checks that its all-reduce sums (train()'s
check_all_reduce), and every row shows its loss at the first and last step: the same
batch each step, and a mirrored row follows its 1-device row's losses, so one whose
loss barely fell where its 1-device row's fell did not train, and is flagged (`trains`).

Exit status 0; 2 if something could not run for a reason the user can fix (op library,
too few GPUs: printed); 1 if a configuration crashed (an all-reduce that does not run,
or does not sum: its error is in the table's notes and the JSON, the other rows are
still measured) or a row did not train.
"""
import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmark_train beside this file
import benchmark_train as bt  # noqa: E402  (also puts the repository on sys.path)


# What custom_op=true (the fused routing op, its default) and custom_op=false train with.
DEFAULT_VARIANTS = ["op+fused", "matmul"]
# NVLink multicast off: on hosts whose GPUs are shared between virtual machines a program
# using it can take the GPUs out of service. Set unless the caller set them.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Set by the benchmark per configuration, so an override would be silently ignored.
RESERVED_KEYS = (*bt.RESERVED_KEYS, "distribute")


# --------------------------------------------------------------------------- arguments

def _all_reduce(text):
    from capsnet.config import ALL_REDUCE

    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in ALL_REDUCE["mirrored"]]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown all-reduce {', '.join(unknown) or repr(text)}; choose from "
                                         f"{', '.join(ALL_REDUCE['mirrored'])}")
    return list(dict.fromkeys(names))


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Training images/s of CapsNet on one device and on N devices (MirroredStrategy), per "
                    "capsule-prediction path; one synthetic batch, repeated.",
        epilog="Overrides are Hydra overrides of configs/train.yaml (model.*, train.* loss and LR values, seed).")
    parser.add_argument("--replicas", type=bt._positive_ints, default=None,
                        help="comma-separated replica counts for mirrored (default: 1 and every visible GPU)")
    parser.add_argument("--batch-sizes", type=bt._positive_ints, default=[128, 512],
                        help="comma-separated PER-GPU batch sizes; mirrored ×N trains on N× that (default 128,512)")
    parser.add_argument("--all-reduce", type=_all_reduce, default=["auto"],
                        help="comma-separated distribute.all_reduce values for mirrored: auto (xla where it "
                             "applies, else collective), xla (in each replica's compiled step: jit variants on GPUs, "
                             "no mixed_float16), collective (TensorFlow's, NCCL across GPUs), nccl, one_device "
                             "(default auto)")
    bt.add_run_arguments(parser, default_variants=DEFAULT_VARIANTS, inputs=bt.TRAIN_INPUTS)
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                        help="gpu (default) or cpu: GPUs hidden, the CPU split into logical devices (smoke runs)")
    args = parser.parse_args(argv)
    if args.input == "on_device" and any(bt.VARIANTS[variant][1] != "jit" for variant in args.variants):
        parser.error("--input on_device (train.data_on_device=true) needs train.xla=jit: pick the +jit variants")
    if len(args.precision) != 1:
        parser.error("--precision: one value here (the scaling compares configurations of one precision)")
    bt.reject_reserved_overrides(parser, args.overrides, RESERVED_KEYS,
                                 "the benchmark (--variants, --batch-sizes, --replicas, --all-reduce)")
    return args


# --------------------------------------------------------------------------- worker (one variant)

def _devices(kind, count):
    """The first `count` devices of `kind` as MirroredStrategy names; on the CPU, logical
    devices (set up before TensorFlow starts: _setup_cpu_devices)."""
    return [f"/{kind}:{i}" for i in range(count)]


def _setup_cpu_devices(count):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)


def mirrored_runner(spec, batch_size, devices, all_reduce, per_call=1):
    """(run, strategy, all-reduce): benchmark_train.runner's run(steps) of the distributed
    training steps over `devices` (MirroredStrategy with distribute.all_reduce=`all_reduce`,
    resolved as train() resolves auto: the third value), `batch_size` per replica,
    `per_call` steps per compiled call, its all-reduce checked first. Also what
    scripts/profile_train.py --replicas profiles."""
    import keras

    from capsnet.losses import loss_params
    from capsnet import config
    from capsnet.training.distribute import check_all_reduce, make_strategy, resolve_all_reduce
    from capsnet.training.model_setup import build_capsnet
    from capsnet.training.optimizer import build_optimizer
    from capsnet.training.steps import make_train_loop, make_train_step

    model_cfg = bt.variant_model_cfg(spec["variant"], spec["model"])
    train_cfg = {**spec["train"], "precision": spec["precision"]}
    input_shape = tuple(model_cfg["input_shape"])
    strategy = make_strategy(config.check_section(config.DistributeConfig, {
        "strategy": "mirrored", "devices": devices, "all_reduce": all_reduce}, "distribute."))
    all_reduce = resolve_all_reduce(all_reduce, "mirrored", spec["xla"], spec["precision"],
                                    strategy.extended.worker_devices, train_cfg["weight_decay"])
    replicas = strategy.num_replicas_in_sync
    global_batch = batch_size * replicas
    keras.utils.set_random_seed(spec["seed"])  # the weights of time_training
    with strategy.scope():
        model = build_capsnet(model_cfg, spec["custom_op"], spec["precision"])
        # The LR schedule of the 1-device row (epochs of its batch): every replica trains on its
        # batch, so the rows' losses compare step by step (epochs of the global batch would
        # decay the rate N times as fast).
        optimizer, _ = build_optimizer(train_cfg, math.ceil(bt.MNIST_TRAIN_EXAMPLES / batch_size), model)
    # As train() does: timing an all-reduce that does not sum would time no training.
    check_all_reduce(strategy, [variable.shape for variable in model.trainable_variables],
                     compiled=all_reduce == "xla")
    # Each replica gets time_training's batch (the global batch: it, `replicas` times over),
    # split over the replicas as train() splits it: the 1-device row's task and losses.
    num_classes = int(model_cfg["num_classes"])
    on_device = spec["input"] == "on_device"  # train.data_on_device=true: the replicas gather their slices of the global batch
    training_set = (bt.synthetic_training_set(spec, global_batch, input_shape, num_classes, strategy=strategy)
                    if on_device else None)
    step = make_train_step(model, optimizer, input_shape=input_shape, losses=loss_params(train_cfg),
                           xla=spec["xla"], strategy=strategy, all_reduce=all_reduce,
                           examples=training_set and training_set.examples)
    if on_device:
        train_steps, iterator = bt.device_train_loop(spec, step, global_batch, input_shape, num_classes, per_call,
                                                     None, training_set=training_set)
        return bt.runner(train_steps, iterator, global_batch, per_call), strategy, all_reduce
    batches = bt.synthetic_batches(spec, batch_size, input_shape, num_classes, copies=replicas)
    iterator = bt.step_input(spec, batches, strategy=strategy)
    return bt.runner(make_train_loop(step, strategy=strategy), iterator, global_batch, per_call), strategy, all_reduce


def time_mirrored_training(spec, batch_size, devices, all_reduce, per_call=1):
    """images/s and ms/step of the distributed training steps over `devices`, `batch_size`
    per replica, `per_call` steps per compiled call."""
    run, strategy, resolved = mirrored_runner(spec, batch_size, devices, all_reduce, per_call)
    replicas = strategy.num_replicas_in_sync
    global_batch = batch_size * replicas
    [(first_loss, last_loss, seconds)], _ = bt.time_steps([run], spec)
    median = statistics.median(seconds)
    return {
        "replicas": replicas,
        "devices": list(strategy.extended.worker_devices),
        "all_reduce": all_reduce if resolved == all_reduce else f"{all_reduce} ({resolved})",
        "batch_size": batch_size,
        "global_batch_size": global_batch,
        "steps_per_execution": per_call,
        "images_per_sec": spec["steps"] * global_batch / median,
        "ms_per_step": 1000.0 * median / spec["steps"],
        "repeat_seconds": seconds,
        "first_loss": first_loss,
        "last_loss": last_loss,
    }


def worker(spec):
    """Every configuration of one variant. After each, the result so far goes to stdout as
    one JSON line (the last is complete): a variant stopped by --timeout keeps its rows."""
    from capsnet import cli

    cli.import_tensorflow_quietly()
    import tensorflow as tf

    from capsnet.errors import AllReduceError, CapsnetError, ConfigError
    from capsnet.training.model_setup import check_op_library
    from capsnet import config
    from capsnet.precision import set_tensor_float_32
    from capsnet.training.xla_flags import set_autoclustering

    result = {"variant": spec["variant"], "results": [], "error": None, "failures": [],
              "tensorflow": tf.__version__}

    def emit():
        print(json.dumps(result), flush=True)

    try:
        routing = bt.variant_model_cfg(spec["variant"], spec["model"])["routing"]
        config.check_xla(spec["xla"], routing["backend"])
        set_autoclustering(spec["xla"] == "autocluster")  # before TensorFlow sets up its devices
        set_tensor_float_32(spec["train"]["tf32"])  # train.tf32 (default on), as train.py sets it
        most = max(spec["replicas"] or [1])
        if spec["device"] == "cpu":
            _setup_cpu_devices(most)
            kind, available = "cpu", most
        else:
            kind, available = "gpu", len(tf.config.list_physical_devices("GPU"))
            if not available:
                raise CapsnetError("no GPU visible to TensorFlow: run on a GPU machine or pass --device cpu")
        replicas = spec["replicas"] or sorted({1, available})
        if max(replicas) > available:
            raise CapsnetError(f"--replicas {max(replicas)} needs {max(replicas)} GPUs, TensorFlow sees {available}")
        devices = _devices(kind, max(replicas))
        result["device"] = bt._device_name(spec["device"])
        result["devices_visible"] = available
        if spec["custom_op"]:
            check_op_library(devices)  # on every device a replica will use
        for batch_size in spec["batch_sizes"]:
            for per_call in spec["steps_per_execution"]:
                print(f"  {spec['variant']}: 1 device, batch {batch_size}, {per_call} steps per call",
                      file=sys.stderr, flush=True)
                [row] = bt.time_training(spec, batch_size, devices[0], per_call, spec["precision"])
                result["results"].append({"config": "1 device", "replicas": 1, "devices": devices[:1],
                                          "all_reduce": None, "global_batch_size": batch_size,
                                          **{k: row[k] for k in ("batch_size", "steps_per_execution",
                                                                 "images_per_sec", "ms_per_step", "repeat_seconds",
                                                                 "first_loss", "last_loss")}})
                result["parameters"] = row["parameters"]
                emit()
                for n in replicas:
                    for all_reduce in spec["all_reduce"]:
                        config = f"mirrored ×{n}"
                        print(f"  {spec['variant']}: {config} ({all_reduce}), {batch_size} per replica, "
                              f"{per_call} steps per call", file=sys.stderr, flush=True)
                        try:
                            row = time_mirrored_training(spec, batch_size, devices[:n], all_reduce, per_call)
                        except (tf.errors.OpError, RuntimeError, ValueError, AllReduceError, ConfigError) as exc:
                            # E.g. an NCCL that does not load, or one that does not sum
                            # (check_all_reduce): the other configurations still count.
                            result["failures"].append({"config": config, "all_reduce": all_reduce,
                                                       "batch_size": batch_size, "steps_per_execution": per_call,
                                                       "error": " ".join(str(exc).split())[:500]})
                            emit()
                            continue
                        result["results"].append({"config": config, **row})
                        emit()
    except CapsnetError as exc:
        result["error"] = " ".join(str(exc).split())
    emit()


def run_variant(variant, args, cfg):
    """One variant in a fresh Python process (bt.run_worker) → its result dict, the rows
    before a crash or a timeout (a hung all-reduce?) kept. NVLink multicast off unless
    the caller's environment says otherwise."""
    custom_op, xla = bt.VARIANTS[variant]
    spec = {"variant": variant, "custom_op": custom_op, "xla": xla, "device": args.device,
            "batch_sizes": args.batch_sizes, "replicas": args.replicas, "all_reduce": args.all_reduce,
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
            "steps_per_execution": args.steps_per_execution, "precision": args.precision[0], "input": args.input,
            **cfg}
    return bt.run_worker(Path(__file__), spec, device=args.device, timeout=args.timeout, env_defaults=NVLS_OFF)


# --------------------------------------------------------------------------- report

def with_scaling(runs):
    """Flat rows, each with images/s ÷ the same variant's 1-device images/s at the same
    per-GPU batch and steps per call."""
    rows = []
    for run in runs:
        custom_op, xla = bt.VARIANTS[run["variant"]]
        single = {(r["batch_size"], r["steps_per_execution"]): r
                  for r in run["results"] if r["config"] == "1 device"}
        for r in run["results"]:
            base = single.get((r["batch_size"], r["steps_per_execution"]))
            rows.append({"variant": run["variant"], "label": bt.label(run["variant"]), "custom_op": custom_op,
                         "xla": xla, **r, "scaling": r["images_per_sec"] / base["images_per_sec"] if base else None,
                         "trains": None if r["config"] == "1 device" else trains(r, base)})
    order = list(bt.VARIANTS)
    return sorted(rows, key=lambda row: (order.index(row["variant"]), row["batch_size"], row["steps_per_execution"],
                                         row["replicas"], row["config"] != "1 device", row["all_reduce"] or ""))


def format_table(rows):
    lines = ["| variant | configuration | all-reduce | batch per GPU | global batch | steps per call | images/s | "
             "ms/step | scaling vs 1 device | loss, first → last step |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        scaling = "-" if row["scaling"] is None else f"{row['scaling']:.2f}×"
        loss = f"{row['first_loss']:.4f} → {row['last_loss']:.4f}{' (NOT TRAINING)' if row['trains'] is False else ''}"
        lines.append(f"| {row['label']} | {row['config']} | {row['all_reduce'] or '-'} | {row['batch_size']} | "
                     f"{row['global_batch_size']} | {row['steps_per_execution']} | {row['images_per_sec']:,.0f} | "
                     f"{row['ms_per_step']:.2f} | {scaling} | {loss} |")
    return "\n".join(lines)


# A mirrored row trains if its loss fell by at least this share of its 1-device row's fall
# (each replica on the 1-device batch, from the same weights, on the same LR schedule: the
# same losses up to the order of the sums; a loose share, as GPU sums differ run to run).
TRAINS_SHARE = 0.1


def trains(row, single):
    """Whether a mirrored row's steps trained, judged against `single`, the 1-device row of
    its batch and steps per call: True, False (its loss fell by less than TRAINS_SHARE of
    the 1-device row's fall: timed, but not training steps), or None (no 1-device row, or its
    loss did not fall either, e.g. a warm-up from a learning rate of 0: nothing to judge by)."""
    if single is None:
        return None
    reference = single["first_loss"] - single["last_loss"]
    if not reference > 0:
        return None
    return bool(row["first_loss"] - row["last_loss"] >= TRAINS_SHARE * reference)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    cfg = bt.compose_config(args.overrides)
    bt.augmentation_set(cfg["data"], args.input)  # none applies here: a set option fails
    runs = [run_variant(variant, args, cfg) for variant in args.variants]
    rows = with_scaling(runs)
    first = next((run for run in runs if run.get("device")), runs[0])
    failures = [{"variant": run["variant"], **f} for run in runs for f in run.get("failures", [])]
    report = {
        "benchmark": "capsnet multi-GPU training throughput (MirroredStrategy)",
        "device": first.get("device"),
        "device_kind": args.device,
        "devices_visible": first.get("devices_visible"),
        "tensorflow": first.get("tensorflow"),
        "parameters": next((run["parameters"] for run in runs if run.get("parameters")), None),
        "model": cfg["model"],
        "overrides": args.overrides,
        "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "seed": cfg["seed"],
        "input": args.input,
        "environment": {key: os.environ.get(key, value) for key, value in NVLS_OFF.items()},
        "results": rows,
        "failures": failures,
        "errors": [{"variant": run["variant"], "error": run["error"]} for run in runs if run["error"]],
        "not_training": [row for row in rows if row["trains"] is False],
    }

    model = "the paper model" if not args.overrides else f"configs + {' '.join(args.overrides)}"
    size = f"{report['parameters']:,} parameters" if report["parameters"] else "parameters unknown"
    print(f"## CapsNet multi-GPU training throughput\n\n"
          f"{report['device'] or args.device} ×{report['devices_visible'] or '?'} · TensorFlow "
          f"{report['tensorflow'] or '?'} · {model} ({size}) · {bt.INPUT_NOTE[args.input]} · batch per GPU fixed, "
          f"global batch = replicas × it · median of {args.repeats} × {args.steps} steps after "
          f"{bt.warmup_steps(args.warmup, args.steps)} warm-up steps\n")
    if rows:
        print(format_table(rows))
    for failure in failures:
        print(f"\n{bt.label(failure['variant'])} {failure['config']} ({failure['all_reduce']}, batch "
              f"{failure['batch_size']}, {failure['steps_per_execution']} steps per call) failed: {failure['error']}")
    for error in report["errors"]:
        print(f"\n{bt.label(error['variant'])} failed: {error['error']}")
    for row in report["not_training"]:
        print(f"\n{row['label']} {row['config']} ({row['all_reduce'] or '-'}, batch {row['batch_size']}, "
              f"{row['steps_per_execution']} steps per call): its loss fell by less than {TRAINS_SHARE:.0%} of the "
              f"1-device row's ({row['first_loss']:.4f} → {row['last_loss']:.4f}): its steps do not train, so its "
              f"time is not a training step's")
    if args.json is not None:
        bt.write_json(args.json, report)
    if failures or report["not_training"] or any(run["error"] and run["crashed"] for run in runs):
        return 1
    return 2 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
