"""How a dataset kind's examples are labelled: the Task's `label_format`, which the compiled
steps, the evaluation, the export and predict ask instead of knowing the dataset.

- `OneLabel`: one class an example, labels int32 (B,); the longest capsule is the prediction
  and the decoder's reconstruction is of it.
- `TwoDigits`: MultiMNIST (Sabour et al. 2017, Sec. 6), labels int32 (B, 2) and each digit
  alone as the reconstruction target (B, 2, H, W, C); the two longest capsules are the
  prediction, each reconstructs its own digit.

Scoring follows the labels' shape (capsnet.scoring); what differs beyond it is here.
"""
import numpy as np
import tensorflow as tf

from capsnet.scoring import label_order

# The prediction of an image whose capsule lengths are not all finite (a NaN or inf pixel).
NO_CLASS = -1


class OneLabel:
    """One class an example."""
    per_example = 1
    # Whether a batch carries reconstruction targets beside the labels, (images, labels,
    # targets): what a test-time view, a replica split or a figure of one label would have to
    # handle too.
    targets = False

    def step_signature(self, image_shape):
        """The compiled steps' input signature: (images, labels[, targets])."""
        return [tf.TensorSpec([None, *image_shape], tf.float32), tf.TensorSpec([None], tf.int32)]

    def test_outputs(self, model, outputs, predictions, labels):
        """The test step's outputs: the model's own (no labels went in, so its decoder
        reconstructed the longest capsule)."""
        return outputs

    def serving_predictions(self, lengths):
        """int32 (N,): the longest capsule of capsule lengths (N, classes), NO_CLASS where an
        image's lengths are not all finite (argmax would answer class 0)."""
        predictions = tf.argmax(lengths, axis=-1, output_type=tf.int32)             # (N,)
        finite = tf.reduce_all(tf.math.is_finite(lengths), axis=-1)                  # (N,)
        return tf.where(finite, predictions, tf.constant(NO_CLASS, tf.int32))

    def served_reconstructions(self, model, outputs, predictions):
        """The reconstructions the export serves, (N, H, W, C): the model's."""
        return outputs["reconstructions"]

    def signature_words(self, h, w, c):
        """(predictions, reconstructions) of the export's signatures, in words."""
        return "int32 (N,): the longest capsule", f"float32 (N, {h}, {w}, {c})"

    def record(self, names, predicted):
        """What predict's record of one image adds for its predicted classes `predicted`
        (1-D ints, longest first): nothing beyond its "class"."""
        return {}

    def reconstruction_image(self, reconstruction):
        """The one image predict writes of an image's reconstruction(s): (H, W, C)."""
        return reconstruction


class TwoDigits(OneLabel):
    """MultiMNIST's two labels an example and the digits as reconstruction targets."""
    per_example = 2
    targets = True

    def step_signature(self, image_shape):
        return [tf.TensorSpec([None, *image_shape], tf.float32), tf.TensorSpec([None, 2], tf.int32),
                tf.TensorSpec([None, 2, *image_shape], tf.float32)]

    def test_outputs(self, model, outputs, predictions, labels):
        if "reconstructions" not in outputs:
            return outputs
        # The model reconstructed from the longest capsule only; here from the two longest,
        # each in the labels' order where it names one, to be compared with that digit.
        return {**outputs, "reconstructions": model.reconstruct(outputs["v_j"], label_order(predictions, labels))}

    def serving_predictions(self, lengths):
        """int32 (N, 2): the two longest capsules, longest first; both NO_CLASS where the
        lengths are not all finite."""
        predictions = tf.math.top_k(lengths, k=2).indices                            # (N, 2) int32
        finite = tf.reduce_all(tf.math.is_finite(lengths), axis=-1)                  # (N,)
        return tf.where(finite[:, None], predictions, tf.constant(NO_CLASS, tf.int32))

    def served_reconstructions(self, model, outputs, predictions):
        # The model reconstructed the longest capsule only (that unused branch is pruned from
        # the served function); here each of the two longest.
        return model.reconstruct(outputs["v_j"], predictions)                         # (N, 2, H, W, C)

    def signature_words(self, h, w, c):
        return "int32 (N, 2): the two longest capsules, longest first", f"float32 (N, 2, {h}, {w}, {c})"

    def record(self, names, predicted):
        return {"classes": [names[c] for c in predicted]}

    def reconstruction_image(self, reconstruction):
        # (2, H, W, C): side by side, the longest capsule's on the left.
        return np.concatenate(list(reconstruction), axis=1)


ONE_LABEL, TWO_DIGITS = OneLabel(), TwoDigits()
LABEL_FORMATS = {fmt.per_example: fmt for fmt in (ONE_LABEL, TWO_DIGITS)}
