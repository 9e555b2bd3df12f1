"""The run dir (capsnet.training.run_dir.RunDir) and the loop built on it: the same numbers as
the loop before it, old run dirs resuming, and the run dir's reliability rules: a directory
that is not ours is never written, the run's state is written by the lock holder only, a
history is checked on resume, and every failed write is one line that leaves the run resumable."""
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import (REPO, compose_config, entry_point_env, repo_env, run_entry_point, tiny_overrides,
                      write_idx_dataset)

# Per-epoch train losses and the final test loss (float.hex: bitwise) of a 2-epoch tiny run on
# write_idx_dataset(64 train, 32 test) with deterministic=true, recorded from the loop before
# RunDir (capsnet/training/loop.py at 65c113f), for both custom_op values.
BEFORE = {
    "false": (["0x1.b0d6f10000000p-1", "0x1.64a9128000000p-1"], "0x1.617f8f0000000p-1"),
    "true": (["0x1.b0d6ee8000000p-1", "0x1.64a9110000000p-1"], "0x1.617f890000000p-1"),
}
# A run dir written by that loop (capsnet/training/loop.py at 6b14e73): 1 epoch of the same run
# with a smaller model (OLD_RUN_MODEL: a small fixture), config.yaml with model.routing as it was
# then, history.jsonl, checkpoints/latest and best, metrics.json; no marker file. OLD_RUN_LOSSES:
# that loop's 2-epoch run of the same config, uninterrupted.
OLD_RUN_DIR = Path(__file__).parent / "run_dirs" / "v0_one_epoch"
OLD_RUN_MODEL = ["model.decoder=false", "model.primary_caps_types=2", "model.conv1_filters=8"]
OLD_RUN_LOSSES = (["0x1.6c52f60000000p-1", "0x1.13d6ae8000000p-1"], "0x1.333a0d0000000p-1")


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    return write_idx_dataset(tmp_path_factory.mktemp("small_idx"), 64, 32)


def small_config(data, run_dir, *extra):
    return compose_config("train", tiny_overrides(data, run_dir, "train.epochs=2", "deterministic=true", *extra))


def losses(metrics):
    return [h["train_loss"].hex() for h in metrics["history"]], metrics["test_loss"].hex()


@pytest.mark.slow
@pytest.mark.parametrize("custom_op", ["false", "true"])
def test_the_loop_gives_bitwise_the_losses_of_the_loop_before(small_data, tmp_path, custom_op):
    from capsnet.training import train

    metrics = train(small_config(small_data, tmp_path / "run", f"custom_op={custom_op}"))
    train_losses, test_loss = BEFORE[custom_op]
    assert losses(metrics) == (train_losses, test_loss)


def old_run_dir(tmp_path, data):
    """OLD_RUN_DIR copied, its config pointing at this test's data and place."""
    run_dir = tmp_path / "old"
    shutil.copytree(OLD_RUN_DIR, run_dir)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    saved["data"]["dir"], saved["run_dir"] = str(data), str(run_dir)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    return run_dir


def test_a_run_dir_of_the_loop_before_resumes_to_the_same_numbers(small_data, tmp_path):
    from capsnet.training import train

    run_dir = old_run_dir(tmp_path, small_data)
    metrics = train(small_config(small_data, run_dir, *OLD_RUN_MODEL))
    assert losses(metrics) == OLD_RUN_LOSSES
    assert metrics["resumed_from"].endswith("ckpt-1") and (run_dir / ".capsnet-run").is_file()
    assert [json.loads(line)["epoch"] for line in (run_dir / "history.jsonl").read_text().splitlines()] == [1, 2]


def test_grad_norm_reaches_tensorboard(trained_run):
    from conftest import read_events

    run_dir, _ = trained_run
    assert "train/grad_norm" in read_events(run_dir)


# --------------------------------------------------------------------------- not ours: never written

def tree(directory):
    """{relative path: bytes} of every file under directory."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(Path(directory).rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_directory_that_is_not_a_run_is_refused_in_one_line_and_left_as_it_was(tiny_idx_dir, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.yaml").write_text("my: own file\n")
    (theirs / "notes.txt").write_text("keep me\n")
    before = tree(theirs)
    result = run_entry_point("train.py", *tiny_overrides(tiny_idx_dir, theirs, "train.epochs=1")[:-1],
                             f"hydra.run.dir={theirs}", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "holds no run of this app" in result.stderr and str(theirs) in result.stderr
    assert tree(theirs) == before and sorted(p.name for p in theirs.iterdir()) == ["config.yaml", "notes.txt"]


@pytest.mark.slow
def test_an_empty_run_dir_override_is_refused(tiny_idx_dir, tmp_path):
    result = run_entry_point("train.py", *tiny_overrides(tiny_idx_dir, "x", "train.epochs=1")[:-1], "hydra.run.dir=",
                             cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "hydra.run.dir is empty" in result.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["under a file", "a file", "a name over 255 bytes"])
def test_a_run_dir_that_cannot_be_made_is_one_line(tiny_idx_dir, tmp_path, kind):
    """Hydra makes the run dir before train.py's code runs: a path that cannot be a directory was
    its mkdir's traceback. Now one line naming the path and the reason (exit 2), nothing made,
    the file in the way untouched."""
    (tmp_path / "notes.txt").write_text("keep me\n")
    run_dir = {"under a file": tmp_path / "notes.txt" / "run", "a file": tmp_path / "notes.txt",
               "a name over 255 bytes": tmp_path / ("r" * 300)}[kind]
    reason = {"under a file": f"{tmp_path / 'notes.txt'} is a file", "a file": "is not a directory",
              "a name over 255 bytes": "File name too long"}[kind]
    result = run_entry_point("train.py", *tiny_overrides(tiny_idx_dir, "x", "train.epochs=1")[:-1],
                             f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: ") and str(run_dir) in result.stderr and reason in result.stderr
    assert "pick another hydra.run.dir" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"] and (tmp_path / "notes.txt").read_text() == "keep me\n"


# train.py with os.access saying argv[1] is not writable (a read-only mount or folder: root
# ignores a folder's mode, so the test cannot make one with chmod), its arguments after it.
READ_ONLY_TRAIN = textwrap.dedent("""
    import os, runpy, sys
    read_only, real_access = os.path.abspath(sys.argv[1]), os.access
    def access(path, mode, **kwargs):
        if os.path.abspath(path) == read_only and mode & os.W_OK:
            return False
        return real_access(path, mode, **kwargs)
    os.access = access
    sys.argv = [{train!r}, *sys.argv[2:]]
    runpy.run_path({train!r}, run_name="__main__")
""")


@pytest.mark.slow
def test_a_read_only_run_dir_is_one_line_before_anything_is_written(trained_run, tiny_idx_dir, tmp_path):
    """Resuming a run whose dir is read-only: the job's first log line (train.log) raised out of
    Python's logging with a traceback. Now one line before any file is opened there."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run[0], run_dir)
    (run_dir / "train.lock").write_text("")
    before = tree(run_dir)
    script = READ_ONLY_TRAIN.format(train=str(REPO / "train.py"))
    result = subprocess.run([sys.executable, "-c", script, str(run_dir),
                             *tiny_overrides(tiny_idx_dir, "x", "train.epochs=5")[:-1], f"hydra.run.dir={run_dir}"],
                            cwd=tmp_path, env=entry_point_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr == f"error: run dir {run_dir} is read-only: a training there could save nothing; make it " \
                            "writable or pick another hydra.run.dir\n"
    assert tree(run_dir) == before


@pytest.mark.slow
def test_a_refused_second_training_writes_nothing_of_the_running_run(tiny_idx_dir, tmp_path):
    """The first training holds the lock (as a running one does); a second train.py in the same
    run dir with another seed is refused, and .hydra/config.yaml, config.yaml stay the first's."""
    from capsnet.training.run_lock import RunLock, write_marker

    run_dir = tmp_path / "run"
    lock = RunLock.acquire(run_dir)
    write_marker(run_dir)
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "config.yaml").write_text("seed: 0\n")
    before = tree(run_dir)
    try:
        result = run_entry_point("train.py", *tiny_overrides(tiny_idx_dir, run_dir, "seed=7")[:-1],
                                 f"hydra.run.dir={run_dir}", cwd=tmp_path)
    finally:
        lock.release()
    assert result.returncode == 2 and "is in use by another training" in result.stderr, result.stderr
    after = tree(run_dir)
    for name in (".hydra/config.yaml", ".capsnet-run"):
        assert after[name] == before[name]
    assert not {"config.yaml", "history.jsonl", "metrics.json", ".hydra/overrides.yaml"} & set(after)


@pytest.mark.slow
def test_train_py_writes_the_hydra_snapshot_and_the_marker(trained_run, tiny_idx_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = run_entry_point("train.py", *tiny_overrides(tiny_idx_dir, run_dir, "train.epochs=1",
                                                         "data.limit_train=32", "data.limit_test=16")[:-1],
                             f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (run_dir / ".capsnet-run").read_text().startswith("capsnet ")
    assert yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())[-1] == f"hydra.run.dir={run_dir}" \
        or f"hydra.run.dir={run_dir}" not in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())["train"]["epochs"] == 1


# --------------------------------------------------------------------------- a run never silently starts over

@pytest.mark.slow
def test_a_history_without_checkpoints_is_refused_and_restart_sets_the_old_run_aside(trained_run, tiny_config,
                                                                                     tmp_path):
    from capsnet.errors import CheckpointError
    from capsnet.training import train

    original_dir, _ = trained_run
    run_dir = tmp_path / "run"
    shutil.copytree(original_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints")
    history = (run_dir / "history.jsonl").read_text()
    with pytest.raises(CheckpointError, match="no checkpoint .* train.restart=true starts the run over"):
        train(tiny_config("train.epochs=1", run_dir=run_dir))
    assert (run_dir / "history.jsonl").read_text() == history

    metrics = train(tiny_config("train.epochs=1", "train.restart=true", run_dir=run_dir))
    aside = [p for p in run_dir.iterdir() if p.name.startswith("restarted-")]
    assert len(aside) == 1 and (aside[0] / "history.jsonl").read_text() == history
    assert metrics["epochs"] == 1 and len((run_dir / "history.jsonl").read_text().splitlines()) == 1
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["restart"] is False


def test_a_rerun_asking_fewer_epochs_keeps_the_runs_own_number(trained_run, tiny_config, tmp_path, capsys):
    from capsnet.training import train

    original_dir, original = trained_run
    run_dir = tmp_path / "run"
    shutil.copytree(original_dir, run_dir)
    metrics = train(tiny_config("train.epochs=2", run_dir=run_dir))
    assert metrics["epochs"] == 4 and yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["epochs"] == 4
    assert f"notice: the run {run_dir} is complete (4 of 4 epochs done)" in capsys.readouterr().out
    assert json.loads((run_dir / "metrics.json").read_text())["best_epoch"] == original["best_epoch"]


# --------------------------------------------------------------------------- history.jsonl

def history_file(tmp_path, epochs, tail=""):
    path = tmp_path / "history.jsonl"
    path.write_text("".join(json.dumps({"epoch": e, "train_loss": 1.0 / e}) + "\n" for e in epochs) + tail)
    return path


def test_history_a_torn_last_line_is_dropped_with_a_notice(tmp_path, capsys):
    from capsnet.training.run_dir import read_history

    path = history_file(tmp_path, [1, 2], tail='{"epoch": 3, "train_lo')
    assert [h["epoch"] for h in read_history(path, 2, repair=True)] == [1, 2]
    assert "was cut short" in capsys.readouterr().out
    assert path.read_text() == "".join(json.dumps({"epoch": e, "train_loss": 1.0 / e}) + "\n" for e in (1, 2))


def test_history_lines_of_epochs_not_saved_are_cut_off_the_end_and_the_rest_kept_byte_for_byte(tmp_path):
    from capsnet.training.run_dir import read_history

    path = history_file(tmp_path, [1, 2, 3])
    kept = path.read_text().splitlines(keepends=True)[:2]
    assert [h["epoch"] for h in read_history(path, 2, repair=True)] == [1, 2]
    assert path.read_text() == "".join(kept)


@pytest.mark.parametrize("epochs, done, message", [
    ([1, 3, 4], 3, "a gap in the epochs"),
    ([2, 3], 3, "expected the line of epoch 1"),
    ([1, 2], 4, "lines for 2 epochs, and the checkpoint holds 4"),
])
def test_history_with_a_gap_or_truncated_is_an_error(tmp_path, epochs, done, message):
    from capsnet.errors import CheckpointError
    from capsnet.training.run_dir import read_history

    path = history_file(tmp_path, epochs)
    with pytest.raises(CheckpointError, match=message):
        read_history(path, done, repair=True)


def test_a_truncated_history_stops_the_resume_instead_of_naming_the_wrong_best_epoch(trained_run, tiny_config,
                                                                                      tmp_path):
    from capsnet.errors import CheckpointError
    from capsnet.training import train

    original_dir, _ = trained_run
    run_dir = tmp_path / "run"
    shutil.copytree(original_dir, run_dir)
    lines = (run_dir / "history.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "history.jsonl").write_text("".join(lines[2:]))
    with pytest.raises(CheckpointError, match="history"):
        train(tiny_config("train.epochs=5", run_dir=run_dir))


# --------------------------------------------------------------------------- config.yaml read strictly

def test_a_key_missing_from_a_marked_runs_config_is_an_error_naming_it(trained_run, tmp_path):
    from capsnet.errors import CheckpointError
    from capsnet.training.checkpoints import read_run_config

    original_dir, _ = trained_run
    run_dir = tmp_path / "run"
    shutil.copytree(original_dir, run_dir)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    del saved["model"]["routing_iterations"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(CheckpointError, match="no key model.routing_iterations"):
        read_run_config(run_dir)
    saved["model"]["routing_iterations"], saved["train"]["colour"] = 3, "red"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(CheckpointError, match="unknown key train.colour"):
        read_run_config(run_dir)


def test_a_run_dir_of_the_loop_before_still_gets_the_keys_added_since(tmp_path, small_data):
    from capsnet.training.checkpoints import read_run_config

    assert read_run_config(old_run_dir(tmp_path, small_data))["train"]["restart"] is False


@pytest.mark.slow
@pytest.mark.parametrize("script", ["evaluate.py", "export.py"])
def test_evaluate_and_export_without_config_yaml_are_one_line(trained_run, tmp_path, script):
    """With config.yaml deleted, both failed on the unresolved ${dataset_shape:...} of Hydra's
    .hydra/config.yaml (the command's, not the run's): one line saying config.yaml is missing."""
    original_dir, _ = trained_run
    run_dir = tmp_path / "run"
    shutil.copytree(original_dir, run_dir)
    (run_dir / ".hydra").mkdir(exist_ok=True)
    (run_dir / ".hydra" / "config.yaml").write_text("model:\n  input_shape: ${dataset_shape:mnist}\n")
    (run_dir / "config.yaml").unlink()
    extra = [f"output={tmp_path / 'model'}"] if script == "export.py" else []
    result = run_entry_point(script, f"checkpoint={run_dir}", *extra, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "has no config.yaml" in result.stderr and "dataset_shape" not in result.stderr
    assert not (tmp_path / "model").exists()


# --------------------------------------------------------------------------- failed writes: one line, resumable

FULL_DISK = textwrap.dedent("""
    import resource, signal, sys
    sys.path.insert(0, {tests!r})
    from conftest import compose_config, tiny_overrides
    from capsnet import cli
    cli.import_tensorflow_quietly()
    from capsnet.errors import CapsnetError
    from capsnet.training import train
    cfg = compose_config("train", tiny_overrides({data!r}, {run!r}, "train.epochs=2"))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as a full disk would
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
    try:
        train(cfg)
    except CapsnetError as exc:
        print("error:", exc, file=sys.stderr)
        sys.exit(2)
""")


@pytest.mark.slow
@pytest.mark.parametrize("limit", [1_000_000, 4_000])
def test_a_write_that_fails_is_one_line_naming_the_file_and_the_run_resumes(tiny_idx_dir, tiny_config, tmp_path,
                                                                            limit):
    """A file-size limit (a full disk for the files that reach it): at 1 MB the checkpoint's data
    file fails, at 4 kB the event file or the history; either way one line, then a rerun
    without the limit trains the run to its end."""
    from capsnet.training import train

    run_dir = tmp_path / "run"
    script = FULL_DISK.format(tests=str(REPO / "tests"), data=str(tiny_idx_dir), run=str(run_dir), limit=limit)
    result = subprocess.run([sys.executable, "-c", script], env=repo_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr and line.startswith("error: cannot ") and str(run_dir) in line, line
    assert "File too large" in line or "is the disk full" in line, line
    metrics = train(tiny_config("train.epochs=2", run_dir=run_dir))
    assert metrics["epochs"] == 2 and [h["epoch"] for h in metrics["history"]] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["config.yaml", "history.jsonl", "metrics.json"])
def test_a_failed_write_of_each_run_file_is_one_line_and_the_run_resumes(tiny_config, tmp_path, monkeypatch, name):
    """The file-size limit above reaches the checkpoint, the event file and config.yaml; a full disk
    when history.jsonl or metrics.json is written (small files, seldom the first to reach a limit)
    must be the same one line naming the file and the reason, and a rerun must finish the run."""
    import errno

    from capsnet.errors import CheckpointError
    from capsnet.training import train

    real_open = Path.open

    def open_on_a_full_disk(self, mode="r", *args, **kwargs):
        # config.yaml and metrics.json are written as <name>.tmp, then renamed over the old one.
        if self.name in (name, name + ".tmp") and ("w" in mode or "a" in mode):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_open(self, mode, *args, **kwargs)

    small = ("train.epochs=2", "data.limit_train=64", "data.limit_test=32")
    monkeypatch.setattr(Path, "open", open_on_a_full_disk)
    with pytest.raises(CheckpointError) as error:
        train(tiny_config(*small))
    assert str(error.value).startswith(f"cannot write {tmp_path / 'run' / name}: No space left on device (is the disk "
                                       "full?); the last saved checkpoint is unchanged") and "\n" not in str(error.value)
    monkeypatch.undo()
    metrics = train(tiny_config(*small))
    assert [h["epoch"] for h in metrics["history"]] == [1, 2]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["epochs"] == 2
    assert len((tmp_path / "run" / "history.jsonl").read_text().splitlines()) == 2


# --------------------------------------------------------------------------- Ctrl-C's line, the device's memory

def test_the_ctrl_c_line_right_after_a_save_counts_the_saved_epoch(tmp_path):
    from types import SimpleNamespace

    from capsnet.training.control import RunControl

    def interrupted(state):
        control = RunControl(state.pop("resume", None))
        for key, value in state.items():
            setattr(control, key, value)
        return control.interrupted()

    latest = tmp_path / "checkpoints" / "latest"
    latest.mkdir(parents=True)
    for n in (2, 3):
        (latest / f"ckpt-{n}.index").write_bytes(b"")
    run = SimpleNamespace(path=tmp_path, chief=True)
    # Epoch 3 saved, the stop before train() noted it (done still 2, epoch 3 running, trained 2).
    line = interrupted({"run": run, "done": 2, "trained": 2, "epoch": 3})
    assert line == "interrupted after epoch 3; rerun the same command to resume from epoch 4"
    line = interrupted({"run": run, "done": 3, "trained": 2, "epoch": 3, "resume": "python train.py x=1"})
    assert line == "interrupted after epoch 3; rerun `python train.py x=1` to resume from epoch 4"
    assert "lost" not in interrupted({"run": run, "done": 3, "trained": 3, "epoch": None})


def test_memory_growth_is_set_for_every_gpu_before_the_strategy(tiny_config, monkeypatch):
    import tensorflow as tf

    from capsnet.training import loop

    calls = []
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: ["GPU:0", "GPU:1"] if kind == "GPU" else [])
    monkeypatch.setattr(tf.config.experimental, "set_memory_growth", lambda gpu, on: calls.append((gpu, on)))
    monkeypatch.setattr(loop, "make_strategy", lambda dcfg: calls.append("strategy"))
    loop.set_up_devices(tiny_config())
    assert calls == [("GPU:0", True), ("GPU:1", True), "strategy"]


def test_a_device_out_of_memory_in_the_first_steps_is_one_line(tiny_config, monkeypatch, tmp_path):
    import tensorflow as tf

    from capsnet.errors import CapsnetError
    from capsnet.training import epoch, train

    def busy(*args, **kwargs):
        raise tf.errors.InternalError(None, None, "No valid config found for convolution (autotuning)")

    monkeypatch.setattr(epoch, "train_epoch", busy)
    with pytest.raises(CapsnetError, match="ran out of memory in the first steps .* another process") as error:
        train(tiny_config("train.epochs=1"))
    assert "\n" not in str(error.value)
    assert not (tmp_path / "run" / "history.jsonl").exists()


def test_resuming_from_part_of_a_checkpoint_leaves_no_unread_values_warning(tmp_path, caplog):
    """resume_from checks the required nodes through a second Checkpoint object; without
    expect_partial TensorFlow warned at every resume, when that object was deleted, that the
    file's other values (step_in_epoch, the optimizer) were never read from it."""
    import gc
    import logging

    import numpy as np
    import tensorflow as tf

    from capsnet.training.checkpoints import resume_from

    weights, step_in_epoch = tf.Variable([1.0, 2.0]), tf.Variable(7, dtype=tf.int64)
    prefix = tf.train.Checkpoint(weights=weights, step_in_epoch=step_in_epoch).save(str(tmp_path / "ckpt"))
    restored = tf.Variable([0.0, 0.0])
    checkpoint = tf.train.Checkpoint(weights=restored, step_in_epoch=tf.Variable(0, dtype=tf.int64))
    with caplog.at_level(logging.WARNING):
        resume_from(checkpoint, prefix, required={"weights": restored})
        del checkpoint
        gc.collect()
    np.testing.assert_array_equal(restored.numpy(), [1.0, 2.0])
    assert "could not be found in the restored object" not in caplog.text
    assert "unrestored values" not in caplog.text


# --------------------------------------------------------------------------- a finished run rerun

def test_a_finished_run_rerun_is_answered_from_its_files_as_train_answers_it(trained_run, tiny_config, tmp_path,
                                                                              capsys):
    """finished_run (train.py, before TensorFlow's import) says what train() says of a finished
    run started again with its config (the notice, `done:`), and returns its metrics.json,
    whose accuracy train()'s own test pass of the final checkpoint measures again."""
    from capsnet.training import train
    from capsnet.training.run_lock import complete_run_notice, finished_run

    original_dir, original = trained_run
    run_dir = tmp_path / "run"
    shutil.copytree(original_dir, run_dir)
    cfg = tiny_config("train.figures=true", run_dir=run_dir)
    capsys.readouterr()
    early = finished_run(cfg)
    said = capsys.readouterr().out.splitlines()
    assert said == [complete_run_notice(run_dir, 4), f"done: {run_dir} (python evaluate.py checkpoint={run_dir})"]
    assert early == json.loads((run_dir / "metrics.json").read_text())
    metrics = train(cfg)
    out = capsys.readouterr().out.splitlines()
    assert said[0] in out and said[1] == out[-1]
    assert metrics["test_accuracy"] == early["test_accuracy"] and metrics["epochs"] == early["epochs"] == 4


@pytest.mark.parametrize("change", ["more epochs", "another seed", "restart", "no metrics", "a history line lost",
                                    "a Ctrl-C checkpoint", "no checkpoint", "metrics older than the checkpoint"])
def test_a_rerun_that_is_not_a_finished_run_is_left_to_train(trained_run, tiny_config, tmp_path, capsys, change):
    """Anything but the finished run with its own config: None, nothing said (train() resumes,
    refuses or repairs)."""
    import os

    from capsnet.training.run_lock import finished_run

    original_dir, _ = trained_run
    run_dir = tmp_path / "run"
    shutil.copytree(original_dir, run_dir)
    extra = {"more epochs": ["train.epochs=5"], "another seed": ["seed=1"], "restart": ["train.restart=true"]}
    cfg = tiny_config("train.figures=true", *extra.get(change, []), run_dir=run_dir)
    latest = run_dir / "checkpoints" / "latest"
    if change == "no metrics":
        (run_dir / "metrics.json").unlink()
    elif change == "a history line lost":
        lines = (run_dir / "history.jsonl").read_text().splitlines()
        (run_dir / "history.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    elif change == "a Ctrl-C checkpoint":
        (run_dir / "checkpoints" / "interrupted").mkdir()
        shutil.copy(latest / "ckpt-4.index", run_dir / "checkpoints" / "interrupted" / "ckpt-90.index")
    elif change == "no checkpoint":
        (latest / "ckpt-4.index").unlink()
    elif change == "metrics older than the checkpoint":
        stamp = (latest / "ckpt-4.index").stat().st_mtime
        os.utime(run_dir / "metrics.json", (stamp - 10, stamp - 10))
    capsys.readouterr()
    assert finished_run(cfg) is None
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_train_py_answers_a_finished_run_without_importing_tensorflow(trained_run, tiny_idx_dir, tmp_path):
    """The same command again in a finished run dir: the notice and `done:`, exit 0, with a
    `tensorflow` on the path that fails to import (train.py never reaches its import)."""
    original_dir, _ = trained_run
    run_dir = tmp_path / "run"
    shutil.copytree(original_dir, run_dir)
    blocker = tmp_path / "blocker" / "tensorflow"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('tensorflow was imported')\n")
    overrides = [*tiny_overrides(tiny_idx_dir, run_dir)[:-1], "train.figures=true", f"hydra.run.dir={run_dir}"]
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], cwd=tmp_path,
                            env=entry_point_env(blocker.parent), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-2:] == [
        f"notice: the run {run_dir} is complete (4 of 4 epochs done): nothing to train; to train it further, rerun "
        f"with a larger train.epochs=N and the same hydra.run.dir={run_dir}",
        f"done: {run_dir} (python evaluate.py checkpoint={run_dir})"]
