"""What a run prints about its time: the epoch lines' phases account for the wall time (no
unreported pauses between epochs or before the end), the estimated time of the run after its
first steps, and progress lines inside an epoch when stdout is not a terminal."""
import re
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from capsnet.training import epoch, loop, progress, train

# The tiny data: 320 training examples at batch 16, 20 steps an epoch.
OVERRIDES = ("data.limit_train=320", "data.limit_test=64")


def with_progress_every(tiny_config, monkeypatch, seconds, *extra):
    """The tiny config with progress lines every `seconds` (train.progress_every_seconds)."""
    return tiny_config(*extra, f"train.progress_every_seconds={seconds}")


def timed_lines(monkeypatch):
    """[(time.perf_counter(), line)] of everything train() says, as it says it."""
    lines, real = [], loop.say

    def say(line, **kwargs):
        lines.append((time.perf_counter(), line))
        return real(line, **kwargs)

    monkeypatch.setattr(loop, "say", say)
    return lines


@pytest.mark.slow
def test_the_epoch_lines_account_for_the_wall_time(tiny_config, monkeypatch):
    """From the first epoch's start to train()'s return, the time is the sum of the epochs'
    printed phases (train, test, save) within 10%: nothing long happens between epochs or
    after the last (an iterator's deletion waited up to tf.data's autotune period: seconds here,
    10-55 s in a long CPU run). A loaded machine slows the phases and the gaps alike."""
    lines = timed_lines(monkeypatch)
    train(tiny_config(*OVERRIDES, "train.epochs=5"))
    end = time.perf_counter()
    start = next(t for t, line in lines if line.startswith("epoch 1/"))
    phases = [float(m.group(1)) for _, line in lines if (m := re.match(r"epoch \d+: .* \| ([\d.]+) s: train", line))]
    assert len(phases) == 5
    wall = end - start
    assert abs(wall - sum(phases)) <= 0.1 * wall, (wall, phases)


@pytest.mark.slow
def test_a_log_file_gets_progress_lines_inside_an_epoch_and_the_runs_estimate(tiny_config, monkeypatch, capsys):
    """stdout not a terminal (capsys: a pipe), progress every 0.05 s: lines naming the step of
    the epoch, images/s and the ETAs of the epoch and the run; once, the estimated time of the
    whole run after the first timed steps."""
    cfg = with_progress_every(tiny_config, monkeypatch, 0.05, *OVERRIDES, "train.epochs=2")
    slow = epoch.train_epoch

    def slowed(train_steps, *args, **kwargs):  # ~10 ms a call: a few lines an epoch on any machine
        def steps(*a):
            time.sleep(0.01)
            return train_steps(*a)
        return slow(steps, *args, **kwargs)

    monkeypatch.setattr(epoch, "train_epoch", slowed)
    train(cfg)
    out = capsys.readouterr().out
    assert not sys.stdout.isatty()
    progress = re.findall(r"^epoch (\d): step (\d+)/20, ([\d.]+) images/s, epoch ETA (\d+) s, run ETA (\d+) s$",
                          out, re.MULTILINE)
    assert {epoch for epoch, *_ in progress} == {"1", "2"}, out
    assert all(0 < int(step) < 20 and float(speed) > 0 for _, step, speed, _, _ in progress)
    # The run's ETA counts the later epoch: larger in epoch 1 than the epoch's own.
    assert any(int(run) > int(epoch_eta) for epoch, _, _, epoch_eta, run in progress if epoch == "1")
    estimates = re.findall(r"^estimated time of the run: .* for 2 epochs \(.* left; .* images/s, 20 steps an epoch\)$",
                           out, re.MULTILINE)
    assert len(estimates) == 1
    assert out.index("estimated time of the run") < out.index("epoch 1: train loss")


@pytest.mark.slow
def test_a_terminal_shows_the_runs_eta_in_the_live_bar_and_no_progress_lines(tiny_config, monkeypatch, capsys):
    cfg = with_progress_every(tiny_config, monkeypatch, 0.0001, *OVERRIDES, "train.epochs=1", "train.progress_bar=true")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    train(cfg)
    out = capsys.readouterr().out
    # In the progress lines' words (format_duration), not a float of minutes.
    assert re.search(r" - run ETA: (\d+ s|\d+ min \d\d s|\d+ h \d\d min)( |\r|\n|$)", out), out
    assert not re.search(r"run ETA[^:]*: [\d.]+ *(\r|\n|$)", out), out
    assert not re.search(r"^epoch 1: step ", out, re.MULTILINE)


@pytest.mark.parametrize("seconds, text", [(0, "0 s"), (59.4, "59 s"), (61, "1 min 01 s"), (7322, "2 h 02 min")])
def test_format_duration(seconds, text):
    assert progress.format_duration(seconds) == text


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def said_lines(monkeypatch):
    lines = []
    monkeypatch.setattr(progress, "say", lines.append)
    return lines


def test_the_eta_is_the_images_left_over_the_images_per_second_shown(monkeypatch):
    """Fake clock, a steady 10 images/s shown: each line's ETAs are the images left over the
    rate shown (not the last call's step time, which swings: here 2x off), the run's estimate
    is said once, in words of the same rate, and two lines' run ETAs differ by the time
    between them; a line comes every `every` seconds."""
    lines, clock = said_lines(monkeypatch), FakeClock()
    report = progress.Progress(epochs=2, steps_per_epoch=100, batch_size=10, test_examples=50, test_every_epochs=1,
                               every=30, live=False, clock=clock)
    report.start_epoch(1)
    clock.now = 5.0
    report(3, seconds_per_step=2.0, images_per_sec=10.0)  # the first timed steps: the estimate, no line yet
    # 2 epochs of 1,000 images and two test passes of 50 images at 10 images/s
    assert lines == ["estimated time of the run: 3 min 30 s for 2 epochs (3 min 27 s left; 10 images/s, "
                     "100 steps an epoch)"]
    etas = []
    for now, step in ((31.0, 29), (61.0, 59), (91.0, 89)):
        clock.now = now
        report(step, seconds_per_step=0.5 if step == 59 else 2.0, images_per_sec=10.0)
        etas.append(report.run_eta)
        epoch_left = (100 - step) * 10 / 10.0
        assert report.run_eta == pytest.approx(epoch_left + 100.0 + 2 * 5.0)
        assert lines[-1] == (f"epoch 1: step {step}/100, 10.0 images/s, epoch ETA "
                             f"{progress.format_duration(epoch_left)}, run ETA {progress.format_duration(report.run_eta)}")
    assert len(lines) == 4
    assert np.diff(etas) == pytest.approx([-30.0, -30.0])
    clock.now = 100.0
    report(98, seconds_per_step=2.0, images_per_sec=10.0)  # 9 s after the last line: none
    assert len(lines) == 4


def test_the_first_line_of_the_estimate_is_said_once_per_process_and_in_the_singular(monkeypatch):
    lines, clock = said_lines(monkeypatch), FakeClock()
    report = progress.Progress(epochs=1, steps_per_epoch=10, batch_size=4, test_examples=8, test_every_epochs=1,
                               every=0, live=False, clock=clock)
    report.start_epoch(1)
    report(2, seconds_per_step=0.5)  # no images/s given: the step time's (4 images in 0.5 s); 40 + 8 images
    report(5, seconds_per_step=0.5)
    assert lines == ["estimated time of the run: 6 s for 1 epoch (5 s left; 8 images/s, 10 steps an epoch)"]
    lines.clear()
    one_step = progress.Progress(epochs=3, steps_per_epoch=1, batch_size=4, test_examples=8, test_every_epochs=1,
                                 every=0, live=False, clock=clock)
    one_step.start_epoch(1)
    one_step(1, seconds_per_step=0.5)  # 3 x 4 + 3 x 8 images at 8 images/s
    assert lines == ["estimated time of the run: 4 s for 3 epochs (4 s left; 8 images/s, 1 step an epoch)"]


def test_the_first_timed_steps_come_within_seconds_of_the_first_on_a_slow_machine(monkeypatch):
    """10 s a step, steps_per_execution=50, fake clock: the epoch's first call (one step, its
    compile: 15 s) bounds the second to one step, so the first report (the run's estimate,
    the progress lines' clock) comes 10 s after the first step, not after a 50-step call."""
    from capsnet.training import epoch as epoch_module
    from capsnet.training.epoch import EpochShape, TrainScalars, train_epoch

    clock, calls, reports = FakeClock(), [], []
    monkeypatch.setattr(epoch_module.time, "perf_counter", clock)

    def train_steps(iterator, batch_sizes):
        ran = int(tf.math.count_nonzero(batch_sizes))
        clock.now += (15.0 if not calls else 10.0 * ran)
        calls.append(ran)
        return {"loss": tf.fill([ran], 0.5), "accuracy": tf.fill([ran], 1.0), "grad_norm": tf.ones([ran])}

    shape = EpochShape(num_examples=2000, batch_size=100, steps_per_execution=50, log_every_steps=1000,
                       progress_bar=False)
    train_epoch(train_steps, None, shape, global_step=0, report=lambda step, *rest: reports.append((clock.now, step)),
                scalars=TrainScalars(tf.summary.create_noop_writer(), lambda: 0.001))
    assert calls == [1] * 20  # a call of 10 s is over CALL_SECONDS: one step each
    assert reports[0] == (25.0, 2)


@pytest.mark.parametrize("long_run_seconds, noticed", [(3600, True), (0, False), (10 * 3600, False)])
def test_a_long_run_on_a_cpu_is_noticed_once_with_the_quickstart_alternative(monkeypatch, long_run_seconds, noticed):
    """50 epochs of 600 steps at 100 images/s (~1.2 s a step: the paper model on 2 cores):
    8 h 20 min of training and 50 test passes of 100 s: the notice, once, names the
    time left, the rate it came from, experiment=quickstart and the key that silences it;
    none with 0 (a GPU, or train.long_run_notice_minutes=0) or when the run is shorter."""
    lines = said_lines(monkeypatch)
    report = progress.Progress(epochs=50, steps_per_epoch=600, batch_size=100, test_examples=10_000,
                               test_every_epochs=1, every=0, live=False, long_run_seconds=long_run_seconds,
                               clock=FakeClock())
    report.start_epoch(1)
    report(2, seconds_per_step=1.0, images_per_sec=100.0)
    report(3, seconds_per_step=1.0, images_per_sec=100.0)
    notices = [line for line in lines if line.startswith("notice:")]
    assert report.run_eta == pytest.approx(597 + 49 * 600 + 50 * 100)  # after step 3
    if noticed:
        assert notices == ["notice: this run needs about 9 h 43 min more on this CPU (at the 100 images/s of its first "
                           "steps); python train.py experiment=quickstart trains a smaller CapsNet in about a minute, "
                           "a GPU this one in minutes (train.long_run_notice_minutes=0: no notice)"]
    else:
        assert notices == []


@pytest.mark.slow
@pytest.mark.parametrize("minutes, noticed", [(0.0001, True), (0, False)])
def test_train_on_a_cpu_says_the_long_run_notice_after_the_estimate(tiny_config, capsys, minutes, noticed):
    """train() wires train.long_run_notice_minutes to Progress on a CPU (the tiny run is
    "long" against a threshold of 6 ms)."""
    if tf.config.list_logical_devices("GPU"):
        pytest.skip("a GPU trains here: the notice is for CPUs")
    train(tiny_config(*OVERRIDES, "train.epochs=1", f"train.long_run_notice_minutes={minutes}"))
    out = capsys.readouterr().out
    assert out.count("notice: this run needs about") == int(noticed)
    if noticed:
        assert out.index("estimated time of the run") < out.index("notice: this run needs about")
