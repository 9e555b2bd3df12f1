"""The run dir of a training: `RunDir`, everything train() keeps on disk, in one object.

A run dir holds:
    .capsnet-run               the marker: a run of this app (its version); a directory without
                               it (and not empty) is refused (run_lock.check_ours)
    train.lock                 held by the training running in it (capsnet.training.run_lock)
    .hydra/                    Hydra's snapshot of the command (config, hydra, overrides), written by
                               the training holding the lock (configs/hydra/default.yaml turns
                               Hydra's own write off: it would come before the lock)
    config.yaml                the resolved config (evaluate.py rebuilds the model from it)
    events.out.tfevents.*      TensorBoard (capsnet.training.summaries.RunSummaries)
    checkpoints/latest/ckpt-N  the last `train.keep_checkpoints` epochs saved (N = epochs done; every
                               `train.save_every_epochs`th, the last, each new best)
    checkpoints/best/ckpt-N    the epoch with the highest validation accuracy (data.validation_fraction),
                               else the highest test accuracy (of the epochs done)
    checkpoints/interrupted/ckpt-S  Ctrl-C's save of the steps run in an unfinished epoch (S = the
                               global step): a rerun goes on from there, and drops it once that
                               epoch is saved
    history.jsonl              one line of metrics per finished epoch, appended; checked on resume
    metrics.json               the final metrics, written at the end
    evaluations/               evaluate.py's reports (best-ckpt-N.json, ...; capsnet.evaluation.report_path),
                               written by evaluate.py, never by the training: outside checkpoints/, whose
                               files the training deletes as best/ and latest/ move on

Only the chief writes here (the other workers of a multi-worker run save into a scratch dir
of their own, as tf.distribute asks). Every write that fails (a full disk, a read-only
directory) is one CheckpointError naming the file and the reason, and leaves the run
resumable: the epoch's checkpoint is its commit point, written last. How a run resumes and
which config changes it refuses: capsnet.training.checkpoints.
"""
import contextlib
import datetime
import errno
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import tensorflow as tf
import yaml

from capsnet.console import count, say
from capsnet.errors import CheckpointError
from capsnet.scoring import json_safe
from capsnet.training.checkpoints import (BestCheckpoint, check_nothing_committed, check_resumable, checkpoint_damage,
                                         checkpoint_numbers, recover_latest, resume_from, save_or_fail,
                                         write_run_config)
from capsnet.training.run_lock import LOCK_NAME, MARKER_NAME, RunLock, check_ours, write_marker

HISTORY_NAME = "history.jsonl"
# What a restart (train.restart=true) leaves in place: the run dir's own identity and lock.
KEPT_ON_RESTART = (MARKER_NAME, LOCK_NAME)


def write_error(path, exc):
    """The one-line CheckpointError for a failed write of `path` (an OSError, or a TensorFlow
    error whose message ends in the OS's reason: '...; File too large')."""
    reason = getattr(exc, "strerror", None) or (str(getattr(exc, "message", exc)).strip().splitlines()
                                                or [type(exc).__name__])[0].split("; ")[-1]
    if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        reason += " (is the disk full?)"
    return CheckpointError(f"cannot write {path}: {reason}; the last saved checkpoint is unchanged: rerun the same "
                           "command to resume once the cause is fixed")


@contextlib.contextmanager
def writing(path):
    """A write of `path`: an OSError becomes write_error's one line."""
    try:
        yield
    except OSError as exc:
        raise write_error(path, exc) from None


def replace_text(path, text):
    """Write `path` whole (a temporary file, then os.replace: a reader sees the old or the new)."""
    temporary = path.with_name(path.name + ".tmp")
    with writing(path):
        temporary.write_text(text)
        os.replace(temporary, path)


class RunDir:
    """The run dir `path` of a training: `RunDir.open` checks it (ours, resumable with this
    config) before anything is read or written; `take` locks it (the chief) and starts or
    restarts the run; `restore` resumes its checkpoints; then `append_history`, `save_epoch`,
    `save_interrupted` and `finish` (metrics.json) as the run goes; `close` at the end."""

    def __init__(self, path, cfg, lock=None):
        self.path, self.cfg = path, cfg
        self.chief, self.lock, self.scratch = True, lock, None
        self.history, self.resumed_from, self.history_size = [], None, 0
        self.notices = []  # said by take, once the run dir is locked

    @classmethod
    def open(cls, cfg, lock=None):
        """The run dir of `cfg` (data.dir resolved), checked: CheckpointError if it is not
        ours (run_lock.check_ours), or if its checkpoints are of a run this config would not
        continue (check_resumable: the notices of what may change are said by take, once the
        lock is held: a second training refused there says nothing of a resume). `lock`: the
        run dir's RunLock, if the caller holds it already (train.py)."""
        if not str(cfg["run_dir"]).strip():
            raise CheckpointError("the run dir is empty (hydra.run.dir= or run_dir=): name a directory, or leave "
                                  "it out for a new one under outputs/")
        run = cls(Path(cfg["run_dir"]).expanduser().resolve(), cfg, lock)
        # This job's own log (train.py's train.log, opened before train() starts) is no sign of
        # another's, nor is the lock it holds (train.py's, taken before its first log line).
        own = {Path(h.baseFilename).name for h in logging.getLogger().handlers
               if isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent == run.path}
        check_ours(run.path, ignore=own | ({LOCK_NAME} if lock is not None else set()))
        if run.has_checkpoints() and not cfg["train"]["restart"]:
            run.notices = [f"notice: resuming {run.path} with {change} (from the next step on)"
                           for change in check_resumable(run.path, cfg)]  # before the data is read
        return run

    def has_checkpoints(self):
        # By the files, not the state file (which may be lost): recover_latest deals with both.
        return bool(checkpoint_numbers(self.path / "checkpoints" / "latest")
                    or checkpoint_numbers(self.path / "checkpoints" / "interrupted"))

    def take(self, chief, hydra_files=None):
        """Lock the run dir for this training (the chief; RunLock: one training per run dir),
        mark it ours, start over where train.restart=true asks (the old files kept aside),
        refuse a run with a history but no checkpoint, and write Hydra's snapshot
        (`hydra_files`: {name: text} for .hydra/); then says open's notices."""
        self.chief, self.hydra_files = chief, hydra_files
        if not chief:
            self.scratch = tempfile.TemporaryDirectory(prefix="capsnet-worker-")
        elif self.path.is_dir():
            # A run dir that exists (a resumed run's) is locked at once: a second training fails
            # before it reads the data. A new one is made and locked by restore(), so that a
            # config or data error before it leaves no run dir behind.
            self._take_now()
        for notice in self.notices:
            say(notice)

    def _take_now(self):
        hydra_files = self.hydra_files
        if self.lock is None:
            self.lock = RunLock.acquire(self.path, announce=say)
        if not (self.path / "config.yaml").is_file():
            # A run dir written before the marker gets it once its config.yaml is rewritten in
            # today's shape (restore): the marker makes read_run_config strict.
            write_marker(self.path)
        if self.cfg["train"]["restart"]:
            self._set_aside_for_restart()
        elif not self.has_checkpoints():
            self._check_nothing_to_lose()
        for name, text in (hydra_files or {}).items():
            with writing(self.path / ".hydra" / name):
                (self.path / ".hydra").mkdir(exist_ok=True)
            replace_text(self.path / ".hydra" / name, text)

    def _check_nothing_to_lose(self):
        """A run dir without checkpoints must hold no run either: a history or metrics without
        checkpoints/ is a run whose checkpoints were lost, never silently redone."""
        check_nothing_committed(self.path)
        found = [name for name in (HISTORY_NAME, "metrics.json") if (self.path / name).is_file()
                 and (self.path / name).stat().st_size]
        # checkpoints/ is made before the first epoch (restore): a run killed before its first
        # checkpoint has it, empty, and redoes its first epochs.
        if found and not (self.path / "checkpoints").is_dir():
            raise CheckpointError(f"run dir {self.path} holds {' and '.join(found)} of a run but no checkpoint in "
                                  f"{self.path / 'checkpoints' / 'latest'} to resume from: not starting over "
                                  "silently; train.restart=true starts the run over, keeping the old files in a "
                                  "restarted-<time>/ folder of the run dir (or use a new hydra.run.dir)")

    def _set_aside_for_restart(self):
        """train.restart=true: everything of the old run moved into restarted-<time>/."""
        old = [p for p in self.path.iterdir() if p.name not in KEPT_ON_RESTART and not p.name.startswith("restarted-")]
        if not old:
            return
        aside = self.path / f"restarted-{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}"
        with writing(aside):
            aside.mkdir()
            for path in old:
                os.replace(path, aside / path.name)
        say(f"notice: train.restart=true: the run starts over; the old run's files are in {aside}")

    # ---- checkpoints

    def checkpoints_dir(self):
        return self.path / "checkpoints" if self.chief else Path(self.scratch.name) / "checkpoints"

    def restore(self, checkpoint, required, epoch, step_in_epoch, steps_per_epoch):
        """Resume `checkpoint` (tf.train.Checkpoint; `required`: its nodes a resume must find)
        from the newest intact epoch checkpoint, then from a Ctrl-C's mid-epoch checkpoint of
        the epoch after it; repair best/; check and read the history; write config.yaml.
        Returns the checkpoint resumed from (None: a new run)."""
        if self.chief and self.lock is None:
            self._take_now()
        directory = self.checkpoints_dir()
        if self.chief:  # there from the start: a run dir with a history and no checkpoints/ lost them
            with writing(directory / "latest"):
                (directory / "latest").mkdir(parents=True, exist_ok=True)
        # The chief's newest intact checkpoint, on every worker; the chief first repairs what a
        # crash or a damaged disk left (recover_latest: before the manager reads the state file).
        self.resumed_from = recover_latest(self.path / "checkpoints" / "latest", repair=self.chief, announce=say)
        if self.resumed_from is None and self.chief:
            check_nothing_committed(self.path)
        self.latest = tf.train.CheckpointManager(checkpoint, str(directory / "latest"),
                                                 max_to_keep=self.cfg["train"]["keep_checkpoints"])
        self.best = BestCheckpoint(checkpoint, directory / "best")
        self.checkpoint = checkpoint
        if self.resumed_from:
            resume_from(checkpoint, self.resumed_from, required=required)
        # A Ctrl-C's checkpoint in the epoch after the last one saved goes on from its step; an
        # older one (its epoch saved since) is stale.
        interrupted_at = tf.train.latest_checkpoint(str(directory / "interrupted"))
        if interrupted_at is not None and checkpoint_damage(interrupted_at) is None and \
                tf.train.load_checkpoint(interrupted_at).get_tensor("epoch/.ATTRIBUTES/VARIABLE_VALUE") == int(epoch):
            resume_from(checkpoint, interrupted_at, required=required)
            self.resumed_from = interrupted_at
            say(f"resuming epoch {int(epoch) + 1} at step {int(step_in_epoch)} of {steps_per_epoch} "
                f"(interrupted there: {interrupted_at})")
        elif self.chief:
            shutil.rmtree(directory / "interrupted", ignore_errors=True)
        self.history = read_history(self.path / HISTORY_NAME, int(epoch), repair=self.chief)
        # Drops a best checkpoint of an epoch that is to be redone; adopts the last epoch done if
        # it was a new best that a crash kept out of best/.
        self.best.recover(int(epoch), last_was_best=last_epoch_was_best(self.history, int(epoch)),
                          latest_dir=directory / "latest", announce=say)
        if self.chief:
            # train.epochs as run: a rerun asking fewer epochs than were done records the run's own.
            # train.restart is a request of this command, not a property of the run.
            train_cfg = {**self.cfg["train"], "epochs": max(int(self.cfg["train"]["epochs"]), int(epoch)),
                         "restart": False}
            recorded = {**self.cfg, "run_dir": str(self.path), "train": train_cfg}
            with writing(self.path / "config.yaml"):
                write_run_config(self.path, recorded)
            write_marker(self.path)
        return self.resumed_from

    def append_history(self, entry):
        """The epoch's line of history.jsonl (before its checkpoint: a redone epoch's line
        supersedes it, read_history)."""
        self.history.append(entry)
        if self.chief:
            path = self.path / HISTORY_NAME
            with writing(path), path.open("a") as f:
                self.history_size = f.tell()
                f.write(json.dumps(entry) + "\n")

    def save_epoch(self, number, is_best):
        """The epoch's checkpoint (the commit point), and best/ if it is a new best."""
        try:
            saved = save_or_fail(lambda: self.latest.save(checkpoint_number=number),
                                 self.checkpoints_dir() / "latest", number)
        except CheckpointError:
            if self.chief:  # the epoch's history line goes with it: no line of an epoch never saved
                with contextlib.suppress(OSError), (self.path / HISTORY_NAME).open("r+b") as f:
                    f.truncate(self.history_size)
            raise
        if is_best:
            self.best.adopt(number, saved)  # the same files: no second write
            self.best.commit(number)
        return saved

    def drop_interrupted(self):
        """A Ctrl-C's checkpoint, superseded once its epoch is saved (after the commit)."""
        if self.chief:
            shutil.rmtree(self.checkpoints_dir() / "interrupted", ignore_errors=True)

    def save_interrupted(self, global_step):
        """Ctrl-C: the steps run in the unfinished epoch, into checkpoints/interrupted/ckpt-<global step>."""
        directory = self.checkpoints_dir() / "interrupted"
        manager = tf.train.CheckpointManager(self.checkpoint, str(directory), max_to_keep=1)
        save_or_fail(lambda: manager.save(checkpoint_number=global_step), directory, global_step)

    def last_good(self):
        return self.latest.latest_checkpoint

    def finish(self, metrics):
        """metrics.json (the chief); the scratch dir of another worker removed."""
        if self.chief:
            replace_text(self.path / "metrics.json", json.dumps(json_safe(metrics), indent=2) + "\n")

    def close(self):
        if self.scratch is not None:
            self.scratch.cleanup()
            self.scratch = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None


# --------------------------------------------------------------------------- the history

def history_entry(epoch, global_step, learning_rate, train_means, test=None, raw_test=None, collapse=None,
                  validation=None, resumed=None):
    """The epoch's line of history.jsonl: train_* means, and for an epoch with a test pass
    (test not None) its validation_* results where the run holds a validation split out, its
    test_* results (and the trained weights' test_raw_* beside a weight average's test) and
    whether it looked collapsed (collapse_reason: `collapsed`, and the reason as `collapse`).
    An epoch resumed mid-way after a Ctrl-C (`resumed`) carries resumed_at_step and
    train_examples, the examples its train_* means cover."""
    entry = {"epoch": epoch, "global_step": global_step, "learning_rate": learning_rate,
             **{f"train_{k}": v for k, v in train_means.items()}, **(resumed or {})}
    if test is None:
        return entry
    return {**entry,
            **({f"validation_{k}": validation[k] for k in ("loss", "margin_loss", "reconstruction_loss", "accuracy")}
               if validation is not None else {}),
            **{f"test_{k}": test[k] for k in ("loss", "margin_loss", "reconstruction_loss", "accuracy",
                                              "images_per_sec")},
            "test_max_length": test.get("max_length"), "collapsed": collapse is not None,
            **({"collapse": collapse} if collapse is not None else {}),
            **({f"test_raw_{k}": raw_test[k] for k in ("loss", "accuracy")} if raw_test is not None else {})}


def read_history(path, epochs_done, *, repair=False):
    """The history lines of the `epochs_done` epochs the checkpoint covers, checked: one line
    per epoch, epochs 1..epochs_done in order (a line missing, out of order or not JSON is a
    CheckpointError: metrics.json's best epoch and mean speed would be wrong). Lines after them
    (epochs trained but never saved: the run redoes them) and a last line cut short by a kill
    (said in a notice) are cut off the file's end, with repair=True (the chief); the lines
    kept are never rewritten: the file only grows, but for that tail."""
    if not path.is_file():
        if epochs_done:
            raise CheckpointError(f"{path} is missing, and the checkpoint holds {count(epochs_done, 'epoch')}: put "
                                  "the run's history back, or train.restart=true to start over (the old files kept aside)")
        return []
    with writing(path):
        data = path.read_bytes()
    entries, end, torn = [], 0, False
    lines = data.split(b"\n")
    for number, line in enumerate(lines, 1):
        if len(entries) == epochs_done or not line.strip():
            break
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if number == len(lines) or (number == len(lines) - 1 and not lines[-1]):
                torn = True  # the last line, cut short by a kill or a full disk
                break
            raise CheckpointError(f"{path}, line {number}, is not a history line (not JSON): the file was edited "
                                  "or damaged; put the run's history back, or train.restart=true") from None
        if not isinstance(entry, dict) or entry.get("epoch") != len(entries) + 1:
            raise CheckpointError(f"{path}, line {number}: expected the line of epoch {len(entries) + 1}, found "
                                  f"{entry.get('epoch') if isinstance(entry, dict) else entry!r}: a gap in the "
                                  "epochs (lines lost or edited); put the run's history back, or train.restart=true")
        entries.append(entry)
        end += len(line) + 1
    torn = torn or (end < len(data) and not data.endswith(b"\n"))  # a torn line after the epochs done
    if len(entries) < epochs_done:
        raise CheckpointError(f"{path} has lines for {count(len(entries), 'epoch')}, and the checkpoint holds {epochs_done}: "
                              "the history was truncated (metrics.json would name the wrong best epoch); put it "
                              "back, or train.restart=true to start over (the old files kept aside)")
    if torn:
        say(f"notice: the last line of {path} was cut short (a kill or a full disk during its write): dropped")
    if repair and end < len(data):
        with writing(path), path.open("r+b") as f:
            f.truncate(end)
    return entries


def last_epoch_was_best(history, epochs_done):
    """Whether epoch `epochs_done` was a new best: it was tested, and its history line's
    validation accuracy (a run with a validation split), else its test accuracy, beats every
    earlier one (the rule train() saves best/ by)."""
    if not history or history[-1]["epoch"] != epochs_done or "test_accuracy" not in history[-1]:
        return False
    key = "validation_accuracy" if "validation_accuracy" in history[-1] else "test_accuracy"
    earlier = [h[key] for h in history[:-1] if key in h]
    return history[-1][key] > max(earlier, default=-1.0)


def hydra_snapshot(task_cfg, hydra_cfg, overrides):
    """{name: text} of Hydra's .hydra/ files (as Hydra's own _save_config writes them) for RunDir.take."""
    from omegaconf import OmegaConf  # noqa: PLC0415  (train.py only)

    return {"config.yaml": OmegaConf.to_yaml(task_cfg), "hydra.yaml": OmegaConf.to_yaml({"hydra": hydra_cfg}),
            "overrides.yaml": yaml.safe_dump(list(overrides))}
