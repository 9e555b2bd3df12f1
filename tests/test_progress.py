"""What a run prints about its time: the epoch lines' phases account for the wall time (no
unreported pauses between epochs or before the end), the estimated time of the run after its
first steps, and progress lines inside an epoch when stdout is not a terminal."""
import re
import sys
import time

import pytest

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
    estimates = re.findall(r"^estimated time of the run: .* for 2 epochs \(.* left; .* s a step, 20 steps an epoch\)$",
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
