"""One training per run dir: `RunLock`, an exclusive lock on run_dir/train.lock held for the run's life.

Two trainings writing one run dir would interleave their checkpoints, history lines and
state files: each would resume from the other's epochs and silently mix two runs. The
lock is fcntl.flock on the open file, which the kernel releases when the process dies
however it dies (SIGKILL included), so a lock left by a dead run is taken over with
no cleanup step; the file names its holder (pid, host, since when) for the one-line
error a second training gets, and for the notice when a dead holder's lock is taken over.
flock is local to a host (and unreliable over some network file systems): multi-worker
runs take it on the chief only.
"""
import datetime
import fcntl
import os
import socket
from pathlib import Path

from capsnet.errors import CheckpointError

LOCK_NAME = "train.lock"


class RunLock:
    """`RunLock.acquire(run_dir)` or CheckpointError naming the holder; `release()` at the end."""

    def __init__(self, path, file):
        self.path, self.file = path, file

    @classmethod
    def acquire(cls, run_dir, announce=print):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_NAME
        file = path.open("a+")
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
