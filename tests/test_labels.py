"""capsnet.tasks.labels, the Task's label format: one label or MultiMNIST's two digits. The
served predictions against NumPy (argmax / the two largest, NO_CLASS where a row is not
finite), the test step's reconstructions in the labels' order against the decoder called
class by class, predict's record and picture, and evaluate's test pairs by task."""
import numpy as np
import pytest

from capsnet.errors import ConfigError
from capsnet.tasks import task_for
from capsnet.tasks.labels import LABEL_FORMATS, NO_CLASS, ONE_LABEL, TWO_DIGITS


def lengths_with_bad_rows():
    lengths = np.random.default_rng(3).uniform(size=(6, 5)).astype(np.float32)
    lengths[2, 1] = np.nan
    lengths[4, 0] = np.inf
    return lengths


def test_served_predictions_against_numpy():
    lengths = lengths_with_bad_rows()
    finite = np.isfinite(lengths).all(axis=1)
    one = ONE_LABEL.serving_predictions(lengths).numpy()
    np.testing.assert_array_equal(one, np.where(finite, np.argmax(np.nan_to_num(lengths), axis=1), NO_CLASS))
    two = TWO_DIGITS.serving_predictions(lengths).numpy()
    expected = np.argsort(-lengths, axis=1, kind="stable")[:, :2]
    np.testing.assert_array_equal(two[finite], expected[finite])
    assert (two[~finite] == NO_CLASS).all() and two.shape == (6, 2)


def test_step_signatures():
    assert [tuple(s.shape) for s in ONE_LABEL.step_signature((8, 8, 1))] == [(None, 8, 8, 1), (None,)]
    assert [tuple(s.shape) for s in TWO_DIGITS.step_signature((8, 8, 1))] == [(None, 8, 8, 1), (None, 2),
                                                                              (None, 2, 8, 8, 1)]
    assert LABEL_FORMATS == {1: ONE_LABEL, 2: TWO_DIGITS}
    assert task_for({"name": "mnist"}).label_format is ONE_LABEL
    assert task_for({"name": "multimnist"}).label_format is TWO_DIGITS


def test_two_digit_test_outputs_reconstruct_each_label_s_digit():
    import tensorflow as tf

    from capsnet.model import build_model
    from capsnet.scoring import predict

    model = build_model(input_shape=(28, 28, 1), num_classes=4, conv1_filters=8, primary_caps_types=2,
                        primary_caps_dim=4, digit_caps_dim=4, decoder_units=(8, 8))
    images = tf.constant(np.random.default_rng(0).uniform(size=(5, 28, 28, 1)).astype(np.float32))
    outputs = model(images, training=False)
    predictions = predict(outputs["lengths"], tf.zeros((5, 2), tf.int32)).numpy()     # (5, 2) the two longest
    labels = np.stack([predictions[:, 1], predictions[:, 0]], axis=1)                  # each label the other slot
    labels[0] = predictions[0]                                                         # ... but the first in order
    served = TWO_DIGITS.test_outputs(model, outputs, tf.constant(predictions), tf.constant(labels))
    assert ONE_LABEL.test_outputs(model, outputs, None, None) is outputs
    for i in range(5):
        for d in range(2):
            expected = model.decoder(outputs["v_j"][i:i + 1], tf.constant([labels[i, d]]))[0]
            np.testing.assert_allclose(served["reconstructions"][i, d], expected, rtol=1e-6, atol=1e-7)


def test_predict_records_and_pictures():
    names = ["a", "b", "c", "d"]
    assert ONE_LABEL.record(names, np.array([2])) == {}
    assert TWO_DIGITS.record(names, np.array([3, 1])) == {"classes": ["d", "b"]}
    pair = np.random.default_rng(1).uniform(size=(2, 4, 3, 1))
    np.testing.assert_array_equal(TWO_DIGITS.reconstruction_image(pair), np.concatenate([pair[0], pair[1]], axis=1))
    single = pair[0]
    assert ONE_LABEL.reconstruction_image(single) is single  # one picture: as it is


def test_evaluate_s_test_pairs_by_task():
    run = {"name": "multimnist", "shift_pixels": 6, "pad_pixels": None}
    task, pairs = task_for(run).for_test_pairs({"shift_pixels": 6}, run_border=4)
    assert pairs == {"shift_pixels": 6, "pad_pixels": 4} and task.cfg["pad_pixels"] == 4  # the run's canvas kept
    task, pairs = task_for(run).for_test_pairs({"pad_pixels": 2}, run_border=4)
    assert pairs == {"shift_pixels": 6, "pad_pixels": 2}
    mnist = task_for({"name": "mnist"})
    assert mnist.for_test_pairs({}, run_border=2) == (mnist, None)
    with pytest.raises(ConfigError, match="MultiMNIST's test pairs: the mnist test images are scored as they are"):
        mnist.for_test_pairs({"shift_pixels": 3}, run_border=2)
