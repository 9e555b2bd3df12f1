"""model=deep_capsnet / deep_cnn (capsnet/deep.py): the ResNet-9 stem with capsules or a dense
head. Output and gradient shapes, the parameter count against one by hand, get_config's round
trip, custom_op=true (the fused op) against custom_op=false on the same weights (outputs and
gradients), the config's one-line errors, the natural-image padding and cutout against NumPy,
and a tiny deep model trained through train() on an image folder, then evaluated, exported
and predicted."""
import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("seeded")

TINY = {"input_shape": (16, 16, 3), "num_classes": 5, "widths": (8, 8, 16, 16), "primary_caps_types": 4,
        "primary_caps_dim": 8, "digit_caps_dim": 4}


def hand_count(image, widths, types, dim, classes, digit_dim, kernel=1, head="capsules"):
    """Convs 3x3 without bias + batch norm (gamma, beta, moving mean and variance) per block;
    then PrimaryCaps' conv and DigitCaps' W, or the bias-free dense layer."""
    h, w, channels = image

    def block(c_in, c_out):
        return 9 * c_in * c_out + 4 * c_out

    w0, w1, w2, w3 = widths
    count = block(channels, w0) + block(w0, w1) + 2 * block(w1, w1) + block(w1, w2) + block(w2, w3) + 2 * block(w3, w3)
    if head == "dense":
        return count + w3 * classes
    in_caps = (h // 8) * (w // 8) * types
    return count + kernel * kernel * w3 * types * dim + types * dim + in_caps * classes * digit_dim * dim


def images(batch=4, shape=(16, 16, 3), seed=0):
    return np.random.default_rng(seed).uniform(size=(batch, *shape)).astype(np.float32)


def lively(model):
    """BN's gamma away from 1 and W larger, so that the capsules are not all near length 0."""
    rng = np.random.default_rng(5)
    for weight in model.trainable_weights:
        if weight.path.endswith("gamma"):
            weight.assign(rng.uniform(0.5, 1.5, weight.shape).astype(np.float32))
        elif weight.path.endswith("digit_caps/W"):
            weight.assign(rng.normal(0, 0.5, weight.shape).astype(np.float32))
    return model


def loss_and_grads(model, x, labels):
    import tensorflow as tf

    from capsnet.losses import margin_loss

    with tf.GradientTape() as tape:
        out = model(x, labels=labels, training=True)
        loss = tf.reduce_sum(margin_loss(labels, out["lengths"]))
    return out, tape.gradient(loss, model.trainable_variables)


@pytest.mark.parametrize("head", ["capsules", "dense"])
def test_shapes_and_parameter_count(head):
    from capsnet.deep import build_deep

    model = build_deep(**TINY, head=head)
    assert model.count_params() == hand_count((16, 16, 3), (8, 8, 16, 16), 4, 8, 5, 4, head=head)
    x, labels = images(), np.array([0, 1, 2, 3])
    out, grads = loss_and_grads(model, x, labels) if head == "capsules" else (model(x, training=True), None)
    if head == "capsules":
        assert {k: tuple(v.shape) for k, v in out.items()} == {"lengths": (4, 5), "v_j": (4, 5, 4),
                                                               "c_ij": (4, 2 * 2 * 4, 5)}
        assert model.in_caps == 16 and model.primary_grid() == (2, 2, 4)
        for variable, grad in zip(model.trainable_variables, grads):
            assert grad is not None and grad.shape == variable.shape, variable.path
            assert np.all(np.isfinite(grad.numpy())), variable.path
        assert any(np.abs(g.numpy()).max() > 0 for g in grads)
    else:
        assert {k: tuple(v.shape) for k, v in out.items()} == {"logits": (4, 5), "lengths": (4, 5)}
        np.testing.assert_allclose(out["lengths"].numpy().sum(axis=1), 1.0, rtol=1e-6)
        assert not hasattr(model, "digit_caps")  # the export's test for a model without capsules


@pytest.mark.parametrize("head, decoder", [("capsules", True), ("capsules", False), ("dense", False)])
def test_output_shapes_are_what_a_call_returns(head, decoder):
    """compute_output_shape (the capsule head's: CapsNet's own, capsnet.model.capsule_output_shapes)
    against the shapes of a forward pass, for the deep model's heads and for CapsNet."""
    from capsnet.deep import build_deep
    from capsnet.model import build_model

    deep = build_deep(**TINY, head=head, decoder=decoder)
    capsnet = build_model(input_shape=(28, 28, 1), num_classes=4, conv1_filters=8, primary_caps_types=2,
                          primary_caps_dim=4, digit_caps_dim=4, decoder=decoder, decoder_units=(8, 8))
    for model, batch in ((deep, images(3)), (capsnet, images(3, (28, 28, 1)))):
        actual = {key: tuple(value.shape) for key, value in model(batch, training=False).items()}
        expected = model.compute_output_shape((3, *model.image_shape))
        assert {key: tuple(shape) for key, shape in expected.items()} == actual, type(model).__name__
        assert ("reconstructions" in actual) == decoder


def test_decoder_reconstructs_the_labelled_capsule():
    """With a decoder: the labels' capsules in training, the longest capsule's without labels."""
    from capsnet.deep import build_deep

    model = lively(build_deep(**TINY, decoder=True, decoder_units=(8,)))
    x = images()
    out = model(x, labels=np.array([0, 1, 2, 3]), training=False)
    assert tuple(out["reconstructions"].shape) == (4, 16, 16, 3)
    predicted = out["lengths"].numpy().argmax(axis=1)
    unlabelled = model(x, training=False)["reconstructions"].numpy()
    np.testing.assert_allclose(unlabelled, model(x, labels=predicted, training=False)["reconstructions"].numpy(),
                               rtol=1e-6)
    other = model(x, labels=(predicted + 1) % 5, training=False)["reconstructions"].numpy()
    assert np.abs(other - unlabelled).max() > 1e-5  # (tolerance above: 5e-7 on outputs near 0.5)


def test_batch_norm_trains_on_the_batch_and_tests_on_its_averages():
    """training=True normalises with the batch's statistics and moves the moving averages by
    1 - momentum; training=False reads the averages (the test pass and the export)."""
    from capsnet.deep import BN_MOMENTUM, build_deep

    model = build_deep(**TINY, head="dense")
    bn = model.stem[0].norm
    x = images(batch=8)
    model(x, training=False)
    np.testing.assert_array_equal(bn.moving_mean.numpy(), 0.0)
    model(x, training=True)
    conv = model.stem[0].conv(x).numpy()
    np.testing.assert_allclose(bn.moving_mean.numpy(), (1 - BN_MOMENTUM) * conv.mean(axis=(0, 1, 2)), rtol=1e-4,
                               atol=1e-6)


def test_get_config_round_trip_and_weights():
    import keras

    from capsnet.deep import DeepCapsNet, build_deep
    from capsnet.routing import DynamicRouting

    model = build_deep(**TINY, router=DynamicRouting(2, leaky=True), decoder=True, decoder_units=(8,))
    config = model.get_config()
    assert {k: config[k] for k in ("input_shape", "num_classes", "widths", "head", "primary_caps_types",
                                   "primary_caps_dim", "primary_caps_kernel_size", "digit_caps_dim", "decoder",
                                   "decoder_units", "w_init_stddev")} == {
        "input_shape": [16, 16, 3], "num_classes": 5, "widths": [8, 8, 16, 16], "head": "capsules",
        "primary_caps_types": 4, "primary_caps_dim": 8, "primary_caps_kernel_size": 1, "digit_caps_dim": 4,
        "decoder": True, "decoder_units": [8], "w_init_stddev": 0.1}
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(model))
    assert isinstance(clone, DeepCapsNet) and clone.get_config() == config
    assert clone.router.iterations == 2 and clone.router.leaky
    clone.set_weights(model.get_weights())
    x = images()
    np.testing.assert_allclose(clone(x)["lengths"].numpy(), model(x)["lengths"].numpy(), rtol=1e-6)
    for layer in (model.stem[0], model.stem[2]):
        assert type(layer).from_config(layer.get_config()).get_config() == layer.get_config()


@pytest.mark.parametrize("leaky", [False, True], ids=["plain", "leaky"])
def test_custom_op_matches_the_matmul_path(leaky, no_tf32):
    """The config's deep_capsnet with custom_op=true routes in the fused op; on the same
    weights its outputs and every gradient are custom_op=false's."""
    from capsnet.training.model_setup import build_capsnet

    cfg = {"kind": "deep_capsnet", "input_shape": [16, 16, 3], "num_classes": 5, "deep_widths": [8, 8, 16, 16],
           "primary_caps_types": 4, "primary_caps_dim": 8, "primary_caps_kernel_size": 3, "digit_caps_dim": 4,
           "routing": {"algorithm": "dynamic", "backend": "auto", "leaky": leaky}, "decoder": False}
    plain = lively(build_capsnet(cfg, custom_op=False))
    fused = build_capsnet(cfg, custom_op=True)
    assert (plain.router.backend, fused.router.backend) == ("matmul", "fused_op")
    fused.set_weights(plain.get_weights())
    x, labels = images(), np.array([3, 1, 4, 1])
    out_plain, grads_plain = loss_and_grads(plain, x, labels)
    out_fused, grads_fused = loss_and_grads(fused, x, labels)
    assert 0.05 < out_plain["lengths"].numpy().mean() < 0.95  # routing that is neither dead nor saturated
    for key in out_plain:
        np.testing.assert_allclose(out_fused[key].numpy(), out_plain[key].numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=key)
    for variable, a, b in zip(plain.trainable_variables, grads_plain, grads_fused):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-3, atol=1e-5, err_msg=variable.path)


def test_config_errors_are_one_line():
    from conftest import compose_config

    from capsnet import config
    from capsnet.errors import ConfigError
    from capsnet.training.model_setup import build_capsnet

    cfg = compose_config("train", ["model=deep_cnn", "custom_op=true", "run_dir=/tmp/unused"])
    with pytest.raises(ConfigError, match=r"^custom_op=true: model.kind=deep_cnn has no capsule routing"):
        config.check(cfg)
    with pytest.raises(ConfigError, match=r"^custom_op=true: model.kind=deep_cnn"):
        build_capsnet(cfg["model"], custom_op=True)
    small = compose_config("train", ["model=deep_capsnet", "model.input_shape=[6,6,1]", "run_dir=/tmp/unused"])
    with pytest.raises(ConfigError, match=r"too small for three 2x2 max-pools: need at least 8"):
        build_capsnet(small["model"], custom_op=False)
    widths = compose_config("train", ["model=deep_capsnet", "model.deep_widths=[8,8,8]", "run_dir=/tmp/unused"])
    with pytest.raises(ConfigError, match=r"widths"):
        build_capsnet(widths["model"], custom_op=False)
    # MNIST's 28x28x1 builds: 3x3 primary grid.
    mnist = build_capsnet(compose_config("train", ["model=deep_capsnet", "model.deep_widths=[4,4,4,4]",
                                                   "run_dir=/tmp/unused"])["model"], custom_op=False)
    assert mnist.primary_grid() == (3, 3, 32)


def test_padding_crop_and_cutout_against_numpy():
    """natural_image_batch's crop_padding: each training image is a window of the image with
    its border reflected (np.pad 'reflect'), of the image's size; cutout: one cutout x cutout
    square (clipped at the edges) of zeros, the rest that window; the test pass neither."""
    import tensorflow as tf

    from capsnet.augment import natural_image_batch

    rng = np.random.default_rng(0)
    batch = rng.integers(1, 256, (16, 10, 10, 3), dtype=np.uint8)  # no zero pixel: the cutout's are its own
    key = tf.constant([3, 1], tf.int64)
    positions = tf.range(16, dtype=tf.int64)
    options = {"crop": None, "flip": False, "brightness": 0.0, "contrast": 0.0, "standardize": False}
    padded = natural_image_batch(batch, key, positions, training=True, padding=2, **options).numpy()
    cut = natural_image_batch(batch, key, positions, training=True, padding=2, cutout=4, **options).numpy()
    assert padded.shape == cut.shape == (16, 10, 10, 3)
    reference = np.pad(batch, [(0, 0), (2, 2), (2, 2), (0, 0)], mode="reflect").astype(np.float32) / 255.0
    offsets = set()
    for i in range(16):
        windows = [(r, c) for r in range(5) for c in range(5)
                   if np.array_equal(padded[i], reference[i, r:r + 10, c:c + 10])]
        assert windows, i
        offsets.add(windows[0])
        zeros = np.all(cut[i] == 0, axis=-1)
        np.testing.assert_array_equal(cut[i][~zeros], padded[i][~zeros])
        rows, cols = np.nonzero(zeros)
        assert 2 <= zeros.sum() <= 16 and zeros.sum() == (np.ptp(rows) + 1) * (np.ptp(cols) + 1), i  # one rectangle
        assert np.ptp(rows) < 4 and np.ptp(cols) < 4
    assert len(offsets) > 5  # the windows vary
    test = natural_image_batch(batch, key, positions, training=False, padding=0, cutout=0, **options).numpy()
    np.testing.assert_array_equal(test, batch.astype(np.float32) / 255.0)


def test_the_preset_composes():
    from conftest import compose_config

    from capsnet import config

    cfg = config.check(compose_config("train", ["experiment=deep_cifar10", "data.dir=/tmp/unused",
                                                "run_dir=/tmp/unused"]))
    assert cfg["model"]["kind"] == "deep_capsnet" and cfg["custom_op"] and not cfg["model"]["decoder"]
    assert (cfg["data"]["crop_padding"], cfg["data"]["cutout"], cfg["data"]["flip"]) == (4, 8, True)
    assert cfg["model"]["input_shape"] == [32, 32, 3]


@pytest.mark.slow
def test_a_tiny_deep_model_trains_evaluates_exports_and_predicts_on_a_folder(tmp_path):
    """The preset's model and augmentation, shrunk, on a generated folder of 3 classes: 3
    epochs on CPU lower the loss and score well above chance; evaluate (also an ensemble of
    two of its epochs), export and predict answer; the figures are drawn with a
    notice for the decoder's."""
    import json

    from conftest import compose_config, read_events
    from test_folder_data import make_folder

    from capsnet.evaluation import evaluate
    from capsnet.export import export
    from capsnet.prediction import predict
    from capsnet.training import train

    root = tmp_path / "shapes"
    make_folder(root, n_per_class=100, size=32, splits=("train",), seed=1)
    make_folder(root, n_per_class=30, size=32, splits=("test",), seed=2)
    run_dir = tmp_path / "run"
    cfg = compose_config("train", ["experiment=deep_cifar10", "data=folder", f"data.dir={root}", "custom_op=false",
                                   "model.deep_widths=[8,8,16,16]", "model.primary_caps_types=4", "train.epochs=3",
                                   "train.batch_size=30", "train.xla=none", "train.precision=float32",
                                   "train.warmup_epochs=0.5", "train.learning_rate=0.05", "train.progress_bar=false",
                                   f"run_dir={run_dir}"])  # the preset's SGD rate is for batch 512
    metrics = train(cfg)
    losses = [h["train_loss"] for h in metrics["history"]]
    assert losses[-1] < 0.8 * losses[0], losses
    assert metrics["test_accuracy"] > 0.6, metrics["test_accuracy"]
    events = read_events(run_dir)
    assert {"figures/routing", "figures/lengths", "figures/confusion", "figures/notes"} <= set(events)
    report = evaluate(str(run_dir))  # no validation split: the final checkpoint
    assert report["accuracy"] == pytest.approx(metrics["test_accuracy"], abs=1e-6)
    latest = run_dir / "checkpoints" / "latest"
    ensemble = evaluate([str(latest / "ckpt-2"), str(latest / "ckpt-3")])  # epochs 2 and 3 as two members
    assert ensemble["accuracy"] > 0.6, ensemble["accuracy"]
    output = tmp_path / "exported"
    export(str(run_dir), output)
    files = [str(sorted((root / "test" / name).iterdir())[0]) for name in ("bird", "cat", "dog")]
    from_run = predict(str(run_dir), files)
    from_export = predict(str(output), files)
    assert [r["class"] for r in from_run] == [r["class"] for r in from_export]
    np.testing.assert_allclose([list(r["lengths"].values()) for r in from_run],
                               [list(r["lengths"].values()) for r in from_export], rtol=1e-4,
                               atol=1e-5)
    assert json.loads((run_dir / "metrics.json").read_text())["epochs"] == 3
