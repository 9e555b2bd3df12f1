"""Run control: what is asked of a training while it runs, and where it stands.

`RunControl` is one run's: the signals (SIGTERM, a job's time limit or a preemption: the
run stops at the end of the epoch it is in, saved; Ctrl-C: after the steps running, saved
there; a second one of either at once), where the run is (the epoch running, the epochs
trained and checkpointed) and how to go on (the resume line every stop names).
`on_schedule`: which epochs test and save (train.test_every_epochs, train.save_every_epochs).
"""
import signal
import sys
import threading

from capsnet.console import say
from capsnet.errors import Interrupted, Terminated
from capsnet.training.checkpoints import checkpoint_numbers


def on_schedule(epoch_number, every, epochs):
    """Whether epoch `epoch_number` (1-based) is one of every `every`th epochs or the last of
    the `epochs`: when train.test_every_epochs tests (the last: the run's final metrics)
    and train.save_every_epochs saves (the last: the run's final checkpoint)."""
    return epoch_number % every == 0 or epoch_number == epochs


class RunControl:
    """One training's stop requests and progress.

    `run`: its RunDir (closed by train()); `epoch`: the epoch running (1-based) or None
    between epochs; `trained`: the epochs finished; `done`: the epochs checkpointed (None
    until the epoch loop starts: the set-up); `interrupt` and `terminate`: a Ctrl-C or a
    SIGTERM asked the run to stop. `resume_command`: the command that resumes the run
    (train.py's, naming the run dir), said in every stop's line.

    Python runs a signal handler between bytecodes of the main thread: the training steps
    run on a worker thread while it waits (capsnet.training.epoch.train_epoch), so the
    handlers run at once there; a signal that lands inside another TensorFlow call (a test
    pass's step, a data load's batch) acts when that call returns."""

    def __init__(self, resume_command=None):
        self.resume_command = resume_command
        self.run = None
        self.epoch = self.trained = self.done = None
        self.interrupt = self.terminate = False
        self._replaced = {}  # {signal number: the handler ours replaced}

    # ---- the signals

    def handle_signals(self, multi_worker=False):
        """From here a signal acts as the class says; during the set-up (before `start`) it
        stops the run at once, nothing trained being lost: SIGTERM as Terminated (the process
        exits through its cleanup, a partial data cache removed, not at once unsaid), Ctrl-C
        as Python's KeyboardInterrupt. Only the main thread may set a handler; a multi-worker
        run keeps the defaults (its workers save together, and a signal reaches one of them).
        `restore_signals` puts the replaced handlers back."""
        if threading.current_thread() is not threading.main_thread() or multi_worker:
            return
        replaced = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._replaced[signal.SIGTERM] = signal.SIG_DFL if replaced is None else replaced
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored
            self._replaced[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)

    def restore_signals(self):
        for signum, handler in self._replaced.items():
            signal.signal(signum, handler)
        self._replaced.clear()

    def _on_sigterm(self, signum, frame):
        if self.done is None:
            raise Terminated(f"stopped by SIGTERM before training started (nothing trained); "
                             f"{self.resume_hint('to start')}")
        if self.terminate:
            raise KeyboardInterrupt  # the second SIGTERM: stop now (train() names what is lost)
        self.terminate = True
        say("SIGTERM: the run stops, saved, at the end of the epoch it is in (a second SIGTERM stops it at once)",
            stream=sys.stderr)

    def _on_sigint(self, signum, frame):
        if self.done is None or self.interrupt:
            raise KeyboardInterrupt  # the set-up, or the second Ctrl-C: stop now (train() names what is lost)
        self.interrupt = True
        where = f"in epoch {self.epoch}" if self.epoch is not None else "between epochs"
        try:
            say(f"Ctrl-C {where}: stopping after the steps running, saving them (Ctrl-C again stops at once, unsaved)")
        except RuntimeError:  # the handler ran inside a write to stdout (a reentrant call): the stop goes on unsaid
            pass

    # ---- where the run is

    def start(self, epochs_done):
        """The epoch loop starts after `epochs_done` epochs (those of the checkpoint resumed)."""
        self.done = self.trained = epochs_done

    def stop_asked(self):
        """Whether Ctrl-C asked the steps to stop (train_epoch's `stop`)."""
        return self.interrupt

    # ---- the lines that end a run

    def resume_hint(self, to="to resume"):
        """How to go on: 'rerun <the command> to resume' (train.py's command names the run dir)."""
        command = self.resume_command
        return f"rerun `{command}` {to}" if command else f"rerun the same command {to}"

    def stopped_after(self, epoch_number, terminating):
        """The Interrupted (Ctrl-C) or Terminated (SIGTERM) of a run stopped after epoch `epoch_number`, saved."""
        if terminating:
            return Terminated(f"stopped by SIGTERM after epoch {epoch_number} (saved); {self.resume_hint()} from "
                              f"epoch {epoch_number + 1}")
        return Interrupted(f"interrupted after epoch {epoch_number}: saved; {self.resume_hint()} from epoch "
                           f"{epoch_number + 1}")

    def interrupted(self):
        """The line for a stop at once (Ctrl-C in the set-up, a second Ctrl-C or SIGTERM): where
        the run stopped and how to go on. An epoch counts as done once its checkpoint is on
        disk: `done` is raised to the newest epoch checkpoint there (a stop right after a
        save, before the loop noted it)."""
        run = self.run
        if run is not None and self.done is not None and run.chief:
            self.done = max([self.done, *checkpoint_numbers(run.path / "checkpoints" / "latest")])
        if self.done is None:
            return f"interrupted before training started; {self.resume_hint('to start')}"
        done, running = self.done, self.epoch
        if running is not None and running <= done:
            running = None  # the epoch running was saved
        trained = max(self.trained or 0, done)
        resume = f"{self.resume_hint()} from epoch {done + 1}"
        if running is None and trained == done:
            return f"interrupted after epoch {done}; {resume}"
        # Lost: the epoch running, and with train.save_every_epochs > 1 the ones trained since the last save.
        last = running if running is not None else trained
        where = f"in epoch {running}" if running is not None else f"after epoch {last}"
        lost = "its progress is lost" if last == done + 1 else f"epochs {done + 1}-{last} are lost"
        return f"interrupted {where} ({lost}: an epoch counts once checkpointed); {resume}"
