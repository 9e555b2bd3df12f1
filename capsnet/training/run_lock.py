"""One training per run dir: `RunLock`, an exclusive lock on run_dir/train.lock held for the run's life.

Two trainings writing one run dir would interleave their checkpoints, history lines and
state files: each would resume from the other's epochs and silently mix two runs. The
lock is fcntl.flock on the open file, which the kernel releases when the process dies
however it dies (SIGKILL included), so a lock left by a dead run is taken over with
no cleanup step; the file names its holder (pid, host, since when) for the one-line
error a second training gets, and for the notice when a dead holder's lock is taken over.
flock is local to a host (and unreliable over some network file systems): multi-worker
runs take it on the chief only.

A run dir is ours only if it is empty or holds a run of this app: `check_ours`, before the
lock file or anything else is written into it. Every run dir has a marker file, MARKER_NAME,
naming the app's version (`write_marker`, right after the lock is taken); a run dir written
before the marker existed is recognised by its config.yaml (a capsnet config). Kept free of
TensorFlow: train.py checks the run dir before the seconds-long import.

`make_run_dir` makes a run dir (and a sweep's dir) as Hydra would, a path that cannot be a
directory (under a file, a name over 255 bytes, a read-only place) or a run dir that is
read-only one CheckpointError line: capsnet.cli.RunDirCallback calls it before Hydra's own mkdir.

`finished_run` answers a finished run started again with the same config from its files, before
TensorFlow is imported (train() would say the same after the import, a model and its data).
"""
import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

import yaml

import capsnet
from capsnet.console import count, say
from capsnet.errors import CheckpointError

LOCK_NAME = "train.lock"
MARKER_NAME = ".capsnet-run"
# hydra/launcher=gpus sends a job's stdout to a file in the job's run dir before train.py
# starts (hydra_plugins/capsnet_launcher): that file is the launcher's, not someone else's.
JOB_OUTPUT_ENV = "CAPSNET_JOB_OUTPUT"


def check_ours(run_dir, ignore=()):
    """CheckpointError (one line) unless `run_dir` is missing, an empty directory, or a run dir
    this app wrote (its MARKER_NAME file, or the config.yaml of a run dir written before the
    marker existed): a training never writes into a directory that is someone else's."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise CheckpointError(f"run dir {run_dir} is not a directory: pick another hydra.run.dir")
    try:
        names = sorted(entry.name for entry in run_dir.iterdir())
    except OSError as exc:
        raise CheckpointError(f"cannot read run dir {run_dir}: {exc.strerror or exc}") from None
    job_output = os.environ.get(JOB_OUTPUT_ENV)
    if job_output and Path(job_output).parent.resolve() == run_dir.resolve():
        ignore = {*ignore, Path(job_output).name}
    names = [name for name in names if name not in ignore]  # `ignore`: the caller's own files (its log)
    if not names or MARKER_NAME in names or _written_before_the_marker(run_dir):
        return
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise CheckpointError(f"{run_dir} is not empty and holds no run of this app (no {MARKER_NAME} file; it holds "
                          f"{shown}): not training into it, so nothing there is overwritten; pick a new or empty "
                          "hydra.run.dir")


def _written_before_the_marker(run_dir):
    """Whether run_dir holds the config.yaml (or Hydra's .hydra/config.yaml) of a capsnet run."""
    for candidate in (run_dir / "config.yaml", run_dir / ".hydra" / "config.yaml"):
        try:
            saved = yaml.safe_load(candidate.read_text())
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            continue
        if isinstance(saved, dict) and {"model", "data", "train"} <= set(saved):
            return True
    return False


def write_marker(run_dir):
    """The run dir's MARKER_NAME file (once): this app's run, written by version __version__
    (read here, not at import: a folder shadowing the package has none, and cli.py, which imports
    this module, must get as far as saying so in one line)."""
    marker = Path(run_dir) / MARKER_NAME
    if not marker.is_file():
        try:
            marker.write_text(f"capsnet {capsnet.__version__}\n")
        except OSError as exc:
            raise CheckpointError(f"cannot write {marker}: {exc.strerror or exc}") from None


def make_run_dir(run_dir, what="run dir", key="hydra.run.dir"):
    """Make `run_dir` (and its parents) as Hydra would, or CheckpointError (one line) naming the
    path and the OS's reason, `key` the setting to change; a run dir that exists is refused if
    it cannot be written (a read-only mount or folder): its first write would be the job's log,
    whose failure is a traceback, and a training that cannot save is no training."""
    run_dir = Path(run_dir).expanduser()
    try:
        if run_dir.is_file():
            raise CheckpointError(f"{what} {run_dir} is not a directory: pick another {key}")
        run_dir.mkdir(parents=True, exist_ok=True)  # a name over 255 bytes fails in is_file already
    except OSError as exc:
        above = next((p for p in run_dir.parents if os.path.lexists(p)), None)
        why = f"{above} is a file" if above is not None and not above.is_dir() else exc.strerror or str(exc)
        raise CheckpointError(f"cannot make {what} {run_dir}: {why}; pick another {key}") from None
    if not os.access(run_dir, os.W_OK):
        raise CheckpointError(f"{what} {run_dir} is read-only: a training there could save nothing; make it "
                              f"writable or pick another {key}")


class RunLock:
    """`RunLock.acquire(run_dir)` or CheckpointError naming the holder; `release()` at the end."""

    def __init__(self, path, file):
        self.path, self.file = path, file

    @classmethod
    def acquire(cls, run_dir, announce=print):
        run_dir = Path(run_dir)
        path = run_dir / LOCK_NAME
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            file = path.open("a+")
        except OSError as exc:  # a read-only place, a path too long, a file in the way
            raise CheckpointError(f"cannot write {path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            file.seek(0)
            holder = file.read().strip() or "a process that did not say who it is"
            file.close()
            raise CheckpointError(f"run dir {run_dir} is in use by another training ({holder}; lock file {path}): "
                                  "wait for it to end, or train into another hydra.run.dir") from None
        file.seek(0)
        previous = file.read().strip()
        if previous:
            # A clean end empties the file (release): a name left in it is a holder that died.
            announce(f"notice: taking over the lock of run dir {run_dir} from {previous}, "
                     f"{_liveness(previous)}")
        file.seek(0)
        file.truncate()
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        file.write(f"pid {os.getpid()} on {socket.gethostname()} since {now}\n")
        file.flush()
        return cls(path, file)

    def release(self):
        """Empty the file (the run ended: no holder to name) and unlock it."""
        if self.file.closed:
            return
        self.file.seek(0)
        self.file.truncate()
        self.file.flush()
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def _liveness(holder):
    """Whether the holder named in a lock file ('pid N on HOST since ...') still runs, in words."""
    words = holder.split()
    if len(words) >= 4 and words[0] == "pid" and words[1].isdigit() and words[3] == socket.gethostname():
        try:
            os.kill(int(words[1]), 0)
        except ProcessLookupError:
            return "which is no longer running"
        except PermissionError:
            pass  # alive, another user's: the lock is free all the same
        return "which no longer holds it"
    return "which no longer holds it (another host, or a run that ended without releasing it)"


def complete_run_notice(run_dir, epochs):
    """The line for a finished run started again (its train.epochs all done): nothing to
    train, and how to train it further."""
    return (f"notice: the run {run_dir} is complete ({epochs} of {count(epochs, 'epoch')} done): nothing to train; to "
            f"train it further, rerun with a larger train.epochs=N and the same hydra.run.dir={run_dir}")


def finished_run(cfg):
    """train.py, with the run dir locked and before TensorFlow is imported: the metrics of the
    run in cfg["run_dir"] if it is finished and `cfg` is its config (config.yaml the same but
    for run_dir, data.dir resolved as train() resolves it; train.restart false), with
    complete_run_notice and the `done:` line said; else None, and train() decides (a resume,
    a refused config, a damaged run). Finished, by its files: metrics.json (written after the
    last epoch's checkpoint, and no older than it) of as many epochs as history.jsonl has
    lines, checkpoints/latest/ckpt-<that epoch> there, no Ctrl-C checkpoint of a later step, one
    checkpoint in best/.
    Reads three small files: milliseconds, against train()'s TensorFlow import, model, data and
    test pass (77 s on a busy 2-core CPU)."""
    run_dir = Path(cfg["run_dir"]).expanduser().resolve()
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        metrics = json.loads((run_dir / "metrics.json").read_text())
        lines = (run_dir / "history.jsonl").read_text().splitlines()
        epochs = [json.loads(line)["epoch"] for line in lines if line.strip()]
        index = run_dir / "checkpoints" / "latest" / f"ckpt-{len(epochs)}.index"
        fresh = (run_dir / "metrics.json").stat().st_mtime >= index.stat().st_mtime
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None
    data = dict(cfg["data"])
    if data.get("dir") is not None:
        data["dir"] = str(Path(data["dir"]).expanduser().resolve())
    current = {**cfg, "data": data, "run_dir": None}
    if (not isinstance(saved, dict) or {**saved, "run_dir": None} != current or cfg["train"]["restart"]
            or not fresh or epochs != list(range(1, len(epochs) + 1)) or metrics.get("epochs") != len(epochs)
            or len(epochs) < cfg["train"]["epochs"] or any((run_dir / "checkpoints" / "interrupted").glob("*.index"))
            or len(list((run_dir / "checkpoints" / "best").glob("ckpt-*.index"))) > 1):  # best/ for train() to repair
        return None
    say(complete_run_notice(run_dir, len(epochs)))
    say(f"done: {run_dir} (python evaluate.py checkpoint={run_dir})")
    return metrics
