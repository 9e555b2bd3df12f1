"""model=baseline_cnn (capsnet/baseline.py): the paper's CNN baseline. Its parameter count
against a count by hand from the layer sizes, its cross-entropy against NumPy, a tiny CNN
trained through train.py (the loss drops), scored by evaluate() against the predictions
recomputed here, exported with class probabilities, and custom_op=true refused."""
import json

import numpy as np
import pytest

from conftest import compose_config, read_events, run_entry_point, tiny_overrides

# A CNN that trains in seconds on 2 CPU cores: the paper's layout, narrow.
TINY_CNN = ["model=baseline_cnn", "model.cnn_filters=[8,8,4]", "model.cnn_dense_units=[32,16]", "model.cnn_dropout=0.2"]


def hand_count(image, filters, kernel, dense, classes):
    """Weights + biases of 'same' 5x5 convs, then FC layers on the flattened maps, by hand."""
    h, w, channels = image
    count = 0
    for f in filters:
        count += kernel * kernel * channels * f + f
        channels = f
    width = h * w * channels  # 'same' padding, stride 1, no pooling: the maps keep H x W
    for units in (*dense, classes):
        count += width * units + units
        width = units
    return count


@pytest.mark.parametrize("image, expected", [((28, 28, 1), 35_445_522), ((40, 40, 1), 69_704_466)])
def test_paper_cnn_parameter_count_is_the_hand_count(image, expected):
    from capsnet.baseline import build_baseline

    model = build_baseline(input_shape=image)
    assert hand_count(image, (256, 256, 128), 5, (328, 192), 10) == expected  # the yaml comment's numbers
    assert model.count_params() == expected


def test_config_builds_the_cnn_and_get_config_is_its_arguments():
    from capsnet.baseline import BaselineCNN
    from capsnet.training.model_setup import build_capsnet

    cfg = compose_config("train", ["model=baseline_cnn", "model.cnn_filters=[4,6,2]", "model.cnn_dense_units=[5]",
                                   "run_dir=/tmp/unused"])
    model = build_capsnet(cfg["model"], custom_op=False)
    assert isinstance(model, BaselineCNN)
    assert model.count_params() == hand_count((28, 28, 1), (4, 6, 2), 5, (5,), 10)
    config = model.get_config()
    assert {k: config[k] for k in ("input_shape", "num_classes", "filters", "kernel_size", "dense_units",
                                   "dropout")} == {"input_shape": [28, 28, 1], "num_classes": 10,
                                                   "filters": [4, 6, 2], "kernel_size": 5, "dense_units": [5],
                                                   "dropout": 0.5}
    clone = BaselineCNN.from_config(config)
    assert clone.get_config() == config


def test_cross_entropy_is_the_numpy_one_and_probabilities_sum_to_one():
    import tensorflow as tf

    from capsnet.baseline import build_baseline
    from capsnet.training.steps import model_losses

    model = build_baseline(filters=(3,), dense_units=(4,), input_shape=(8, 8, 1))
    images = np.random.default_rng(0).random((5, 8, 8, 1)).astype(np.float32)
    labels = np.array([0, 3, 9, 3, 1], np.int32)
    outputs = model(tf.constant(images), training=False)
    logits = outputs["logits"].numpy().astype(np.float64)
    np.testing.assert_allclose(outputs["lengths"].numpy().sum(axis=1), 1.0, rtol=1e-6)
    log_softmax = logits - logits.max(axis=1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(axis=1, keepdims=True))
    expected = -log_softmax[np.arange(5), labels]
    total, term, reconstruction = model_losses(images, labels, outputs, m_plus=0.9, m_minus=0.1, lambda_=0.5,
                                               reconstruction_weight=0.0005)
    np.testing.assert_allclose(total.numpy(), expected, rtol=1e-5)
    np.testing.assert_allclose(term.numpy(), expected, rtol=1e-5)
    assert not reconstruction.numpy().any()


def test_custom_op_is_refused_for_the_cnn(tmp_path):
    from capsnet import config
    from capsnet.errors import ConfigError

    cfg = compose_config("train", [*TINY_CNN, "custom_op=true", f"run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^custom_op=true: model.kind=baseline_cnn has no capsule routing"):
        config.check(cfg)


@pytest.mark.slow
def test_tiny_cnn_trains_through_train_py_and_evaluate_scores_it(tiny_idx_dir, tmp_path):
    import tensorflow as tf

    from capsnet.evaluation import evaluate
    from capsnet.idx import read_idx
    from capsnet.training.checkpoints import read_run_config, restore_model
    from capsnet.training.model_setup import build_capsnet

    run_dir = tmp_path / "cnn"
    overrides = tiny_overrides(tiny_idx_dir, run_dir, *TINY_CNN, "train.epochs=3", "train.learning_rate=0.003",
                              "train.figures=true")
    result = run_entry_point("train.py", *overrides, cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    losses = [h["train_loss"] for h in metrics["history"]]
    assert losses[-1] < 0.8 * losses[0], losses
    assert metrics["test_reconstruction_loss"] == 0.0
    # TensorBoard's end-of-training figures: the CNN's two, and the line saying why not the others.
    events = read_events(run_dir)
    assert sorted(tag for tag in events if tag.startswith("figures/")) == ["figures/confusion", "figures/lengths",
                                                                            "figures/notes"]
    assert "routing/c_ij" not in events

    report = evaluate(str(run_dir), which="latest")
    # The reference: the latest checkpoint's model rebuilt here, argmax of its probabilities.
    model = build_capsnet(read_run_config(run_dir)["model"], custom_op=False)
    restore_model(model, str(run_dir / "checkpoints" / "latest" / "ckpt-3"))
    images = read_idx(tiny_idx_dir / "t10k-images-idx3-ubyte.gz").astype(np.float32)[..., None] / 255.0
    labels = read_idx(tiny_idx_dir / "t10k-labels-idx1-ubyte.gz").astype(np.int64)
    probabilities = model(tf.constant(images), training=False)["lengths"].numpy()
    predictions = probabilities.argmax(axis=1)
    confusion = np.zeros((10, 10), np.int64)
    for label, prediction in zip(labels, predictions):
        confusion[label, prediction] += 1
    assert report["confusion_matrix"] == confusion.tolist()
    assert report["accuracy"] == pytest.approx(np.mean(predictions == labels))
    assert report["accuracy"] > 0.3  # chance is 0.1
    nll = -np.log(probabilities[np.arange(len(labels)), labels])
    assert report["loss"] == pytest.approx(nll.mean(), rel=1e-4)

    # The export serves the CNN's class probabilities under the CapsNet's output names.
    from capsnet.export import export

    out = export(str(run_dir), str(tmp_path / "saved"), which="latest")
    served = tf.saved_model.load(out["output"]).signatures["serving_default"](images=tf.constant(images[:7]))
    np.testing.assert_allclose(served["lengths"].numpy(), probabilities[:7], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(served["predictions"].numpy(), predictions[:7])
