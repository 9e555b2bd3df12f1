"""Checkpoints: what a run saves, how a run resumes, and how a checkpoint is found again.

A training checkpoint (tf.train.Checkpoint) holds the model weights keyed by their path
in the model (`checkpoint_weights`, node "model"), the optimizer (Adam's moments and its
step counter), the epoch counter, the best accuracy so far and, with a weight average,
its weights (node "ema"). `restore_model` loads the weights alone (evaluate.py);
`resolve_checkpoint` maps a run dir or checkpoint path to (prefix, run dir, config).

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
superseded or deleted on restart (`BestCheckpoint`, `read_history`).

Resuming refuses a config that would change the run's trajectory (RESUME_KEYS: the
model, the data, the seed, the optimizer and loss values; `check_resumable`) and names
what differs, but for train.learning_rate, which may change with a notice (how a
diverged run continues from its last good checkpoint: RESUME_NOTICE_KEYS); train.epochs (to extend a run), custom_op, train.xla, model.routing,
deterministic, logging and progress keys may change, and so may the distribute
strategy and devices (a run started on one GPU may continue on two). A saved config is
read in today's shape (capsnet.config.migrate: keys added since at the defaults it was
trained with, the old routing flags as model.routing).
"""
import json
import os
from pathlib import Path

import tensorflow as tf
import yaml

from capsnet import config
from capsnet.config import WHICH  # a run dir's checkpoints: best (the highest test accuracy) or latest
from capsnet.data import AUGMENTATION_KEYS
from capsnet.errors import CheckpointError, ConfigError


# --------------------------------------------------------------------------- run config and checkpoint paths

def read_run_config(run_dir):
    """The plain-dict config a run was trained with (config.yaml, else Hydra's .hydra/config.yaml),
    in today's shape (config.migrate; not checked: config.check it)."""
    for candidate in (Path(run_dir) / "config.yaml", Path(run_dir) / ".hydra" / "config.yaml"):
        if candidate.is_file():
            try:
                cfg = yaml.safe_load(candidate.read_text())
            except yaml.YAMLError as exc:
                raise CheckpointError(f"cannot parse the run config {candidate}: {exc}".splitlines()[0]) from exc
            if not isinstance(cfg, dict) or "model" not in cfg:
                raise CheckpointError(f"the run config {candidate} has no model section")
            try:
                return config.migrate(cfg)
            except ConfigError as exc:  # old routing flags that were never valid together
                raise ConfigError(f"the run config of {run_dir}: {exc}") from exc
    return None


def write_run_config(run_dir, cfg):
    """config.yaml: the resolved config of the run (read_run_config; evaluate.py rebuilds the model from it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    # Replaced whole (os.replace): other workers may be reading it (check_resumable).
    temporary = run_dir / "config.yaml.tmp"
    temporary.write_text(yaml.safe_dump(cfg, sort_keys=False))
    os.replace(temporary, run_dir / "config.yaml")


def _is_checkpoint_prefix(path):
    return Path(str(path) + ".index").is_file()


def resolve_checkpoint(checkpoint, which="best"):
    """Map a run dir or a checkpoint path to (checkpoint prefix, run dir, run config).

    A run dir uses checkpoints/best (or checkpoints/latest with which="latest");
    a directory holding a TF `checkpoint` state file uses its newest checkpoint;
    a prefix (`.../ckpt-3`, or its `.index` file) is used as is. The run config is
    looked up in the checkpoint's parent directories.
    """
    if which not in WHICH:
        raise ConfigError(f"which must be one of {', '.join(WHICH)}, got {which!r}")
    path = Path(os.path.expanduser(str(checkpoint)))
    if path.suffix == ".index":
        path = path.with_suffix("")
    if path.is_dir() and (path / "checkpoints").is_dir():
        managed = path / "checkpoints" / which
        prefix = tf.train.latest_checkpoint(str(managed))
        if prefix is None:
            raise CheckpointError(f"run dir {path} has no {which} checkpoint in {managed}")
    elif path.is_dir():
        prefix = tf.train.latest_checkpoint(str(path))
        if prefix is None:
            raise CheckpointError(
                f"no checkpoint in {path}: expected a run dir (with checkpoints/) or a checkpoint path like "
                f".../checkpoints/latest/ckpt-3")
    elif _is_checkpoint_prefix(path):
        prefix = str(path)
    else:
        raise CheckpointError(
            f"checkpoint not found: {checkpoint} (expected a run dir or a checkpoint path like "
            f".../checkpoints/latest/ckpt-3)")
    # The run dir is the nearest ancestor holding the run's config.
    for parent in list(Path(prefix).parents)[:4]:
        cfg = read_run_config(parent)
        if cfg is not None:
            return prefix, parent, cfg
    raise CheckpointError(f"no config.yaml for checkpoint {prefix} in its run dir: cannot rebuild the model")


def checkpoint_weights(model):
    """The model's weights by their path inside the model ("decoder/fc1/kernel"), for tf.train.Checkpoint.

    This dict, not the Keras model object, is what training checkpoints hold: it keys
    every weight by a stable, readable name that follows the layer names, not the
    Python attributes that hold the layers, and it is the checkpoint format (existing
    run dirs load through it). Checkpointing the model object itself also sees every
    weight now (the layers hold no sublayers in Python lists, which Keras 3 hides from
    tf.train.Checkpoint), but under other names.
    """
    weights = {}
    for variable in model.weights:
        path = variable.path
        name = path[len(model.name) + 1:] if path.startswith(model.name + "/") else path
        if name in weights:
            raise RuntimeError(f"two model weights share the path {name!r}: checkpoint names must be unique")
        weights[name] = variable
    return weights


# evaluate(weights=...): the trained weights (checkpoint node "model") or their moving
# average (node "ema", kept by runs with train.ema_decay > 0; the same names below it).
WEIGHTS = {"raw": "model", "ema": "ema"}


def restore_model(model, prefix, weights="raw"):
    """Load the model weights (only) from a training checkpoint: the trained ones (weights="raw")
    or their moving average ("ema"); returns the epoch it was saved at."""
    epoch = tf.Variable(0, dtype=tf.int64, trainable=False)
    checkpoint = tf.train.Checkpoint(**{WEIGHTS[weights]: checkpoint_weights(model)}, epoch=epoch)
    try:
        status = checkpoint.read(prefix)
        # The optimizer state in the file is not needed here (expect_partial), but every
        # model weight must come from the file: a silent miss would evaluate random weights.
        status.expect_partial()
        status.assert_existing_objects_matched()
    except (tf.errors.OpError, ValueError, AssertionError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"cannot load the model from checkpoint {prefix}: {message} "
            f"(does the run's config.yaml match the checkpoint?)") from exc
    return int(epoch.numpy())


def resume_from(checkpoint, prefix):
    """Restore all of a training checkpoint (weights, optimizer, counters) to continue the
    run: CheckpointError if the file does not match what this run builds."""
    try:
        checkpoint.restore(prefix).assert_existing_objects_matched()
    except (tf.errors.OpError, ValueError, AssertionError) as exc:
        raise CheckpointError(f"cannot resume from {prefix}: {str(exc).strip().splitlines()[0]}") from exc


# --------------------------------------------------------------------------- resume rules

# What a resumed run must share with the run it continues: everything that changes the
# trajectory of the weights. The model section is compared whole, except model.routing
# (how routing is computed, not what: the same W and the same math).
RESUME_KEYS = {
    "data": ("name", "dir", "limit_train", "limit_test", *AUGMENTATION_KEYS),
    "train": ("batch_size", "learning_rate", "lr_decay_rate", "lr_decay_steps", "lr_staircase",
              "m_plus", "m_minus", "lambda_", "reconstruction_weight", "ema_decay"),
}
RESUME_FREE_MODEL_KEYS = ("routing",)
# Of RESUME_KEYS, what a resume may change with a notice: lowering the learning rate is
# how a run that diverged (TrainingDiverged) continues from its last good checkpoint.
# The optimizer's schedule is rebuilt from the config (the checkpoint holds Adam's
# moments and step counter, not the rate), so the new rate applies from the next step.
RESUME_NOTICE_KEYS = ("train.learning_rate",)


def _resume_values(cfg):
    """{dotted key: value} of a config over what a resume must not change (tuples as lists,
    as they come back from config.yaml). A saved config is compared in today's shape
    (config.migrate: a key added since at the value the run was trained with)."""
    cfg = config.migrate(cfg)

    def section(name):
        values = cfg.get(name)
        return values if isinstance(values, dict) else {}

    values = {"seed": cfg.get("seed")}
    values.update({f"model.{k}": v for k, v in section("model").items() if k not in RESUME_FREE_MODEL_KEYS})
    for name, keys in RESUME_KEYS.items():
        values.update({f"{name}.{k}": section(name).get(k) for k in keys})
    # Of distribute, only what sets the learning rate: the strategy, devices and all-reduce
    # do not change the trajectory (a run may move from one GPU to several and back).
    distribute = section("distribute")
    values["distribute.scale_lr"] = distribute["scale_lr"]
    if distribute["scale_lr"] != "none":  # the base batch matters only when it scales
        values["distribute.lr_base_batch_size"] = distribute["lr_base_batch_size"]
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def _config_differences(saved, current):
    """{key: 'key: old -> new'} for every resume-relevant value that differs (a missing key counts)."""
    saved, current = _resume_values(saved), _resume_values(current)

    def shown(values, key):
        return repr(values[key]) if key in values else "(absent)"

    return {k: f"{k}: {shown(saved, k)} -> {shown(current, k)}" for k in sorted(set(saved) | set(current))
            if k not in saved or k not in current or saved[k] != current[k]}


def check_resumable(run_dir, cfg):
    """Resuming run_dir with `cfg` (data.dir resolved) must continue the same run: a changed
    seed, model, data or optimizer value would silently mix two runs. CheckpointError
    lists what differs. A changed RESUME_NOTICE_KEYS value (the learning rate) is allowed:
    returns the 'key: old -> new' lines to announce (the run's config.yaml then records
    the new value)."""
    if not (run_dir / "config.yaml").is_file():
        return []  # nothing to compare (a run dir from before config.yaml was written)
    saved = read_run_config(run_dir)  # a corrupt config.yaml → CheckpointError
    differences = _config_differences(saved, cfg)
    refused = [line for key, line in differences.items() if key not in RESUME_NOTICE_KEYS]
    if refused:
        raise CheckpointError(f"run dir {run_dir} was trained with a different config ({'; '.join(refused)}): "
                              "resume with the run's values (train.epochs may grow; train.learning_rate may "
                              "change) or use a new hydra.run.dir")
    return [line for key, line in differences.items() if key in RESUME_NOTICE_KEYS]


# --------------------------------------------------------------------------- the best checkpoint and the history

class BestCheckpoint:
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


def read_history(path, epochs_done):
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
