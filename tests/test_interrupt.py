"""Ctrl-C in the middle of an epoch: the steps run are saved (checkpoints/interrupted/), and
the rerun goes on from that step with the same batches, ending as the uninterrupted run."""
import os
import signal

import numpy as np
import pytest
import tensorflow as tf

from capsnet.errors import Interrupted
from capsnet.training import train

# 320 examples at batch 16: 20 steps an epoch, fetched (and reported) every 4 (log_every_steps).
OVERRIDES = ("data.limit_train=320", "data.limit_test=64", "train.epochs=3", "deterministic=true")


def ctrl_c_in(monkeypatch, epoch, after_step):
    """A SIGINT to this process once epoch `epoch` has run `after_step` steps (at the report
    after them), as Ctrl-C in a terminal sends it."""
    from capsnet.training.progress import Progress

    real = Progress.__call__
    sent = []

    def report(self, step_in_epoch, *args):
        if self.epoch == epoch and step_in_epoch >= after_step and not sent:
            sent.append(step_in_epoch)
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, step_in_epoch, *args)

    monkeypatch.setattr(Progress, "__call__", report)
    return sent


def final_weights(run_dir):
    reader = tf.train.load_checkpoint(str(run_dir / "checkpoints" / "latest" / "ckpt-3"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name.startswith("model/") or name.startswith("optimizer/")}


@pytest.fixture
def default_sigint():
    """SIGINT raising KeyboardInterrupt (Python's default), as train.py has it in a terminal."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_resumed_epoch_s_means_and_bar_count_the_steps_before_the_interruption(capsys):
    """train_epoch stopped by Ctrl-C after some steps, its window kept as the checkpoint keeps
    it (MetricWindow.to_json) and the epoch resumed from there: the means are the
    uninterrupted epoch's (example-weighted over all its steps, the short last batch
    included) and the bar's last line counts the epoch's steps, 20/20."""
    from capsnet.training.epoch import EpochShape, TrainScalars, train_epoch
    from capsnet.training.summaries import MetricWindow

    losses = np.linspace(2.0, 0.1, 20)  # step i's loss; its accuracy 1 - loss / 2

    def train_steps(iterator, batch_sizes):
        ran = int(tf.math.count_nonzero(batch_sizes))
        values = losses[iterator["next"]:iterator["next"] + ran]
        iterator["next"] += ran
        return {"loss": tf.constant(values), "accuracy": tf.constant(1 - values / 2), "grad_norm": tf.ones([ran])}

    shape = EpochShape(num_examples=310, batch_size=16, steps_per_execution=3, log_every_steps=4,
                       progress_bar=True)
    scalars = TrainScalars(tf.summary.create_noop_writer(), lambda: 0.001)
    whole, _, _ = train_epoch(train_steps, {"next": 0}, shape, global_step=0, scalars=scalars)
    window, asked = MetricWindow(), []
    _, step, stopped_at = train_epoch(train_steps, {"next": 0}, shape, global_step=0, scalars=scalars,
                                      stop=lambda: asked.append(1) or len(asked) >= 3, window=window)
    assert 0 < stopped_at < 20 and step == stopped_at
    capsys.readouterr()
    resumed = MetricWindow.from_json(window.to_json())
    means, step, _ = train_epoch(train_steps, {"next": stopped_at}, shape, global_step=step, first_step=stopped_at,
                                 scalars=scalars, window=resumed)
    assert step == 20 and resumed.examples == 310
    sizes = np.array([16] * 19 + [310 - 19 * 16])
    for key, values in (("loss", losses), ("accuracy", 1 - losses / 2)):
        assert means[key] == pytest.approx(np.sum(values * sizes) / 310, rel=1e-12) == whole[key]
    assert "20/20" in capsys.readouterr().out


@pytest.mark.slow
def test_ctrl_c_mid_epoch_saves_the_steps_run_and_the_rerun_ends_as_the_uninterrupted_run(
        tiny_config, tmp_path, monkeypatch, capsys, default_sigint):
    reference = train(tiny_config(*OVERRIDES, run_dir=tmp_path / "whole"))
    capsys.readouterr()

    run_dir = tmp_path / "run"
    sent = ctrl_c_in(monkeypatch, epoch=2, after_step=8)
    with pytest.raises(Interrupted) as stop:
        train(tiny_config(*OVERRIDES, run_dir=run_dir))
    out = capsys.readouterr().out
    assert sent == [8]
    assert "Ctrl-C in epoch 2: stopping after the steps running, saving them" in out
    # The flag is read after the next call: the step it ended at is saved and named.
    message = str(stop.value)
    assert message.startswith("interrupted at step ") and message.endswith(
        " of 20 in epoch 2: saved; rerun the same command to resume from there")
    step = int(message.removeprefix("interrupted at step ").split(" ", 1)[0])
    assert 8 < step < 20
    saved = tf.train.latest_checkpoint(str(run_dir / "checkpoints" / "interrupted"))
    reader = tf.train.load_checkpoint(saved)
    assert reader.get_tensor("step_in_epoch/.ATTRIBUTES/VARIABLE_VALUE") == step
    assert reader.get_tensor("epoch/.ATTRIBUTES/VARIABLE_VALUE") == 1
    assert reader.get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE") == 20 + step
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back

    monkeypatch.undo()
    metrics = train(tiny_config(*OVERRIDES, run_dir=run_dir))
    out = capsys.readouterr().out
    assert f"resuming epoch 2 at step {step} of 20" in out and f"epoch 2/3 (from step {step})" in out
    assert metrics["global_step"] == reference["global_step"] == 60
    # Bitwise the uninterrupted run's: the weights, Adam's state and the results after it.
    ours, theirs = final_weights(run_dir), final_weights(tmp_path / "whole")
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert metrics["test_loss"] == reference["test_loss"]
    assert metrics["history"][2]["train_loss"] == reference["history"][2]["train_loss"]
    # The resumed epoch's train means cover all its steps, the 320 examples, before and after the Ctrl-C.
    resumed = metrics["history"][1]
    assert resumed["resumed_at_step"] == step and resumed["train_examples"] == 320
    for key in ("train_loss", "train_accuracy", "train_margin_loss"):
        assert resumed[key] == reference["history"][1][key], key
    assert not (run_dir / "checkpoints" / "interrupted").exists()  # superseded by epoch 2's checkpoint


@pytest.mark.slow
def test_ctrl_c_in_the_first_epoch_resumes_without_an_epoch_checkpoint(tiny_config, tmp_path, monkeypatch,
                                                                       capsys, default_sigint):
    run_dir = tmp_path / "run"
    ctrl_c_in(monkeypatch, epoch=1, after_step=4)
    with pytest.raises(Interrupted, match=r"^interrupted at step \d+ of 20 in epoch 1: saved"):
        train(tiny_config(*OVERRIDES, "train.epochs=1", run_dir=run_dir))
    monkeypatch.undo()
    metrics = train(tiny_config(*OVERRIDES, "train.epochs=1", run_dir=run_dir))
    assert metrics["global_step"] == 20 and metrics["epochs"] == 1
    assert "resuming epoch 1 at step" in capsys.readouterr().out


@pytest.mark.slow
def test_train_py_answers_ctrl_c_within_a_second_and_exits_within_three(tiny_idx_dir, tmp_path):
    """train.py on a long tiny run, SIGINT in epoch 3: the notice on stdout within 1 s, the
    process gone (exit 130) within 3 s, the one-line message naming what was saved."""
    import subprocess
    import sys
    import time

    from conftest import REPO, entry_point_env, sigint_as_in_a_terminal, tiny_overrides

    overrides = tiny_overrides(tiny_idx_dir, tmp_path / "run", "train.epochs=200", "data.limit_train=320",
                               "data.limit_test=16")
    log = tmp_path / "out.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, str(REPO / "train.py"), *overrides], cwd=tmp_path,
                                   env=entry_point_env(), preexec_fn=sigint_as_in_a_terminal,
                                   stdout=out, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 180
            while "epoch 3/" not in log.read_text() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            sent = time.monotonic()
            process.send_signal(signal.SIGINT)
            noticed = None
            while process.poll() is None and time.monotonic() < sent + 30:
                if noticed is None and "Ctrl-C " in log.read_text():
                    noticed = time.monotonic()
                time.sleep(0.02)
            exited = time.monotonic()
            _, stderr = process.communicate(timeout=60)
        finally:
            process.kill()
    if noticed is None and "Ctrl-C " in log.read_text():
        noticed = exited
    assert process.returncode == 130, stderr
    assert noticed is not None and noticed - sent < 1.0, (noticed, sent)
    assert exited - sent < 3.0
    assert stderr.count("\n") == 1 and stderr.startswith("interrupted ")
    # The command that resumes it, naming the run dir (a plain run's dir is named by its start time).
    assert ": saved; rerun `python train.py model.conv1_filters=16 " in stderr
    assert f" hydra.run.dir={tmp_path / 'run'}` to resume from there" in stderr
