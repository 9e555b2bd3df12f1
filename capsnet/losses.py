"""CapsNet losses: margin loss (Eq. 4) and the reconstruction sum of squared errors.

Both return one value per example, shape (batch,); the weight that combines them is
deliberately not applied in either. `capsnet_losses` is the paper's total loss the
compiled train and test steps use, margin + reconstruction_weight · reconstruction
(paper: 0.0005, a config value), and `loss_params(train_cfg)` its arguments from a
checked config.
"""
import numbers

import keras
import tensorflow as tf

from capsnet.precision import float32_math

__all__ = ["margin_loss", "reconstruction_loss", "MarginLoss", "ReconstructionLoss", "capsnet_losses",
           "loss_params"]


def _check_margins(m_plus, m_minus, lambda_):
    for name, value in (("m_plus", m_plus), ("m_minus", m_minus), ("lambda_", lambda_)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"margin_loss: {name} must be a number, got {value!r}")
    if not 0 <= m_minus < m_plus <= 1:
        raise ValueError(
            f"margin_loss: need 0 <= m_minus < m_plus <= 1 (capsule lengths lie in [0, 1)), "
            f"got m_plus={m_plus!r}, m_minus={m_minus!r}")
    if lambda_ < 0:
        raise ValueError(f"margin_loss: lambda_ must be >= 0, got {lambda_!r}")


def margin_loss(labels, lengths, m_plus=0.9, m_minus=0.1, lambda_=0.5):
    """Eq. 4 summed over classes k, per example.

    L = Σ_k T_k max(0, m+ − |v_k|)² + λ (1 − T_k) max(0, |v_k| − m−)², T_k = [k == label].
    λ < 1 down-weights the absent classes so that early in training the lengths of
    all digit capsules are not all pushed to zero. With two labels per example
    (MultiMNIST, Sec. 6) T_k = 1 for both classes.

    Args:
        labels: int class ids (batch,), or (batch, 2) for two-digit images, each in
            [0, num_classes).
        lengths: capsule lengths |v_k| (batch, num_classes).

    Returns:
        (batch,) loss per example.
    """
    _check_margins(m_plus, m_minus, lambda_)
    labels = tf.convert_to_tensor(labels)
    lengths = float32_math(lengths)  # 16-bit lengths: the loss in float32 (capsnet.precision)
    if not labels.dtype.is_integer:
        raise ValueError(f"margin_loss: labels must be integer class ids, got dtype {labels.dtype.name}")
    two_labels = labels.shape.rank == 2 and labels.shape[1] == 2
    if ((labels.shape.rank != 1 and not two_labels) or lengths.shape.rank != 2
            or not labels.shape[:1].is_compatible_with(lengths.shape[:1])):
        raise ValueError(
            "margin_loss: expected labels (batch,) or (batch, 2) and lengths (batch, num_classes), "
            f"got labels {tuple(labels.shape)} and lengths {tuple(lengths.shape)}")
    num_classes = lengths.shape[-1]
    if num_classes is None:
        num_classes = tf.shape(lengths)[-1]
    elif tf.executing_eagerly() and labels.shape[0]:
        # Eager only: an out-of-range id would one-hot to all zeros (a silently
        # wrong loss); in a compiled step the input pipeline has checked the labels
        # and an assert op would cost a device-to-host sync per step.
        low, high = int(tf.reduce_min(labels)), int(tf.reduce_max(labels))
        if low < 0 or high >= num_classes:
            raise ValueError(
                f"margin_loss: labels must lie in [0, {num_classes}), got values in [{low}, {high}]")
    T = tf.one_hot(labels, num_classes, dtype=lengths.dtype)            # (B, num_classes) or (B, 2, num_classes)
    if two_labels:
        T = tf.reduce_max(T, axis=1)                                    # (B, num_classes): both present
    present = T * tf.square(tf.nn.relu(m_plus - lengths))               # (B, num_classes)
    absent = lambda_ * (1.0 - T) * tf.square(tf.nn.relu(lengths - m_minus))
    return tf.reduce_sum(present + absent, axis=-1)                     # (B,)


def reconstruction_loss(images, reconstructions):
    """Sum of squared pixel errors per example, (batch,) (the paper's reconstruction loss).

    Sums over every axis but the batch: for two-digit data, images and reconstructions
    (batch, 2, H, W, C) give the sum over both digits, each against its own image."""
    # 16-bit values: the squares and their sum in float32 (capsnet.precision).
    images = float32_math(images)
    reconstructions = float32_math(reconstructions)
    if images.shape.rank is None or images.shape.rank < 2 or not images.shape.is_compatible_with(
            reconstructions.shape):
        raise ValueError(
            "reconstruction_loss: images and reconstructions must have the same shape "
            f"(batch, ...), got {tuple(images.shape)} and {tuple(reconstructions.shape)}")
    images = tf.cast(images, reconstructions.dtype)
    return tf.reduce_sum(tf.square(reconstructions - images), axis=list(range(1, images.shape.rank)))


def capsnet_losses(images, labels, outputs, *, m_plus, m_minus, lambda_, reconstruction_weight, targets=None):
    """The paper's total loss per example: margin + reconstruction_weight · reconstruction.

    Returns (total, margin, reconstruction), each (batch,). Without a decoder
    (no "reconstructions" output) the reconstruction term is zero. `targets`: what the
    reconstructions are compared with; None = the images. Two-digit data passes labels
    (batch, 2) and targets (batch, 2, H, W, C), each digit alone: the reconstruction
    term is then the sum over the two digits.
    """
    margin = margin_loss(labels, outputs["lengths"], m_plus, m_minus, lambda_)          # (B,)
    if "reconstructions" in outputs:
        targets = images if targets is None else targets
        reconstruction = reconstruction_loss(targets, outputs["reconstructions"])         # (B,)
    else:
        reconstruction = tf.zeros_like(margin)
    return margin + reconstruction_weight * reconstruction, margin, reconstruction


LOSS_KEYS = ("m_plus", "m_minus", "lambda_", "reconstruction_weight")


def loss_params(train_cfg):
    """The loss arguments of capsnet_losses from a config's `train` section, checked by
    capsnet.config.check (finite numbers, 0 <= m_minus < m_plus <= 1, lambda_ >= 0,
    reconstruction_weight >= 0: TrainConfig's field checks and margin rule)."""
    return {key: float(train_cfg[key]) for key in LOSS_KEYS}


@keras.saving.register_keras_serializable(package="capsnet")
class MarginLoss(keras.losses.Loss):
    """`margin_loss` as a Keras loss: y_true = int labels (batch,), y_pred = lengths."""

    def __init__(self, m_plus=0.9, m_minus=0.1, lambda_=0.5, name="margin_loss", **kwargs):
        _check_margins(m_plus, m_minus, lambda_)
        super().__init__(name=name, **kwargs)
        self.m_plus = float(m_plus)
        self.m_minus = float(m_minus)
        self.lambda_ = float(lambda_)

    def call(self, y_true, y_pred):
        # Keras casts y_true to the loss dtype (float); class ids are exact in float.
        labels = tf.cast(y_true, tf.int32)
        return margin_loss(labels, y_pred, self.m_plus, self.m_minus, self.lambda_)

    def get_config(self):
        return {**super().get_config(), "m_plus": self.m_plus, "m_minus": self.m_minus,
                "lambda_": self.lambda_}


@keras.saving.register_keras_serializable(package="capsnet")
class ReconstructionLoss(keras.losses.Loss):
    """`reconstruction_loss` as a Keras loss: y_true = images, y_pred = reconstructions."""

    def __init__(self, name="reconstruction_loss", **kwargs):
        super().__init__(name=name, **kwargs)

    def call(self, y_true, y_pred):
        return reconstruction_loss(y_true, y_pred)

    def get_config(self):
        return super().get_config()
