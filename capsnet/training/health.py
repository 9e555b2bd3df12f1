"""Run health: what says a run has gone wrong without an exception of its own.

- A step whose loss or gradient norm is not finite (the compiled loop's non-finite guard
  cuts its values there; capsnet.training.epoch fetches them): NonFiniteStep, which the run
  ends with as TrainingDiverged (`diverged`), nothing of that epoch saved.
- Test results that look collapsed (`collapse_reason`: every capsule ~0, or accuracy at
  chance) for train.collapse_patience test passes in a row (`collapsed_for`): the run stops,
  saved, with TrainingCollapsed (`collapsed`).
"""
import math

from capsnet.errors import TrainingCollapsed, TrainingDiverged


class NonFiniteStep(Exception):
    """The non-finite guard stopped training: `step` (the global step number, 1-based)
    had a loss or gradient norm that is not finite; `values` are its step values."""

    def __init__(self, step, values):
        super().__init__(f"step {step}: {values}")
        self.step, self.values = step, values

    def describe(self):
        """'the loss is nan' or 'the gradient norm is inf (loss 0.31)'."""
        loss, norm = self.values.get("loss", math.nan), self.values.get("grad_norm", math.nan)
        if not math.isfinite(loss):
            return f"the loss is {loss}" + (f" (gradient norm {norm:g})" if "grad_norm" in self.values else "")
        return f"the gradient norm is {norm} (loss {loss:g})"


def diverged(stop, epoch_number, last_good, *, configured_rate, learning_rate, precision="float32"):
    """The one-line TrainingDiverged for a NonFiniteStep in epoch `epoch_number`: `last_good`
    the newest checkpoint (None before the first), `configured_rate` train.learning_rate,
    `learning_rate` the rate trained (scaled by distribute.scale_lr), `precision` train.precision."""
    where = (f"the last good checkpoint is {last_good} (epoch {epoch_number - 1}, untouched); "
             if last_good else "no checkpoint was saved yet; ")
    lower = (f"try a lower train.learning_rate (now {configured_rate:g}"
             + (f", {learning_rate:g} as scaled" if learning_rate != configured_rate else "")
             + ("; rerunning with a lower one resumes from that checkpoint)" if last_good else ")"))
    if precision != "float32":
        lower += f" or train.precision=float32 (now {precision})"
    return TrainingDiverged(f"training diverged at epoch {epoch_number}, step {stop.step}: {stop.describe()}; "
                            f"{where}{lower}")


# A collapsed epoch (collapse_reason): every test capsule shorter than this (no class is
# ever "present": the margin loss's m_minus side has won), or, after the first epochs,
# a test accuracy within this factor of chance (one guess among the label sets).
COLLAPSE_MAX_LENGTH = 0.05


COLLAPSE_CHANCE_FACTOR = 1.5


COLLAPSE_AFTER_EPOCHS = 2


def collapse_reason(test, epoch_number, num_classes, labels_per_example=1):
    """Why the epoch's test results look collapsed, in words, or None.

    A run can go wrong without a NaN: every capsule length shrinks to ~0, or the
    predictions stop depending on the input, and the loss curve alone can look calm.
    The accuracy test waits COLLAPSE_AFTER_EPOCHS epochs: a run may start at chance.
    Chance is one guess among the label sets: 1 / num_classes for one label per example,
    1 / C(num_classes, 2) = 1/45 for MultiMNIST's two (both digits right)."""
    if test.get("max_length") is not None and test["max_length"] < COLLAPSE_MAX_LENGTH:
        return f"every test capsule length is below {COLLAPSE_MAX_LENGTH} (longest {test['max_length']:.4f})"
    chance = 1.0 / math.comb(num_classes, labels_per_example)
    if epoch_number > COLLAPSE_AFTER_EPOCHS and test["accuracy"] <= COLLAPSE_CHANCE_FACTOR * chance:
        labels = f"{num_classes} classes" if labels_per_example == 1 else \
            f"{labels_per_example} of {num_classes} classes"
        return f"test accuracy {test['accuracy']:.4f} is at chance ({chance:.4f} for {labels})"
    return None


def collapsed_for(history, patience):
    """Whether the last `patience` test passes of `history` (history_entry lines, in epoch
    order; an epoch without a test pass has no `collapsed`) were all flagged collapsed, with
    no epoch missing from the history since the first of them; False for patience None
    (train on)."""
    if not patience:
        return False
    tested = [i for i, h in enumerate(history) if "collapsed" in h]
    if len(tested) < patience:
        return False
    since = history[tested[-patience]:]
    return (all(history[i]["collapsed"] for i in tested[-patience:])
            and since[-1]["epoch"] - since[0]["epoch"] == len(since) - 1)


def collapsed(epoch_number, collapse, run_path, patience, test_every_epochs):
    """The one-line TrainingCollapsed of a run stopped after epoch `epoch_number` (saved in
    `run_path`): its last `patience` test passes (one every `test_every_epochs` epochs)
    looked collapsed, the last for the reason `collapse`."""
    passes = (f"{patience} epoch{'s' if patience > 1 else ''}" if test_every_epochs == 1 else
              f"{patience} test pass{'es' if patience > 1 else ''} (one every {test_every_epochs} epochs)")
    return TrainingCollapsed(f"training stopped at epoch {epoch_number}: the test results looked collapsed for "
                             f"{passes} in a row ({collapse}); the epoch is saved in {run_path}; "
                             "train.collapse_patience=null trains on regardless")
