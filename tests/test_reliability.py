"""A run that goes wrong says so at once and loses nothing (issue #19): the non-finite
guard, damaged checkpoints and checkpoint state, one training per run dir, and the
smaller checks. Tiny synthetic data (conftest), train() in-process or the CLI as a
subprocess; files corrupted with real bytes."""
import json
import shutil

import numpy as np
import pytest
import tensorflow as tf

from capsnet.errors import TrainingDiverged
from capsnet.training import train
from capsnet.training import steps as steps_module
from capsnet.training.steps import STEP_VALUES, make_train_loop
from conftest import run_entry_point, tiny_overrides

STEPS_PER_EPOCH = 20  # 320 tiny training images / batch 16


def tree_bytes(directory):
    """{relative path: bytes} of every file under directory (what 'untouched' compares)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- 1. the non-finite guard

def test_train_loop_stops_at_the_first_non_finite_step_on_the_device():
    """make_train_loop runs no step after the first whose loss or grad_norm is not finite:
    the call returns the values up to and including that step."""
    calls = tf.Variable(0)

    @tf.function
    def fake_step(images, labels):
        calls.assign_add(1)
        n = tf.cast(calls, tf.float32)
        bad_loss = tf.where(tf.equal(calls, 3), np.nan, n)
        bad_norm = tf.where(tf.equal(calls, 6), np.inf, 1.0)
        return {"loss": bad_loss, "margin_loss": n, "reconstruction_loss": n, "accuracy": n, "grad_norm": bad_norm}

    dataset = tf.data.Dataset.from_tensors((tf.zeros([2, 4]), tf.zeros([2], tf.int32))).repeat()
    loop = make_train_loop(fake_step)
    iterator = iter(dataset)
    out = loop(iterator, tf.constant([2] * 5, tf.int32))
    assert set(out) == set(STEP_VALUES)
    np.testing.assert_array_equal(out["margin_loss"].numpy(), [1, 2, 3])  # stopped after step 3: NaN loss
    assert int(calls.numpy()) == 3
    out = loop(iterator, tf.constant([2] * 5, tf.int32))
    np.testing.assert_array_equal(out["margin_loss"].numpy(), [4, 5, 6])  # step 6: an infinite gradient norm
    out = loop(iterator, tf.constant([2, 2, 0, 0, 0], tf.int32))
    np.testing.assert_array_equal(out["loss"].numpy(), [7, 8])  # finite: all the steps asked for


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


def test_a_diverging_learning_rate_stops_the_cli_with_one_line_and_a_lower_one_resumes(tiny_idx_dir, tmp_path):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_idx_dir, run_dir, "train.epochs=1")
    assert run_entry_point("train.py", *overrides, cwd=tmp_path).returncode == 0
    before = tree_bytes(run_dir / "checkpoints")
    result = run_entry_point("train.py", *overrides, "train.epochs=2", "train.learning_rate=1e8", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert errors[0].startswith("error: training diverged at epoch 2, step 2")
    assert "checkpoints/latest/ckpt-1 (epoch 1, untouched)" in errors[0]
    assert "train.learning_rate (now 1e+08" in errors[0]
    assert tree_bytes(run_dir / "checkpoints") == before
    # The documented way on: the same command with a lower learning rate resumes from ckpt-1, with a notice.
    result = run_entry_point("train.py", *overrides, "train.epochs=2", "train.learning_rate=0.005", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "train.learning_rate: 100000000.0 -> 0.005" in result.stdout
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["resumed_from"].endswith("latest/ckpt-1") and metrics["epochs"] == 2
    assert [h["epoch"] for h in metrics["history"]] == [1, 2]
    assert all(np.isfinite(h["train_loss"]) for h in metrics["history"])
