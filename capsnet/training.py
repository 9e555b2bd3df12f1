"""Train CapsNet: `train(cfg) -> metrics`, the body of `python train.py`.

Reads top to bottom like the loop it is: config → setup → data → model and optimizer
(new, or resumed from the run dir's last checkpoint) → compiled steps → epochs →
final metrics. `cfg` is a plain dict shaped like configs/train.yaml (train.py converts
Hydra's config at the boundary); nothing here sees a Hydra object.

The pieces train() is made of, shared with scripts/benchmark_train.py:
`build_capsnet(model_cfg, custom_op)`, `build_optimizer(train_cfg, steps_per_epoch,
model)` and `make_train_step(model, optimizer, input_shape=..., losses=..., xla=...)`
with xla none | jit | autocluster (train.xla; see set_autoclustering).

A run dir holds:
    config.yaml                the resolved config (evaluate.py rebuilds the model from it)
    events.out.tfevents.*      TensorBoard: scalars, reconstructions, histograms, HParams
    checkpoints/latest/ckpt-N  the last `train.keep_checkpoints` epochs (N = epochs done)
    checkpoints/best/ckpt-N    the epoch with the highest test accuracy (of the epochs done)
    history.jsonl              one line of metrics per finished epoch
    metrics.json               the final metrics, written at the end

Resume: rerunning with the same run dir restores model weights, optimizer state
(Adam moments and its step counter, from which the LR schedule follows), the epoch
counter and the best accuracy so far, then continues with the next epoch. The only
randomness after weight initialization is the data's: order and shifts are stateless
functions of (seed, epoch) (capsnet.data), so there is no generator state to save, and
with deterministic=true a resumed run ends bitwise equal to an uninterrupted one.
A run killed mid-epoch loses that epoch only. TensorBoard's step is the global step
(optimizer.iterations), so the curves continue where the checkpoint left them.

An epoch ends with: its history line, its best checkpoint (if it is the best), and
LAST checkpoints/latest/ckpt-N, the commit point: a run killed before it redoes the
epoch, and whatever that epoch wrote before (a history line, best/ckpt-N) is
superseded or deleted on restart (see _BestCheckpoint).

Resuming refuses a config that would change the run's trajectory (RESUME_KEYS: the
model, the data, the seed, the optimizer and loss values) and names what differs;
train.epochs (to extend a run), custom_op, train.xla, model.jit_routing,
deterministic, logging and progress keys may change.
"""
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
import yaml
from tensorflow.python.framework import config as tf_config

from capsnet import ops
from capsnet.data import load_split, make_dataset
from capsnet.errors import CheckpointError, ConfigError, OpLibraryError
from capsnet.evaluation import (
    capsnet_losses, checkpoint_weights, evaluate_model, json_safe, loss_params, make_eval_step, read_run_config,
)
from capsnet.model import build_model
from capsnet.validation import boolean, integer, positive_float, positive_int

log = logging.getLogger(__name__)

# Values shown side by side in TensorBoard's HParams dashboard, and the metrics they explain.
HPARAMS = ("custom_op", "xla", "dataset", "batch_size", "routing_iterations", "seed", "learning_rate", "decoder")
HPARAM_METRICS = ("test/accuracy", "train/images_per_sec")


# --------------------------------------------------------------------------- small pure helpers

def learning_rate_schedule(learning_rate, decay_rate, decay_steps, staircase=False):
    """lr(step) = learning_rate · decay_rate^(step / decay_steps); a Keras schedule of
    the optimizer's step counter, so restoring the counter restores the LR."""
    return keras.optimizers.schedules.ExponentialDecay(
        initial_learning_rate=learning_rate, decay_steps=decay_steps, decay_rate=decay_rate,
        staircase=staircase)


def image_grid(images, reconstructions):
    """Inputs over reconstructions: two rows of N tiles, (N, H, W, C) x 2 → (1, 2H, N·W, C)."""
    images = np.asarray(images, np.float32)
    reconstructions = np.asarray(reconstructions, np.float32)
    if images.ndim != 4 or images.shape != reconstructions.shape:
        raise ValueError(f"image_grid: need two (N, H, W, C) arrays of one shape, got "
                         f"{images.shape} and {reconstructions.shape}")
    n, h, w, c = images.shape
    rows = np.stack([images, reconstructions])                        # (2, N, H, W, C)
    grid = rows.transpose(0, 2, 1, 3, 4).reshape(2 * h, n * w, c)     # (2H, N·W, C)
    return np.clip(grid, 0.0, 1.0)[None]                              # (1, 2H, N·W, C)


def check_labels(labels, images, *, model, split):
    """The data must fit the model: image shape = input_shape, labels in [0, num_classes).

    `model` is a built CapsNet: its input_shape and num_classes have been checked
    (build_capsnet), unlike the raw config values.
    """
    input_shape = tuple(model.image_shape)
    if tuple(images.shape[1:]) != input_shape:
        raise ConfigError(f"{split} images have shape {tuple(images.shape[1:])} but model.input_shape is "
                          f"{list(input_shape)}")
    num_classes = int(model.num_classes)
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise ConfigError(f"{split} labels lie in [{labels.min()}, {labels.max()}] but model.num_classes is "
                          f"{num_classes}")


def build_capsnet(model_cfg, custom_op):
    """The CapsNet of a config's `model` section; bad values (a non-integer num_classes,
    input_shape=5, an unknown key, ...) → ConfigError naming them.

    The values go to CapsNet as they are: it checks them (and turns lists into
    tuples), so a bool(...) or tuple(...) here cannot misread or crash on them first.
    """
    try:
        return build_model(**dict(model_cfg), custom_op=custom_op)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"model: {' '.join(str(exc).split())}") from exc


def check_op_library():
    """custom_op=true must use the compiled op: fail now, with the op's one-line error, if
    it cannot run (not built, stale, or built without CUDA while TensorFlow sees a GPU)
    rather than deep inside the first compiled step."""
    if tf.config.list_physical_devices("GPU") and ops.build_stamp(ops.library_path()).get("cuda") is False:
        # The op has only a CPU kernel: TensorFlow would place it on the CPU and copy u and
        # u_hat across every step, silently, while the rest of the model runs on the GPU.
        raise OpLibraryError(f"the capsnet op library {ops.library_path()} was built without CUDA, but TensorFlow "
                             "sees a GPU (the op would run on the CPU): run `make ops-cuda` (needs nvcc), "
                             "or set custom_op=false")
    u = tf.zeros((1, 1, 1))        # (batch, in_caps, in_dim)
    W = tf.zeros((1, 1, 1, 1))     # (in_caps, out_caps, out_dim, in_dim)
    try:
        ops.capsule_prediction(u, W)
    except OpLibraryError:
        raise
    except tf.errors.OpError as exc:
        raise OpLibraryError(f"the capsule-prediction op library does not run: {exc.message}; "
                             "rebuild it with `make ops`") from exc


def build_optimizer(train_cfg, steps_per_epoch, model):
    """The paper's optimizer for `model`: Adam on an exponentially decaying LR.

    Returns (optimizer, schedule). `train_cfg` is a config's `train` section;
    lr_decay_steps null decays once per `steps_per_epoch`. Adam's moments are created
    now (optimizer.build), so a checkpoint restore fills them in place instead of being
    deferred to the first step, and the first compiled step creates no variables.
    """
    decay_steps = train_cfg["lr_decay_steps"] or steps_per_epoch
    schedule = learning_rate_schedule(train_cfg["learning_rate"], train_cfg["lr_decay_rate"], decay_steps,
                                      train_cfg["lr_staircase"])
    optimizer = keras.optimizers.Adam(learning_rate=schedule)
    optimizer.build(model.trainable_variables)
    return optimizer, schedule


# --------------------------------------------------------------------------- compiled steps

XLA_MODES = ("none", "autocluster", "jit")


def check_xla(xla, custom_op, jit_routing=False):
    """`train.xla` must be one of XLA_MODES; jit cannot compile the custom op, and
    jit_routing (an XLA computation of its own) must not be nested inside jit."""
    if xla not in XLA_MODES:
        raise ConfigError(f"train.xla must be one of {', '.join(XLA_MODES)}, got {xla!r}")
    if xla == "jit" and custom_op:
        # XLA has no kernel for our op: jit_compile would fail on it at the first step.
        raise ConfigError("train.xla=jit cannot compile the custom op (custom_op=true): use train.xla=autocluster, "
                          "which compiles the TensorFlow ops around it")
    if xla == "jit" and jit_routing:
        # The whole step is one XLA computation already; the nested jit_compile function
        # aborted the process on an H200 (benchmark_train, 2026-11-21).
        raise ConfigError("model.jit_routing=true is redundant under train.xla=jit (the whole step is compiled): "
                          "set model.jit_routing=false")


def set_autoclustering(enabled):
    """Turn XLA autoclustering on or off for this PROCESS: it applies to every tf.function
    run afterwards (the train step, the eval step, and anything else).

    TensorFlow autoclusters only GPU ops unless --tf_xla_cpu_global_jit is in
    TF_XLA_FLAGS; enabling adds it, so that `autocluster` also works on a CPU-only
    machine. TensorFlow reads TF_XLA_FLAGS once per process, when it first sets up its
    devices (the first tensor, variable or device query): call this before that for
    the flag to count. Once read, the flag stays; set_jit alone then decides whether
    functions instantiated later are clustered.
    """
    if enabled:
        flags = os.environ.get("TF_XLA_FLAGS", "")
        if "--tf_xla_cpu_global_jit" not in flags:
            os.environ["TF_XLA_FLAGS"] = (flags + " --tf_xla_cpu_global_jit").strip()
    tf.config.optimizer.set_jit("autoclustering" if enabled else False)


def make_train_step(model, optimizer, *, input_shape, losses, xla="none"):
    """The compiled training step: (images, labels) → {loss, margin_loss, reconstruction_loss, accuracy}.

    One Adam step on the mean total loss of the batch; the returned values are batch
    means (tensors still on the device: reading one waits for the step).

    Args:
        model: a CapsNet (its `custom_op` decides whether jit is allowed).
        optimizer: a built Keras optimizer (build_optimizer).
        input_shape: image shape (H, W, C); the batch size may vary between calls.
        losses: capsnet_losses' keyword arguments (loss_params(train_cfg)).
        xla: "none"; "jit" compiles the whole step with XLA (tf.function(jit_compile=True),
            matmul path only); "autocluster" turns on XLA autoclustering for the process
            (set_autoclustering), so XLA compiles clusters of plain TF ops around the custom
            op. "none" and "jit" turn autoclustering off: the last step made decides.
    """
    check_xla(xla, getattr(model, "custom_op", False), getattr(model, "jit_routing", False))
    set_autoclustering(xla == "autocluster")
    image_spec = tf.TensorSpec([None, *input_shape], tf.float32)

    @tf.function(input_signature=[image_spec, tf.TensorSpec([None], tf.int32)], jit_compile=xla == "jit")
    def train_step(images, labels):
        with tf.GradientTape() as tape:
            # Labels mask the decoder input: reconstruct the TRUE class in training.
            outputs = model(images, labels=labels, training=True)
            total, margin, reconstruction = capsnet_losses(images, labels, outputs, **losses)  # (B,) each
            loss = tf.reduce_mean(total)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        predictions = tf.argmax(outputs["lengths"], axis=-1, output_type=tf.int32)  # (B,)
        return {
            "loss": loss,
            "margin_loss": tf.reduce_mean(margin),
            "reconstruction_loss": tf.reduce_mean(reconstruction),
            "accuracy": tf.reduce_mean(tf.cast(tf.equal(predictions, labels), tf.float32)),
        }

    return train_step


# --------------------------------------------------------------------------- config checks

# (section, key, default when absent; None = required). Only real booleans pass: Hydra
# passes `custom_op=no` as the string 'no', which bool() would read as True.
BOOL_KEYS = (
    (None, "custom_op", None), (None, "deterministic", False), (None, "debug", False),
    ("train", "lr_staircase", None), ("train", "progress_bar", None),
    ("model", "decoder", True), ("model", "stop_gradient_routing", True), ("model", "jit_routing", False),
)


def _check_bools(cfg):
    for section, key, default in BOOL_KEYS:
        values = cfg[section] if section else cfg
        if not isinstance(values, dict):
            raise ConfigError(f"{section} must be a section of keys, got {values!r}")
        value = values[key] if default is None else values.get(key, default)
        boolean(f"{section}.{key}" if section else key, value, error=ConfigError)


def _check_config(cfg):
    """Every value train() reads before the heavy work (data, model): ConfigError naming it."""
    _check_bools(cfg)
    train_cfg = cfg["train"]
    for key in ("epochs", "batch_size", "keep_checkpoints", "log_every_steps", "num_images",
                "histogram_examples"):
        positive_int(f"train.{key}", train_cfg[key], error=ConfigError)
    positive_int("train.lr_decay_steps", train_cfg["lr_decay_steps"], allow_none=True, error=ConfigError)
    for key in ("learning_rate", "lr_decay_rate"):
        positive_float(f"train.{key}", train_cfg[key], error=ConfigError)
    loss_params(cfg["train"])  # m_plus, m_minus, lambda_, reconstruction_weight
    check_xla(cfg["train"]["xla"], cfg["custom_op"], cfg["model"].get("jit_routing", False))
    integer("seed", cfg["seed"], error=ConfigError)
    if not cfg.get("run_dir"):
        raise ConfigError("run_dir is not set (train.py sets it to Hydra's run dir; tests pass one)")


# What a resumed run must share with the run it continues: everything that changes the
# trajectory of the weights. The model section is compared whole, except jit_routing
# (how routing is compiled, not what it computes).
RESUME_KEYS = {
    "data": ("name", "dir", "limit_train", "limit_test", "shift_pixels"),
    "train": ("batch_size", "learning_rate", "lr_decay_rate", "lr_decay_steps", "lr_staircase",
              "m_plus", "m_minus", "lambda_", "reconstruction_weight"),
}
RESUME_FREE_MODEL_KEYS = ("jit_routing",)


def _resume_values(cfg):
    """{dotted key: value} of a config over what a resume must not change (tuples as lists,
    as they come back from config.yaml)."""

    def section(name):
        values = cfg.get(name)
        return values if isinstance(values, dict) else {}

    values = {"seed": cfg.get("seed")}
    values.update({f"model.{k}": v for k, v in section("model").items() if k not in RESUME_FREE_MODEL_KEYS})
    for name, keys in RESUME_KEYS.items():
        values.update({f"{name}.{k}": section(name).get(k) for k in keys})
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def _config_differences(saved, current):
    """'key: old -> new' for every resume-relevant value that differs (a missing key counts)."""
    saved, current = _resume_values(saved), _resume_values(current)

    def shown(values, key):
        return repr(values[key]) if key in values else "(absent)"

    return [f"{k}: {shown(saved, k)} -> {shown(current, k)}" for k in sorted(set(saved) | set(current))
            if k not in saved or k not in current or saved[k] != current[k]]


def _check_resumable(run_dir, cfg):
    """Resuming run_dir with `cfg` (data.dir resolved) must continue the same run: a changed
    seed, model, data or optimizer value would silently mix two runs. CheckpointError
    lists what differs."""
    if not (run_dir / "config.yaml").is_file():
        return  # nothing to compare (a run dir from before config.yaml was written)
    saved = read_run_config(run_dir)  # a corrupt config.yaml → CheckpointError
    differences = _config_differences(saved, cfg)
    if differences:
        raise CheckpointError(f"run dir {run_dir} was trained with a different config ({'; '.join(differences)}): "
                              "resume with the run's values (train.epochs may grow) or use a new hydra.run.dir")


class _BestCheckpoint:
    """checkpoints/best: the epoch with the highest test accuracy among the epochs done.

    Written in two phases around the epoch's commit point (latest.save), so that it
    never names an epoch a crash makes the run redo, and never loses the previous best
    before the new one counts: save(N) writes ckpt-N beside the current best;
    commit(N), once latest holds epoch N, points the `checkpoint` state file (which
    evaluate.py reads) at ckpt-N and deletes the old best. recover(epochs_done), on every
    (re)start, keeps the highest ckpt-N with N <= epochs_done (best epochs only grow, so
    that is the best as of the restored epoch) and deletes the rest: uncommitted ones
    and any left by a crash between commit's two steps.
    """

    def __init__(self, checkpoint, directory):
        self.checkpoint, self.directory = checkpoint, Path(directory)

    def numbers(self):
        """Epoch numbers N of the ckpt-N in the directory, ascending."""
        names = (p.name[len("ckpt-"):-len(".index")] for p in self.directory.glob("ckpt-*.index"))
        return sorted(int(n) for n in names if n.isdigit())

    def save(self, number):
        self.directory.mkdir(parents=True, exist_ok=True)
        self.checkpoint.write(str(self.directory / f"ckpt-{number}"))

    def commit(self, number):
        self._keep_only(number)

    def recover(self, epochs_done):
        done = [n for n in self.numbers() if n <= epochs_done]
        self._keep_only(done[-1] if done else None)

    def _keep_only(self, number):
        # The state file first (atomically): it must never name a deleted checkpoint.
        state = self.directory / "checkpoint"
        if number is None:
            state.unlink(missing_ok=True)
        else:
            # The CheckpointState text format tf.train.latest_checkpoint reads; relative
            # paths, so a copied or moved run dir still finds its checkpoint.
            temporary = self.directory / "checkpoint.tmp"
            temporary.write_text(f'model_checkpoint_path: "ckpt-{number}"\n'
                                 f'all_model_checkpoint_paths: "ckpt-{number}"\n')
            os.replace(temporary, state)
        for n in self.numbers():
            if n != number:
                # The checkpoint's own files only (an evaluation's ckpt-N.eval.json stays).
                for path in [self.directory / f"ckpt-{n}.index", *self.directory.glob(f"ckpt-{n}.data-*")]:
                    path.unlink(missing_ok=True)


def _read_history(path, epochs_done):
    """Per-epoch metrics of the epochs the checkpoint covers (a killed run may have logged more)."""
    if not path.is_file():
        return []
    by_epoch = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(entry, dict) and 1 <= entry.get("epoch", 0) <= epochs_done:
            by_epoch[entry["epoch"]] = entry
    return [by_epoch[e] for e in sorted(by_epoch)]


class _Window:
    """Example-weighted sums of step values over a window of steps, and the clock of its timed steps."""

    def __init__(self):
        self.sums, self.examples = {}, 0
        self.timed_steps, self.timed_images, self.timed_seconds = 0, 0, 0.0

    def add(self, values, batch):
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + value * batch
        self.examples += batch

    def add_time(self, steps, images, seconds):
        self.timed_steps += steps
        self.timed_images += images
        self.timed_seconds += seconds

    def means(self):
        means = {key: total / max(self.examples, 1) for key, total in self.sums.items()}
        if self.timed_steps and self.timed_seconds > 0:
            means["images_per_sec"] = self.timed_images / self.timed_seconds
            means["step_time_ms"] = 1000.0 * self.timed_seconds / self.timed_steps
        return means


# --------------------------------------------------------------------------- TensorBoard

def _write_hparams(writer, run_dir, cfg, data_cfg):
    from tensorboard.plugins.hparams import api as hp  # noqa: PLC0415  (only needed once)

    values = {
        "custom_op": bool(cfg["custom_op"]),
        "xla": str(cfg["train"]["xla"]),
        "dataset": str(data_cfg["name"]),
        "batch_size": int(cfg["train"]["batch_size"]),
        "routing_iterations": int(cfg["model"]["routing_iterations"]),
        "seed": int(cfg["seed"]),
        "learning_rate": float(cfg["train"]["learning_rate"]),
        "decoder": bool(cfg["model"]["decoder"]),
    }
    with writer.as_default():
        # Every run writes the same experiment config (no per-run domains), so a sweep's
        # runs merge into one HParams table.
        hp.hparams_config(hparams=[hp.HParam(name) for name in HPARAMS],
                          metrics=[hp.Metric(tag) for tag in HPARAM_METRICS])
        hp.hparams(values, trial_id=str(run_dir))


def _write_train_scalars(writer, window, learning_rate, step):
    means = window.means()
    with writer.as_default(step=step):
        for key in ("loss", "margin_loss", "reconstruction_loss", "accuracy", "images_per_sec", "step_time_ms"):
            if key in means:
                tf.summary.scalar(f"train/{key}", means[key])
        tf.summary.scalar("train/learning_rate", learning_rate)


def _write_epoch_summaries(writer, model, test, show_images, tcfg, step):
    outputs = model(show_images, training=False)  # no labels: masked by the prediction, as at test time
    with writer.as_default(step=step):
        for key in ("loss", "margin_loss", "reconstruction_loss", "accuracy", "images_per_sec"):
            tf.summary.scalar(f"test/{key}", test[key])
        n = tcfg["histogram_examples"]
        # The coupling coefficients after the last routing iteration and the class scores.
        tf.summary.histogram("routing/c_ij", outputs["c_ij"][:n])
        tf.summary.histogram("capsules/lengths", outputs["lengths"][:n])
        if "reconstructions" in outputs:
            n = tcfg["num_images"]
            tf.summary.image("reconstructions/inputs_over_reconstructions",
                             image_grid(show_images[:n], outputs["reconstructions"][:n]), max_outputs=1)
    writer.flush()


# --------------------------------------------------------------------------- train

def train(cfg):
    """Train (or resume) the run in cfg["run_dir"]; returns the final metrics (also metrics.json)."""
    # ---- config and setup
    _check_config(cfg)
    model_cfg, data_cfg, tcfg = dict(cfg["model"]), dict(cfg["data"]), dict(cfg["train"])
    run_dir = Path(cfg["run_dir"]).expanduser().resolve()
    seed, custom_op = int(cfg["seed"]), cfg["custom_op"]
    if data_cfg.get("dir") is not None:
        # Absolute, so evaluate.py finds the data from any working directory.
        data_cfg["dir"] = str(Path(data_cfg["dir"]).expanduser().resolve())
    latest_dir = run_dir / "checkpoints" / "latest"
    if tf.train.latest_checkpoint(str(latest_dir)):
        _check_resumable(run_dir, {**cfg, "data": data_cfg})  # before the data is read
    # Before anything touches a device: on a CPU-only machine autoclustering needs a
    # TF_XLA_FLAGS flag that TensorFlow reads once, when it sets up its devices.
    set_autoclustering(tcfg["xla"] == "autocluster")
    if cfg.get("deterministic", False):
        tf.config.experimental.enable_op_determinism()
    elif tf_config.is_op_determinism_enabled():
        # A sweep (-m) runs its jobs in one process: a `true` job must not leave it on for the next.
        tf_config.disable_op_determinism()
    keras.utils.set_random_seed(seed)  # Python, NumPy and TF seeds: the initial weights
    if custom_op:
        check_op_library()
    # The model first: its config errors (model.num_classes=abc) come before the data is read,
    # and check_labels compares the data with the checked values.
    model = build_capsnet(model_cfg, custom_op)

    # ---- data (uint8 in memory; make_dataset scales, shuffles and shifts per (seed, epoch))
    train_images, train_labels = load_split(data_cfg["name"], "train", data_dir=data_cfg.get("dir"),
                                            limit=data_cfg.get("limit_train"))
    test_images, test_labels = load_split(data_cfg["name"], "test", data_dir=data_cfg.get("dir"),
                                          limit=data_cfg.get("limit_test"))
    check_labels(train_labels, train_images, model=model, split=f"{data_cfg['name']} train")
    check_labels(test_labels, test_images, model=model, split=f"{data_cfg['name']} test")
    batch_size = int(tcfg["batch_size"])
    steps_per_epoch = math.ceil(len(train_labels) / batch_size)
    test_ds = make_dataset(test_images, test_labels, batch_size=batch_size, training=False)
    # A fixed set of test images for the reconstruction grid and the histograms, every epoch.
    n_show = min(len(test_labels), max(tcfg["num_images"], tcfg["histogram_examples"]))
    show_images, _ = next(iter(make_dataset(
        test_images[:n_show], test_labels[:n_show], batch_size=n_show, training=False)))

    # ---- optimizer, checkpoints (new or resumed)
    optimizer, schedule = build_optimizer(tcfg, steps_per_epoch, model)
    epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")  # epochs done
    best_accuracy = tf.Variable(-1.0, dtype=tf.float64, trainable=False, name="best_accuracy")
    checkpoint = tf.train.Checkpoint(model=checkpoint_weights(model), optimizer=optimizer, epoch=epoch,
                                     best_accuracy=best_accuracy)
    latest = tf.train.CheckpointManager(checkpoint, str(latest_dir), max_to_keep=tcfg["keep_checkpoints"])
    best = _BestCheckpoint(checkpoint, run_dir / "checkpoints" / "best")
    history_path = run_dir / "history.jsonl"
    resumed_from = latest.latest_checkpoint
    if resumed_from:
        try:
            checkpoint.restore(resumed_from).assert_existing_objects_matched()
        except (tf.errors.OpError, ValueError, AssertionError) as exc:
            raise CheckpointError(f"cannot resume from {resumed_from}: "
                                  f"{str(exc).strip().splitlines()[0]}") from exc
        log.info("resumed from %s: %d of %d epochs done, step %d", resumed_from, int(epoch),
                 tcfg["epochs"], int(optimizer.iterations))
    best.recover(int(epoch))  # drops a best checkpoint of an epoch that is to be redone
    history = _read_history(history_path, int(epoch))
    run_dir.mkdir(parents=True, exist_ok=True)
    saved_cfg = {**cfg, "run_dir": str(run_dir), "data": data_cfg}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved_cfg, sort_keys=False))

    # ---- TensorBoard: one writer per run dir, so `tensorboard --logdir outputs` lists runs side by side
    writer = tf.summary.create_file_writer(str(run_dir))
    if not resumed_from:
        _write_hparams(writer, run_dir, cfg, data_cfg)

    # ---- compiled steps (xla=autocluster switches XLA on for the whole process)
    losses = loss_params(tcfg)
    train_step = make_train_step(model, optimizer, input_shape=model.image_shape, losses=losses, xla=tcfg["xla"])
    eval_step = make_eval_step(model, model.image_shape, jit_compile=tcfg["xla"] == "jit", **losses)
    num_classes = model.num_classes

    # ---- the loop
    test = None
    interactive = sys.stdout.isatty()
    global_step = int(optimizer.iterations)  # counted on the host: reading the variable would wait for the device
    for epoch_index in range(int(epoch), tcfg["epochs"]):
        print(f"epoch {epoch_index + 1}/{tcfg['epochs']}", flush=True)
        # Interactive: a live bar; in a log file: one line per epoch.
        bar = keras.utils.Progbar(steps_per_epoch, verbose=1 if interactive else 2,
                                  stateful_metrics=["loss", "accuracy", "images/s"]) if tcfg["progress_bar"] else None
        train_ds = make_dataset(train_images, train_labels, batch_size=batch_size, training=True,
                                seed=seed, epoch=epoch_index, shift_pixels=data_cfg["shift_pixels"])
        epoch_window, log_window = _Window(), _Window()
        pending = []  # (step outputs still on the device, batch size)
        tick = time.perf_counter()
        for step_in_epoch, (images, labels) in enumerate(train_ds):
            pending.append((train_step(images, labels), int(labels.shape[0])))
            global_step += 1
            log_now = global_step % tcfg["log_every_steps"] == 0
            last = step_in_epoch + 1 == steps_per_epoch
            if not (step_in_epoch == 0 or log_now or last or time.perf_counter() - tick > 1.0):
                continue  # no fetch: the host queues the next step while the device runs this one
            # Fetching the values waits for the device, so the clock now measures finished
            # steps. That happens after the epoch's first step (it traces/compiles the step or
            # refills the shuffle buffer: left out of images/s and step time), at log steps,
            # at the epoch's end and about once a second; not every step, which would make
            # the device idle while the host dispatches the next one.
            fetched = [({k: float(v) for k, v in out.items()}, batch) for out, batch in pending]
            now = time.perf_counter()
            for window in (epoch_window, log_window):
                for values, batch in fetched:
                    window.add(values, batch)
                if step_in_epoch > 0:
                    window.add_time(len(fetched), sum(batch for _, batch in fetched), now - tick)
            pending, tick = [], now
            if log_now:
                # The LR of the next update: the schedule at the step counter.
                _write_train_scalars(writer, log_window, schedule(global_step), global_step)
                log_window = _Window()
            if bar is not None:
                means = epoch_window.means()
                bar.update(step_in_epoch + 1, [("loss", means["loss"]), ("accuracy", means["accuracy"]),
                                               ("images/s", means.get("images_per_sec", float("nan")))])
        assert not pending, "the last step of an epoch is always fetched"
        if log_window.examples:
            _write_train_scalars(writer, log_window, schedule(global_step), global_step)
        train_means = epoch_window.means()

        # Test pass, images and histograms; then the epoch's records, the checkpoint LAST.
        test = evaluate_model(eval_step, test_ds, num_classes)
        _write_epoch_summaries(writer, model, test, show_images, tcfg, global_step)
        epoch.assign(epoch_index + 1)
        is_best = test["accuracy"] > float(best_accuracy)
        if is_best:
            best_accuracy.assign(test["accuracy"])
        entry = {"epoch": epoch_index + 1, "global_step": global_step,
                 "learning_rate": float(schedule(global_step)),
                 **{f"train_{k}": v for k, v in train_means.items()},
                 **{f"test_{k}": test[k] for k in ("loss", "margin_loss", "reconstruction_loss", "accuracy",
                                                   "images_per_sec")}}
        history.append(entry)
        with history_path.open("a") as f:
            f.write(json.dumps(entry) + "\n")  # a redone epoch's line supersedes this one (_read_history)
        if is_best:
            best.save(epoch_index + 1)
        # The commit point: until this checkpoint exists, a restart redoes the epoch.
        latest.save(checkpoint_number=epoch_index + 1)
        if is_best:
            best.commit(epoch_index + 1)
        print(f"epoch {epoch_index + 1}: train loss {train_means['loss']:.4f} acc {train_means['accuracy']:.4f}"
              f" | test loss {test['loss']:.4f} acc {test['accuracy']:.4f}"
              f"{' (best)' if is_best else ''}", flush=True)

    # ---- final metrics
    if test is None:
        # Nothing left to train (a finished run rerun): measure the checkpoint as it is.
        test = evaluate_model(eval_step, test_ds, num_classes)
    train_speeds = [h["train_images_per_sec"] for h in history if "train_images_per_sec" in h]
    best_epoch = max(history, key=lambda h: h["test_accuracy"])["epoch"] if history else None
    metrics = {
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "test_margin_loss": test["margin_loss"],
        "test_reconstruction_loss": test["reconstruction_loss"],
        "test_per_class_accuracy": test["per_class_accuracy"],
        "train_loss": history[-1]["train_loss"] if history else None,
        "train_accuracy": history[-1]["train_accuracy"] if history else None,
        "images_per_sec": float(np.mean(train_speeds)) if train_speeds else None,
        "test_images_per_sec": test["images_per_sec"],
        "best_test_accuracy": float(best_accuracy),
        "best_epoch": best_epoch,
        "epochs": int(epoch),
        "global_step": int(optimizer.iterations),
        "resumed_from": resumed_from,
        "run_dir": str(run_dir),
        "history": history,
    }
    writer.close()
    (run_dir / "metrics.json").write_text(json.dumps(json_safe(metrics), indent=2) + "\n")
    return metrics
