"""Progress display: what a training shows while an epoch runs.

- `EpochBar` (train.progress_bar): keras' Progbar of the epoch's steps, through its public
  API: on a terminal a live bar, with the run's ETA after it; in a log file one line at
  the epoch's end.
- `Progress` (train.progress_every_seconds): the run's ETA, the estimate of the whole run
  said once, and in a log file a line every few seconds inside an epoch.
"""
import math
import sys
import time

import keras

from capsnet import console
from capsnet.console import count, say
from capsnet.training.control import on_schedule


def live_progress_bar(progress_bar):
    """Whether train.progress_bar draws a live bar (on a terminal; in a log file: one line
    per epoch instead)."""
    return bool(progress_bar) and sys.stdout.isatty()


def steps_per_call(steps_per_epoch, steps_per_execution, progress_bar):
    """The most steps train_epoch runs in one call: steps_per_execution, or with a live
    progress bar (train.progress_bar on a terminal) at most 1/20 of the epoch: the bar moves
    only when a call's values are fetched, so it then moves ~20 times an epoch whatever
    steps_per_execution is (the same steps and values; at 469 steps an epoch, 24-step
    calls, whose host overhead is negligible)."""
    if live_progress_bar(progress_bar):
        return min(steps_per_execution, max(1, math.ceil(steps_per_epoch / 20)))
    return steps_per_execution


def format_duration(seconds):
    """'42 s', '7 min 05 s', '2 h 13 min'."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """The progress of a run inside its epochs: train_epoch's `report`.

    Estimates the run's time left from the images/s shown (the epoch's mean over its timed
    steps: smoothed, so one slow call does not swing it) as the images left to train (this
    and the later epochs') over that rate, plus the test passes left (the last one's time;
    before the first, `test_examples`, the test and validation splits, at that rate); prints once, after the first timed steps
    of this process, the estimated time of the whole run, and, when stdout is not a terminal
    (a log file, a job scheduler: no live bar), a line every `every` seconds of `clock` inside
    an epoch: steps done, images/s, the ETA of the epoch and of the run. At a steady rate two
    lines' ETAs differ by the time between them. `run_eta`: the latest estimate of the run's
    seconds left (the live bar shows it). With the estimate said, if the time left is over
    `long_run_seconds` (> 0: train.long_run_notice_minutes, on a CPU), one notice that it is
    long and what trains in a minute instead (the paper model's epoch of full MNIST takes
    ~12 minutes on 2 cores: 1.2 s a step, docs/benchmarks.md)."""

    def __init__(self, *, epochs, steps_per_epoch, batch_size, test_examples, test_every_epochs, every, live,
                 long_run_seconds=0, clock=time.perf_counter):
        self.epochs, self.steps_per_epoch, self.batch_size = epochs, steps_per_epoch, batch_size
        self.test_examples, self.test_every_epochs = test_examples, test_every_epochs
        self.every, self.live, self.clock = every, live, clock
        self.long_run_seconds = long_run_seconds
        self.epoch = None  # 1-based, the epoch training
        self.test_seconds = None  # the last test pass's
        self.run_eta = None
        self.announced = False
        self.last_line = None

    def start_epoch(self, epoch_number):
        self.epoch = epoch_number
        self.last_line = self.clock()

    def tested(self, seconds):
        self.test_seconds = seconds

    def __call__(self, step_in_epoch, seconds_per_step, images_per_sec=None):
        rate = images_per_sec or self.batch_size / seconds_per_step  # images/s
        epoch_left = (self.steps_per_epoch - step_in_epoch) * self.batch_size / rate
        epoch_seconds = self.steps_per_epoch * self.batch_size / rate
        tests_left = sum(1 for e in range(self.epoch, self.epochs + 1) if on_schedule(e, self.test_every_epochs,
                                                                                        self.epochs))
        test_seconds = self.test_seconds if self.test_seconds is not None else self.test_examples / rate
        self.run_eta = epoch_left + (self.epochs - self.epoch) * epoch_seconds + tests_left * test_seconds
        if not self.announced:
            self.announced = True
            total = self.epochs * epoch_seconds + self.test_passes() * test_seconds
            say(f"estimated time of the run: {format_duration(total)} for {count(self.epochs, 'epoch')} "
                f"({format_duration(self.run_eta)} left; {rate:.3g} images/s, {count(self.steps_per_epoch, 'step')} an "
                "epoch)")
            if self.long_run_seconds and self.run_eta > self.long_run_seconds:
                say(f"notice: this run needs about {format_duration(self.run_eta)} more on this CPU (at the "
                    f"{rate:.3g} images/s of its first steps); python train.py experiment=quickstart trains a smaller "
                    "CapsNet in about a minute, a GPU this one in minutes (train.long_run_notice_minutes=0: no notice)")
        now = self.clock()
        if not self.live and self.every and now - self.last_line >= self.every and step_in_epoch < self.steps_per_epoch:
            self.last_line = now
            say(f"epoch {self.epoch}: step {step_in_epoch}/{self.steps_per_epoch}, {rate:.1f} images/s, epoch ETA "
                f"{format_duration(epoch_left)}, run ETA {format_duration(self.run_eta)}")

    def test_passes(self):
        return sum(1 for e in range(1, self.epochs + 1) if on_schedule(e, self.test_every_epochs, self.epochs))


class EpochBar:
    """keras' Progbar of an epoch's `steps_per_epoch` steps. `live` (a terminal): redrawn in
    place at every update, the run's ETA after it in format_duration's words, as the
    progress lines say it ("run ETA: 3 min 28 s"; Progbar's values are numbers only); else
    (a log file) Progbar's one line at the epoch's end."""

    def __init__(self, steps_per_epoch, live):
        self.steps_per_epoch, self.live = steps_per_epoch, live
        # interval=0: every update draws, so the ETA written after it follows the bar's line.
        self.bar = keras.utils.Progbar(steps_per_epoch, verbose=1 if live else 2, interval=0,
                                       stateful_metrics=["loss", "accuracy", "images/s"])

    def update(self, step_in_epoch, means, run_eta=None):
        """The bar at `step_in_epoch`, showing the epoch's `means` (loss, accuracy, images/s)."""
        shown = [("loss", means["loss"]), ("accuracy", means["accuracy"])]
        if "images_per_sec" in means:  # none yet after the epoch's first (untimed) step
            shown.append(("images/s", means["images_per_sec"]))
        last = step_in_epoch == self.steps_per_epoch
        if self.live:
            sys.stdout.write("\r\x1b[2K")  # the line cleared: the last ETA written after the bar goes too
        self.bar.update(step_in_epoch, shown)
        if self.live and not last and run_eta is not None:
            sys.stdout.write(f" - run ETA: {format_duration(run_eta)}")
            sys.stdout.flush()
        console.bar_line_open(self.live and not last)  # at the epoch's end the bar ends its line
