"""CapsNet: parameter counts, outputs, decoder masking, config, weights across custom_op."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from capsnet.errors import ConfigError, OpLibraryError
from capsnet.losses import margin_loss, reconstruction_loss
from capsnet.model import CapsNet, build_model
from capsnet.routing import DynamicRouting
from conftest import compose_config

pytestmark = pytest.mark.usefixtures("seeded")  # same initial weights every run: failures reproduce


# Small enough to run in milliseconds: 28 → 20 → 6, 6·6·4 = 144 primary capsules.
SMALL = dict(conv1_filters=16, primary_caps_types=4, digit_caps_dim=8, decoder_units=(32, 64))
CONFIG_SMALL = ["model.conv1_filters=16", "model.primary_caps_types=4", "model.digit_caps_dim=8",
                "model.decoder_units=[32,64]"]


def config(*overrides):
    """The real configs/ composition (run_dir is Hydra's at run time; unused here)."""
    return compose_config("train", ["run_dir=unused", *overrides])


def images(batch=4, seed=0):
    return np.random.default_rng(seed).uniform(size=(batch, 28, 28, 1)).astype(np.float32)


def lively(model):
    """Scale both convolutions up ×10 so capsules have lengths ~0.1–1 instead of the
    ~1e-4 of a fresh model (squash is quadratic for short vectors), like a trained
    model: differences between capsules then show in the outputs."""
    for conv in (model.conv1, model.primary_caps.conv):
        conv.kernel.assign(conv.kernel * 10.0)
    return model


# ----------------------------------------------------------------- the paper's numbers

def test_paper_parameter_counts():
    # conv1 9·9·1·256+256 = 20,992; PrimaryCaps 9·9·256·256+256 = 5,308,672;
    # DigitCaps W 1152·10·16·8 = 1,474,560; decoder 160·512+512 + 512·1024+1024 + 1024·784+784
    assert build_model(decoder=False).count_params() == 6_804_224
    model = build_model()
    assert model.count_params() == 8_215_568
    assert model.in_caps == 1152
    assert tuple(model.digit_caps.W.shape) == (1152, 10, 16, 8)


def test_paper_config_forward_shapes():
    out = build_model()(images(batch=1))
    assert {k: tuple(v.shape) for k, v in out.items()} == {
        "lengths": (1, 10), "v_j": (1, 10, 16), "c_ij": (1, 1152, 10), "reconstructions": (1, 28, 28, 1)}


# ----------------------------------------------------------------- outputs

def test_outputs_are_consistent():
    model = lively(build_model(**SMALL))
    out = model(images())
    assert sorted(out) == ["c_ij", "lengths", "reconstructions", "v_j"]
    v_j = out["v_j"].numpy()
    np.testing.assert_allclose(out["lengths"].numpy(), np.linalg.norm(v_j, axis=-1), rtol=1e-4, atol=1e-6)
    assert np.all(out["lengths"].numpy() < 1)
    np.testing.assert_allclose(out["c_ij"].numpy().sum(axis=-1), 1.0, rtol=1e-5)
    recon = out["reconstructions"].numpy()
    assert recon.dtype == np.float32 and np.all((recon >= 0) & (recon <= 1))


def test_no_decoder_means_no_reconstructions():
    model = build_model(decoder=False, **SMALL)
    out = model(images(), labels=np.array([0, 1, 2, 3]))
    assert sorted(out) == ["c_ij", "lengths", "v_j"]
    assert model.decoder is None


def test_decoder_masks_by_labels_else_by_prediction():
    model = lively(build_model(**SMALL))
    x = images()
    evaluated = model(x)
    predicted = np.argmax(evaluated["lengths"].numpy(), axis=-1).astype(np.int32)
    # without labels: the decoder sees the predicted capsule
    np.testing.assert_allclose(evaluated["reconstructions"].numpy(),
                               model.decoder(evaluated["v_j"], predicted).numpy(), rtol=1e-6)
    np.testing.assert_allclose(model(x, labels=predicted)["reconstructions"].numpy(),
                               evaluated["reconstructions"].numpy(), rtol=1e-6)
    # with labels: the labelled capsule, whatever the prediction
    other = (predicted + 1) % 10
    trained = model(x, labels=other)
    np.testing.assert_allclose(trained["reconstructions"].numpy(),
                               model.decoder(trained["v_j"], other).numpy(), rtol=1e-6)
    assert not np.allclose(trained["reconstructions"].numpy(), evaluated["reconstructions"].numpy())
    np.testing.assert_array_equal(trained["lengths"].numpy(), evaluated["lengths"].numpy())


def test_every_weight_gets_a_gradient_and_a_step_lowers_the_loss():
    model = build_model(**SMALL)
    x, labels = images(batch=8), np.arange(8) % 10
    optimizer = keras.optimizers.Adam(1e-3)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            out = model(x, labels=labels, training=True)
            loss = tf.reduce_mean(margin_loss(labels, out["lengths"])
                                  + 0.0005 * reconstruction_loss(x, out["reconstructions"]))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss, grads

    first, grads = step()
    for var, grad in zip(model.trainable_variables, grads):
        assert grad is not None and np.any(grad.numpy() != 0), var.path
    for _ in range(5):
        last, _ = step()
    assert float(last) < float(first)


# ----------------------------------------------------------------- config and weights

def _truncated(values, stddev):
    """A draw of Keras' TruncatedNormal(stddev) (redrawn beyond 2σ): inside ±2σ, its spread
    ~0.88σ; a sample of thousands lands within 5% of that."""
    assert np.abs(values).max() <= 2 * stddev
    assert values.std() == pytest.approx(0.8796 * stddev, rel=0.05)


@pytest.mark.parametrize("scale", [0.03125, 1.0])
def test_the_authors_initializers_start_every_layer_as_their_code_does(scale):
    """model.initializers=authors against the authors' variables.py (truncated normals, biases
    at 0.1): Conv1 σ 0.05; PrimaryCaps σ 0.1 under the authors' 1/32, so the kernel the conv
    applies has σ 0.1/32 at any primary_caps_scale (stored σ 0.1 at their 1/32); the decoder
    σ 0.1; W σ w_init_stddev. The biases with keys of their own keep them."""
    model = build_model(initializers="authors", w_init_stddev=0.05, primary_caps_scale=scale,
                        primary_caps_bias=0.2, digit_caps_bias=0.3, conv1_filters=64, primary_caps_types=8,
                        digit_caps_dim=8, decoder_units=(64, 128))
    _truncated(model.conv1.kernel.numpy(), 0.05)
    np.testing.assert_array_equal(model.conv1.bias.numpy(), np.float32(0.1))
    stored = model.primary_caps.conv.kernel.numpy()
    _truncated(stored, 0.1 / 32 / scale)
    _truncated(model.primary_caps.kernel_scale * stored, 0.1 / 32)  # what the conv applies
    np.testing.assert_array_equal(model.primary_caps.conv.bias.numpy(), np.float32(0.2))
    _truncated(model.digit_caps.W.numpy(), 0.05)
    np.testing.assert_array_equal(model.digit_caps.b_j.numpy(), np.float32(0.3))
    for layer in model.decoder.dense_layers:
        _truncated(layer.kernel.numpy(), 0.1)
        np.testing.assert_array_equal(layer.bias.numpy(), np.float32(0.1))


def test_keras_initializers_stay_the_default():
    model = build_model(**SMALL)
    assert model.get_config()["initializers"] == "keras" and config()["model"]["initializers"] == "keras"
    for layer in (model.conv1, model.primary_caps.conv, *model.decoder.dense_layers):
        np.testing.assert_array_equal(layer.bias.numpy(), 0.0)
        fan_in, fan_out = np.prod(layer.kernel.shape[:-1]), layer.kernel.shape[-1]
        if len(layer.kernel.shape) == 4:  # a conv: Glorot counts the receptive field on both sides
            fan_out *= np.prod(layer.kernel.shape[:2])
        assert np.abs(layer.kernel.numpy()).max() <= np.sqrt(6 / (fan_in + fan_out))  # Glorot-uniform's bound
    W = model.digit_caps.W.numpy()
    assert np.abs(W).max() > 2 * 0.1  # a full normal: 4.6% of its 92,160 entries beyond 2σ
    assert W.std() == pytest.approx(0.1, rel=0.02)


@pytest.mark.parametrize("initializers", ["keras", "authors"])
def test_each_decoder_layer_draws_its_own_start(initializers):
    """One unseeded Keras initializer draws the same values at every call: the decoder's
    layers must each make their own (a shared one gave fc2 fc1's values, correlation 1)."""
    model = build_model(initializers=initializers, primary_caps_scale=0.03125, **{**SMALL, "decoder_units": (64, 64)})
    fc1, fc2, fc3 = (layer.kernel.numpy() for layer in model.decoder.dense_layers)
    for a, b in ((fc1[:64, :64], fc2), (fc2, fc3[:, :64])):
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.05


def test_initializers_round_trip_and_a_bad_value_is_a_one_line_error():
    model = build_model(initializers="authors", primary_caps_scale=0.03125, **SMALL)
    config_ = model.get_config()
    assert config_["initializers"] == "authors"
    assert CapsNet.from_config(config_).get_config() == config_
    with pytest.raises(ValueError, match=r"^CapsNet: initializers must be one of keras, authors, got 'glorot'$"):
        CapsNet(initializers="glorot")
    with pytest.raises(ConfigError, match=r"model\.initializers must be one of keras, authors, got 'glorot'"):
        config("model.initializers=glorot")


def test_config_round_trip():
    model = build_model(routing_iterations=2, stop_gradient_routing=False, num_classes=7, w_init_stddev=0.02,
                        primary_caps_scale=0.25, primary_caps_bias=0.1, **SMALL)
    config = model.get_config()
    assert model.router == DynamicRouting(iterations=2, stop_gradient=False)
    assert config["router"]["config"] == {"iterations": 2, "stop_gradient": False, "leaky": False, "backend": "matmul"}
    assert {"name", "trainable", "dtype"} <= set(config)  # merged over keras' base config
    assert not {"custom_op", "jit_routing", "fused_routing"} & set(config)  # no read-only flags
    assert config["w_init_stddev"] == 0.02
    assert config["primary_caps_scale"] == 0.25 and config["primary_caps_bias"] == 0.1
    clone = CapsNet.from_config(config)
    assert clone.get_config() == config
    clone.build((None, 28, 28, 1))
    clone.set_weights(model.get_weights())
    x = images()
    for key, value in model(x).items():
        np.testing.assert_array_equal(clone(x)[key].numpy(), value.numpy())


@pytest.mark.parametrize("stddev", [0.1, 0.01])
def test_w_init_stddev_sets_the_spread_of_W(stddev):
    """model.w_init_stddev reaches DigitCaps: W's 144·10·8·8 = 92,160 entries have that
    standard deviation (sampling error ~0.23%) and mean ~0 (~0.33% of it)."""
    W = build_model(w_init_stddev=stddev, **SMALL).digit_caps.W.numpy()
    assert abs(W.std() / stddev - 1) < 0.01 and abs(W.mean()) < 0.01 * stddev
    assert config(f"model.w_init_stddev={stddev}")["model"]["w_init_stddev"] == stddev


def test_primary_caps_scale_and_bias_reach_primary_caps():
    """model.primary_caps_scale / primary_caps_bias (the authors' 1/32 and 0.1) set
    PrimaryCaps' kernel scale and its conv bias's start; the defaults are the paper's
    convolution (scale 1, bias 0). The capsules' math: tests/test_layers.py."""
    authors = build_model(primary_caps_scale=1 / 32, primary_caps_bias=0.1, **SMALL)
    assert authors.primary_caps.conv.kernel_scale == 1 / 32
    np.testing.assert_array_equal(authors.primary_caps.conv.bias.numpy(), np.float32(0.1))
    paper = build_model(**SMALL)
    assert paper.primary_caps.conv.kernel_scale == 1.0 and not paper.primary_caps.conv.bias.numpy().any()
    model_cfg = config("model.primary_caps_scale=0.03125", "model.primary_caps_bias=0.1")["model"]
    assert (model_cfg["primary_caps_scale"], model_cfg["primary_caps_bias"]) == (0.03125, 0.1)


def test_weights_load_across_custom_op(tmp_path):
    plain = build_model(name="capsnet", **SMALL)
    path = str(tmp_path / "capsnet.weights.h5")
    plain.save_weights(path)
    compiled = build_model(routing="op", name="capsnet", **SMALL)
    compiled.load_weights(path)
    assert [w.path for w in compiled.weights] == [w.path for w in plain.weights]
    for a, b in zip(plain.weights, compiled.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # and through a tf.train.Checkpoint, as a trainer would
    prefix = tf.train.Checkpoint(model=plain).save(str(tmp_path / "ckpt"))
    other = build_model(routing="op", **SMALL)
    tf.train.Checkpoint(model=other).restore(prefix).assert_existing_objects_matched()
    np.testing.assert_array_equal(other.digit_caps.W.numpy(), plain.digit_caps.W.numpy())


def test_tf_checkpoint_of_the_model_restores_every_weight(tmp_path):
    """tf.train.Checkpoint(model=model) must see every weight: sublayers that Keras hides
    from TF's object graph (e.g. kept in a Python list) would silently not be saved or
    restored, and a restored model would keep their random initial values."""
    saved = build_model(**SMALL)
    rng = np.random.default_rng(7)
    for weight in saved.weights:  # distinct values everywhere (biases start at zero)
        weight.assign(rng.normal(size=weight.shape).astype(np.float32))
    prefix = tf.train.Checkpoint(model=saved).save(str(tmp_path / "ckpt"))
    in_file = [name for name, _ in tf.train.list_variables(prefix) if name.startswith("model/")]
    assert len(in_file) == len(saved.weights) == 11  # conv1, primary, W, 3 decoder layers x (kernel, bias)

    restored = build_model(**SMALL)
    tf.train.Checkpoint(model=restored).restore(prefix).assert_existing_objects_matched()
    inner = [w.path.split("/", 1)[1] for w in restored.weights]  # without the model's unique name
    assert inner == [w.path.split("/", 1)[1] for w in saved.weights]
    assert {"decoder/fc1/kernel", "decoder/fc2/kernel", "decoder/fc3/kernel"} <= set(inner)
    for a, b in zip(saved.weights, restored.weights):
        np.testing.assert_array_equal(b.numpy(), a.numpy(), err_msg=a.path)


def test_custom_op_matches_matmul_path(no_tf32):
    """The compiled op (`make ops`) against the matmul path on the same weights.

    Needs capsnet/lib/_capsnet_ops.so; `make test` builds it first. Runs on the GPU
    where TensorFlow sees one (the op's CUDA kernels), else on the CPU.
    """
    plain = lively(build_model(**SMALL))
    compiled = build_model(routing="op", **SMALL)
    compiled.set_weights(plain.get_weights())
    x, labels = images(), np.array([3, 1, 4, 1])

    def run(model):
        with tf.GradientTape() as tape:
            out = model(x, labels=labels)
            loss = tf.reduce_sum(margin_loss(labels, out["lengths"])
                                 + reconstruction_loss(x, out["reconstructions"]))
        return out, tape.gradient(loss, model.trainable_variables)

    out_plain, grads_plain = run(plain)
    out_compiled, grads_compiled = run(compiled)
    for key in out_plain:
        np.testing.assert_allclose(out_compiled[key].numpy(), out_plain[key].numpy(), rtol=1e-4, atol=1e-6)
    for var, a, b in zip(plain.trainable_variables, grads_plain, grads_compiled):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-3, atol=1e-6, err_msg=var.path)


# ----------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs, match", [
    (dict(router="dynamic"), "CapsNet: router must be a capsnet.routing.Router, got 'dynamic'"),
    (dict(num_classes=2.0), "num_classes must be a positive integer, got 2.0"),
    (dict(decoder="yes"), "decoder must be true or false, got 'yes'"),
    (dict(input_shape=(28, 28)), r"input_shape must be 3 positive integers, got \(28, 28\)"),
    (dict(input_shape=(16, 16, 1)), r"input_shape \(16, 16, 1\) is too small .* need at least 17 pixels"),
    (dict(decoder_units=[]), "decoder_units must be a non-empty sequence"),
    (dict(w_init_stddev=0), "w_init_stddev must be a positive number, got 0"),
])
def test_rejects_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CapsNet(**kwargs)


def test_rejects_bad_images_and_labels():
    model = build_model(**SMALL)
    with pytest.raises(ValueError, match=r"expected shape=\(None, 28, 28, 1\), found shape=\(2, 28, 27, 1\)"):
        model(np.zeros((2, 28, 27, 1), np.float32))
    with pytest.raises(ValueError, match="images must be float in \\[0, 1\\], got dtype uint8"):
        model(np.zeros((2, 28, 28, 1), np.uint8))
    with pytest.raises(ValueError, match=r"labels must be integer class ids of shape \(batch,\), got float32"):
        model(images(batch=2), labels=np.array([1.0, 2.0], np.float32))
    with pytest.raises(ValueError, match=r"expected images \(batch, 28, 28, 1\), got shape \(None, 32, 32, 1\)"):
        CapsNet(**SMALL).build((None, 32, 32, 1))


def test_missing_op_library_is_one_clear_line(monkeypatch):
    from capsnet import ops

    def unbuilt():
        raise OpLibraryError("the capsnet op library is not built: run `make ops`")

    monkeypatch.setattr(ops, "load_op_library", unbuilt)
    for backend in ("op", "op_xla", "fused_op"):
        # Raised while the model is built (Router.prepare), outside Keras' call(), which
        # would rewrite it into a multi-line report of the call arguments.
        for make in (lambda: build_model(routing=backend, **SMALL),
                     lambda: CapsNet(router=DynamicRouting(backend=backend), **SMALL)(images(batch=1))):
            with pytest.raises(OpLibraryError) as err:
                make()
            assert str(err.value) == "the capsnet op library is not built: run `make ops`"


@pytest.mark.slow
@pytest.mark.parametrize("custom_op", [False, True])
def test_jit_routing_computes_the_same_outputs_and_gradients(custom_op, no_tf32):
    plain = lively(build_model(routing="op" if custom_op else "matmul", **SMALL))
    jitted = build_model(routing="op_xla" if custom_op else "matmul_xla", **SMALL)
    jitted.set_weights(plain.get_weights())
    x, labels = images(), np.array([3, 1, 4, 1])

    def run(model):
        with tf.GradientTape() as tape:
            out = model(x, labels=labels)
            loss = tf.reduce_sum(margin_loss(labels, out["lengths"]))
        return out, tape.gradient(loss, model.trainable_variables)

    out_plain, grads_plain = run(plain)
    out_jit, grads_jit = run(jitted)
    assert jitted.router.backend.endswith("_xla")
    for key in out_plain:
        np.testing.assert_allclose(out_jit[key].numpy(), out_plain[key].numpy(), rtol=1e-4, atol=1e-6)
    for var, a, b in zip(plain.trainable_variables, grads_plain, grads_jit):
        if a is None:
            assert b is None, var.path  # the decoder gets no gradient from the margin loss alone
            continue
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-3, atol=1e-6, err_msg=var.path)


# ----------------------------------------------------------------- fused routing

def _loss_and_grads(model, x, labels):
    """Outputs and the gradients of the training loss (margin + reconstruction)."""
    with tf.GradientTape() as tape:
        out = model(x, labels=labels)
        loss = tf.reduce_sum(margin_loss(labels, out["lengths"]) + reconstruction_loss(x, out["reconstructions"]))
    return out, tape.gradient(loss, model.trainable_variables)


@pytest.mark.parametrize("leaky", [False, True], ids=["plain", "leaky"])
@pytest.mark.parametrize("routing_iterations", [1, 3])
def test_fused_routing_matches_the_matmul_path(routing_iterations, leaky, no_tf32):
    """model.fused_routing=true (one op for prediction + routing) against the plain
    custom_op=false model on the same weights: every output and every gradient, with the
    plain and the leaky softmax. On the GPU where TensorFlow sees one, else on the CPU."""
    plain = lively(build_model(router=DynamicRouting(routing_iterations, leaky=leaky, backend="matmul"), **SMALL))
    fused = build_model(router=DynamicRouting(routing_iterations, leaky=leaky, backend="fused_op"), **SMALL)
    fused.set_weights(plain.get_weights())
    x, labels = images(), np.array([3, 1, 4, 1])
    out_plain, grads_plain = _loss_and_grads(plain, x, labels)
    out_fused, grads_fused = _loss_and_grads(fused, x, labels)
    assert fused.router.backend == "fused_op" and fused.router.leaky is leaky
    for key in out_plain:
        np.testing.assert_allclose(out_fused[key].numpy(), out_plain[key].numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=key)
    for var, a, b in zip(plain.trainable_variables, grads_plain, grads_fused):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-3, atol=1e-6, err_msg=var.path)


@pytest.mark.slow
@pytest.mark.parametrize("leaky", [False, True], ids=["plain", "leaky"])
def test_fused_routing_train_step_matches_the_matmul_path(leaky, no_tf32):
    """The real compiled train step (capsnet.training.steps.make_train_step) of both models,
    built from the config with custom_op=false and true, from the same weights: the losses
    of five Adam steps agree. With model.routing.leaky=true (the CIFAR-10 preset's routing)
    custom_op=true trains through the fused op too."""
    from capsnet.losses import loss_params
    from capsnet.training.model_setup import build_capsnet
    from capsnet.training.steps import make_train_step

    x, labels = images(batch=8), (np.arange(8) % 10).astype(np.int32)
    losses = {}
    start = None
    for name, custom_op in (("plain", False), ("fused", True)):
        cfg = config(f"custom_op={str(custom_op).lower()}", f"model.routing.leaky={str(leaky).lower()}",
                     *CONFIG_SMALL)
        model = build_capsnet(cfg["model"], cfg["custom_op"])
        assert model.router.backend == ("fused_op" if custom_op else "matmul") and model.router.leaky is leaky
        if start is None:  # the first model's start, lively, for both
            start = lively(model).get_weights()
        model.set_weights(start)
        train_cfg = cfg["train"]
        step = make_train_step(model, keras.optimizers.Adam(1e-3), input_shape=(28, 28, 1),
                               losses=loss_params(train_cfg))
        losses[name] = [float(step(x, labels)["loss"]) for _ in range(5)]
    np.testing.assert_allclose(losses["fused"], losses["plain"], rtol=2e-4)
    assert losses["fused"][-1] < losses["fused"][0]


def test_weights_load_across_fused_routing(tmp_path):
    fused = build_model(routing="fused_op", name="capsnet", **SMALL)
    rng = np.random.default_rng(3)
    for weight in fused.weights:
        weight.assign(rng.normal(size=weight.shape).astype(np.float32))
    path = str(tmp_path / "fused.weights.h5")
    fused.save_weights(path)
    plain = build_model(name="capsnet", **SMALL)
    plain.load_weights(path)
    for a, b in zip(fused.weights, plain.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # and a trainer's tf.train.Checkpoint, both ways
    prefix = tf.train.Checkpoint(model=fused).save(str(tmp_path / "ckpt"))
    other = build_model(**SMALL)
    tf.train.Checkpoint(model=other).restore(prefix).assert_existing_objects_matched()
    np.testing.assert_array_equal(other.digit_caps.W.numpy(), fused.digit_caps.W.numpy())
    prefix = tf.train.Checkpoint(model=plain).save(str(tmp_path / "ckpt_plain"))
    back = build_model(routing="fused_op", **SMALL)
    tf.train.Checkpoint(model=back).restore(prefix).assert_existing_objects_matched()
    np.testing.assert_array_equal(back.digit_caps.W.numpy(), fused.digit_caps.W.numpy())


def test_fused_routing_from_the_config():
    from capsnet.errors import ConfigError
    from capsnet.training.model_setup import build_capsnet

    cfg = config("custom_op=true", "model.routing=auto", *CONFIG_SMALL)
    model = build_capsnet(cfg["model"], cfg["custom_op"])
    assert model.digit_caps.router.backend == "fused_op" and model.get_config()["router"]["config"]["backend"] == "fused_op"
    assert config()["model"]["routing"]["backend"] == "auto"  # the fused op wherever it applies

    # fused_routing=true without custom_op=true, or without stop-gradient routing, cannot be
    # written as a config any more; an old run config saying so is refused in the old words.
    from capsnet.config import migrate

    old = {**config(*CONFIG_SMALL), "custom_op": False}
    old["model"] = {**{k: v for k, v in old["model"].items() if k != "routing"}, "jit_routing": False,
                    "fused_routing": True}
    with pytest.raises(ConfigError) as err:
        migrate(old)
    assert "fused_routing=true needs custom_op=true" in str(err.value) and "\n" not in str(err.value)
    old = {**old, "custom_op": True, "model": {**old["model"], "stop_gradient_routing": False}}
    with pytest.raises(ConfigError, match="stop_gradient_routing=false"):
        migrate(old)


@pytest.mark.parametrize("overrides, fused", [
    (["custom_op=true"], True),                                       # the fast path by default
    (["custom_op=false"], False),                                     # no compiled op
    (["custom_op=true", "model.routing=xla"], False),                 # asked for the other speed-up
    (["custom_op=true", "model.stop_gradient_routing=false"], False),  # a gradient the op lacks
    (["custom_op=true", "model.routing=tf"], False),                  # forced off (the old string override)
    (["custom_op=true", "model.routing.backend=tf"], False),          # forced off
    (["custom_op=true", "model.routing.leaky=true"], True),           # the op routes leaky too (its attr)
    (["custom_op=true", "model.digit_caps_bias=0.1"], False),         # nor a bias
])
def test_fused_routing_null_turns_on_where_it_applies(overrides, fused):
    from capsnet.training.model_setup import build_capsnet

    cfg = config(*overrides, *CONFIG_SMALL)
    model = build_capsnet(cfg["model"], cfg["custom_op"])
    assert (model.digit_caps.router.backend == "fused_op") is fused
