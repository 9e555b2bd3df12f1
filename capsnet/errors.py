"""User-facing errors.

Anything a user can cause (a bad config value, a missing data dir or checkpoint, a
corrupt file, an unbuilt op library) raises a `CapsnetError` whose message names
what and where in one line. The entry points (train.py, evaluate.py) print that
line and exit with status 2 instead of dumping a traceback.
"""


class CapsnetError(Exception):
    """An error the user can fix; str(err) is a complete one-line explanation."""


class ConfigError(CapsnetError):
    """A config value is invalid."""


class AllReduceError(CapsnetError):
    """The replicas' all-reduce does not run or does not sum (distribute.check_all_reduce):
    the devices' communication library, not a config value, is at fault."""


class DataError(CapsnetError):
    """A dataset cannot be found, downloaded or parsed."""


class CheckpointError(CapsnetError):
    """A checkpoint or run directory is missing or unusable."""


class OpLibraryError(CapsnetError):
    """The compiled op library is missing, stale or unusable."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during training; str(err) is the one line to print: where the run
    stopped and how to resume it. A KeyboardInterrupt, so that whatever catches one still does."""


class Terminated(Interrupted):
    """SIGTERM during training (a job's time limit, a preemption): the run finished and saved
    the epoch it was in, then stopped; str(err) is the one line to print."""


class TrainingDiverged(CapsnetError):
    """A training step's loss or gradients were not finite: training stopped, nothing saved."""


class TrainingCollapsed(CapsnetError):
    """The test results looked collapsed (training.health.collapse_reason) for
    train.collapse_patience epochs in a row: training stopped, that epoch saved."""


class SweepJobsFailed(CapsnetError):
    """Jobs of a parallel sweep (hydra/launcher=gpus) ended with a non-zero exit status."""
