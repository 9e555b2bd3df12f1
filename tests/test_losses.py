"""Margin and reconstruction losses against hand-computed cases and NumPy."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from capsnet.losses import MarginLoss, ReconstructionLoss, margin_loss, reconstruction_loss
from conftest import np_margin_loss


def test_margin_loss_hand_computed():
    labels = tf.constant([0, 2])
    lengths = tf.constant([[0.95, 0.05, 0.3],    # present 0.95 > 0.9: 0; absent 0.3: 0.5·0.2²
                           [0.5, 0.2, 0.6]])     # present (0.9−0.6)²; absent 0.5·0.4² + 0.5·0.1²
    expected = [0.5 * 0.2**2, 0.3**2 + 0.5 * 0.4**2 + 0.5 * 0.1**2]  # [0.02, 0.175]
    np.testing.assert_allclose(margin_loss(labels, lengths).numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("m_plus, m_minus, lambda_", [(0.9, 0.1, 0.5), (0.8, 0.3, 1.0), (1.0, 0.0, 0.0)])
def test_margin_loss_matches_numpy(m_plus, m_minus, lambda_):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, size=16)
    lengths = rng.uniform(0, 1, size=(16, 10))
    got = margin_loss(tf.constant(labels), tf.constant(lengths), m_plus, m_minus, lambda_)
    assert got.shape == (16,)
    np.testing.assert_allclose(got.numpy(), np_margin_loss(labels, lengths, m_plus, m_minus, lambda_),
                               rtol=1e-12)


def test_margin_loss_is_zero_for_confident_correct_predictions():
    lengths = tf.constant([[0.05, 0.95], [0.91, 0.0]])
    np.testing.assert_array_equal(margin_loss(tf.constant([1, 0]), lengths).numpy(), [0.0, 0.0])


def test_margin_loss_gradient_matches_numpy():
    labels = np.array([1, 0, 2])
    lengths0 = np.random.default_rng(2).uniform(0, 1, size=(3, 3))
    lengths = tf.constant(lengths0)
    with tf.GradientTape() as tape:
        tape.watch(lengths)
        loss = tf.reduce_sum(margin_loss(tf.constant(labels), lengths))
    T = np.eye(3)[labels]
    expected = (-2 * T * np.maximum(0, 0.9 - lengths0)
                + 2 * 0.5 * (1 - T) * np.maximum(0, lengths0 - 0.1))
    np.testing.assert_allclose(tape.gradient(loss, lengths).numpy(), expected, rtol=1e-12)


def test_reconstruction_loss_hand_computed():
    images = np.array([[[0.0, 1.0], [1.0, 1.0]], [[0.2, 0.2], [0.2, 0.2]]])[..., None]
    recons = np.array([[[0.5, 1.0], [0.0, 1.0]], [[0.2, 0.2], [0.2, 0.2]]])[..., None]
    np.testing.assert_allclose(reconstruction_loss(images, recons).numpy(), [0.25 + 1.0, 0.0])


def test_reconstruction_loss_matches_numpy():
    rng = np.random.default_rng(3)
    images = rng.uniform(size=(5, 28, 28, 1)).astype(np.float32)
    recons = rng.uniform(size=(5, 28, 28, 1)).astype(np.float32)
    expected = ((recons.astype(np.float64) - images) ** 2).reshape(5, -1).sum(axis=1)
    got = reconstruction_loss(tf.constant(images), tf.constant(recons))
    assert got.shape == (5,)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5)


def test_loss_classes_average_the_per_example_losses():
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 10, size=8)
    lengths = rng.uniform(size=(8, 10)).astype(np.float32)
    expected = np_margin_loss(labels, lengths, 0.8, 0.2, 0.25).mean()
    np.testing.assert_allclose(float(MarginLoss(0.8, 0.2, 0.25)(labels, lengths)), expected, rtol=1e-5)
    images = rng.uniform(size=(8, 4, 4, 1)).astype(np.float32)
    recons = rng.uniform(size=(8, 4, 4, 1)).astype(np.float32)
    np.testing.assert_allclose(float(ReconstructionLoss()(images, recons)),
                               ((recons - images) ** 2).reshape(8, -1).sum(axis=1).mean(), rtol=1e-5)


@pytest.mark.parametrize("loss", [MarginLoss(0.8, 0.2, 0.25, reduction="sum"), ReconstructionLoss(name="rec")])
def test_loss_config_round_trip(loss):
    config = loss.get_config()
    clone = type(loss).from_config(config)
    assert clone.get_config() == config
    revived = keras.losses.deserialize(keras.losses.serialize(loss))
    assert type(revived) is type(loss) and revived.get_config() == config


# ----------------------------------------------------------------- bad input

def test_margin_loss_rejects_float_labels():
    with pytest.raises(ValueError, match="labels must be integer class ids, got dtype float32"):
        margin_loss(tf.constant([0.0, 1.0]), tf.ones((2, 3)))


def test_margin_loss_rejects_out_of_range_labels():
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\), got values in \[0, 3\]"):
        margin_loss(tf.constant([0, 3]), tf.ones((2, 3)))


@pytest.mark.parametrize("labels, lengths", [((2, 1), (2, 3)), ((3,), (2, 3)), ((2,), (2,))])
def test_margin_loss_rejects_mismatched_shapes(labels, lengths):
    with pytest.raises(ValueError, match="expected labels"):
        margin_loss(tf.zeros(labels, tf.int32), tf.zeros(lengths))


@pytest.mark.parametrize("kwargs", [dict(m_plus=0.1, m_minus=0.9), dict(m_plus=1.5), dict(m_minus=-0.1),
                                    dict(lambda_=-1.0), dict(m_plus="0.9")])
def test_margin_loss_rejects_bad_margins(kwargs):
    with pytest.raises(ValueError, match="margin_loss"):
        margin_loss(tf.constant([0]), tf.ones((1, 3)), **kwargs)
    with pytest.raises(ValueError, match="margin_loss"):
        MarginLoss(**kwargs)


def test_reconstruction_loss_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\(2, 28, 28, 1\) and \(2, 784\)"):
        reconstruction_loss(tf.zeros((2, 28, 28, 1)), tf.zeros((2, 784)))
