"""scripts/probe_init_gradients.py: a model's start on one batch, its statistics against
NumPy on the model's own outputs, its command line, and the authors' start it exposed."""
import numpy as np
import pytest
import tensorflow as tf

from capsnet.losses import margin_loss
from capsnet.model import build_model
from conftest import TINY_MODEL, load_script

probe_script = load_script("probe_init_gradients")
LOSSES = dict(m_plus=0.9, m_minus=0.1, lambda_=0.5, reconstruction_weight=0.0005)
SMALL = dict(conv1_filters=16, primary_caps_types=4, digit_caps_dim=8, decoder_units=(32, 64))


def _digits(batch=16, size=28):
    """Images in [0, 1] with stroke-like structure (mostly dark, a bright bar), labels (batch,)."""
    rng = np.random.default_rng(0)
    images = np.zeros((batch, size, size, 1), np.float32)
    for image in images:
        y, x = rng.integers(6, size - 6, 2)
        image[y - 4:y + 4, x - 2:x + 2] = 1.0
    return tf.constant(images), tf.constant(rng.integers(0, 10, batch).astype(np.int32))


def test_the_statistics_are_the_models_outputs_aggregated_as_named():
    tf.keras.utils.set_random_seed(0)
    model = build_model(**SMALL)
    images, labels = _digits()
    stats, variables = probe_script.probe(model, images, labels, LOSSES)
    conv1 = model.conv1(images).numpy()
    outputs = model(images, labels=labels, training=True)
    lengths, c_ij = outputs["lengths"].numpy(), outputs["c_ij"].numpy()  # (B, 10), (B, in_caps, 10)
    labelled = lengths[np.arange(len(lengths)), labels.numpy()]
    others = np.concatenate([np.delete(row, label) for row, label in zip(lengths, labels.numpy())])
    assert stats["v_length_present"] == pytest.approx(labelled.mean(), rel=1e-5)
    assert stats["v_length_absent"] == pytest.approx(others.mean(), rel=1e-5)
    assert stats["v_length_max"] == pytest.approx(lengths.max(), rel=1e-5)
    assert stats["c_ij_max_mean"] == pytest.approx(np.mean([row.max() for row in c_ij.reshape(-1, 10)]), rel=1e-5)
    assert stats["conv1_active"] == pytest.approx(np.mean(conv1 > 0))
    u = model.primary_caps(conv1).numpy()
    assert stats["u_length_mean"] == pytest.approx(np.sqrt((u ** 2).sum(-1)).mean(), rel=1e-5)
    margin = margin_loss(labels, outputs["lengths"], 0.9, 0.1, 0.5)
    assert stats["margin"] == pytest.approx(float(tf.reduce_mean(margin)), rel=1e-5)
    squared_error = ((outputs["reconstructions"].numpy() - images.numpy()) ** 2).reshape(len(lengths), -1).sum(-1)
    assert stats["reconstruction"] == pytest.approx(squared_error.mean(), rel=1e-4)
    assert [path for path, *_ in variables] == [v.path for v in model.trainable_variables]
    for (_, w_rms, g_rms, _, _), variable in zip(variables, model.trainable_variables):
        assert w_rms == pytest.approx(np.sqrt(np.mean(variable.numpy() ** 2)), rel=1e-6)
        assert g_rms > 0


def test_two_digit_labels_count_both_classes_as_labelled():
    tf.keras.utils.set_random_seed(0)
    model = build_model(input_shape=(36, 36, 1), **SMALL)
    images, _ = _digits(size=36)
    labels = tf.constant(np.stack([np.arange(16) % 10, (np.arange(16) + 3) % 10], axis=1).astype(np.int32))
    targets = tf.stack([images, images], axis=1)  # (B, 2, H, W, C)
    stats, _ = probe_script.probe(model, images, labels, LOSSES, targets=targets)
    lengths = model(images, labels=labels, training=True)["lengths"].numpy()
    mask = np.zeros(lengths.shape, bool)
    mask[np.arange(16), labels.numpy()[:, 0]] = mask[np.arange(16), labels.numpy()[:, 1]] = True
    assert stats["v_length_present"] == pytest.approx(lengths[mask].mean(), rel=1e-5)
    assert stats["v_length_absent"] == pytest.approx(lengths[~mask].mean(), rel=1e-5)


def test_the_command_line_probes_noise_or_the_configs_data(tiny_idx_dir, capsys):
    probe_script.main(["--batch", "8,4", *TINY_MODEL])  # no data.dir: uniform noise
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed if line.startswith("batch")] == ["batch 8", "batch 4"]
    probe_script.main(["--batch", "8", *TINY_MODEL, f"data.dir={tiny_idx_dir}"])
    batch_line = capsys.readouterr().out.splitlines()[0]
    assert batch_line.startswith("batch 8: loss ") and "conv1 ReLUs active" in batch_line


@pytest.mark.parametrize("args, message", [
    (["model.nonexistent=3"], "model.nonexistent"),
    (["model.primary_caps_scale=-1"], "model.primary_caps_scale must be a positive number"),
    (["data.name=multimnist"], "multimnist has two labels an image, not a noise batch: set data.dir"),
    (["data.dir=/nonexistent/mnist"], "data.dir=/nonexistent/mnist is not a directory"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        probe_script.main(args)
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: ") and message in error[0]


@pytest.mark.parametrize("batch", ["0", "-3", "abc", "8,"])
def test_a_bad_batch_size_is_refused_by_the_parser(batch, capsys):
    with pytest.raises(SystemExit) as exit_:
        probe_script.main(["--batch", batch])
    assert exit_.value.code == 2
    assert "batch sizes must be positive integers" in capsys.readouterr().err


@pytest.mark.parametrize("scale", [1.0, 1 / 32])
def test_the_authors_start_leaves_primary_capsules_unsaturated_at_any_scale(scale):
    """The authors' PrimaryCaps start is their σ 0.1 under their 1/32: at primary_caps_scale 1
    a stored σ 0.1 (what the thirty-ninth session's MNIST runs had) starts every primary
    capsule near length 1; the start must not depend on the scale."""
    images, labels = _digits()
    tf.keras.utils.set_random_seed(0)
    model = build_model(initializers="authors", primary_caps_scale=scale, conv1_filters=256, primary_caps_types=4,
                        digit_caps_dim=8, decoder_units=(32, 64))
    stats, _ = probe_script.probe(model, images, labels, LOSSES)
    assert stats["u_length_mean"] < 0.3, stats  # the stored σ 0.1 at scale 1 started them at ~0.96 here
