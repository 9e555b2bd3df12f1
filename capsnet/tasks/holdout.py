"""The validation split: `data.validation_fraction` of the training examples held out, for
every data kind (capsnet.tasks.base.Task.load_train_validation; an image folder splits its
files before decoding them, capsnet.tasks.images).

Why a split of its own: the checkpoint kept as best/ is the epoch with the highest accuracy
on the data it is chosen on; chosen on the test set, the test accuracy reported for it is
no longer an estimate of new data's. Held out of the training examples, the validation
split chooses best/ and the test split stays unseen by every choice.

The draw is NumPy alone (no TensorFlow): per class, where the labels are one class each
(the MNIST family, MultiMNIST's digits before they are paired, natural images), each
class's examples permuted by a generator seeded with (VALIDATION_SEED, class), so that the
split of a class does not depend on the others' sizes; `round(n_class * fraction)` of each
class held out, always leaving a class at least one training example. Labels of another
shape are drawn over all examples. The same labels and fraction give the same split in
every run and on every machine.
"""
import numpy as np

from capsnet.errors import ConfigError

VALIDATION_SEED = 81017  # not folder.SPLIT_SEED: the folder's test draw is another split


def validation_indices(labels, fraction, *, where="the training split"):
    """(train indices, validation indices) of `labels` (N,) for `fraction` in (0, 1): both
    sorted int64, disjoint, together every index. ConfigError (one line) where the fraction
    holds out no example (`where` names the data in it)."""
    labels = np.asarray(labels)
    n = len(labels)
    if labels.ndim == 1 and n:
        held = []
        for k in np.unique(labels):
            members = np.flatnonzero(labels == k)
            order = np.random.default_rng([VALIDATION_SEED, int(k)]).permutation(len(members))
            count = min(int(round(len(members) * fraction)), len(members) - 1)
            held.append(members[order[:count]])
        held = np.sort(np.concatenate(held))
    else:
        order = np.random.default_rng(VALIDATION_SEED).permutation(n)
        held = np.sort(order[:min(int(round(n * fraction)), n - 1)])
    if not len(held):
        raise ConfigError(f"data.validation_fraction={fraction} of {where} ({n} examples) holds out no example: "
                          "raise it, or give more training examples (data.limit_train)")
    return np.setdiff1d(np.arange(n), held).astype(np.int64), held.astype(np.int64)
