"""Training throughput of CapsNet: images/s per capsule-prediction path and XLA mode.

    .venv/bin/python scripts/benchmark_train.py                 # GPU: batch 128 and 512, every variant
    .venv/bin/python scripts/benchmark_train.py --device cpu --batch-sizes 8 --steps 3 --repeats 1
    .venv/bin/python scripts/benchmark_train.py --json bench.json model.routing_iterations=1
    .venv/bin/python scripts/benchmark_train.py --precision float32,mixed_bfloat16,mixed_float16
    .venv/bin/python scripts/benchmark_train.py --guard on,off --variants op+fused   # the guard's cost

What it measures (the [speed] issue's benchmark 2): training steps per second of the
model in configs/ (the paper's CapsNet unless Hydra overrides say otherwise, e.g.
`model.decoder=false`), with the real optimizer (Adam on the decaying LR, as train()
builds it) and the real compiled step (capsnet.training.steps.make_train_step), for

    op                     custom_op=true  xla=none
    op+autocluster         custom_op=true  xla=autocluster
    op+fused               custom_op=true  xla=none         model.routing=auto (the fused op)
    op+fused+autocluster   custom_op=true  xla=autocluster  model.routing=auto (the fused op)
    op+jit                 custom_op=true  xla=jit          model.routing=tf (the op in the XLA step)
    op+fused+jit           custom_op=true  xla=jit          model.routing=auto (the fused op in the XLA step)
    matmul                 custom_op=false xla=none         (the baseline of the ratio column)
    matmul+jit             custom_op=false xla=jit
    matmul+autocluster     custom_op=false xla=autocluster

The fused variants route inside the compiled op (capsnet.ops.capsule_routing):
model.routing=auto, which capsnet.config.router_spec resolves to the fused op with
custom_op=true (they refuse model.digit_caps_bias, which that op does not add); the
others route in TF ops (model.routing=tf). model.routing is set by the variant; the
other model.* keys come from the config and overrides as they are.

How:
- Each variant runs in its own subprocess, one after the other on the same device:
  XLA autoclustering, its flags and op determinism are process-wide settings, and a
  fresh process also starts with a clean GPU memory pool. Determinism stays off.
- The data is one synthetic MNIST-shaped batch (uniform [0, 1] images, uniform labels)
  repeated by tf.data from host memory: the step's input path is train()'s (a dataset
  iterator read inside the compiled call, its batches prefetched to the device:
  capsnet.training.distribute.input_iterator), the data itself costs nothing.
  `--input device` instead copies the batch to the device once and gives it to every
  step: the steps without the input pipeline (no tf.data, no copy a step).
  `--input on_device` times train.data_on_device=true's loop over a synthetic training
  set of 60,000, each batch augmented on the device as the config's data section says
  (2-pixel shifts; an override such as data.elastic_alpha=16 adds that distortion). The
  other inputs repeat one batch unaugmented, so they refuse augmentation overrides.
- The steps run as train() runs them (capsnet.training.steps.make_train_loop), K =
  `--steps-per-execution` steps per compiled call (train.steps_per_execution; a list
  measures each). A fresh model per (batch size, K); `--warmup` steps first, at least
  1 + `--steps` (tracing, XLA compilation of every call length, cuDNN/XLA autotuning), not
  timed. Then `--repeats` times: `--steps`
  steps dispatched back to back and ONE device sync at the end (reading the last loss
  waits for every step, since each reads the weights the previous one wrote). The
  median repeat gives images/s and ms/step; the ratio column compares variants at the
  same batch size, K and precision.
- `--precision` (train.precision, default float32; a list measures each, in the same
  process): the model's Keras dtype policy, mixed_float16 with its loss scaling.
- `--guard on,off` also times each configuration without the non-finite guard's work
  in the step (the gradients' global norm: make_train_step guard=False; train() always
  guards; the loop's finiteness check on the stacked values after its K steps stays), so
  its cost is the ratio of the two rows; labels and the JSON's "guard" say which. The two
  are timed taking turns, repeat by repeat, in one process (their peak memory is of both).
- Peak device memory: the allocator's statistics are reset after the warm-up
  (tf.config.experimental.reset_memory_stats), so the peak of the timed steps
  (get_memory_info()["peak"]) is the steady state's, without one-off autotuning
  workspaces; on a CPU (--device cpu) through TensorFlow's BFC allocator, which the
  workers turn on there (TF_CPU_ALLOCATOR_USE_BFC).

Prints a markdown table (stdout; progress goes to stderr) and with `--json PATH` also
writes the results as JSON. Exit status 0; 2 if a variant could not run for a reason the
user can fix (op library not built, no GPU; the reason is printed), 1 if one crashed.
"""
import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a clone without `pip install -e .` too

from capsnet.cli import fail  # noqa: E402  (`error: ...` on one line, exit 2, as train.py does)
from capsnet.validation import positive_int  # noqa: E402

# name: (custom_op, xla)
VARIANTS = {
    "op": (True, "none"),
    "op+autocluster": (True, "autocluster"),
    "op+fused": (True, "none"),
    "op+fused+autocluster": (True, "autocluster"),
    "op+jit": (True, "jit"),
    "op+fused+jit": (True, "jit"),
    "matmul": (False, "none"),
    "matmul+jit": (False, "jit"),
    "matmul+autocluster": (False, "autocluster"),
}
# Variants whose model routes inside the compiled op (variant_model_cfg).
FUSED_VARIANTS = ("op+fused", "op+fused+autocluster", "op+fused+jit")
BASELINE = "matmul"
# The LR schedule decays once per epoch of the full MNIST training set, as in train().
MNIST_TRAIN_EXAMPLES = 60_000
# --input: train()'s input pipeline (the default), one batch kept on the device (step_input), or
# (this benchmark only) train.data_on_device's loop (device_train_loop); the report's header says which.
INPUT_NOTE = {"pipeline": "one synthetic batch repeated by tf.data",
              "device": "one synthetic batch kept on the device (--input device: no input pipeline)",
              "on_device": "train.data_on_device=true: a synthetic uint8 training set of 60,000 on the device, each "
                           "step's batch gathered and shifted there, a call's steps one XLA program (--input on_device)"}
INPUTS = ("pipeline", "device")  # benchmark_scale's and profile_train's (a strategy's steps)
TRAIN_INPUTS = tuple(INPUT_NOTE)
# Set by the variant, not by an override: an override would be silently ignored.
RESERVED_KEYS = ("custom_op", "train.xla", "train.batch_size", "train.steps_per_execution", "train.precision",
                 "deterministic", "model.routing", "train.data_on_device")


def label(variant):
    custom_op, xla = VARIANTS[variant]
    return f"custom_op={str(custom_op).lower()} xla={xla}" + (" fused_routing" if variant in FUSED_VARIANTS else "")


def variant_model_cfg(variant, model_cfg):
    """The config's model section as `variant` builds it: the fused variants
    model.routing.backend=auto (with custom_op=true: the fused op, capsnet.config.router_spec),
    the others model.routing.backend=tf. Only the backend changes: the routing section's
    other keys (algorithm, leaky: experiment=paper_cifar10's leaky routing) are the config's."""
    if variant in FUSED_VARIANTS:
        if model_cfg.get("digit_caps_bias") is not None:
            fail(f"{variant} times the fused routing op, which has no capsule bias: drop "
                 f"model.digit_caps_bias={model_cfg['digit_caps_bias']} or that variant")
        return _with_backend(model_cfg, "auto")
    # The other variants time the unfused paths: the op for u_hat alone, TF routing
    # (auto would pick the fused op for custom_op=true).
    return _with_backend(model_cfg, "tf")


def _with_backend(model_cfg, backend):
    routing = model_cfg.get("routing", {})
    routing = {} if isinstance(routing, str) else routing  # the old string form names the backend alone
    return {**model_cfg, "routing": {**routing, "backend": backend}}


# --------------------------------------------------------------------------- arguments

# argparse type functions: parse the text, then the shared check; argparse wants
# ArgumentTypeError (it prints "argument --steps: <message>").

def _positive_ints(text):
    try:
        values = [positive_int("value", int(v)) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"need comma-separated positive integers, got {text!r}")
    return values


def _positive_int(text):
    try:
        return positive_int("value", int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"need a positive integer, got {text!r}") from None


def _guards(text):
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names or any(v not in ("on", "off") for v in names):
        raise argparse.ArgumentTypeError(f"--guard takes on, off or on,off, got {text!r}")
    return [v == "on" for v in dict.fromkeys(names)]


def _precisions(text):
    from capsnet.config import PRECISIONS

    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in PRECISIONS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown precision(s) {', '.join(unknown) or repr(text)}; choose from {', '.join(PRECISIONS)}")
    return list(dict.fromkeys(names))


def _variants(text):
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown variant(s) {', '.join(unknown) or repr(text)}; choose from {', '.join(VARIANTS)}")
    return list(dict.fromkeys(names))


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Training images/s of CapsNet per capsule-prediction path and XLA mode "
                    "(one subprocess per variant; one synthetic batch, repeated).",
        epilog="Overrides are Hydra overrides of configs/train.yaml (model.*, train.* loss and LR values, seed).")
    parser.add_argument("--batch-sizes", type=_positive_ints, default=[128, 512],
                        help="comma-separated batch sizes (default 128,512)")
    add_run_arguments(parser, default_variants=list(VARIANTS), inputs=TRAIN_INPUTS)
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                        help="gpu (default; fails without one) or cpu (GPUs hidden; for smoke runs)")
    args = parser.parse_args(argv)
    reject_reserved_overrides(parser, args.overrides, RESERVED_KEYS, "each variant (--variants) or --batch-sizes")
    if args.input == "on_device" and any(VARIANTS[variant][1] != "jit" for variant in args.variants):
        parser.error("--input on_device (train.data_on_device=true) needs train.xla=jit: pick the +jit variants")
    return args


def add_run_arguments(parser, *, default_variants, inputs=INPUTS):
    """The arguments this benchmark shares with benchmark_scale.py: timing protocol,
    variants, output, per-variant timeout, Hydra overrides and the internal --worker."""
    parser.add_argument("--steps", type=_positive_int, default=50, help="timed steps per repeat (default 50)")
    parser.add_argument("--steps-per-execution", type=_positive_ints, default=[1],
                        help="comma-separated train.steps_per_execution values: steps per compiled call "
                             "(default 1)")
    parser.add_argument("--warmup", type=_positive_int, default=10,
                        help="untimed steps first, at least 1 + --steps: tracing, XLA compilation, autotuning, NCCL setup "
                             "(default 10)")
    parser.add_argument("--repeats", type=_positive_int, default=5, help="timed repeats; the median counts (default 5)")
    parser.add_argument("--precision", type=_precisions, default=["float32"],
                        help="comma-separated train.precision values (default float32)")
    parser.add_argument("--guard", type=_guards, default=[True], metavar="on|off|on,off",
                        help="with the non-finite guard (on, default), without it (off), or both")
    parser.add_argument("--variants", type=_variants, default=default_variants,
                        help=f"comma-separated, from: {', '.join(VARIANTS)} (default {','.join(default_variants)})")
    parser.add_argument("--input", choices=inputs, default="pipeline",
                        help="pipeline (default): each step's batch comes from tf.data through the iterator train() "
                             "uses (input_iterator); device: one batch copied to the device(s) once and given to "
                             "every step, no copy a step (the step's cost without its input)"
                             + ("; on_device: train.data_on_device=true, a synthetic training set of 60,000 in "
                                "device memory, each step's batch gathered and shifted there, a call's steps one "
                                "XLA program (the +jit variants)" if "on_device" in inputs else ""))
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here as JSON")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds one variant (all its configurations) may take before it is stopped "
                             "(default 1800)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="Hydra overrides of configs/train.yaml")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one variant, spec as JSON


def reject_reserved_overrides(parser, overrides, reserved, set_by):
    """An override of a key the benchmark sets itself (a section name covers its keys)
    would be silently replaced: refuse it, naming what sets it."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in reserved or key.split(".")[0] in reserved:
            parser.error(f"{key} is set by {set_by}, not by an override")


def augmentation_set(data_cfg, input_kind):
    """The data section's augmentation beyond shifts, as the overrides that set it
    (["data.elastic_alpha=16", ...]; [] when every option is off). Only `--input on_device`
    augments its batches: for another input a set option fails with one line, since it
    would be silently ignored (benchmark_train, benchmark_scale and profile_train)."""
    from capsnet.config import augmentation_on  # TensorFlow-free: this runs in the parent process

    augmentation = augmentation_on(data_cfg)
    if augmentation and input_kind != "on_device":
        fail(f"{', '.join(augmentation)}: only benchmark_train's --input on_device augments its batches (the "
             f"other inputs repeat one synthetic batch)")
    return augmentation


def compose_config(overrides):
    """The model, train and data sections and seed of configs/train.yaml with `overrides` (plain dicts)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            cfg = compose(config_name="train", overrides=list(overrides))
        return {
            "model": OmegaConf.to_container(cfg.model, resolve=True),
            "train": OmegaConf.to_container(cfg.train, resolve=True),
            "data": OmegaConf.to_container(cfg.data, resolve=True),
            "seed": int(cfg.seed),
        }
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        # Hydra appends its whole config search path to some messages: keep what names the problem.
        fail(f"bad override: {str(exc).split('Config search path')[0]}")


# --------------------------------------------------------------------------- worker (one variant)

def _device_name(kind):
    import tensorflow as tf

    if kind == "gpu":
        details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
        return details.get("device_name", "GPU")
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "CPU"
    return f"{model} ({os.cpu_count()} cores visible)"


def synthetic_batches(spec, batch_size, input_shape, num_classes, copies=1):
    """One synthetic MNIST-shaped batch (uniform [0, 1] images, uniform labels) drawn from
    spec's seed, repeated by tf.data from host memory, as train() feeds its steps.

    copies > 1: each batch is the drawn one `copies` times over, end to end (copies ×
    batch_size examples), so a strategy of `copies` replicas gives every replica the very
    batch of the one-device run: the same gradient, so the same losses. (A fresh draw of
    copies × batch_size instead is another task: on one H100, 1,024 uniformly random labels
    left the loss flat over 260 steps where 512 fell 0.84 → 0.25.)"""
    import tensorflow as tf

    with tf.device("/CPU:0"):
        generator = tf.random.Generator.from_seed(spec["seed"])
        images = generator.uniform((batch_size, *input_shape))                       # (B, H, W, C) in [0, 1)
        labels = generator.uniform((batch_size,), maxval=num_classes, dtype=tf.int32)  # (B,)
        images = tf.tile(images, [copies] + [1] * len(input_shape))                  # (copies·B, H, W, C)
        labels = tf.tile(labels, [copies])
    # Batched (not from_tensors), so a strategy can split it; cached, so it is batched once.
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(copies * batch_size).cache().repeat()


def step_input(spec, dataset, *, device=None, strategy=None):
    """The iterator a benchmark's steps read: input_iterator's (spec["input"] "pipeline", as
    train() feeds its steps), or ("device") the dataset's first batch on the device (each
    replica's slice on its device under `strategy`), copied once and repeated for every
    step: then no step waits for a host-to-device copy."""
    import tensorflow as tf

    from capsnet.training.distribute import distribute_dataset, input_iterator

    if spec["input"] == "pipeline":
        return input_iterator(dataset, strategy, device=device)
    if strategy is not None:
        return itertools.repeat(next(iter(distribute_dataset(strategy, dataset))))
    with tf.device(device):
        return itertools.repeat(tuple(tf.identity(t) for t in next(iter(dataset))))


def synthetic_training_set(spec, batch_size, input_shape, num_classes, tf_device=None, strategy=None):
    """--input on_device's training set: a synthetic uint8 one of MNIST's size (drawn from
    spec's seed) on `tf_device` (a DeviceTrainingSet), or under `strategy` on every
    replica's device (a MirroredTrainingSet of global batches of `batch_size`), augmented as
    the config's data section says (train()'s arguments: the paper's MNIST shifts by 2
    pixels; data.elastic_alpha etc. as set)."""
    import numpy as np

    from capsnet.config import augmentation_options
    from capsnet.training.device_input import DeviceTrainingSet, MirroredTrainingSet

    rng = np.random.default_rng(spec["seed"])
    images = rng.integers(0, 256, (MNIST_TRAIN_EXAMPLES, *input_shape), dtype=np.uint8)
    labels = rng.integers(0, num_classes, MNIST_TRAIN_EXAMPLES)
    keywords = {"batch_size": batch_size, "seed": spec["seed"], "shift_pixels": spec["data"]["shift_pixels"],
                **augmentation_options(spec["data"])}
    if strategy is not None:
        return MirroredTrainingSet(strategy, images, labels, **keywords)
    return DeviceTrainingSet(images, labels, device=tf_device, **keywords)


def device_train_loop(spec, step, batch_size, input_shape, num_classes, per_call, tf_device, training_set=None):
    """--input on_device: (train_steps, its first argument) as train() makes them with
    train.data_on_device=true, over `training_set` (default: synthetic_training_set's on
    `tf_device`; a mirrored one needs `step` made with its `examples`). Epochs 0 and 1 are drawn
    up front and taken in turn, so no step waits for an epoch's draws (train() draws the
    next epoch's while this one trains)."""
    import numpy as np

    from capsnet.training.device_input import make_device_train_loop

    if training_set is None:
        training_set = synthetic_training_set(spec, batch_size, input_shape, num_classes, tf_device)
    device_steps = make_device_train_loop(step, training_set, steps_per_execution=per_call)
    epochs = [training_set.epoch(0), training_set.epoch(1)]
    steps_per_epoch = MNIST_TRAIN_EXAMPLES // batch_size

    def train_steps(_, batch_sizes):
        length = int(np.count_nonzero(batch_sizes))
        if epochs[0].steps_run + length > steps_per_epoch:  # full batches only: the next epoch
            epochs.reverse()
            epochs[0].steps_run = 0
        return device_steps(epochs[0], batch_sizes)

    return train_steps, None


def runner(train_steps, iterator, global_batch, per_call):
    """run(steps) → the last step's loss: `steps` steps of make_train_loop's `train_steps`,
    `per_call` a call as train() calls it; reading the loss waits for every step (each
    reads the weights the previous one wrote)."""
    import tensorflow as tf

    def run(steps):
        lengths = [per_call] * (steps // per_call) + ([steps % per_call] if steps % per_call else [])
        for length in lengths:
            out = train_steps(iterator, tf.constant([global_batch] * length + [0] * (per_call - length), tf.int32))
        return float(out["loss"][-1])
    return run


def warmup_steps(warmup, steps):
    """The untimed steps before the repeats: `--warmup`, at least one step and a repeat's
    `steps` (time_steps says why)."""
    return max(warmup, 1 + steps)


def time_steps(runs, spec, tf_device=None):
    """Time each of `runs` (runner's): the first step alone (it traces: never timed),
    `--warmup` - 1 more but at least `--steps` (calls of every length the repeats make: the
    device loop, --input on_device, compiles a full call's program apart from the others),
    then `--repeats` × `--steps` steps with ONE device sync each.
    Several runs (the guard on and off) take turns, in alternating order from repeat to
    repeat, so a drift of the GPU's clocks over the run weighs on each alike.
    Returns per run (first loss, last loss, seconds of each repeat), and the peak bytes of
    `tf_device`'s allocator over the timed steps (of all runs together; None without a
    tf_device, or where the allocator keeps no statistics: a CPU without the BFC allocator
    reports zeros)."""
    import tensorflow as tf

    first = [run(1) for run in runs]
    for run in runs:
        run(warmup_steps(spec["warmup"], spec["steps"]) - 1)  # finished before the clock starts
    memory_device = None
    if tf_device is not None:  # "/cpu:0" -> "CPU:0", the form the memory queries take
        device = tf.DeviceSpec.from_string(tf_device)
        memory_device = f"{device.device_type}:{device.device_index or 0}"
        tf.config.experimental.reset_memory_stats(memory_device)  # the steady state's peak, not warm-up's
    seconds, last = [[] for _ in runs], [None] * len(runs)
    for repeat in range(spec["repeats"]):
        order = range(len(runs)) if repeat % 2 == 0 else reversed(range(len(runs)))
        for i in order:
            start = time.perf_counter()
            last[i] = runs[i](spec["steps"])
            seconds[i].append(time.perf_counter() - start)
    peak = (tf.config.experimental.get_memory_info(memory_device)["peak"] or None) if memory_device else None
    return [(first[i], last[i], seconds[i]) for i in range(len(runs))], peak


def time_training(spec, batch_size, tf_device, per_call=1, precision="float32", guards=(True,)):
    """images/s, ms/step and peak memory of one (variant, batch size, steps per call, precision),
    a row per entry of `guards` (with the non-finite guard's norm or without): each a fresh
    model, optimizer and step, timed taking turns (time_steps).
    Running out of device memory is a CapsnetError naming the batch size (the first line of
    TensorFlow's message, not its allocator dump)."""
    import keras
    import tensorflow as tf

    from capsnet.errors import CapsnetError
    from capsnet.losses import loss_params
    from capsnet.training.model_setup import build_capsnet
    from capsnet.training.optimizer import build_optimizer
    from capsnet.training.steps import make_train_loop, make_train_step

    model_cfg = variant_model_cfg(spec["variant"], spec["model"])
    train_cfg = {**spec["train"], "precision": precision}
    input_shape = tuple(model_cfg["input_shape"])
    runs, models = [], []
    try:
        with tf.device(tf_device):
            for guard in guards:
                keras.utils.set_random_seed(spec["seed"])  # the same initial weights for every variant
                model = build_capsnet(model_cfg, spec["custom_op"], precision)
                optimizer, _ = build_optimizer(train_cfg, math.ceil(MNIST_TRAIN_EXAMPLES / batch_size), model)
                step = make_train_step(model, optimizer, input_shape=input_shape, losses=loss_params(train_cfg),
                                       xla=spec["xla"], guard=guard)
                if spec["input"] == "on_device":
                    train_steps, iterator = device_train_loop(spec, step, batch_size, input_shape,
                                                              int(model_cfg["num_classes"]), per_call, tf_device)
                else:
                    train_steps = make_train_loop(step)
                    iterator = step_input(spec, synthetic_batches(spec, batch_size, input_shape,
                                                                  int(model_cfg["num_classes"])), device=tf_device)
                runs.append(runner(train_steps, iterator, batch_size, per_call))
                models.append(model)
            timed, peak = time_steps(runs, spec, tf_device)
    except tf.errors.ResourceExhaustedError as exc:
        raise CapsnetError(f"out of device memory at batch {batch_size}: "
                           f"{str(exc).strip().splitlines()[0]}") from exc
    rows = []
    for guard, model, (first_loss, last_loss, seconds) in zip(guards, models, timed):
        median = statistics.median(seconds)
        rows.append({
            "batch_size": batch_size,
            "steps_per_execution": per_call,
            "precision": precision,
            "tf32": spec["train"]["tf32"],
            "guard": guard,
            "images_per_sec": spec["steps"] * batch_size / median,
            # Of the rows timed together (--guard on,off: both models at once).
            "peak_memory_mib": None if peak is None else peak / 2**20,
            "ms_per_step": 1000.0 * median / spec["steps"],
            "repeat_seconds": seconds,
            "first_loss": first_loss,
            "last_loss": last_loss,
            "parameters": int(model.count_params()),
        })
    return rows


def worker(spec):
    """Run one variant for every batch size; the last stdout line is the result as JSON."""
    from capsnet import cli

    cli.import_tensorflow_quietly()
    import tensorflow as tf

    from capsnet.errors import CapsnetError
    from capsnet.training.model_setup import check_op_library
    from capsnet import config
    from capsnet.precision import set_tensor_float_32
    from capsnet.training.xla_flags import set_autoclustering

    result = {"variant": spec["variant"], "results": [], "error": None, "tensorflow": tf.__version__}
    try:
        routing = variant_model_cfg(spec["variant"], spec["model"])["routing"]
        config.check_xla(spec["xla"], routing["backend"])
        # Before TensorFlow sets up its devices: it reads the XLA flags then (see set_autoclustering).
        set_autoclustering(spec["xla"] == "autocluster")
        set_tensor_float_32(spec["train"]["tf32"])  # train.tf32 (TensorFlow's default: on), as train.py sets it
        if spec["device"] == "gpu" and not tf.config.list_physical_devices("GPU"):
            raise CapsnetError("no GPU visible to TensorFlow: run on a GPU machine (CUDA drivers, "
                               "tensorflow[and-cuda]) or pass --device cpu for a smoke run")
        tf_device = "/GPU:0" if spec["device"] == "gpu" else "/CPU:0"
        result["device"] = _device_name(spec["device"])
        if spec["custom_op"]:
            check_op_library()  # also refuses a CPU-only library while a GPU is visible
        for precision in spec["precisions"]:
            for batch_size in spec["batch_sizes"]:
                for per_call in spec["steps_per_execution"]:
                    guards = spec.get("guards", [True])
                    print(f"  {spec['variant']}: {precision}, batch {batch_size}, {per_call} steps per call"
                          + ("" if guards == [True] else ", guard " + "/".join("on" if g else "off" for g in guards)),
                          file=sys.stderr, flush=True)
                    result["results"].extend(time_training(spec, batch_size, tf_device, per_call, precision, guards))
    except CapsnetError as exc:
        result["error"] = " ".join(str(exc).split())
    print(json.dumps(result))


def run_variant(variant, args, cfg):
    """One variant in a fresh Python process → its result dict (or one with an error)."""
    custom_op, xla = VARIANTS[variant]
    spec = {"variant": variant, "custom_op": custom_op, "xla": xla, "device": args.device,
            "batch_sizes": args.batch_sizes, "steps": args.steps, "warmup": args.warmup,
            "repeats": args.repeats, "steps_per_execution": args.steps_per_execution, "precisions": args.precision,
            "guards": args.guard, "input": args.input, **cfg}
    return run_worker(Path(__file__), spec, device=args.device, timeout=args.timeout)


def run_worker(script, spec, *, device, timeout, env_defaults=None):
    """Run `script --worker spec` in a fresh Python process → the last JSON object it
    printed (a worker may print its result so far after each configuration), with
    "crashed"; on a crash or after `timeout` seconds, the rows printed before are kept
    and "error" says what stopped it. Shared with benchmark_scale.py.

    env_defaults: environment variables set unless the caller's environment has them.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    for key, value in (env_defaults or {}).items():
        env.setdefault(key, value)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = "-1"  # hide GPUs, so nothing runs or allocates there
        # TensorFlow's CPU allocator keeps memory statistics only as a BFC allocator: with it
        # the peak column is measured on a CPU too (it matched XLA's CPU plan of the step).
        env.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    print(f"{label(spec['variant'])} ...", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run([sys.executable, str(Path(script).resolve()), "--worker", json.dumps(spec)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
        stdout, stderr, stopped = proc.stdout, proc.stderr, None
    except subprocess.TimeoutExpired as exc:
        stdout, stderr = (text.decode(errors="replace") if isinstance(text, bytes) else text or ""
                          for text in (exc.stdout, exc.stderr))
        stopped = f"stopped after --timeout {timeout:g} s; the rows before are kept"
    sys.stderr.write(stderr)  # progress lines, warnings, and a crash's traceback
    printed = _last_json_line(stdout)
    result = printed or {"variant": spec["variant"], "results": [], "failures": []}
    if stopped:
        return {**result, "error": stopped, "crashed": True}
    if printed is None or proc.returncode != 0:
        # A crash (e.g. inside NCCL) after some rows: keep them, report the crash.
        tail = stderr.strip().splitlines()[-1:] or ["no output"]
        return {**result, "crashed": True, "error": f"worker exited with status {proc.returncode}: {tail[0]}"}
    return {**result, "crashed": False}


def _last_json_line(text):
    """The last line of `text` that is a JSON object (the worker's latest result), or None."""
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def write_json(path, report):
    """The report as JSON at `path` (its folder made if missing); a one-line error if it cannot be."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror}")


# --------------------------------------------------------------------------- report

def with_ratios(runs):
    """Flat result rows, each with images/s ÷ the baseline's at the same batch size, steps
    per call and precision (None without one)."""
    def key(r):
        return r["batch_size"], r["steps_per_execution"], r.get("precision", "float32"), r.get("guard", True)

    baseline = {key(r): r["images_per_sec"] for run in runs if run["variant"] == BASELINE for r in run["results"]}
    rows = []
    for run in runs:
        custom_op, xla = VARIANTS[run["variant"]]
        for r in run["results"]:
            base = baseline.get(key(r))
            rows.append({"variant": run["variant"], "label": label(run["variant"]), "custom_op": custom_op,
                         "xla": xla, "fused_routing": run["variant"] in FUSED_VARIANTS, **r,
                         "ratio": r["images_per_sec"] / base if base else None})
    from capsnet.config import PRECISIONS

    return sorted(rows, key=lambda row: (row["batch_size"], row["steps_per_execution"],
                                         PRECISIONS.index(row.get("precision", "float32")),
                                         list(VARIANTS).index(row["variant"]), not row.get("guard", True)))


def format_table(rows):
    lines = [f"| variant | precision | batch | steps per call | images/s | ms/step | peak MiB | "
             f"vs {label(BASELINE)} |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}×"
        peak = row.get("peak_memory_mib")
        name = row["label"] + ("" if row.get("guard", True) else " no_guard")
        lines.append(f"| {name} | {row.get('precision', 'float32')} | {row['batch_size']} | "
                     f"{row['steps_per_execution']} | {row['images_per_sec']:,.0f} | "
                     f"{row['ms_per_step']:.2f} | {'-' if peak is None else f'{peak:,.0f}'} | {ratio} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    cfg = compose_config(args.overrides)
    augmentation = augmentation_set(cfg["data"], args.input)
    for variant in args.variants:  # a variant the config rules out fails here, before its worker starts
        variant_model_cfg(variant, cfg["model"])
    runs = [run_variant(variant, args, cfg) for variant in args.variants]
    rows = with_ratios(runs)
    first = next((run for run in runs if run.get("device")), runs[0])
    parameters = next((row["parameters"] for row in rows), None)
    report = {
        "benchmark": "capsnet training throughput",
        "device": first.get("device"),
        "device_kind": args.device,
        "tensorflow": first.get("tensorflow"),
        "parameters": parameters,
        "model": cfg["model"],
        "overrides": args.overrides,
        "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "seed": cfg["seed"],
        "input": args.input,
        "augmentation": augmentation,
        "results": rows,
        "errors": [{"variant": run["variant"], "error": run["error"]} for run in runs if run["error"]],
    }

    model = "the paper model" if not args.overrides else f"configs + {' '.join(args.overrides)}"
    size = f"{parameters:,} parameters" if parameters else "parameters unknown"
    print(f"## CapsNet training throughput\n\n"
          f"{report['device'] or args.device} · TensorFlow {report['tensorflow'] or '?'} · {model} ({size}) · "
          f"{INPUT_NOTE[args.input]} · median of {args.repeats} × {args.steps} steps after "
          f"{warmup_steps(args.warmup, args.steps)} warm-up steps\n")
    if rows:
        print(format_table(rows))
    for error in report["errors"]:
        print(f"\n{label(error['variant'])} failed: {error['error']}")
    if args.json is not None:
        write_json(args.json, report)
    if any(run["error"] and run["crashed"] for run in runs):
        return 1
    return 2 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
