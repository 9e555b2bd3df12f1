"""A run that goes wrong says so at once and loses nothing: the non-finite
guard, damaged checkpoints and checkpoint state, one training per run dir, and the
smaller checks. Tiny synthetic data (conftest), train() in-process or the CLI as a
subprocess; files corrupted with real bytes."""
import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from capsnet.errors import CheckpointError, ConfigError, DataError, TrainingDiverged
from capsnet.training import train
from capsnet.training import steps as steps_module
from capsnet.training.steps import STEP_VALUES, make_train_loop
from conftest import (REPO, assert_trained_as, entry_point_env, run_entry_point, sigint_as_in_a_terminal,
                      tiny_overrides)

STEPS_PER_EPOCH = 20  # 320 tiny training images / batch 16


def tree_bytes(directory):
    """{relative path: bytes} of every file under directory (what 'untouched' compares)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- 1. the non-finite guard

def test_train_loop_values_stop_at_the_first_non_finite_step():
    """make_train_loop returns the values up to and including the first step whose loss or
    grad_norm is not finite; it runs every step it was given (its condition reads nothing
    the device computes, so the host never waits for a step before queuing the next)."""
    calls = tf.Variable(0)

    @tf.function
    def fake_step(images, labels):
        calls.assign_add(1)
        n = tf.cast(calls, tf.float32)
        bad_loss = tf.where(tf.equal(calls, 3), np.nan, n)
        bad_norm = tf.where(tf.equal(calls, 7), np.inf, 1.0)
        return {"loss": bad_loss, "margin_loss": n, "reconstruction_loss": n, "accuracy": n, "grad_norm": bad_norm}

    dataset = tf.data.Dataset.from_tensors((tf.zeros([2, 4]), tf.zeros([2], tf.int32))).repeat()
    loop = make_train_loop(fake_step)
    iterator = iter(dataset)
    out = loop(iterator, tf.constant([2] * 5, tf.int32))
    assert set(out) == set(STEP_VALUES)
    np.testing.assert_array_equal(out["margin_loss"].numpy(), [1, 2, 3])  # step 3: a NaN loss
    assert np.isnan(out["loss"].numpy()[-1])
    assert int(calls.numpy()) == 5  # the two steps after it ran too
    out = loop(iterator, tf.constant([2] * 5, tf.int32))
    np.testing.assert_array_equal(out["margin_loss"].numpy(), [6, 7])  # step 7: an infinite gradient norm
    assert np.isinf(out["grad_norm"].numpy()[-1]) and int(calls.numpy()) == 10
    calls.assign(2)
    out = loop(iterator, tf.constant([2, 0, 0, 0, 0], tf.int32))  # the last step of a call is bad
    np.testing.assert_array_equal(out["margin_loss"].numpy(), [3])
    assert np.isnan(out["loss"].numpy()[-1])
    calls.assign(7)
    out = loop(iterator, tf.constant([2, 2, 2, 0, 0], tf.int32))
    np.testing.assert_array_equal(out["loss"].numpy(), [8, 9, 10])  # finite: all the steps asked for
    assert np.all(out["grad_norm"].numpy() == 1)


@pytest.mark.slow
def test_unguarded_train_step_trains_identically_without_the_gradient_norm(tiny_config):
    """make_train_step(guard=False), the benchmark's way to time the guard, leaves the
    training itself alone: the same losses step for step, grad_norm 0 instead of the
    gradients' global norm (which the guarded step reports, checked against NumPy)."""
    import keras

    from capsnet.losses import capsnet_losses, loss_params
    from capsnet.training.model_setup import build_capsnet
    from capsnet.training.optimizer import build_optimizer
    from capsnet.training.steps import make_train_step

    cfg = tiny_config()
    shape = tuple(cfg["model"]["input_shape"])
    generator = np.random.default_rng(0)
    images = generator.uniform(size=(8, *shape)).astype(np.float32)
    labels = generator.integers(0, int(cfg["model"]["num_classes"]), size=8).astype(np.int32)
    runs = {}
    for guard in (False, True):  # the guarded model last: the norm below is checked on it
        keras.utils.set_random_seed(0)
        model = build_capsnet(cfg["model"], False, "float32")
        optimizer, _ = build_optimizer(cfg["train"], 10, model)
        step = make_train_step(model, optimizer, input_shape=shape, losses=loss_params(cfg["train"]), guard=guard)
        runs[guard] = [{k: float(v) for k, v in step(images, labels).items()} for _ in range(3)]
    with tf.GradientTape() as tape:
        outputs = model(images, labels=labels, training=True)
        loss = tf.reduce_mean(capsnet_losses(images, labels, outputs, **loss_params(cfg["train"]))[0])
    grads = tape.gradient(loss, model.trainable_variables)
    expected_norm = np.sqrt(sum(np.sum(np.square(g.numpy().astype(np.float64))) for g in grads))
    for guarded, unguarded in zip(runs[True], runs[False]):
        assert unguarded["loss"] == guarded["loss"]
        assert unguarded["grad_norm"] == 0.0 and guarded["grad_norm"] > 0
    # The 4th step's norm from outside the step, on the weights the 3 steps left.
    step4 = make_train_step(model, optimizer, input_shape=shape, losses=loss_params(cfg["train"]))
    assert float(step4(images, labels)["grad_norm"]) == pytest.approx(expected_norm, rel=1e-4)


@pytest.fixture
def nan_after(monkeypatch):
    """nan_after(k): the loss of every capsnet_losses call after the k-th is NaN (train and
    test steps both count: a tf.Variable counter inside the traced steps)."""
    real = steps_module.capsnet_losses

    def make(k):
        calls = tf.Variable(0)

        def poisoned(*args, **kwargs):
            total, margin, reconstruction = real(*args, **kwargs)
            calls.assign_add(1)
            return tf.where(calls > k, np.nan, total), margin, reconstruction

        monkeypatch.setattr(steps_module, "capsnet_losses", poisoned)

    return make


@pytest.mark.slow
def test_a_non_finite_loss_stops_training_at_its_step_and_leaves_the_checkpoints(tiny_config, tmp_path, nan_after,
                                                                                   capsys):
    run_dir = tmp_path / "run"
    train(tiny_config("train.epochs=2", "train.steps_per_execution=8"))
    before = tree_bytes(run_dir / "checkpoints")
    history = (run_dir / "history.jsonl").read_text()
    # Resumed: epoch 3's steps are capsnet_losses calls 1..; its 5th (global step 45) is the first NaN.
    nan_after(4)
    with pytest.raises(TrainingDiverged) as err:
        train(tiny_config("train.epochs=4", "train.steps_per_execution=8"))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"training diverged at epoch 3, step {2 * STEPS_PER_EPOCH + 5}: the loss is nan")
    assert f"the last good checkpoint is {run_dir}/checkpoints/latest/ckpt-2 (epoch 2, untouched)" in message
    assert "train.learning_rate (now 0.01" in message
    assert tree_bytes(run_dir / "checkpoints") == before  # no checkpoint written, best/ and latest/ as they were
    assert (run_dir / "history.jsonl").read_text() == history


@pytest.mark.slow
def test_a_diverging_learning_rate_stops_the_cli_with_one_line_and_a_lower_one_resumes(tiny_idx_dir, tmp_path):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_idx_dir, run_dir, "train.epochs=1")
    assert run_entry_point("train.py", *overrides, cwd=tmp_path).returncode == 0
    before = tree_bytes(run_dir / "checkpoints")
    result = run_entry_point("train.py", *overrides, "train.epochs=2", "train.learning_rate=1e8",
                             f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert errors[0].startswith("error: training diverged at epoch 2, step 2")
    assert "checkpoints/latest/ckpt-1 (epoch 1, untouched)" in errors[0]
    assert "train.learning_rate (now 1e+08" in errors[0]
    assert errors[0] in (run_dir / "train.log").read_text()  # the run's log says how it ended
    assert tree_bytes(run_dir / "checkpoints") == before
    # The documented way on: the same command with a lower learning rate resumes from ckpt-1, with a notice.
    result = run_entry_point("train.py", *overrides, "train.epochs=2", "train.learning_rate=0.005", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "train.learning_rate: 100000000.0 -> 0.005" in result.stdout
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["resumed_from"].endswith("latest/ckpt-1") and metrics["epochs"] == 2
    assert [h["epoch"] for h in metrics["history"]] == [1, 2]
    assert all(np.isfinite(h["train_loss"]) for h in metrics["history"])


# --------------------------------------------------------------------------- 2, 3. damaged checkpoints, the state file

def damage(prefix, kind):
    """Damage the checkpoint at `prefix` with real bytes, as a disk or a killed copy would."""
    index, data = Path(f"{prefix}.index"), Path(f"{prefix}.data-00000-of-00001")
    rng = np.random.default_rng(0)
    if kind == "truncated data":
        with data.open("r+b") as f:
            f.truncate(data.stat().st_size // 2)
    elif kind == "zero-byte data":
        data.write_bytes(b"")
    elif kind == "random bytes in data":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 3:len(raw) // 3 + 64] = rng.bytes(64)
        data.write_bytes(bytes(raw))
    elif kind == "zero-byte index":
        index.write_bytes(b"")
    elif kind == "random-byte index":
        index.write_bytes(rng.bytes(index.stat().st_size))
    return data if "data" in kind else index


def copied_run(trained_run, tmp_path, name="run"):
    run_dir = tmp_path / name
    shutil.copytree(trained_run[0], run_dir)
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["truncated data", "zero-byte index", "random-byte index", "random bytes in data"])
def test_resume_sets_a_damaged_checkpoint_aside_and_resumes_from_the_newest_intact_one(trained_run, tiny_config,
                                                                                      tmp_path, capsys, kind):
    run_dir = copied_run(trained_run, tmp_path)
    latest = run_dir / "checkpoints" / "latest"
    damaged = damage(latest / "ckpt-4", kind)
    metrics = train(tiny_config("train.epochs=5", run_dir=run_dir))
    out = capsys.readouterr().out
    notices = [line for line in out.splitlines() if line.startswith("notice:")]
    assert len(notices) == 1 and f"checkpoint file {damaged} is damaged" in notices[0], out
    assert notices[0].endswith(f"set aside as ckpt-4.*.damaged; resuming from {latest / 'ckpt-3'}")
    assert metrics["resumed_from"] == str(latest / "ckpt-3")
    assert metrics["epochs"] == 5 and [h["epoch"] for h in metrics["history"]] == [1, 2, 3, 4, 5]
    assert damaged.with_name(damaged.name + ".damaged").is_file()  # kept, not deleted
    assert tf.train.latest_checkpoint(str(latest)) == str(latest / "ckpt-5")


def test_resume_with_every_checkpoint_damaged_refuses_and_starts_nothing_over(trained_run, tiny_config, tmp_path):
    run_dir = copied_run(trained_run, tmp_path)
    latest = run_dir / "checkpoints" / "latest"
    for prefix in sorted(latest.glob("ckpt-*.index")):
        damage(str(prefix)[:-len(".index")], "zero-byte index")
    before = tree_bytes(run_dir)
    with pytest.raises(CheckpointError, match=f"no checkpoint in {latest} can be read .*cannot resume") as err:
        train(tiny_config("train.epochs=5", run_dir=run_dir))
    assert "\n" not in str(err.value)
    assert tree_bytes(run_dir) == before


@pytest.mark.parametrize("state", ["missing", "zero-byte", "garbage", "random bytes"])
def test_a_lost_checkpoint_state_file_is_rebuilt_from_the_files(trained_run, tiny_config, tmp_path, capsys, state):
    run_dir = copied_run(trained_run, tmp_path)
    latest = run_dir / "checkpoints" / "latest"
    best_before = tree_bytes(run_dir / "checkpoints" / "best")
    state_file = latest / "checkpoint"
    if state == "missing":
        state_file.unlink()
    else:
        state_file.write_bytes({"zero-byte": b"", "garbage": b"model_checkpoint_path: {{{ not a state",
                                "random bytes": np.random.default_rng(1).bytes(200)}[state])
    (latest / "ckpt-5_temp").mkdir()  # orphans of a save that was killed
    (latest / "ckpt-5_temp" / "part-00000-of-00001.index").write_bytes(b"half")
    (latest / "ckpt-5.index.tempstate123456").write_bytes(b"half")
    metrics = train(tiny_config(run_dir=run_dir))  # all 4 epochs done: nothing to train
    out = capsys.readouterr().out
    assert metrics["resumed_from"] == str(latest / "ckpt-4") and metrics["epochs"] == 4
    assert f"notice: the checkpoint state file {state_file} is" in out
    assert "rebuilt from the ckpt-*.index files" in out
    assert tf.train.latest_checkpoint(str(latest)) == str(latest / "ckpt-4")
    assert not (latest / "ckpt-5_temp").exists() and not list(latest.glob("*.tempstate*"))
    assert tree_bytes(run_dir / "checkpoints" / "best") == best_before  # best/ kept as it was


def test_a_checkpoint_saved_but_not_recorded_is_resumed_from(trained_run, tiny_config, tmp_path, capsys):
    """A kill between the checkpoint's write and the state file's update: the checkpoint is
    whole (read back), so the epoch counts."""
    run_dir = copied_run(trained_run, tmp_path)
    latest = run_dir / "checkpoints" / "latest"
    (latest / "checkpoint").write_text('model_checkpoint_path: "ckpt-3"\nall_model_checkpoint_paths: "ckpt-3"\n')
    metrics = train(tiny_config(run_dir=run_dir))
    assert metrics["resumed_from"] == str(latest / "ckpt-4")
    assert "was saved but not yet recorded" in capsys.readouterr().out


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_naming_the_directory(tiny_config, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    train(tiny_config("train.epochs=1"))
    before = tree_bytes(run_dir / "checkpoints")
    real_write = tf.train.Checkpoint._write

    def no_space(self, file_prefix, *args, **kwargs):
        Path(f"{file_prefix}_temp").mkdir()  # what a real save has made when the disk fills up
        Path(f"{file_prefix}.index").write_bytes(b"partial")
        raise tf.errors.ResourceExhaustedError(None, None, f"{file_prefix}_temp/part-00000: No space left on device")

    monkeypatch.setattr(tf.train.Checkpoint, "_write", no_space)
    with pytest.raises(CheckpointError) as err:
        train(tiny_config("train.epochs=2"))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"cannot save checkpoint ckpt-2 into {run_dir / 'checkpoints'}/")
    assert "No space left on device" in message and "is the disk full?" in message
    assert tree_bytes(run_dir / "checkpoints") == before  # cleaned up after itself; best/ and latest/ as they were
    monkeypatch.setattr(tf.train.Checkpoint, "_write", real_write)
    assert train(tiny_config("train.epochs=2"))["epochs"] == 2


@pytest.mark.parametrize("kind", ["truncated data", "zero-byte data", "random-byte index"])
def test_evaluate_a_damaged_checkpoint_names_the_file_and_the_intact_ones(trained_run, tmp_path, kind):
    from capsnet.evaluation import evaluate

    run_dir = copied_run(trained_run, tmp_path)
    best = Path(tf.train.latest_checkpoint(str(run_dir / "checkpoints" / "best")))
    damaged = damage(best, kind)
    with pytest.raises(CheckpointError) as err:
        evaluate(str(run_dir), which="best", data_dir=None)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint file {damaged} is damaged")
    assert f"intact checkpoints of {run_dir}: checkpoints/latest/ckpt-4, checkpoints/latest/ckpt-3" in message
    assert "config.yaml match" not in message  # not the hint for a checkpoint of another model


@pytest.mark.parametrize("moment", ["before its check", "before the restore"])
def test_evaluate_while_a_training_moves_best_on_says_the_checkpoint_was_replaced(trained_run, tmp_path, monkeypatch,
                                                                                  moment):
    """best/ moving to a new best between evaluate's resolving its checkpoint and reading it (a
    training's BestCheckpoint.commit deletes the previous best's files): right after the state
    file is read, or while the test data loads, before the restore. One line saying the
    checkpoint was replaced and what to do: not a damaged file, not a config that does not
    match. Run again, evaluate finds the new best."""
    import capsnet.evaluation as evaluation
    import capsnet.training.checkpoints as checkpoints

    run_dir = copied_run(trained_run, tmp_path).resolve()
    best_dir, latest_dir = run_dir / "checkpoints" / "best", run_dir / "checkpoints" / "latest"
    resolved = tf.train.latest_checkpoint(str(best_dir))
    moved_to = max(set(checkpoints.checkpoint_numbers(latest_dir)) - set(checkpoints.checkpoint_numbers(best_dir)))

    def move_best_on():
        best = checkpoints.BestCheckpoint(tf.train.Checkpoint(), best_dir)
        best.adopt(moved_to, latest_dir / f"ckpt-{moved_to}")
        best.commit(moved_to)

    if moment == "before its check":
        real = checkpoints._newest_named
        monkeypatch.setattr(checkpoints, "_newest_named", lambda directory: (real(directory), move_best_on())[0])
    else:
        real = evaluation.load_run_test_split
        monkeypatch.setattr(evaluation, "load_run_test_split", lambda *a, **k: (real(*a, **k), move_best_on())[0])
    with pytest.raises(CheckpointError) as err:
        evaluation.evaluate(str(run_dir), which="best", data_dir=None, output=str(tmp_path / "report.json"))
    assert str(err.value) == (f"checkpoint {resolved} was replaced while it was being read (a training is writing "
                              "this run: its best/ moved on): run again, or give which=latest or a checkpoint path")
    assert not (tmp_path / "report.json").exists()
    monkeypatch.undo()
    assert evaluation.evaluate(str(run_dir), data_dir=None, output=str(tmp_path / "report.json"))["epoch"] == moved_to


def test_repairing_a_damaged_only_best_checkpoint_says_the_state_file_goes(trained_run, tmp_path):
    from capsnet.training.checkpoints import BestCheckpoint

    run_dir = copied_run(trained_run, tmp_path)
    best_dir = run_dir / "checkpoints" / "best"
    damage(tf.train.latest_checkpoint(str(best_dir)), "truncated data")
    notices = []
    BestCheckpoint(tf.train.Checkpoint(), best_dir).recover(4, announce=notices.append)
    assert not (best_dir / "checkpoint").exists() and list(best_dir.glob("*.damaged"))
    assert len(notices) == 2 and "set aside" in notices[0]
    assert notices[1].startswith(f"notice: {best_dir} holds no intact checkpoint: its state file removed")


@pytest.mark.slow
def test_evaluate_cli_on_a_damaged_checkpoint_prints_one_line(trained_run, tmp_path):
    run_dir = copied_run(trained_run, tmp_path)
    # evaluate.py's default for a run without a validation split: the final checkpoint
    damage(tf.train.latest_checkpoint(str(run_dir / "checkpoints" / "latest")), "truncated data")
    result = run_entry_point("evaluate.py", f"checkpoint={run_dir}", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: checkpoint file "), result.stderr
    assert "is damaged (shorter than its index says: truncated or emptied)" in result.stderr


@pytest.mark.slow
def test_kills_during_saves_never_leave_a_state_file_naming_a_damaged_checkpoint(tiny_idx_dir, tmp_path):
    """SIGKILL a training subprocess at varying moments of epochs that are mostly test pass
    and saves (2 steps each), a few times, checking after each kill that what the state
    files name reads whole; then rerun to the end."""
    from capsnet.training.checkpoints import checkpoint_damage, read_state

    run_dir = tmp_path / "run"
    args = [sys.executable, str(REPO / "train.py"),
            *tiny_overrides(tiny_idx_dir, run_dir, "train.epochs=40", "data.limit_train=32", "data.limit_test=16",
                            "train.keep_checkpoints=2")]
    rng = np.random.default_rng(19)
    for attempt in range(4):
        log = tmp_path / f"attempt{attempt}.log"
        with log.open("w") as out:
            process = subprocess.Popen(args, cwd=tmp_path, env=entry_point_env(), stdout=out, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 120
                while log.read_text().count("epoch ") < 4 and process.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)  # until a few epochs (and saves) ran in this attempt
                time.sleep(rng.uniform(0.0, 1.0))
            finally:
                process.kill()
                process.wait()
        for which in ("latest", "best"):
            named, problem = read_state(run_dir / "checkpoints" / which)
            if named is not None:
                assert checkpoint_damage(named) is None, (attempt, which, log.read_text()[-2000:])
    result = subprocess.run(args, cwd=tmp_path, env=entry_point_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "damaged" not in result.stdout
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert [h["epoch"] for h in metrics["history"]] == list(range(1, 41))


# --------------------------------------------------------------------------- 4. one training per run dir

def test_a_run_dir_held_by_another_training_is_refused_naming_the_holder(trained_run, tiny_config, tmp_path):
    run_dir = copied_run(trained_run, tmp_path)
    before = tree_bytes(run_dir / "checkpoints")
    with (run_dir / "train.lock").open("a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 4242 on otherhost since 2026-11-23T23:00:00+00:00\n")
        held.flush()
        with pytest.raises(CheckpointError) as err:
            train(tiny_config("train.epochs=5", run_dir=run_dir))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"run dir {run_dir} is in use by another training "
                              f"(pid 4242 on otherhost since 2026-11-23T23:00:00+00:00; lock file {run_dir}/train.lock)")
    assert tree_bytes(run_dir / "checkpoints") == before


@pytest.mark.slow
def test_the_lock_of_a_dead_training_is_taken_over_with_a_notice(trained_run, tiny_config, tmp_path, capsys):
    run_dir = copied_run(trained_run, tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / "train.lock").write_text(f"pid {dead.pid} on {socket.gethostname()} since 2026-11-23T23:00:00\n")
    metrics = train(tiny_config(run_dir=run_dir))
    assert metrics["epochs"] == 4
    assert (f"notice: taking over the lock of run dir {run_dir} from pid {dead.pid} on {socket.gethostname()} "
            "since 2026-11-23T23:00:00, which is no longer running") in capsys.readouterr().out
    assert (run_dir / "train.lock").read_text() == ""  # released at the end: no holder named


@pytest.mark.slow
def test_a_second_train_py_on_a_running_run_dir_fails_at_once(tiny_idx_dir, tmp_path):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_idx_dir, run_dir, "train.epochs=200", "data.limit_train=32", "data.limit_test=16")
    log = tmp_path / "first.log"
    with log.open("w") as out:
        first = subprocess.Popen([sys.executable, str(REPO / "train.py"), *overrides], cwd=tmp_path,
                                 env=entry_point_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while "epoch 2/" not in log.read_text() and first.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert first.poll() is None, log.read_text()[-2000:]
            second = run_entry_point("train.py", *overrides, cwd=tmp_path)
            assert first.poll() is None  # the first run goes on
        finally:
            first.kill()
            first.wait()
    assert second.returncode == 2
    assert second.stderr.count("\n") == 1, second.stderr
    assert second.stderr.startswith(f"error: run dir {run_dir} is in use by another training "
                                    f"(pid {first.pid} on {socket.gethostname()} since ")
    # SIGKILLed: the kernel released the lock; the next run takes it over and resumes.
    third = run_entry_point("train.py", *overrides[:-3], "train.epochs=3", *overrides[-2:], cwd=tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"taking over the lock of run dir {run_dir} from pid {first.pid}" in third.stdout


@pytest.mark.slow
def test_a_refused_second_train_py_writes_and_says_nothing_of_the_running_run(trained_run, tiny_idx_dir, tmp_path):
    """A second train.py into a run dir another training holds, with another learning rate,
    is refused in one line before anything else: no "resuming ... learning_rate" notice of a
    resume that never happens, and not a byte written into the run dir (its train.log is
    the running run's)."""
    from conftest import TINY_MODEL, TINY_TRAIN

    run_dir = copied_run(trained_run, tmp_path)
    (run_dir / "train.log").write_text("the running run's log\n")
    with (run_dir / "train.lock").open("a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 4242 on otherhost since 2026-11-23T23:00:00+00:00\n")
        held.flush()
        before = tree_bytes(run_dir)
        second = run_entry_point("train.py", *TINY_MODEL, *TINY_TRAIN, f"data.dir={tiny_idx_dir}",
                                 "train.learning_rate=0.005", f"hydra.run.dir={run_dir}", cwd=tmp_path)
        after = tree_bytes(run_dir)
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr.count("\n") == 1, second.stderr
    assert second.stderr.startswith(f"error: run dir {run_dir} is in use by another training (pid 4242 on otherhost")
    assert "resuming" not in second.stdout + second.stderr and "notice" not in second.stdout, second.stdout
    assert after == before


# The data load of a folder run made slow (a large folder on a slow disk): its disk cache
# begun (capsnet.tasks.images._cache_file: the folder made and removed at exit), then a wait.
SLOW_LOAD = """
import time

import capsnet.tasks.images as images

_cache_dir = images._cache_dir


def slow_cache_dir(*args, **kwargs):
    path = _cache_dir(*args, **kwargs)
    print("loading into the cache", flush=True)
    time.sleep(300)
    return path


images._cache_dir = slow_cache_dir
"""


@pytest.mark.slow
def test_sigterm_during_the_data_load_says_so_exits_143_and_removes_the_partial_cache(tiny_idx_dir, tmp_path):
    """SIGTERM while train.py loads a folder into its disk cache: the run stops at once (nothing
    trained), says so in one line naming how to start it again, exits 143 as a terminated run
    does, and leaves no capsnet-cache-* folder behind (no -15 death with the cache left)."""
    from conftest import TINY_MODEL, TINY_TRAIN
    from test_folder_data import make_folder

    root = make_folder(tmp_path / "images", n_per_class=2, size=32)
    cache, hook = tmp_path / "cache", tmp_path / "hook"
    cache.mkdir()
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_LOAD)
    overrides = [*TINY_MODEL, *TINY_TRAIN, "data=folder", f"data.dir={root}", "data.cache=disk",
                 f"data.cache_dir={cache}", f"hydra.run.dir={tmp_path / 'run'}"]
    log = tmp_path / "out.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, str(REPO / "train.py"), *overrides], cwd=tmp_path,
                                   env=entry_point_env(hook), stdout=out, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 180
            while "loading into the cache" not in log.read_text() and process.poll() is None and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            assert process.poll() is None, log.read_text()[-2000:]
            assert len(list(cache.glob("capsnet-cache-*"))) == 1  # the load's cache, begun
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=60)
        finally:
            process.kill()
    assert process.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr, stderr
    assert stderr.splitlines()[-1].startswith("stopped by SIGTERM before training started (nothing trained); "
                                              "rerun `python train.py "), stderr
    assert stderr.splitlines()[-1].endswith(f"hydra.run.dir={tmp_path / 'run'}` to start"), stderr
    assert not list(cache.glob("capsnet-cache-*"))


# --------------------------------------------------------------------------- 5. the smaller items

def test_resume_without_the_runs_config_yaml_is_refused(trained_run, tiny_config, tmp_path):
    """Hydra's .hydra/config.yaml is this command's, not the run's: it proves nothing."""
    run_dir = copied_run(trained_run, tmp_path)
    (run_dir / ".hydra").mkdir()
    shutil.move(run_dir / "config.yaml", run_dir / ".hydra" / "config.yaml")
    before = tree_bytes(run_dir)
    with pytest.raises(CheckpointError) as err:
        train(tiny_config("seed=7", "train.epochs=5", run_dir=run_dir))
    assert str(err.value) == (f"run dir {run_dir} has checkpoints but no config.yaml: cannot check that this config "
                              "continues the same run (seed, model, data, learning rate); put the run's config.yaml "
                              "back, or train into a new hydra.run.dir")
    assert tree_bytes(run_dir) == before


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_a_learning_rate_that_is_not_finite_is_refused(tiny_config, tmp_path, value):
    with pytest.raises(ConfigError, match=r"train\.learning_rate must be a finite positive number|"
                                          r"train\.learning_rate must be a positive number") as err:
        train(tiny_config(f"train.learning_rate={value}"))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


def test_history_keeps_one_line_per_epoch_after_kills(trained_run, tiny_config, tmp_path, capsys):
    """Lines of epochs a kill kept from their checkpoint, and a line cut short by one: cut off
    the end of the file on restart (with a notice for the torn line), the lines of the epochs
    done kept byte for byte (history.jsonl is only appended to)."""
    run_dir = copied_run(trained_run, tmp_path)
    path = run_dir / "history.jsonl"
    kept = path.read_text()
    lines = kept.splitlines()
    third = json.loads(lines[2])
    path.write_text(kept + json.dumps({**third, "epoch": 5}) + "\n" + '{"epoch": 6, "train_lo')
    metrics = train(tiny_config(run_dir=run_dir))  # 4 epochs done: nothing to train
    assert path.read_text() == kept
    assert [h["epoch"] for h in metrics["history"]] == [1, 2, 3, 4]
    assert "was cut short" in capsys.readouterr().out


def test_a_plain_idx_file_that_differs_from_its_gz_is_refused(tmp_path):
    from capsnet.data import load_split
    from conftest import write_idx_dataset

    data_dir = write_idx_dataset(tmp_path / "both", n_train=32, n_test=8)
    write_idx_dataset(tmp_path / "plain", n_train=32, n_test=8, gz=False)
    # The gunzipped copy beside its archive: the same data, read from the plain file.
    shutil.copy(tmp_path / "plain" / "train-images-idx3-ubyte", data_dir)
    images, _ = load_split("mnist", "train", data_dir=data_dir)
    assert images.shape == (32, 28, 28, 1)
    # Another dataset under the same name: which one trains must not depend on lookup order.
    other = write_idx_dataset(tmp_path / "other", n_train=16, n_test=8, gz=False)
    shutil.copy(other / "train-images-idx3-ubyte", data_dir)
    with pytest.raises(DataError) as err:
        load_split("mnist", "train", data_dir=data_dir)
    assert str(err.value).startswith(f"{data_dir}/train-images-idx3-ubyte and {data_dir}/train-images-idx3-ubyte.gz "
                                     "are both there but hold different data")


@pytest.mark.parametrize("override, message", [
    ("data.shift_pixels=30", r"data\.shift_pixels must be in \[0, 27\], got 30"),
    ("data.limit_train=0", r"data\.limit_train must be ≥ 1, got 0"),
    ("data.limit_test=abc", r"data\.limit_test must be an integer, got 'abc'"),
])
def test_data_errors_name_their_key(tiny_config, override, message):
    with pytest.raises(ConfigError, match=message):
        train(tiny_config(override))


def signal_train_py_in_epoch_3(signum, tiny_idx_dir, tmp_path, *extra):
    """train.py on a 200-epoch tiny run in tmp_path/run, sent `signum` once epoch 3 starts:
    (exit status, stderr)."""
    overrides = tiny_overrides(tiny_idx_dir, tmp_path / "run", "train.epochs=200", "data.limit_train=32",
                               "data.limit_test=16", *extra)
    log = tmp_path / "out.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, str(REPO / "train.py"), *overrides], cwd=tmp_path,
                                   env=entry_point_env(), preexec_fn=sigint_as_in_a_terminal,
                                   stdout=out, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while "epoch 3/" not in log.read_text() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            process.send_signal(signum)
            _, stderr = process.communicate(timeout=60)
        finally:
            process.kill()
    # The command that resumes the run names its dir (and the overrides); as "the same command" here.
    resume = " ".join(["python", "train.py", *[shlex.quote(o) for o in overrides if not o.startswith("run_dir=")],
                       f"hydra.run.dir={tmp_path / 'run'}"])
    assert f"rerun `{resume}` to" in stderr, stderr
    return process.returncode, stderr.replace(f"rerun `{resume}` to", "rerun the same command to")


@pytest.mark.slow
def test_ctrl_c_prints_one_line_and_exits_130(tiny_idx_dir, tmp_path):
    run_dir = tmp_path / "run"
    returncode, stderr = signal_train_py_in_epoch_3(signal.SIGINT, tiny_idx_dir, tmp_path)
    assert returncode == 130
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert stderr.startswith("interrupted ") and ": saved; rerun the same command to resume" in stderr
    # In an epoch: its steps run are saved (interrupted/); between two: the epoch before (latest/).
    mid_epoch = tf.train.latest_checkpoint(str(run_dir / "checkpoints" / "interrupted"))
    if mid_epoch is not None:
        reader = tf.train.load_checkpoint(mid_epoch)
        step, done = (int(reader.get_tensor(f"{name}/.ATTRIBUTES/VARIABLE_VALUE")) for name in ("step_in_epoch", "epoch"))
        assert stderr == f"interrupted at step {step} of 2 in epoch {done + 1}: saved; rerun the same command to " \
                         "resume from there\n"
    else:
        done = int(tf.train.latest_checkpoint(str(run_dir / "checkpoints" / "latest")).rsplit("-", 1)[1])
        assert stderr == f"interrupted after epoch {done}: saved; rerun the same command to resume from epoch {done + 1}\n"
    assert (run_dir / "train.lock").read_text() == ""  # released on the way out


# --------------------------------------------------------------------------- 6. collapse warning

@pytest.mark.slow
def test_a_collapsed_run_is_flagged_in_the_log_tensorboard_and_history(tiny_config, tmp_path, capsys):
    """learning_rate=1 on the tiny data: no NaN, but the predictions stay at chance (10
    classes) through epoch 3, the first the accuracy rule applies to."""
    from conftest import read_events

    run_dir = tmp_path / "run"
    metrics = train(tiny_config("train.learning_rate=1", "train.epochs=3"))
    history = metrics["history"]
    assert history[2]["test_accuracy"] <= 0.15
    assert history[2]["collapsed"] is True
    assert history[2]["collapse"].startswith(f"test accuracy {history[2]['test_accuracy']:.4f} is at chance")
    assert [json.loads(line)["collapsed"] for line in (run_dir / "history.jsonl").read_text().splitlines()] == \
        [h["collapsed"] for h in history]
    assert any("[COLLAPSED: test accuracy" in line for line in capsys.readouterr().out.splitlines()[-3:])
    events = read_events(run_dir)
    collapsed = {step: value.simple_value if value.HasField("simple_value") else
                 float(tf.make_ndarray(value.tensor)) for step, value in events["test/collapsed"]}
    assert collapsed[3 * STEPS_PER_EPOCH] == 1.0
    assert sorted(step for step, _ in events["test/collapse"]) == \
        [STEPS_PER_EPOCH * e for e in (1, 2, 3) if history[e - 1]["collapsed"]]


def test_collapse_rules():
    from capsnet.training.health import collapse_reason

    healthy = {"max_length": 0.93, "accuracy": 0.97}
    assert all(collapse_reason(healthy, epoch, 10) is None for epoch in (1, 2, 3, 50))
    assert collapse_reason({"max_length": 0.9, "accuracy": 0.12}, 2, 10) is None  # early epochs may sit at chance
    assert collapse_reason({"max_length": 0.9, "accuracy": 0.15}, 3, 10).startswith("test accuracy 0.1500 is at chance")
    assert collapse_reason({"max_length": 0.049, "accuracy": 0.9}, 1, 10) == \
        "every test capsule length is below 0.05 (longest 0.0490)"
    # MultiMNIST (both digits right): chance is 1/45, not 1/10
    assert collapse_reason({"max_length": 0.9, "accuracy": 0.12}, 3, 10, labels_per_example=2) is None
    assert collapse_reason({"max_length": 0.4, "accuracy": 0.0246}, 3, 10, labels_per_example=2) == \
        "test accuracy 0.0246 is at chance (0.0222 for 2 of 10 classes)"


def test_collapse_patience_counts_flagged_epochs_in_a_row():
    from capsnet.training.health import collapsed_for

    def history(*flags, first=1):
        return [{"epoch": first + i, "collapsed": flag} for i, flag in enumerate(flags)]

    assert collapsed_for(history(False, True, True), 2)
    assert not collapsed_for(history(False, True, True), 3)
    assert not collapsed_for(history(True, False, True), 2)  # not in a row
    assert not collapsed_for(history(True, True, True), None)  # null: train on
    assert not collapsed_for([{"epoch": 1, "collapsed": True}, {"epoch": 3, "collapsed": True}], 2)  # a gap
    assert not collapsed_for([{"epoch": 1}, {"epoch": 2}], 1)  # lines saved before the flag existed


@pytest.mark.slow
def test_a_run_collapsed_for_the_patience_stops_with_one_line(tiny_config, tmp_path):
    """learning_rate=1 on the tiny data (as above): with collapse_patience=1 the first
    flagged epoch ends training with TrainingCollapsed, after that epoch is saved."""
    from capsnet.errors import TrainingCollapsed

    run_dir = tmp_path / "run"
    with pytest.raises(TrainingCollapsed) as err:
        train(tiny_config("train.learning_rate=1", "train.epochs=6", "train.collapse_patience=1"))
    lines = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    assert [h["collapsed"] for h in lines] == [False] * (len(lines) - 1) + [True]  # stopped at the first
    stopped = lines[-1]["epoch"]
    assert stopped < 6
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"training stopped at epoch {stopped}: the test results looked collapsed for 1 "
                              f"epoch in a row ({lines[-1]['collapse']})")
    assert str(run_dir) in message and "train.collapse_patience=null" in message
    assert tf.train.latest_checkpoint(str(run_dir / "checkpoints" / "latest")).endswith(f"ckpt-{stopped}")


def test_a_healthy_run_is_not_flagged(trained_run):
    history = trained_run[1]["history"]
    assert [h["collapsed"] for h in history] == [False] * 4
    assert all(0.05 < h["test_max_length"] < 1 for h in history)


def test_a_run_dir_that_lost_latest_but_has_a_best_checkpoint_is_not_started_over(trained_run, tiny_config, tmp_path):
    run_dir = copied_run(trained_run, tmp_path)
    shutil.rmtree(run_dir / "checkpoints" / "latest")
    best_before = tree_bytes(run_dir / "checkpoints" / "best")
    with pytest.raises(CheckpointError, match=f"run dir {run_dir} has a best checkpoint .* not starting over"):
        train(tiny_config(run_dir=run_dir))
    assert tree_bytes(run_dir / "checkpoints" / "best") == best_before


# --------------------------------------------------------------------------- best/ shares latest's files

def test_best_checkpoint_is_latest_files_not_a_second_write(trained_run):
    """best/ckpt-B is the same files as latest/ckpt-B while latest keeps it (hard links: the
    epoch's checkpoint is written once), and restores the same values."""
    run_dir, metrics = trained_run
    best_dir, latest_dir = run_dir / "checkpoints" / "best", run_dir / "checkpoints" / "latest"
    best = Path(tf.train.latest_checkpoint(str(best_dir)))
    assert best.name == f"ckpt-{metrics['best_epoch']}"
    latest = latest_dir / best.name
    files = [p.name[len(best.name):] for p in best_dir.glob(best.name + ".*")]
    assert ".index" in files and any(f.startswith(".data-") for f in files)
    for suffix in files:
        if (latest_dir / (best.name + suffix)).exists():
            assert (best_dir / (best.name + suffix)).stat().st_ino == (latest_dir / (best.name + suffix)).stat().st_ino
        else:  # rotated out of latest/: best's link is the one left
            assert (best_dir / (best.name + suffix)).stat().st_nlink == 1
    assert not list(best_dir.glob("*.tmp"))
    if Path(str(latest) + ".index").exists():
        ours, theirs = tf.train.load_checkpoint(str(best)), tf.train.load_checkpoint(str(latest))
        assert sorted(ours.get_variable_to_shape_map()) == sorted(theirs.get_variable_to_shape_map())


def _small_checkpoints(directory, numbers, value=1.0):
    variable = tf.Variable(value)
    checkpoint = tf.train.Checkpoint(v=variable)
    manager = tf.train.CheckpointManager(checkpoint, str(directory), max_to_keep=None)
    for n in numbers:
        variable.assign(value * n)
        manager.save(checkpoint_number=n)
    return checkpoint


def test_a_best_epoch_a_crash_kept_out_of_best_is_adopted_on_restart(tmp_path):
    """A crash after the commit point (latest/ckpt-3) and before best/ adopted it: recover
    with last_was_best adopts it from latest; without, the older best stays."""
    from capsnet.training.checkpoints import BestCheckpoint, read_state

    checkpoint = _small_checkpoints(tmp_path / "latest", [1, 2, 3])
    for last_was_best, kept in ((False, 2), (True, 3)):
        best_dir = tmp_path / f"best_{last_was_best}"
        best = BestCheckpoint(checkpoint, best_dir)
        best.adopt(2, tmp_path / "latest" / "ckpt-2")
        best.commit(2)
        (best_dir / "ckpt-3.index.tmp").write_bytes(b"a cut-short adoption")
        best.recover(3, last_was_best=last_was_best, latest_dir=tmp_path / "latest", announce=pytest.fail)
        assert best.numbers() == [kept] and not list(best_dir.glob("*.tmp"))
        assert read_state(best_dir)[0] == str(best_dir / f"ckpt-{kept}")
        assert tf.train.load_checkpoint(str(best_dir / f"ckpt-{kept}")).get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE") == kept
    # An epoch to be redone (done = 2) is never adopted, whatever its line said.
    best = BestCheckpoint(checkpoint, tmp_path / "best_redo")
    best.recover(2, last_was_best=True, latest_dir=tmp_path / "nothing here", announce=pytest.fail)
    assert best.numbers() == []


def test_adopt_copies_where_links_fail(tmp_path, monkeypatch):
    from capsnet.training import checkpoints

    checkpoint = _small_checkpoints(tmp_path / "latest", [1])

    def no_links(*args):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(checkpoints.os, "link", no_links)
    best = checkpoints.BestCheckpoint(checkpoint, tmp_path / "best")
    best.adopt(1, tmp_path / "latest" / "ckpt-1")
    for source in (tmp_path / "latest").glob("ckpt-1.*"):
        copy = tmp_path / "best" / source.name
        assert copy.read_bytes() == source.read_bytes() and copy.stat().st_ino != source.stat().st_ino


def _value(prefix):
    return float(tf.train.load_checkpoint(str(prefix)).get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE"))


def test_a_damaged_best_link_is_taken_again_from_latests_intact_copy(tmp_path):
    """best/ckpt-2 shares latest's files; its data file replaced by a damaged one (a new
    file: an editor's save, a restore, a sync tool), latest/ckpt-2 still reads whole: the
    repair sets best's aside and links latest's again, with a notice saying so, instead of
    leaving best/ empty. Damaged in place (both links), best/ is empty as before."""
    from capsnet.training.checkpoints import BestCheckpoint, checkpoint_damage, read_state

    checkpoint = _small_checkpoints(tmp_path / "latest", [1, 2, 3])
    best_dir = tmp_path / "best"
    best = BestCheckpoint(checkpoint, best_dir)
    best.adopt(2, tmp_path / "latest" / "ckpt-2")
    best.commit(2)
    data = next(best_dir.glob("ckpt-2.data-*"))
    raw = data.read_bytes()
    data.unlink()
    data.write_bytes(raw[:len(raw) // 2])
    notices = []
    best.recover(3, latest_dir=tmp_path / "latest", announce=notices.append)
    assert len(notices) == 1, notices
    assert notices[0].startswith(f"notice: checkpoint file {data} is damaged")
    assert notices[0].endswith(f"{tmp_path / 'latest' / 'ckpt-2'} holds the same epoch intact: the best checkpoint "
                               "taken from it again")
    assert best.numbers() == [2] and read_state(best_dir)[0] == str(best_dir / "ckpt-2")
    assert checkpoint_damage(str(best_dir / "ckpt-2")) is None and _value(best_dir / "ckpt-2") == 2
    assert data.with_name(data.name + ".damaged").is_file()  # kept
    assert data.stat().st_ino == next((tmp_path / "latest").glob("ckpt-2.data-*")).stat().st_ino
    # In place: latest's link is damaged too, nothing intact to take.
    with data.open("r+b") as f:
        f.truncate(len(raw) // 2)
    notices = []
    best.recover(3, latest_dir=tmp_path / "latest", announce=notices.append)
    assert best.numbers() == [] and len(notices) == 2 and "holds no intact checkpoint" in notices[1]


def test_a_lost_best_index_is_taken_again_from_latest_leaving_no_tmp_file(tmp_path):
    """best/ckpt-2.index deleted (its data file still a link of latest's): the checkpoint
    best/'s state file names is taken again from latest, with a notice; re-linking the data
    file that is already the same file leaves no ckpt-2.data-*.tmp behind."""
    from capsnet.training.checkpoints import BestCheckpoint, read_state

    checkpoint = _small_checkpoints(tmp_path / "latest", [1, 2, 3])
    best_dir = tmp_path / "best"
    best = BestCheckpoint(checkpoint, best_dir)
    best.adopt(2, tmp_path / "latest" / "ckpt-2")
    best.commit(2)
    (best_dir / "ckpt-2.index").unlink()
    notices = []
    best.recover(3, latest_dir=tmp_path / "latest", announce=notices.append)
    assert notices == [f"notice: {best_dir / 'ckpt-2.index'}, which best/'s state file names, is missing: the best "
                       f"checkpoint taken again from {tmp_path / 'latest' / 'ckpt-2'}"]
    assert best.numbers() == [2] and read_state(best_dir)[0] == str(best_dir / "ckpt-2") and _value(best_dir / "ckpt-2") == 2
    assert sorted(p.name for p in best_dir.iterdir()) == ["checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index"]
    # The last epoch, a new best whose index a crash kept out of best/: the same, unsaid.
    (best_dir / "ckpt-3.data-00000-of-00001").hardlink_to(tmp_path / "latest" / "ckpt-3.data-00000-of-00001")
    best.recover(3, last_was_best=True, latest_dir=tmp_path / "latest", announce=pytest.fail)
    assert best.numbers() == [3] and not list(best_dir.glob("*.tmp"))


def test_a_lost_newest_latest_index_is_said_as_it_happened(tmp_path):
    """latest/ckpt-3.index deleted, best/ckpt-3 its intact link: the notices say that the
    state file names ckpt-3, whose index is missing, and that best/ckpt-3 (intact) goes
    because epoch 3 is trained again; not that ckpt-2 'was saved but not yet recorded',
    nor that best/ holds nothing intact."""
    from capsnet.training.checkpoints import BestCheckpoint, read_state, recover_latest

    latest = tmp_path / "latest"
    checkpoint = _small_checkpoints(latest, [1, 2, 3])
    best_dir = tmp_path / "best"
    best = BestCheckpoint(checkpoint, best_dir)
    best.adopt(3, latest / "ckpt-3")
    best.commit(3)
    (latest / "ckpt-3.index").unlink()
    notices = []
    assert recover_latest(latest, announce=notices.append) == str(latest / "ckpt-2")
    assert notices == [f"notice: {latest / 'checkpoint'} names {latest / 'ckpt-3'}, whose index file "
                       f"{latest / 'ckpt-3'}.index is missing: resuming from {latest / 'ckpt-2'}, the newest "
                       "checkpoint there (the epochs after it are trained again)"]
    assert read_state(latest)[0] == str(latest / "ckpt-2")
    notices = []
    best.recover(2, latest_dir=latest, announce=notices.append)
    assert notices == [f"notice: {best_dir / 'ckpt-3'} is of epoch 3, which the run trains again (it resumes after "
                       "epoch 2): removed; the next epoch that beats the run's best test accuracy is recorded in "
                       "its place"]
    assert best.numbers() == [] and not (best_dir / "checkpoint").exists()


@pytest.mark.slow
def test_benchmark_checkpoint_script_times_the_three_kinds(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_checkpoint.py"), "--dir", str(tmp_path),
                             "--repeats", "2", "--parameters", "1000"],
                            env=entry_point_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| latest")]
    assert [row.split(" | ")[0] for row in rows] == ["| latest only", "| latest + best written again",
                                                      "| latest + best as links"]
    assert list(tmp_path.iterdir()) == []  # its temporary directory removed


def test_last_epoch_was_best_is_the_strict_rule():
    from capsnet.training.run_dir import last_epoch_was_best

    history = [{"epoch": 1, "test_accuracy": 0.5}, {"epoch": 2, "test_accuracy": 0.7}, {"epoch": 3, "test_accuracy": 0.7}]
    assert last_epoch_was_best(history[:2], 2) and last_epoch_was_best(history[:1], 1)
    assert not last_epoch_was_best(history, 3)  # a tie is not a new best (train's rule: >)
    assert not last_epoch_was_best(history[:2], 3) and not last_epoch_was_best([], 0)


# --------------------------------------------------------------------------- train.test_every_epochs

def test_the_test_and_save_schedules_take_every_nth_and_the_last_epoch():
    from capsnet.training.control import on_schedule

    assert [e for e in range(1, 11) if on_schedule(e, 3, 10)] == [3, 6, 9, 10]
    assert [e for e in range(1, 5) if on_schedule(e, 1, 4)] == [1, 2, 3, 4]
    assert [e for e in range(1, 5) if on_schedule(e, 10, 4)] == [4]


# --------------------------------------------------------------------------- train.save_every_epochs

def saved_epochs(run_dir, which="latest"):
    state = tf.train.get_checkpoint_state(str(run_dir / "checkpoints" / which))
    return [int(Path(p).name.split("-")[1]) for p in state.all_model_checkpoint_paths]


def before_epoch(monkeypatch, number, action):
    """`action()` just before the loop trains epoch `number` of this process's next run
    (training.epoch.train_epoch wrapped; monkeypatch.undo() unwraps it)."""
    from capsnet.training import epoch

    calls, real = [], epoch.train_epoch

    def wrapped(*args, **kwargs):
        calls.append(None)
        if len(calls) == number:
            action()
        return real(*args, **kwargs)

    monkeypatch.setattr(epoch, "train_epoch", wrapped)


@pytest.mark.slow
def test_a_run_saving_every_third_epoch_trains_the_same_and_saves_on_schedule(trained_run, tiny_config, tmp_path):
    """train.save_every_epochs=3 over trained_run's 4 epochs, tested at the last only (so no
    earlier best forces a save): latest/ holds epochs 3 and 4, the training is trained_run's."""
    metrics = train(tiny_config("train.save_every_epochs=3", "train.test_every_epochs=4"))
    assert_trained_as(metrics, trained_run[1])
    assert saved_epochs(tmp_path / "run") == [3, 4]
    assert saved_epochs(tmp_path / "run", "best") == [4]


@pytest.mark.slow
def test_a_new_best_is_saved_whatever_the_save_schedule(tiny_config, tmp_path):
    """Tested every epoch and saved on schedule only at the last (save_every 10 > 4 epochs):
    the saved epochs are exactly the new bests, counted from the history, and the last."""
    metrics = train(tiny_config("train.save_every_epochs=10", "train.keep_checkpoints=10"))
    bests, high = [], -1.0
    for entry in metrics["history"]:
        if entry["test_accuracy"] > high:
            bests.append(entry["epoch"])
            high = entry["test_accuracy"]
    assert saved_epochs(tmp_path / "run") == sorted({*bests, 4})
    assert saved_epochs(tmp_path / "run", "best") == [bests[-1]]


@pytest.mark.slow
def test_an_interrupted_run_redoes_the_epochs_since_its_last_save(trained_run, tiny_config, tmp_path, monkeypatch):
    """Saved every 2nd epoch, Ctrl-C in epoch 4: epochs 3-4 are lost (the line says so) and the
    rerun redoes them from ckpt-2, ending as trained_run (the uninterrupted run) did, with one
    history line an epoch."""
    from capsnet.errors import Interrupted

    def ctrl_c():
        raise KeyboardInterrupt

    before_epoch(monkeypatch, 4, ctrl_c)
    overrides = ("train.save_every_epochs=2", "train.test_every_epochs=4")
    with pytest.raises(Interrupted) as stop:
        train(tiny_config(*overrides))
    assert str(stop.value) == ("interrupted in epoch 4 (epochs 3-4 are lost: an epoch counts once checkpointed); "
                               "rerun the same command to resume from epoch 3")
    assert saved_epochs(tmp_path / "run") == [2]
    monkeypatch.undo()
    metrics = train(tiny_config(*overrides))
    assert [h["epoch"] for h in metrics["history"]] == [1, 2, 3, 4]
    assert_trained_as(metrics, trained_run[1])
    lines = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [1, 2, 3, 4]


@pytest.mark.slow
def test_sigterm_stops_the_run_at_the_end_of_its_epoch_saved(trained_run, tiny_config, tmp_path, monkeypatch):
    """SIGTERM in epoch 2 of a run that would save only at its last epoch: epoch 2 is finished
    and saved, train() raises Terminated with the line to print, the handler it replaced is
    back; the rerun resumes from epoch 3 and ends as trained_run did."""
    import os

    from capsnet.errors import Terminated

    before_epoch(monkeypatch, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
    overrides = ("train.save_every_epochs=10", "train.test_every_epochs=10")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated) as stop:
        train(tiny_config(*overrides))
    assert str(stop.value) == "stopped by SIGTERM after epoch 2 (saved); rerun the same command to resume from epoch 3"
    assert signal.getsignal(signal.SIGTERM) == before
    assert saved_epochs(tmp_path / "run") == [2]
    monkeypatch.undo()
    metrics = train(tiny_config(*overrides))
    assert_trained_as(metrics, trained_run[1])
    assert saved_epochs(tmp_path / "run") == [2, 4]


@pytest.mark.slow
def test_train_py_stops_on_sigterm_with_one_line_and_exit_143(tiny_idx_dir, tmp_path):
    run_dir = tmp_path / "run"
    returncode, stderr = signal_train_py_in_epoch_3(signal.SIGTERM, tiny_idx_dir, tmp_path,
                                                    "train.save_every_epochs=1000", "train.test_every_epochs=1000")
    assert returncode == 143, stderr
    assert "Traceback" not in stderr, stderr
    notice, line = stderr.splitlines()[-2:]
    assert notice.startswith("SIGTERM: the run stops, saved, at the end of the epoch it is in")
    epoch = int(line.removeprefix("stopped by SIGTERM after epoch ").split(" ", 1)[0])
    assert line == (f"stopped by SIGTERM after epoch {epoch} (saved); rerun the same command to resume from "
                    f"epoch {epoch + 1}")
    assert epoch >= 3 and saved_epochs(run_dir) == [epoch]  # the only checkpoint: on schedule it saves at 200
    assert (run_dir / "train.lock").read_text() == ""


def test_the_interrupt_line_names_every_epoch_lost():
    from capsnet.training.control import RunControl

    def interrupted(control):
        return control.interrupted()

    def state(done, trained, epoch):
        control = RunControl()
        control.done, control.trained, control.epoch = done, trained, epoch
        return control

    assert interrupted(state(5, 5, None)) == "interrupted after epoch 5; rerun the same command to resume from epoch 6"
    assert interrupted(state(5, 5, 6)).startswith("interrupted in epoch 6 (its progress is lost: ")
    assert interrupted(state(5, 7, None)).startswith("interrupted after epoch 7 (epochs 6-7 are lost: ")
    assert interrupted(state(5, 7, 8)) == ("interrupted in epoch 8 (epochs 6-8 are lost: an epoch counts once "
                                           "checkpointed); rerun the same command to resume from epoch 6")

def test_collapse_patience_and_best_count_only_the_epochs_tested():
    from capsnet.training.health import collapsed_for
    from capsnet.training.run_dir import last_epoch_was_best

    untested = lambda e: {"epoch": e}  # noqa: E731 (history_entry's line of an epoch without a test pass)
    tested = lambda e, flag, acc=0.5: {"epoch": e, "collapsed": flag, "test_accuracy": acc}  # noqa: E731
    assert collapsed_for([untested(1), tested(2, True), untested(3), tested(4, True), untested(5)], 2)
    assert not collapsed_for([tested(2, False), untested(3), tested(4, True)], 2)
    assert not collapsed_for([tested(2, True), tested(4, True)], 2)  # epoch 3 missing from the history: a gap
    assert last_epoch_was_best([tested(2, False, 0.5), untested(3), tested(4, False, 0.6)], 4)
    assert not last_epoch_was_best([tested(2, False, 0.5), untested(3), tested(4, False, 0.5)], 4)
    assert not last_epoch_was_best([tested(2, False, 0.5), untested(3)], 3)  # not tested: cannot be best


@pytest.mark.slow
def test_a_run_testing_every_third_epoch_trains_the_same_and_saves_every_epoch(trained_run, tiny_config, tmp_path):
    """train.test_every_epochs=3 over trained_run's 4 epochs: epochs 3 and 4 are tested (the
    last always), 1 and 2 only trained and saved; the training itself is trained_run's (same
    seed), so the tests it runs match trained_run's at the same epochs. A resume to 7 epochs
    tests 6 and 7."""
    metrics = train(tiny_config("train.test_every_epochs=3"))
    ours, theirs = metrics["history"], trained_run[1]["history"]
    assert [h["epoch"] for h in ours] == [1, 2, 3, 4]
    assert ["test_accuracy" in h for h in ours] == [False, False, True, True]
    assert ["collapsed" in h for h in ours] == [False, False, True, True]
    for mine, reference in zip(ours, theirs):
        assert mine["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-3)
    for mine, reference in zip(ours[2:], theirs[2:]):
        assert mine["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-3)
    assert metrics["test_loss"] == pytest.approx(theirs[3]["test_loss"], rel=1e-3)
    assert metrics["best_epoch"] == (3 if ours[2]["test_accuracy"] >= ours[3]["test_accuracy"] else 4)
    best = tf.train.latest_checkpoint(str(tmp_path / "run" / "checkpoints" / "best"))
    assert best.endswith(f"ckpt-{metrics['best_epoch']}")
    state = tf.train.get_checkpoint_state(str(tmp_path / "run" / "checkpoints" / "latest"))
    assert [Path(p).name for p in state.all_model_checkpoint_paths] == ["ckpt-2", "ckpt-3", "ckpt-4"]

    resumed = train(tiny_config("train.test_every_epochs=3", "train.epochs=7"))
    assert [("test_accuracy" in h) for h in resumed["history"]] == [False, False, True, True, False, True, True]
    lines = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert lines == json.loads(json.dumps(resumed["history"]))


def test_evaluate_on_a_read_only_run_stops_before_the_pass(trained_run, tmp_path, monkeypatch):
    """A report that could not be written into the run's evaluations/ is one line before the
    test pass, not an error after it (root ignores chmod, so the read-only folder is os.access's
    answer); output= elsewhere still evaluates."""
    import capsnet.evaluation as evaluation

    run_dir = copied_run(trained_run, tmp_path).resolve()
    shutil.rmtree(run_dir / "evaluations", ignore_errors=True)  # other tests' reports of the shared run
    reports = run_dir / "evaluations"
    real_access = os.access
    monkeypatch.setattr(evaluation.os, "access", lambda path, mode: Path(path) != run_dir and real_access(path, mode))
    passes = []
    real_pass = evaluation.evaluate_model
    monkeypatch.setattr(evaluation, "evaluate_model", lambda *a, **k: passes.append(1) or real_pass(*a, **k))
    with pytest.raises(CheckpointError) as err:
        evaluation.evaluate(str(run_dir), data_dir=None)
    assert str(err.value) == (f"cannot write the evaluation report into {reports}: {run_dir} is read-only; "
                              "output=PATH writes it elsewhere")
    assert passes == []
    report = evaluation.evaluate(str(run_dir), data_dir=None, output=str(tmp_path / "elsewhere" / "report.json"))
    assert passes and (tmp_path / "elsewhere" / "report.json").is_file() and report["accuracy"] > 0
