"""Checkpoints: what a run saves, how a run resumes, and how a checkpoint is found again.

A training checkpoint (tf.train.Checkpoint) holds the model weights keyed by their path
in the model (`checkpoint_weights`, node "model"), the optimizer (Adam's moments and its
step counter), the epoch counter, the best accuracy so far (the validation split's where
the run holds one out, else the test split's: best/ is chosen on it) and, with a weight average,
its weights (node "ema"). `restore_model` loads the weights alone (evaluate.py);
`resolve_checkpoint` maps a run dir or checkpoint path to (prefix, run dir, config).

Resume: rerunning with the same run dir restores model weights, optimizer state
(Adam moments and its step counter, from which the LR schedule follows), the epoch
counter and the best accuracy so far, then continues with the next epoch. The only
randomness after weight initialization is the data's: order and shifts are stateless
functions of (seed, epoch) (capsnet.data), so there is no generator state to save, and
with deterministic=true a resumed run ends bitwise equal to an uninterrupted one.
A run killed mid-epoch loses that epoch only (with train.save_every_epochs=N > 1, also the
epochs trained since the last one saved); Ctrl-C instead saves the steps run into
checkpoints/interrupted/ (the epoch counter, step_in_epoch: the steps of the next epoch
done, and epoch_window: the sums of their metrics, so that the resumed epoch's train means
cover all its steps), and the rerun skips that epoch's first step_in_epoch batches (capsnet.training.epoch). TensorBoard's step is the global step
(optimizer.iterations), so the curves continue where the checkpoint left them.

An epoch ends with: its history line, then checkpoints/latest/ckpt-N (every epoch, or on
train.save_every_epochs' schedule), the commit point: a run killed before it redoes the
epoch, and the history line that epoch wrote is cut off on restart (run_dir.read_history).
Then, if it is the best, best/ckpt-N as links to latest's files (a run killed before that
is repaired on restart: `BestCheckpoint`). SIGTERM ends a run at an epoch's end, saved
(capsnet.training.loop.train). The run dir as a whole (its files, its lock, who writes
it): capsnet.training.run_dir.RunDir.

Resuming refuses a config that would change the run's trajectory (RESUME_KEYS: the
model, the data, the seed, the optimizer and loss values; `check_resumable`) and names
what differs, but for train.learning_rate, which may change with a notice (how a
diverged run continues from its last good checkpoint: RESUME_NOTICE_KEYS); train.epochs (to extend a run), custom_op, train.xla, model.routing,
model.primary_caps_conv, deterministic, logging and progress keys may change, and so may the distribute
strategy and devices (a run started on one GPU may continue on two). A saved config is
read in today's shape (capsnet.config.migrate: keys added since at the defaults it was
trained with, the old routing flags as model.routing).
"""
import dataclasses
import os
import shutil
from pathlib import Path

import tensorflow as tf
import yaml

from capsnet import config
from capsnet.config import WHICH  # a run dir's checkpoints: best (chosen on validation, else test) or latest
from capsnet.config.migrate import ADDED_SINCE_MARKER
from capsnet.data.pipeline import AUGMENTATION_KEYS
from capsnet.errors import CheckpointError, ConfigError
from capsnet.training.run_lock import MARKER_NAME


# --------------------------------------------------------------------------- run config and checkpoint paths

def read_run_config(run_dir):
    """The plain-dict config a run was trained with (its config.yaml), in today's shape (not
    checked: config.check it); None where run_dir has no config.yaml.

    A run dir of this app's marker (run_lock.MARKER_NAME: written by a version that records
    every key) is read strictly: a key missing from config.yaml or unknown to the schema is a
    CheckpointError naming it, never filled with today's default, except the keys added since
    the marker (config.migrate.ADDED_SINCE_MARKER). A run dir written before the marker gets
    the keys added since at the defaults it was trained with (config.migrate).
    Hydra's .hydra/config.yaml is not the run's config (unresolved: `${dataset_shape:...}`)."""
    candidate = Path(run_dir) / "config.yaml"
    if not candidate.is_file():
        if (Path(run_dir) / ".hydra" / "config.yaml").is_file() and (Path(run_dir) / "checkpoints").is_dir():
            raise CheckpointError(f"run dir {run_dir} has no config.yaml (the run's resolved config, which "
                                  "rebuilds its model): put it back; .hydra/config.yaml is the command's, unresolved")
        return None
    try:
        cfg = yaml.safe_load(candidate.read_text())
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot parse the run config {candidate}: {exc}".splitlines()[0]) from exc
    if not isinstance(cfg, dict) or "model" not in cfg:
        raise CheckpointError(f"the run config {candidate} has no model section")
    if (Path(run_dir) / MARKER_NAME).is_file():
        _check_keys(cfg, candidate)
    try:
        return config.migrate(cfg)
    except ConfigError as exc:  # old routing flags that were never valid together
        raise ConfigError(f"the run config of {run_dir}: {exc}") from exc


def _check_keys(saved, path):
    """CheckpointError naming the first key of the schema (capsnet.config.TrainAppConfig) that
    `saved` lacks, or that it has and the schema does not. A key added since run dirs were
    marked (config.migrate.ADDED_SINCE_MARKER) may be missing: migrate gives it the default
    the run was trained with."""
    for field in dataclasses.fields(config.TrainAppConfig):
        if field.name not in saved:
            raise CheckpointError(f"the run config {path} has no key {field.name}: was it edited? put the run's "
                                  "config.yaml back")
        if dataclasses.is_dataclass(field.type):
            section = saved[field.name] if isinstance(saved[field.name], dict) else {}
            names = [f.name for f in dataclasses.fields(field.type)]
            for name in names:
                if name not in section and f"{field.name}.{name}" not in ADDED_SINCE_MARKER:
                    raise CheckpointError(f"the run config {path} has no key {field.name}.{name}: was it edited? "
                                          "put the run's config.yaml back")
            unknown = sorted(set(section) - set(names))
            if unknown:
                raise CheckpointError(f"the run config {path} has an unknown key {field.name}.{unknown[0]}: was it "
                                      "edited? put the run's config.yaml back")
    unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(config.TrainAppConfig)})
    if unknown:
        raise CheckpointError(f"the run config {path} has an unknown key {unknown[0]}: was it edited? put the "
                              "run's config.yaml back")


def write_run_config(run_dir, cfg):
    """config.yaml: the resolved config of the run (read_run_config; evaluate.py rebuilds the model from it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    # Replaced whole (os.replace): other workers may be reading it (check_resumable).
    temporary = run_dir / "config.yaml.tmp"
    temporary.write_text(yaml.safe_dump(cfg, sort_keys=False))
    os.replace(temporary, run_dir / "config.yaml")


def _is_checkpoint_prefix(path):
    return Path(str(path) + ".index").is_file()


def default_which(run_dir):
    """A run dir's checkpoint when none is asked for: best where the run chose it on a
    validation split (data.validation_fraction), else latest, the final one: a best/ chosen
    on the test set makes the test accuracy reported for it optimistic."""
    cfg = read_run_config(run_dir)
    return "best" if cfg is not None and (cfg.get("data") or {}).get("validation_fraction") else "latest"


def best_chosen_on(prefix, cfg):
    """What the checkpoint at `prefix` of the run of config `cfg` was chosen on: "validation"
    or "test" for a run's checkpoints/best/ckpt-N (the run's data.validation_fraction says
    which), None for any other."""
    if Path(prefix).parent.name != "best" or Path(prefix).parent.parent.name != "checkpoints":
        return None
    return "validation" if (cfg.get("data") or {}).get("validation_fraction") else "test"


def resolve_checkpoint(checkpoint, which=None):
    """Map a run dir or a checkpoint path to (checkpoint prefix, run dir, run config).

    A run dir uses checkpoints/best or checkpoints/latest (`which`; None: default_which);
    a directory holding a TF `checkpoint` state file uses its newest checkpoint;
    a prefix (`.../ckpt-3`, or its `.index` file) is used as is. The run config is
    looked up in the checkpoint's parent directories.
    """
    if which is not None and which not in WHICH:
        raise ConfigError(f"which must be one of {', '.join(WHICH)}, got {which!r}")
    path = Path(os.path.expanduser(str(checkpoint)))
    if path.suffix == ".index":
        path = path.with_suffix("")
    if path.is_dir() and (path / "checkpoints").is_dir():
        which = which or default_which(path)
        managed = path / "checkpoints" / which
        prefix = _newest_named(managed)
        if prefix is None:
            raise CheckpointError(f"run dir {path} has no {which} checkpoint in {managed}")
    elif path.is_dir():
        prefix = _newest_named(path)
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
    seen = _is_checkpoint_prefix(prefix)  # its files gone later: replaced, not damaged (_check_intact)
    # The run dir is the nearest ancestor holding the run's config.
    for parent in list(Path(prefix).parents)[:4]:
        cfg = read_run_config(parent)
        if cfg is not None:
            _check_intact(prefix, parent, seen)
            return prefix, parent, cfg
    raise CheckpointError(f"no config.yaml for checkpoint {prefix} in its run dir: cannot rebuild the model")


def _newest_named(directory):
    """The checkpoint `directory`'s state file names (tf.train.latest_checkpoint); with no
    usable state file (missing, empty, garbage), the newest ckpt-N by its files, with a
    notice: a lost state file must not hide the checkpoints beside it."""
    named, problem = read_state(directory)
    if problem is None or not checkpoint_numbers(directory):
        return named
    newest = str(Path(directory) / f"ckpt-{checkpoint_numbers(directory)[-1]}")
    print(f"notice: the checkpoint state file {Path(directory) / 'checkpoint'} is {problem}: using the newest "
          f"checkpoint by its files, {newest}", flush=True)
    return newest


def _check_intact(prefix, run_dir, seen=True):
    """CheckpointError naming the damaged file, and the intact checkpoints of the run that
    could be used instead, if `prefix` does not read whole (checkpoint_damage). Checked
    before TensorFlow restores from it: a failed restore reports a misleading mismatch and
    leaves a screenful of warnings about unrestored values. A checkpoint whose index file
    was there when it was resolved (`seen`), or that its directory's state file no longer
    names, and is gone now was replaced by a training, not damaged (replaced_while_reading)."""
    damage = checkpoint_damage(prefix)
    if damage is None:
        return
    if not _is_checkpoint_prefix(prefix) and (seen or read_state(Path(prefix).parent)[0] != prefix):
        raise replaced_while_reading(prefix)
    others = [str(Path(p).relative_to(run_dir)) if Path(p).is_relative_to(run_dir) else p
              for p in intact_checkpoints(run_dir) if p != str(prefix)]
    instead = (f"intact checkpoints of {run_dir}: {', '.join(others)} (pass one as checkpoint=)" if others
               else f"{run_dir} has no intact checkpoint")
    raise CheckpointError(f"{damage}: cannot load {prefix}; {instead}")


def intact_checkpoints(run_dir):
    """Every ckpt-N under run_dir/checkpoints (best/, then latest/, newest first) that reads whole."""
    found = []
    for which in ("best", "latest"):
        directory = Path(run_dir) / "checkpoints" / which
        found += [str(directory / f"ckpt-{n}") for n in reversed(checkpoint_numbers(directory))]
    return [prefix for prefix in found if checkpoint_damage(prefix) is None]


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


def replaced_while_reading(prefix):
    """The CheckpointError for checkpoint `prefix` whose files went between resolve_checkpoint
    and reading them: a training writing its run dir moved best/ on (BestCheckpoint.commit
    deletes the previous best's files) or pruned latest/ (train.keep_checkpoints). Neither
    the checkpoint nor the run's config is at fault: the same command finds the new one."""
    return CheckpointError(f"checkpoint {prefix} was replaced while it was being read (a training is writing this "
                           f"run: its {Path(prefix).parent.name}/ moved on): run again, or give which=latest or a "
                           "checkpoint path")


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
        if not _is_checkpoint_prefix(prefix):  # resolved with its files, gone now: not the config's fault
            raise replaced_while_reading(prefix) from exc
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"cannot load the model from checkpoint {prefix}: {message} "
            f"(does the run's config.yaml match the checkpoint?)") from exc
    return int(epoch.numpy())


def resume_from(checkpoint, prefix, required=None):
    """Restore all of a training checkpoint (weights, optimizer, counters) to continue the
    run: CheckpointError if the file does not match what this run builds. `required`:
    {node: trackable}, the nodes of `checkpoint` that the file must have; the others are
    restored where it has them and left as they are where it has not (mixed_float16's loss
    scale: a float32 run's checkpoint has none). None: every node is required."""
    try:
        if required is None:
            checkpoint.restore(prefix).assert_existing_objects_matched()
        else:
            # Checked, then marked partial: the file's other values (the counters, the rest of
            # `checkpoint`) are restored below, and TensorFlow would warn, as this object is
            # deleted, that they were never read.
            tf.train.Checkpoint(**required).restore(prefix).assert_existing_objects_matched().expect_partial()
            checkpoint.restore(prefix).expect_partial()  # the rest, and the save counter
    except (tf.errors.OpError, ValueError, AssertionError) as exc:
        raise CheckpointError(f"cannot resume from {prefix}: {str(exc).strip().splitlines()[0]}") from exc


# --------------------------------------------------------------------------- damaged checkpoints, the state file

def checkpoint_numbers(directory):
    """The numbers N of the ckpt-N.index files in `directory`, ascending (the files, not the
    state file: what is on disk whatever the state file says)."""
    names = (p.name[len("ckpt-"):-len(".index")] for p in Path(directory).glob("ckpt-*.index"))
    return sorted(int(n) for n in names if n.isdigit())


def checkpoint_damage(prefix):
    """None if the checkpoint at `prefix` reads back whole, else one line naming its damaged
    file and what is wrong.

    Every tensor is read: TensorFlow checks each against the CRC32C stored in the index,
    so a truncated, emptied or overwritten .data file is found here, not halfway through
    a restore (a zero-byte or random-byte .index fails to open at all). Reading a
    checkpoint of the paper model takes well under a second.
    """
    index = Path(f"{prefix}.index")
    try:
        reader = tf.train.load_checkpoint(str(prefix))
    except (tf.errors.OpError, ValueError, IndexError, OSError) as exc:
        return f"checkpoint file {index} is damaged ({_reason(exc)})"
    try:
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except (tf.errors.OpError, ValueError, IndexError, OSError) as exc:
        data = sorted(Path(prefix).parent.glob(f"{Path(prefix).name}.data-*"))
        named = ", ".join(str(p) for p in data) if data else f"{prefix}.data-*"
        return f"checkpoint file {named} is damaged ({_reason(exc)})"
    return None


def _reason(exc):
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "Read less bytes than requested" in text:
        return "shorter than its index says: truncated or emptied"
    if "No such file" in text:
        return "missing"
    return text.split(": ")[-1] if "Checksum does not match" in text else text


def read_state(directory):
    """(the checkpoint the `checkpoint` state file names, None) or (None, why it cannot be used)."""
    state = Path(directory) / "checkpoint"
    if not state.is_file():
        return None, "missing"
    try:
        named = tf.train.get_checkpoint_state(str(directory))
    except (ValueError, tf.errors.OpError, UnicodeDecodeError) as exc:  # empty, or not the text format
        return None, f"unreadable ({_reason(exc)})"
    if named is None or not named.model_checkpoint_path:
        return None, "unreadable (it names no checkpoint)"
    # get_checkpoint_state has already put `directory` in front of a relative name (as
    # tf.train.latest_checkpoint and CheckpointManager read it): used as it comes, it is
    # relative where `directory` is (evaluate.py outputs/<date>/<time>).
    return named.model_checkpoint_path, None


def write_state(directory, number, numbers):
    """Point the `checkpoint` state file of `directory` at ckpt-`number`, listing ckpt-`numbers`
    (the CheckpointState text format tf.train.latest_checkpoint and CheckpointManager read;
    relative paths, so a copied or moved run dir still finds its checkpoints). Replaced
    whole (os.replace): a kill leaves the old state file or the new one."""
    directory = Path(directory)
    temporary = directory / "checkpoint.tmp"
    temporary.write_text(f'model_checkpoint_path: "ckpt-{number}"\n'
                         + "".join(f'all_model_checkpoint_paths: "ckpt-{n}"\n' for n in numbers))
    os.replace(temporary, directory / "checkpoint")


def remove_orphans(directory):
    """Remove what a save killed halfway leaves: `<prefix>_temp/` directories (a save writes
    its shards there and moves them into place at the end), TensorFlow's `*.tempstate*`
    files (an index or state file written under a temporary name, then renamed),
    checkpoint.tmp (write_state's) and ckpt-N.*.tmp (BestCheckpoint.adopt's)."""
    for path in Path(directory).glob("*_temp"):
        shutil.rmtree(path, ignore_errors=True)
    for path in [*Path(directory).glob("*.tempstate*"), *Path(directory).glob("ckpt-*.tmp"),
                 Path(directory) / "checkpoint.tmp"]:
        path.unlink(missing_ok=True)


def _number(prefix):
    """N of a checkpoint prefix .../ckpt-N (None: no prefix, or another name)."""
    number = Path(prefix).name[len("ckpt-"):] if prefix is not None else ""
    return int(number) if number.isdigit() else None


def _set_aside(prefix):
    """Rename a damaged checkpoint's files to <name>.damaged: out of the way of the run
    (which may save the same number again) but kept, not deleted."""
    for path in [Path(f"{prefix}.index"), *Path(prefix).parent.glob(f"{Path(prefix).name}.data-*")]:
        if path.exists():
            os.replace(path, path.with_name(path.name + ".damaged"))


def recover_latest(directory, *, repair=True, announce=print):
    """The checkpoint a run resumes from in `directory` (checkpoints/latest), or None when it
    holds none: the newest ckpt-N whose files read whole (checkpoint_damage).

    What a crash or a damaged disk may leave is dealt with here, each with a notice:
    orphaned `_temp` directories of a killed save are removed; a newer checkpoint that
    is damaged is set aside as *.damaged and the run resumes from the newest intact one;
    a `checkpoint` state file that is missing, empty or garbage, or that does not name
    that checkpoint (a kill between a save and its record), is rebuilt from the files.
    Checkpoint files of which none reads whole are a CheckpointError: the run never
    silently starts over. repair=False (a worker that is not the chief) changes nothing
    on disk.
    """
    directory = Path(directory)
    if repair:
        remove_orphans(directory)
    numbers = checkpoint_numbers(directory)
    if not numbers:
        return None
    damaged = []
    for number in reversed(numbers):
        prefix = str(directory / f"ckpt-{number}")
        damage = checkpoint_damage(prefix)
        if damage is None:
            break
        damaged.append((prefix, damage))
    else:
        raise CheckpointError(f"no checkpoint in {directory} can be read ({'; '.join(d for _, d in damaged)}): "
                              "cannot resume; move the run dir away (or use a new hydra.run.dir) to start over")
    for bad, damage in damaged:
        announce(f"notice: {damage}: set aside as {Path(bad).name}.*.damaged; resuming from {prefix}")
        if repair:
            _set_aside(bad)
    named, problem = read_state(directory)
    if named != prefix and repair:
        if problem is not None:
            announce(f"notice: the checkpoint state file {directory / 'checkpoint'} is {problem}: rebuilt from "
                     f"the ckpt-*.index files (newest intact: {prefix})")
        elif not damaged and not _is_checkpoint_prefix(named):
            # The state file names a newer checkpoint whose index file is gone (deleted, or lost
            # with its disk): its epochs are redone, not "saved but not recorded".
            announce(f"notice: {directory / 'checkpoint'} names {named}, whose index file {named}.index is "
                     f"missing: resuming from {prefix}, the newest checkpoint there (the epochs after it are "
                     "trained again)")
        elif not damaged:
            announce(f"notice: {prefix} was saved but not yet recorded in {directory / 'checkpoint'} "
                     f"(named {named}): resuming from it")
        write_state(directory, number, [n for n in numbers if n <= number])
    return prefix


def check_nothing_committed(run_dir):
    """Before a run starts from scratch in run_dir (no latest/ checkpoint): CheckpointError if
    best/ holds a committed checkpoint (its state file names one), which starting over would
    delete (BestCheckpoint.recover(0)): latest/ was lost, not never written. An uncommitted
    best/ckpt-1 (no state file: a run dir of a version that wrote best/ before the commit
    point) is the first epoch's to redo, and goes."""
    best_dir = Path(run_dir) / "checkpoints" / "best"
    named, _ = read_state(best_dir)
    if named is not None and checkpoint_numbers(best_dir):
        raise CheckpointError(f"run dir {run_dir} has a best checkpoint ({named}) but no checkpoint in "
                              f"{Path(run_dir) / 'checkpoints' / 'latest'} to resume from: not starting over, "
                              "which would delete it; put checkpoints/latest back, or train into a new hydra.run.dir")


def save_or_fail(save, directory, number):
    """Run `save()` (a checkpoint write of ckpt-`number` into `directory`); a write that fails
    (a full disk: OSError or TensorFlow's ResourceExhausted/other errors) removes what it
    left (its _temp directory, a partial ckpt-`number`) and is one CheckpointError naming
    the directory. The state file is written only after a successful write, so it still
    names the last good checkpoint."""
    try:
        return save()
    except (OSError, tf.errors.OpError) as exc:
        remove_orphans(directory)
        named, _ = read_state(directory)
        if named != str(Path(directory) / f"ckpt-{number}"):
            for path in [Path(directory) / f"ckpt-{number}.index", *Path(directory).glob(f"ckpt-{number}.data-*")]:
                path.unlink(missing_ok=True)
        raise CheckpointError(f"cannot save checkpoint ckpt-{number} into {directory}: {_reason(exc)} "
                              "(is the disk full?); the last saved checkpoint there is unchanged") from exc


# --------------------------------------------------------------------------- resume rules

# What a resumed run must share with the run it continues: everything that changes the
# trajectory of the weights. The model section is compared whole, except model.routing
# (how routing is computed, not what: the same W and the same math).
RESUME_KEYS = {
    "data": ("name", "dir", "limit_train", "limit_test", "validation_fraction", "test_fraction", *AUGMENTATION_KEYS),
    "train": ("batch_size", "drop_remainder", "learning_rate", "lr_schedule", "m_plus", "m_minus", "lambda_",
              "reconstruction_weight", "weight_decay", "ema_decay"),
}
RESUME_FREE_MODEL_KEYS = ("routing", "primary_caps_conv")  # how, not what, it computes; routing: its backend alone
# What each train.lr_schedule reads besides the learning rate: a resume keeps the keys of the
# run's schedule and may change the other's. The cosine schedule ends at train.epochs (moving
# the end would jump the rate); the exponential one has no end, so its run may be extended.
SCHEDULE_RESUME_KEYS = {"exponential": ("lr_decay_rate", "lr_decay_steps", "lr_staircase", "lr_decay_floor"),
                        "cosine": ("warmup_epochs", "epochs")}
# Of RESUME_KEYS, what a resume may change with a notice: lowering the learning rate is
# how a run that diverged (TrainingDiverged) continues from its last good checkpoint.
# The optimizer's schedule is rebuilt from the config (the checkpoint holds Adam's
# moments and step counter, not the rate), so the new rate applies from the next step.
RESUME_NOTICE_KEYS = ("train.learning_rate",)


def _resume_values(cfg, schedules):
    """{dotted key: value} of a config over what a resume must not change, with the keys of
    the LR `schedules` (tuples as lists, as they come back from config.yaml). A saved config
    is compared in today's shape (config.migrate: a key added since at the value the run was
    trained with)."""
    cfg = config.migrate(cfg)

    def section(name):
        values = cfg.get(name)
        return values if isinstance(values, dict) else {}

    values = {"seed": cfg.get("seed")}
    values.update({f"model.{k}": v for k, v in section("model").items() if k not in RESUME_FREE_MODEL_KEYS})
    # The routing algorithm and its options (leaky, ...) change the math; only the backend is
    # free. A run saved before routing was a section had dynamic routing, not leaky.
    routing = section("model").get("routing")
    routing = routing if isinstance(routing, dict) else {"algorithm": "dynamic", "leaky": False}
    values.update({f"model.routing.{k}": v for k, v in routing.items() if k != "backend"})
    for name, keys in RESUME_KEYS.items():
        values.update({f"{name}.{k}": section(name).get(k) for k in keys})
    values.update({f"train.{k}": section("train").get(k)
                   for schedule in schedules for k in SCHEDULE_RESUME_KEYS.get(schedule, ())})
    # Of distribute, only what sets the learning rate: the strategy, devices and all-reduce
    # do not change the trajectory (a run may move from one GPU to several and back).
    distribute = section("distribute")
    values["distribute.scale_lr"] = distribute["scale_lr"]
    if distribute["scale_lr"] != "none":  # the base batch matters only when it scales
        values["distribute.lr_base_batch_size"] = distribute["lr_base_batch_size"]
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def _config_differences(saved, current):
    """{key: 'key: old -> new'} for every resume-relevant value that differs (a missing key
    counts); of the LR schedules' keys, those of the saved run's schedule (a change of
    schedule is itself a difference). `saved` as read_run_config gives it: in today's shape."""
    schedules = [saved["train"].get("lr_schedule")]
    saved, current = _resume_values(saved, schedules), _resume_values(current, schedules)

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
        # Not .hydra/config.yaml: the snapshot of THIS command's config, so it would always
        # agree. Without the run's
        # own record a changed seed or learning rate would continue unnoticed.
        raise CheckpointError(f"run dir {run_dir} has checkpoints but no config.yaml: cannot check that this "
                              "config continues the same run (seed, model, data, learning rate); put the run's "
                              "config.yaml back, or train into a new hydra.run.dir")
    saved = read_run_config(run_dir)  # a corrupt config.yaml → CheckpointError
    differences = _config_differences(saved, cfg)
    refused = [line for key, line in differences.items() if key not in RESUME_NOTICE_KEYS]
    if refused:
        # Of the keys compared, those that may change: train.epochs where the run's schedule has no end
        # (SCHEDULE_RESUME_KEYS), and RESUME_NOTICE_KEYS.
        extends = "epochs" not in SCHEDULE_RESUME_KEYS.get(saved["train"].get("lr_schedule"), ())
        may_change = ["train.epochs may grow"] * extends + [f"{key} may change" for key in RESUME_NOTICE_KEYS]
        raise CheckpointError(f"run dir {run_dir} was trained with a different config ({'; '.join(refused)}): "
                              f"resume with the run's values ({'; '.join(may_change)}) or use a new hydra.run.dir")
    return [line for key, line in differences.items() if key in RESUME_NOTICE_KEYS]


# --------------------------------------------------------------------------- the best checkpoint

class BestCheckpoint:
    """checkpoints/best: the epoch with the highest validation accuracy (a run with
    data.validation_fraction), else test accuracy, among the epochs done.

    Written after the epoch's commit point (latest.save), so that it never names an epoch
    a crash makes the run redo, and never loses the previous best before the new one
    counts: adopt(N, latest's ckpt-N) puts ckpt-N beside the current best as hard links
    to latest's files (the same bytes: no second write of the weights and the optimizer's
    state, ~0.3 s an epoch for the paper model on this project's CPU machine; a copy where
    the two directories cannot share files); commit(N) then points the `checkpoint` state
    file (which evaluate.py reads) at ckpt-N and deletes the old best. recover(epochs_done,
    ...), on every (re)start, keeps the highest ckpt-N with N <= epochs_done (best epochs
    only grow, so that is the best as of the restored epoch) and deletes the rest: any left
    by a crash between commit's two steps; and a best epoch whose adoption a crash cut
    short (after the commit point) is adopted then, from latest.
    """

    def __init__(self, checkpoint, directory):
        self.checkpoint, self.directory = checkpoint, Path(directory)

    def numbers(self):
        """Epoch numbers N of the ckpt-N in the directory, ascending."""
        return checkpoint_numbers(self.directory)

    def adopt(self, number, source):
        """best/ckpt-`number` from the checkpoint at prefix `source`: hard links, else copies;
        the data files first and the index last, each put in place whole (a crash leaves
        either no ckpt-N.index, which recover ignores, or the whole checkpoint)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        source = Path(source)
        files = [*sorted(source.parent.glob(source.name + ".data-*")), source.parent / (source.name + ".index")]

        def link_all():
            for path in files:
                target = self.directory / f"ckpt-{number}{path.name[len(source.name):]}"
                if target.exists() and os.path.samefile(path, target):
                    # Linked already (best/ lost only the index): renaming a second link of the
                    # same file onto it does nothing, and would leave the .tmp link behind.
                    continue
                temporary = target.with_name(target.name + ".tmp")
                temporary.unlink(missing_ok=True)
                try:
                    os.link(path, temporary)
                except OSError:
                    shutil.copyfile(path, temporary)
                os.replace(temporary, target)

        save_or_fail(link_all, self.directory, number)

    def commit(self, number):
        self._keep_only(number)

    def recover(self, epochs_done, *, last_was_best=False, latest_dir=None, announce=print):
        """Also: orphaned _temp directories (and a cut-short adoption's *.tmp files) removed,
        and a damaged best checkpoint set aside (*.damaged, with a notice): never deleted;
        where `latest_dir` holds the same epoch intact (its files were best's before the
        damage reached only best's link: a file replaced, not written in place), best/ takes
        it from there again, else the next intact one below it. last_was_best: epoch
        `epochs_done` was a new best (its history line beats every earlier one); if best/
        lacks it (a crash between the commit point and adopt), or lacks the checkpoint its
        state file names (an index file lost), it is adopted from `latest_dir`. A best
        checkpoint of an epoch after `epochs_done` (the run redoes that epoch: latest/ lost
        it) goes, with a notice."""
        remove_orphans(self.directory)
        named = _number(read_state(self.directory)[0])
        for number in self._lost(epochs_done, last_was_best, named):
            source = Path(latest_dir) / f"ckpt-{number}" if latest_dir is not None else None
            if source is not None and _is_checkpoint_prefix(source):
                if number == named:
                    announce(f"notice: {self.directory / f'ckpt-{number}.index'}, which best/'s state file names, "
                             f"is missing: the best checkpoint taken again from {source}")
                self.adopt(number, source)
        # A committed best of an epoch the run redoes (latest/ lost it; an uncommitted one is a
        # crash's leftover and goes unsaid).
        redone = named is not None and named > epochs_done and named in self.numbers()
        if redone:
            announce(f"notice: {self.directory / f'ckpt-{named}'} is of epoch {named}, which the run trains again "
                     f"(it resumes after epoch {epochs_done}): removed; the next epoch that beats the run's best "
                     "test accuracy is recorded in its place")
        done = [n for n in self.numbers() if n <= epochs_done]
        set_aside = False
        while done:
            number = done[-1]
            damage = checkpoint_damage(str(self.directory / f"ckpt-{number}"))
            if damage is None:
                break
            _set_aside(str(self.directory / f"ckpt-{number}"))
            source = Path(latest_dir) / f"ckpt-{number}" if latest_dir is not None else None
            if source is not None and _is_checkpoint_prefix(source) and checkpoint_damage(str(source)) is None:
                announce(f"notice: {damage}: set aside as ckpt-{number}.*.damaged; {source} holds the same epoch "
                         "intact: the best checkpoint taken from it again")
                self.adopt(number, source)
                break
            announce(f"notice: {damage}: set aside as ckpt-{number}.*.damaged; the best checkpoint is now "
                     f"the newest intact one below it, if any (evaluate.py which=latest has the last epoch)")
            done.pop()
            set_aside = True
        if not done and (set_aside or not redone) and (self.directory / "checkpoint").is_file():
            announce(f"notice: {self.directory} holds no intact checkpoint: its state file removed (the next "
                     "epoch that beats the run's best test accuracy records one; which=latest evaluates meanwhile)")
        self._keep_only(done[-1] if done else None)

    def _lost(self, epochs_done, last_was_best, named):
        """The best epochs best/ should hold and has no index file of: the last epoch done
        where it was a new best, and the one best/'s state file names (`named`, up to
        epochs_done)."""
        wanted = {epochs_done} if last_was_best else set()
        if named is not None and named <= epochs_done:
            wanted.add(named)
        return sorted(wanted - set(self.numbers()))

    def _keep_only(self, number):
        # The state file first (atomically): it must never name a deleted checkpoint.
        state = self.directory / "checkpoint"
        if number is None:
            state.unlink(missing_ok=True)
        else:
            write_state(self.directory, number, [number])
        for n in self.numbers():
            if n != number:
                # The checkpoint's own files only: a report an older evaluate.py wrote beside it
                # (ckpt-N.eval.json; evaluate.py now writes into the run's evaluations/) stays.
                for path in [self.directory / f"ckpt-{n}.index", *self.directory.glob(f"ckpt-{n}.data-*")]:
                    path.unlink(missing_ok=True)
