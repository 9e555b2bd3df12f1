"""model.padding=same (the authors' CIFAR-10 model, padding=SAME): Conv1 keeps the image
size and PrimaryCaps gives ceil(size / 2) per side, counted by hand; the compiled op and
the matmul path agree on it; the config round-trips and a bad value is one line."""
import numpy as np
import pytest
import tensorflow as tf

from capsnet.errors import ConfigError
from capsnet.losses import margin_loss
from capsnet.model import CapsNet, build_model
from capsnet.training.model_setup import build_capsnet
from conftest import compose_config

pytestmark = pytest.mark.usefixtures("seeded")

SMALL = dict(input_shape=(24, 24, 3), conv1_filters=8, primary_caps_types=4, digit_caps_dim=8, decoder=False,
             padding="same")


def images(batch=3):
    return np.random.default_rng(0).uniform(size=(batch, 24, 24, 3)).astype(np.float32)


def test_same_padding_shapes_and_parameter_count():
    model = build_model(**SMALL)
    out = model(images())
    assert model.in_caps == 12 * 12 * 4  # 24 -> 24 (Conv1) -> 12 (stride 2, 'same')
    assert tuple(out["c_ij"].shape) == (3, 576, 10)
    conv1 = 9 * 9 * 3 * 8 + 8
    primary = 9 * 9 * 8 * (4 * 8) + 4 * 8
    digit = 576 * 10 * 8 * 8
    assert model.count_params() == conv1 + primary + digit
    valid = build_model(**{**SMALL, "padding": "valid"})
    assert valid.in_caps == 4 * 4 * 4  # 24 -> 16 -> 4


def test_same_padding_op_matches_matmul_path(no_tf32):
    plain = build_model(**SMALL)
    compiled = build_model(routing="op", **SMALL)
    x, labels = images(), np.array([3, 1, 4])
    plain(x)
    compiled(x)
    for conv in (plain.conv1, plain.primary_caps.conv):  # capsules long enough to differ
        conv.kernel.assign(conv.kernel * 10.0)
    compiled.set_weights(plain.get_weights())

    def run(model):
        with tf.GradientTape() as tape:
            out = model(x, labels=labels)
            loss = tf.reduce_sum(margin_loss(labels, out["lengths"]))
        return out, tape.gradient(loss, model.trainable_variables)

    (a, grads_a), (b, grads_b) = run(plain), run(compiled)
    np.testing.assert_allclose(b["lengths"].numpy(), a["lengths"].numpy(), rtol=1e-4, atol=1e-6)
    assert np.ptp(a["lengths"].numpy()) > 1e-3
    for var, ga, gb in zip(plain.trainable_variables, grads_a, grads_b):
        np.testing.assert_allclose(gb.numpy(), ga.numpy(), rtol=1e-3, atol=1e-6, err_msg=var.path)


def test_padding_round_trips_and_comes_from_the_config():
    model = build_model(**SMALL)
    assert model.get_config()["padding"] == "same"
    assert CapsNet.from_config(model.get_config()).in_caps == model.in_caps
    cfg = compose_config("train", ["run_dir=unused", "experiment=paper_cifar10", "model.padding=same",
                                   "model.conv1_filters=8", "model.primary_caps_types=4"])
    assert build_capsnet(cfg["model"], custom_op=False).in_caps == 12 * 12 * 4
    with pytest.raises(ConfigError, match=r"model\.padding must be one of valid, same, got 'full'"):
        compose_config("train", ["run_dir=unused", "model.padding=full"])
