"""scripts/probe_init_gradients.py: a model's start on one batch, against direct computation."""
import numpy as np
import pytest
import tensorflow as tf

from capsnet.losses import margin_loss
from capsnet.model import build_model
from conftest import load_script

probe_script = load_script("probe_init_gradients")
LOSSES = dict(m_plus=0.9, m_minus=0.1, lambda_=0.5, reconstruction_weight=0.0005)


def _digits(batch=16):
    """Images in [0, 1] with stroke-like structure (mostly dark, a bright blob), labels (batch,)."""
    rng = np.random.default_rng(0)
    images = np.zeros((batch, 28, 28, 1), np.float32)
    for image in images:
        y, x = rng.integers(6, 22, 2)
        image[y - 4:y + 4, x - 2:x + 2] = 1.0
    return tf.constant(images), tf.constant(rng.integers(0, 10, batch).astype(np.int32))


def test_the_probe_reports_what_the_model_computes():
    tf.keras.utils.set_random_seed(0)
    model = build_model(conv1_filters=16, primary_caps_types=4, digit_caps_dim=8, decoder_units=(32, 64))
    images, labels = _digits()
    stats, variables = probe_script.probe(model, images, labels, LOSSES)
    conv1 = model.conv1(images).numpy()
    outputs = model(images, labels=labels, training=True)
    assert stats["conv1_active"] == pytest.approx(np.mean(conv1 > 0))
    assert stats["u_length_mean"] == pytest.approx(np.linalg.norm(model.primary_caps(conv1).numpy(), axis=-1).mean(),
                                                   rel=1e-5)
    assert stats["margin"] == pytest.approx(float(tf.reduce_mean(margin_loss(labels, outputs["lengths"], 0.9, 0.1, 0.5))),
                                            rel=1e-5)
    assert [path for path, *_ in variables] == [v.path for v in model.trainable_variables]
    assert all(g_rms > 0 for _, _, g_rms, _, _ in variables)


@pytest.mark.parametrize("scale", [1.0, 1 / 32])
def test_the_authors_start_leaves_primary_capsules_unsaturated_at_any_scale(scale):
    """The authors' PrimaryCaps start is their σ 0.1 under their 1/32: at primary_caps_scale 1
    a stored σ 0.1 (what the thirty-ninth session's MNIST runs had) starts every primary
    capsule near length 1 on MNIST; the start must not depend on the scale."""
    images, labels = _digits()
    tf.keras.utils.set_random_seed(0)
    model = build_model(initializers="authors", primary_caps_scale=scale, conv1_filters=256, primary_caps_types=4,
                        digit_caps_dim=8, decoder_units=(32, 64))
    stats, _ = probe_script.probe(model, images, labels, LOSSES)
    assert stats["conv1_active"] > 0.7  # Conv1's 0.1 bias keeps most ReLUs on at the start
    assert stats["u_length_mean"] < 0.3, stats  # the stored σ 0.1 at scale 1 started them at ~0.96 here
