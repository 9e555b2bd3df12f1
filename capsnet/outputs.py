"""Where evaluate.py's report and export.py's SavedModel may be written, by their paths alone.
No TensorFlow: the entry points check an `output=` here before its seconds-long import, and
capsnet.evaluation and capsnet.export check through here too."""
import os
from pathlib import Path

from capsnet.errors import CheckpointError, ConfigError

# A run dir's own files (capsnet.training.run_dir, run_lock): no report is written over one.
RUN_FILES = ("config.yaml", "history.jsonl", "metrics.json", "train.lock", ".capsnet-run")


def in_run_checkpoints(path):
    """Whether `path` (resolved) is under a run dir's checkpoints/ (a folder beside a config.yaml),
    where no output goes: a training deletes and links files there as best/ and latest/ move on."""
    return any(part.name == "checkpoints" and (part.parent / "config.yaml").is_file() for part in path.parents)


def check_output(output, overwrite=False):
    """An evaluation report's output= path: CheckpointError (one line) for a file of a run
    (config.yaml, history, metrics, the lock and marker, anything under checkpoints/, whose
    files best/ and latest/ share by hard link) and, unless `overwrite`, for any existing file."""
    resolved = output.resolve()
    if in_run_checkpoints(resolved) or (resolved.name in RUN_FILES and (resolved.parent / "config.yaml").is_file()):
        raise CheckpointError(f"output={output} is a file of a run (its config, history, metrics or checkpoints): "
                              "write the report elsewhere (output=null puts it in the run's evaluations/)")
    if output.exists() and not overwrite:
        raise CheckpointError(f"output={output} exists: overwrite=true replaces it, or name another file")


def check_export_output(output):
    """An export's output= directory, absolute: ConfigError (one line) where it is not given,
    exists (an export never overwrites), lies under a file, or inside a run's checkpoints/."""
    if output is None or str(output).strip() == "":
        raise ConfigError("output=... is required: the SavedModel directory to create")
    output = Path(os.path.expanduser(str(output))).absolute()
    if output.exists() or output.is_symlink():
        raise ConfigError(f"output {output} already exists: export writes a new directory and never overwrites one "
                          "(remove it or choose another)")
    for parent in output.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"output {output}: {parent} is not a directory")
            break
    if in_run_checkpoints(output.resolve()):
        raise ConfigError(f"output {output} is inside a run's checkpoints/, whose files a training deletes as best/ "
                          "and latest/ move on: export somewhere else")
    return output
