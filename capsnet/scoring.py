"""How predictions are scored, one label per example or two (MultiMNIST).

- `predict`, `correct_predictions`, `label_order` (TensorFlow, inside the compiled
  train and test steps): one label → the longest capsule (argmax); two labels
  (batch, 2) → the two longest capsules, right iff they are exactly the two labels.
- `score(labels, predictions)` → `confusion_report` (accuracy, per-class accuracy and
  the confusion matrix) or `pair_report` (two-digit data): pure NumPy, the scores of
  every test pass and evaluation report.
- `json_safe`: a report with NaN/inf written as null, which JSON can hold.
"""
import math

import numpy as np
import tensorflow as tf


def predict(lengths, labels):
    """The predicted classes, shaped like `labels`: (batch,) the longest capsule, or for
    labels (batch, 2) the two longest capsules (batch, 2), longest first."""
    if labels.shape.rank == 2:
        return tf.math.top_k(lengths, k=labels.shape[1]).indices             # (B, 2) int32
    return tf.argmax(lengths, axis=-1, output_type=tf.int32)                  # (B,)


def correct_predictions(predictions, labels):
    """(batch,) float32, 1 where the prediction is right: the class (one label), or, with
    two labels, both (the paper's MultiMNIST scoring: the two longest capsules are exactly
    the two labels, in either order; the two labels of an example differ)."""
    if labels.shape.rank == 2:
        found = tf.reduce_any(labels[:, :, None] == predictions[:, None, :], axis=-1)  # (B, 2): label among top 2
        return tf.cast(tf.reduce_all(found, axis=-1), tf.float32)
    return tf.cast(tf.equal(predictions, labels), tf.float32)


def label_order(predictions, labels):
    """Two predicted classes (batch, 2) in the labels' order where one of them is a label
    of the other slot (swapped), so that each reconstruction from a rightly predicted
    capsule is compared with that label's digit."""
    swap = (predictions[:, 0] == labels[:, 1]) | (predictions[:, 1] == labels[:, 0])  # (B,)
    return tf.where(swap[:, None], predictions[:, ::-1], predictions)                  # (B, 2)


def score(labels, predictions, num_classes):
    """The report's scores (pure NumPy) of predictions shaped like `labels`: one label per
    example → confusion_report; two (N, 2) → pair_report."""
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    if labels.ndim == 2:
        return pair_report(labels, predictions, num_classes)
    confusion = np.zeros((num_classes, num_classes), np.int64)  # rows: true class, cols: predicted
    np.add.at(confusion, (labels, predictions), 1)
    return confusion_report(confusion)


def confusion_report(confusion):
    """accuracy, per_class_accuracy (None for a class with no examples), confusion_matrix (lists)."""
    confusion = np.asarray(confusion, np.int64)
    per_class_total = confusion.sum(axis=1)
    per_class = [None if total == 0 else float(confusion[k, k] / total)
                 for k, total in enumerate(per_class_total)]
    return {
        "accuracy": float(np.trace(confusion) / max(confusion.sum(), 1)),
        "per_class_accuracy": per_class,
        "confusion_matrix": confusion.tolist(),
    }


def pair_report(labels, predictions, num_classes):
    """Scores of two-digit examples (pure NumPy): labels and predictions int (N, 2).

    accuracy: the fraction whose two predictions are exactly the two labels (either
    order); per_class_accuracy[k]: the recall of class k, the fraction of the examples
    containing k that have k among their two predictions (None: no example contains k);
    per_class_examples[k]: how many examples contain k; confusion_matrix: None.
    """
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    found = (labels[:, :, None] == predictions[:, None, :]).any(axis=-1)  # (N, 2): each label among the predictions
    present = np.zeros(num_classes, np.int64)
    hits = np.zeros(num_classes, np.int64)
    np.add.at(present, labels.ravel(), 1)
    np.add.at(hits, labels.ravel(), found.ravel().astype(np.int64))
    return {
        "accuracy": float(found.all(axis=1).mean()),
        "per_class_accuracy": [None if p == 0 else float(h / p) for h, p in zip(hits, present)],
        "per_class_examples": present.tolist(),
        "confusion_matrix": None,
    }


def json_safe(value):
    """`value` with every NaN/inf float replaced by None: JSON has no NaN (json.dumps
    would write invalid JSON), so they are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return value

