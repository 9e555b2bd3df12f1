"""What the entry points (train.py, evaluate.py, export.py, predict.py) share: one-line errors,
the run dir checked and made before Hydra writes into it (`check_run_dir`, `RunDirCallback`),
and a quiet TensorFlow import.

A user error (a `CapsnetError`, or a Hydra/OmegaConf config error such as an unknown
key) ends the program with ONE line on stderr, `error: <message>`, and exit status 2.
Everything else (a bug) keeps its traceback. `HYDRA_FULL_ERROR=1` or `debug=true`
shows the traceback for user errors too.

This module must not import TensorFlow: config errors are reported before the
seconds-long TensorFlow import.
"""
import contextlib
import functools
import io
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import yaml
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf.errors import OmegaConfBaseException

import capsnet
from capsnet import config
from capsnet.config import describe
from capsnet.console import say
from capsnet.datasets import DATASETS
from capsnet.errors import CapsnetError, CheckpointError, Interrupted, Terminated
from capsnet.training.run_lock import RunLock, check_ours, make_run_dir

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a program stopped by Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM: a training stopped, saved, at the end of an epoch (errors.Terminated)

# The user's own HYDRA_FULL_ERROR, read before run() sets it for its own purposes.
_user_full_error_value = os.environ.get("HYDRA_FULL_ERROR")
_user_full_error = _user_full_error_value == "1"


def _full_errors_requested():
    return _user_full_error


def user_environ():
    """This process's environment as the user gave it, without the HYDRA_FULL_ERROR that run()
    sets for itself: for the processes it starts (a sweep job of hydra/launcher=gpus), which
    would otherwise print tracebacks instead of one-line errors."""
    env = dict(os.environ)
    env.pop("HYDRA_FULL_ERROR", None)
    if _user_full_error_value is not None:
        env["HYDRA_FULL_ERROR"] = _user_full_error_value
    return env


def fail(message):
    """Print `error: <message>` as one line on stderr (and in the run's train.log, if the
    run dir is kept) and exit with status 2."""
    say("error: " + " ".join(str(message).split()), stream=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


def one_line(exc):
    """Hydra's config errors are several lines (message, hint, cause); keep what names the problem.
    A value of the wrong type (OmegaConf's ValidationError) is said in its key's own words:
    `train.m_plus must be a finite number, got 'abc'` (capsnet.config.explain); an unknown key
    with the known ones closest to it (capsnet.config.unknown_key), not Hydra's `+key=value`
    hint (the schemas are closed: a key added that way fails in turn)."""
    own = _own_cause(exc)
    if own is not None:  # ours, raised inside a resolver: OmegaConf's wrapping adds only noise
        return " ".join(str(own).split())
    explained = config.explain(exc) or config.unknown_key(exc)
    if explained is not None:
        return explained
    # Hydra appends the whole config search path to "Could not find ..." errors.
    text = " ".join(str(exc).split("Config search path")[0].split())
    cause = exc.__cause__
    if cause is not None and str(cause).strip():
        text += " (" + str(cause).strip().splitlines()[0] + ")"
    return text


def _own_cause(exc):
    """The CapsnetError that `exc` (an OmegaConf error) wraps, if any: a resolver such as
    `${dataset_shape:...}` that reads the data (a folder's classes) raises ours, and OmegaConf
    reports it as "ConfigError raised while resolving interpolation: ... full_key: ...
    reference_type=...", which says the same and more."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, CapsnetError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def reports_user_errors(task):
    """Decorate the task function of `@hydra.main`: a CapsnetError (or an OmegaConf error
    while resolving the config) → `error: ...`, exit 2.

    Caught here, inside the job, because Hydra would otherwise add its own
    "Error executing job" line and a traceback.
    """

    @functools.wraps(task)
    def wrapper(cfg):
        try:
            return task(cfg)
        except KeyboardInterrupt as exc:
            # Ctrl-C: one line (train()'s says where the run stopped and how to resume), no traceback.
            if _full_errors_requested() or cfg.get("debug", False) is True:
                raise
            say(" ".join((str(exc) or "interrupted").split()), stream=sys.stderr)
            sys.exit(EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED)
        except (CapsnetError, OmegaConfBaseException) as exc:
            _remove_unused_run_dir()
            # OmegaConf errors here come from resolving the config (a bad interpolation).
            # `is True`: debug=no is the string 'no' (a ConfigError of its own), not a request.
            if _full_errors_requested() or cfg.get("debug", False) is True:
                raise
            fail(one_line(exc) if isinstance(exc, OmegaConfBaseException) else exc)

    return wrapper


def _remove_unused_run_dir():
    """After a user error: remove the run dir Hydra made for this job if it holds nothing
    but what this job wrote there before any training (its .hydra/ snapshot, the job's log,
    the run dir's marker), and the
    parents that leaves empty up to the working directory, so that a failed
    `python train.py` leaves no empty outputs/<date>/<time>/ behind. A run dir with
    anything else in it (a resumed run's checkpoints) is kept."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir).resolve()
    cwd = Path(hydra_cfg.runtime.cwd).resolve()
    if run_dir == cwd or run_dir in cwd.parents:  # evaluate.py, export.py: no run dir of their own (run.dir=.)
        return
    # .hydra/ (written by the training holding the lock: capsnet.training.run_dir) and the
    # marker of a run dir (run_lock.MARKER_NAME) that holds nothing else.
    own = {".hydra", ".capsnet-run", f"{hydra_cfg.job.name}.log"}
    # train.lock (capsnet.training.run_lock) is ours to remove only when empty: released.
    # One that names a holder belongs to another training starting in this run dir.
    lock = run_dir / "train.lock"
    try:
        if any(entry.name not in own and not (entry == lock and lock.stat().st_size == 0)
               for entry in run_dir.iterdir()):
            return
        _close_log_files()  # the job's train.log goes with it: nothing may reopen it (delay: true) afterwards
        shutil.rmtree(run_dir)
        for parent in run_dir.parents:  # outputs/<date>, outputs: only if now empty
            if parent == cwd or cwd not in parent.parents:
                break
            parent.rmdir()
    except OSError:
        pass  # not empty, or not ours to remove: leave it


def check_run_dir(run_dir, given=None):
    """train.py, before anything is written into the run dir: CheckpointError (one line) for
    an empty hydra.run.dir (`given`: Hydra's run.dir as the user set it; it would be the
    current directory), or a directory that holds something other than a run of this app
    (capsnet.training.run_lock.check_ours). A refused run dir gets no train.log either: the
    job's log files are closed before the error is reported."""
    try:
        if given is not None and not str(given).strip():
            raise CheckpointError("hydra.run.dir is empty: it would train into the current directory; name a "
                                  "directory, or leave hydra.run.dir out for a new one under outputs/")
        check_ours(run_dir)
    except CheckpointError:
        _close_log_files()
        raise


def lock_run_dir(run_dir):
    """train.py, before its first log line: the run dir's lock (run_lock.RunLock), or
    CheckpointError (one line) for a run dir in use by another training, with the job's log
    files closed first, as check_run_dir does: that run's train.log is this job's too, and
    nothing may be written there by a training that does not hold the lock."""
    try:
        return RunLock.acquire(run_dir, announce=say)
    except CheckpointError:
        _close_log_files()
        raise


class RunDirCallback(Callback):
    """Hydra callback (configs/hydra/default.yaml): the run dir (a sweep's dir) made by
    capsnet.training.run_lock.make_run_dir before Hydra's own mkdir and log files, a failure
    one `error:` line and exit status 2 (an exception raised by a callback Hydra turns into
    a warning)."""

    def on_run_start(self, config, **kwargs):
        given = config.hydra.run.dir
        if str(given).strip():  # empty: train.py's check_run_dir says so, in its words
            self._make(given, "run dir", "hydra.run.dir")

    def on_multirun_start(self, config, **kwargs):
        self._make(config.hydra.sweep.dir, "sweep dir", "hydra.sweep.dir")

    @staticmethod
    def _make(path, what, key):
        try:
            make_run_dir(path, what, key)
        except CheckpointError as exc:
            fail(exc)


def _close_log_files():
    """Detach and close the root logger's file handlers (the job's train.log)."""
    import logging

    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        root.removeHandler(handler)
        handler.close()


def run(hydra_main):
    """Call a `@hydra.main` function; config composition errors (and a launcher's CapsnetError)
    → `error: ...`, exit 2."""
    # Hydra prints its own multi-line report for config errors and exits 1, unless
    # HYDRA_FULL_ERROR is set, in which case it re-raises: set it so we get the
    # exception, and honour the user's own setting by re-raising in turn.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
            with _help_with_descriptions():
                hydra_main()
        else:
            hydra_main()
    except (HydraException, OmegaConfBaseException) as exc:
        if _full_errors_requested():
            raise
        fail(one_line(exc))
    except CapsnetError as exc:
        # Raised outside the task function, by a sweep's launcher (hydra/launcher=gpus: its
        # config, or jobs that failed in their own processes).
        if _full_errors_requested():
            raise
        fail(exc)
    except Interrupted as exc:  # Ctrl-C while a launcher waited for its jobs
        if _full_errors_requested():
            raise
        say(" ".join(str(exc).split()), stream=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


@contextlib.contextmanager
def _help_with_descriptions():
    """`--help`: Hydra's help (configs/hydra/default.yaml's and each app's help template), taken
    and written out with two changes. Its config groups without the option `schema` (the
    schemas each group's files extend, capsnet.config.register: not a choice for a user;
    Hydra has no hidden options). Its `$CONFIG` (the composed config, as YAML) laid out as
    `key=default  description`, grouped by section, each key's description its comment in
    configs/ (capsnet.config.describe)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        sys.stdout.write(_described_help(captured.getvalue()))
        sys.stdout.flush()


# The line of a help template before its $CONFIG, naming the app's config file.
_KEYS_MARK = re.compile(r"^== Keys \(configs/(\w+)\.yaml\) ==$", re.MULTILINE)


def _described_help(text):
    """Hydra's help `text` as _help_with_descriptions writes it out."""
    mark = _KEYS_MARK.search(text)
    if mark is None:  # --hydra-help, or a template without the mark: Hydra's text as it is
        return text
    head, lines = _drop_schema_options(text[:mark.end()]), text[mark.end():].split("\n")
    start = next((i for i, line in enumerate(lines) if re.match(r"[A-Za-z_]\w*:", line)), None)
    if start is None:
        return text
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    values = describe.shown_values("\n".join(lines[start:end]))
    width = shutil.get_terminal_size((0, 0)).columns or None if sys.__stdout__.isatty() else None
    keys = describe.format_keys(values, mark.group(1), width).rstrip("\n").split("\n")
    return head + "\n".join(lines[:start] + keys + lines[end:])


def _drop_schema_options(groups):
    """The `group: a, b, schema` lines of Hydra's help (its config groups) without the `schema` option."""
    def drop(match):
        options = match.group(2).split(", ")
        return f"{match.group(1)}: {', '.join(o for o in options if o != 'schema')}" if "schema" in options \
            else match.group(0)

    return re.sub(r"^([\w/]+): (.*)$", drop, groups, flags=re.MULTILINE)


def check_checkpoints_exist(checkpoint, command):
    """evaluate.py, export.py (`command`): a checkpoint path that does not exist → CheckpointError
    (the wording of capsnet.training.checkpoints.resolve_checkpoint), and one that is an
    exported SavedModel (its saved_model.pb), which has no checkpoint to read, said to be one,
    with what takes it, and a folder with no checkpoint in it or under its checkpoints/ (a run
    dir's parent, outputs/): before the seconds-long TensorFlow import that resolving a
    checkpoint needs. `checkpoint`: a path or a list of them."""
    for item in checkpoint if isinstance(checkpoint, (list, tuple)) else [checkpoint]:
        path = os.path.expanduser(str(item))
        # A checkpoint prefix (.../ckpt-3) is no file itself: its .index is.
        if not (os.path.exists(path) or os.path.isfile(path + ".index")):
            raise CheckpointError(f"checkpoint not found: {item} (expected a run dir or a checkpoint path like "
                                  ".../checkpoints/latest/ckpt-3)")
        if os.path.isfile(os.path.join(path, "saved_model.pb")):
            raise CheckpointError(f"checkpoint={item} is an exported SavedModel, not a run dir or checkpoint: "
                                  f"{command} reads the run dir it was exported from; the export itself is for "
                                  f"predict.py checkpoint={item} images=... or TF Serving (README: Export and serve)")
        folder = Path(path)
        if folder.is_dir() and not ((folder / "checkpoints").is_dir() or (folder / "checkpoint").is_file()
                                    or any(folder.glob("ckpt-*.index"))):
            # What resolve_checkpoint says of a folder with neither checkpoints/ nor a checkpoint in it.
            raise CheckpointError(f"no checkpoint in {folder}: expected a run dir (with checkpoints/) or a checkpoint "
                                  "path like .../checkpoints/latest/ckpt-3")


def check_evaluation_data(checkpoint, data):
    """evaluate.py: a `data.dir` given for an MNIST-family test split (`data.name`, else the
    run's, from the config.yaml of the first checkpoint's run dir) checked by its paths as
    train.py checks its own (config.check_data_files, the test split's IDX files), before the
    TensorFlow import. A run dir that cannot be read is left to resolve_checkpoint to report."""
    if data.get("dir") is None:
        return
    name = data.get("name")
    first = Path(os.path.expanduser(str(checkpoint[0] if isinstance(checkpoint, (list, tuple)) else checkpoint)))
    for run_dir in [first, *first.parents][:5]:
        if name is None and (run_dir / "config.yaml").is_file():
            try:
                name = (yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {})["data"]["name"]
            except (OSError, yaml.YAMLError, KeyError, TypeError):
                return
    if name in DATASETS:
        config.check_data_files({"name": name, "dir": data["dir"]}, splits=("test",))


def _check_not_shadowed():
    """Exit with one line if `capsnet` is not this package: a folder named capsnet in the
    current directory (a clone's top level, without __init__.py) is imported as a namespace
    package in its place when the installed capsnet is found later on the import path (an
    editable install's finder comes after the current directory), and its modules then
    come from here while `capsnet` itself is that folder: errors deep in Keras, far from
    the cause."""
    here = Path(__file__).resolve().parent
    found = getattr(capsnet, "__file__", None)
    if found is not None and Path(found).resolve().parent == here:
        return
    where = ", ".join(map(str, getattr(capsnet, "__path__", []))) or "?"
    what = "a folder without __init__.py" if found is None else f"another copy ({found})"
    fail(f"the package capsnet was imported from {where}, {what} that shadows capsnet at {here}: run from "
         "another directory, or rename that folder")


def import_tensorflow_quietly():
    """Import TensorFlow without its start-up log lines on stderr.

    TensorFlow's native libraries print several lines (oneDNN notice, "could not find
    cuda drivers", absl's "log messages before InitializeLog") straight to file
    descriptor 2 while loading, before TF_CPP_MIN_LOG_LEVEL takes effect; they would
    bury the one-line error a user should see. They are captured during the import and
    dropped, unless TF_CPP_MIN_LOG_LEVEL is set by the user (then they are replayed).
    Later native logs follow TF_CPP_MIN_LOG_LEVEL, which defaults to 3 (errors
    surface as Python exceptions, which we report).
    """
    if "tensorflow" in sys.modules:
        return
    user_log_level = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.stderr.flush()
    saved_fd = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        failed = True
        try:
            with _without_matplotlib():
                import tensorflow  # noqa: F401  (the import is the point)

            failed = False
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            # A failed import keeps its native log: it may say why.
            if failed or user_log_level is not None:
                captured.seek(0)
                sys.stderr.write(captured.read().decode(errors="replace"))


@contextlib.contextmanager
def _without_matplotlib():
    """matplotlib cannot be imported inside: TensorFlow's import imports Keras, and Keras'
    keras.visualization imports matplotlib.pyplot if it can (`try: import matplotlib.pyplot`),
    ~0.8 s of the ~4.7 s import on the 2-core CPU machine (`python -X importtime`), for
    plotting functions nothing here calls; only the end-of-training figures
    (capsnet.figures) draw with matplotlib, and they import it themselves, as they can again
    once this is left. (In such a process keras.visualization.plot_image_gallery says that
    matplotlib is not installed.) A process that imported matplotlib already is left as it is."""
    if "matplotlib" in sys.modules:
        yield
        return
    sys.modules["matplotlib"] = None  # `import matplotlib[.x]` raises ImportError meanwhile
    try:
        yield
    finally:
        if "matplotlib" in sys.modules and sys.modules["matplotlib"] is None:
            del sys.modules["matplotlib"]


_check_not_shadowed()
