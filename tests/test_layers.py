"""PrimaryCaps, DigitCaps, Decoder (and CapsNet as a layer): shapes, weights, config, math."""
import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

import capsnet.routing
from capsnet import ops
from capsnet.layers import Conv2D, Decoder, DigitCaps, PrimaryCaps, capsule_lengths, relu_one_buffer, squash
from capsnet.model import CapsNet
from capsnet.routing import DynamicRouting, router_argument
from conftest import np_capsule_prediction
from test_routing import EPSILON, np_dynamic_routing, np_squash

pytestmark = pytest.mark.usefixtures("seeded")  # same initial weights every run: failures reproduce


def legacy_digit_caps(**kwargs):
    """DigitCaps of the arguments it took before routers (routing=<backend>,
    routing_iterations, stop_gradient_routing): capsnet.config.migrate.legacy_router_spec's."""
    return DigitCaps(**router_argument(kwargs, "bias_init"))


def _flat(structure):
    """Outputs or shapes as a flat list: a dict by sorted key, a tuple in order, or one item."""
    if isinstance(structure, dict):
        return [structure[k] for k in sorted(structure)]
    if isinstance(structure, (tuple, list)) and structure and not isinstance(structure[0], (int, type(None))):
        return list(structure)
    return [structure]


def check_layer(layer, args, expected_shapes, expected_params):
    """The shared layer contract, applied to every layer.

    - called on `args`, the outputs have `expected_shapes` (same structure as the
      outputs: one shape, a tuple of shapes or a dict of shapes), and
      compute_output_shape with an unknown batch agrees;
    - count_params() == expected_params;
    - get_config() names every __init__ argument; from_config(get_config()) gives a
      layer with the same config and, with the same weights, the same outputs; Keras'
      own serialization revives the registered class.
    """
    outputs = layer(*args)
    got = [tuple(t.shape) for t in _flat(outputs)]
    assert got == [tuple(s) for s in _flat(expected_shapes)]
    symbolic = layer.compute_output_shape(*[(None, *np.shape(a)[1:]) for a in args])
    assert [tuple(s) for s in _flat(symbolic)] == [(None, *s[1:]) for s in got]
    assert layer.count_params() == expected_params

    config = layer.get_config()
    init_args = [
        name for name, p in inspect.signature(type(layer).__init__).parameters.items()
        if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    assert set(init_args) <= set(config), f"get_config misses {set(init_args) - set(config)}"
    clone = type(layer).from_config(config)
    assert clone.get_config() == config
    clone(*args)  # build
    clone.set_weights(layer.get_weights())
    for a, b in zip(_flat(outputs), _flat(clone(*args))):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    revived = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(revived) is type(layer) and revived.get_config() == config


# ----------------------------------------------------------------- the contract, every layer

rng = np.random.default_rng(0)
FEATURES = rng.uniform(size=(2, 12, 12, 6)).astype(np.float32)
CAPSULES = np_squash(rng.normal(size=(2, 18, 4))).astype(np.float32)
V_J = np_squash(rng.normal(size=(2, 5, 6))).astype(np.float32)
IMAGES = rng.uniform(size=(2, 28, 28, 1)).astype(np.float32)

# name: (constructor, call args, output shapes, parameter count worked out by hand)
LAYER_CASES = {
    # conv 3×3×6 → 3·4 filters; grid (12 − 3)//2 + 1 = 5 → 5·5·3 capsules
    "primary_caps": (lambda: PrimaryCaps(num_types=3, dim=4, kernel_size=3, strides=2),
                     (FEATURES,), (2, 75, 4), 3 * 3 * 6 * 12 + 12),
    # the same on space-to-depth blocks (capsnet.conv): same outputs and weights
    "primary_caps_blocks": (lambda: PrimaryCaps(num_types=3, dim=4, kernel_size=3, strides=2,
                                                conv_form="space_to_depth"),
                            (FEATURES,), (2, 75, 4), 3 * 3 * 6 * 12 + 12),
    # 'same': grid ceil(12/2) × ceil(12/3) = 6 × 4, 2 types
    "primary_caps_same": (lambda: PrimaryCaps(num_types=2, dim=5, kernel_size=(3, 5), strides=(2, 3),
                                              padding="same"),
                          (FEATURES,), (2, 6 * 4 * 2, 5), 3 * 5 * 6 * 10 + 10),
    # W only: (in_caps, num_caps, dim, in_dim)
    "digit_caps": (lambda: legacy_digit_caps(num_caps=5, dim=6, routing_iterations=2),
                   (CAPSULES,), ((2, 5, 6), (2, 18, 5)), 18 * 5 * 6 * 4),
    # with a capsule bias b_j (num_caps, dim) beside W
    "digit_caps_bias": (lambda: legacy_digit_caps(num_caps=5, dim=6, routing_iterations=2, bias_init=0.1),
                        (CAPSULES,), ((2, 5, 6), (2, 18, 5)), 18 * 5 * 6 * 4 + 5 * 6),
    # the same with the fused prediction + routing op: same outputs and weight
    "digit_caps_fused": (lambda: legacy_digit_caps(num_caps=5, dim=6, routing_iterations=2, routing="fused_op"),
                         (CAPSULES,), ((2, 5, 6), (2, 18, 5)), 18 * 5 * 6 * 4),
    # 5·6 → 7 → 9 → 4·3·2
    "decoder": (lambda: Decoder(units=(7, 9), output_shape=(4, 3, 2)),
                (V_J, np.array([1, 4])), (2, 4, 3, 2), (30 * 7 + 7) + (7 * 9 + 9) + (9 * 24 + 24)),
    # 28 → conv1 9×9 → 20 → primary 9×9/2 → 6: 6·6·2 = 72 capsules
    "capsnet": (lambda: CapsNet(conv1_filters=6, primary_caps_types=2, primary_caps_dim=4,
                                digit_caps_dim=5, decoder_units=(8,)),
                (IMAGES,), {"c_ij": (2, 72, 10), "lengths": (2, 10), "reconstructions": (2, 28, 28, 1),
                            "v_j": (2, 10, 5)},
                (81 * 6 + 6) + (81 * 6 * 8 + 8) + 72 * 10 * 5 * 4 + (50 * 8 + 8) + (8 * 784 + 784)),
}


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_layer_contract(case):
    make, args, shapes, params = LAYER_CASES[case]
    check_layer(make(), args, shapes, params)


# ----------------------------------------------------------------- squash / lengths

def test_layers_exports_the_routing_squash():
    assert squash is capsnet.routing.squash


def test_capsule_lengths_finite_gradient_at_zero():
    v = tf.constant([[0.0, 0.0], [0.6, 0.8]])
    with tf.GradientTape() as tape:
        tape.watch(v)
        lengths = capsule_lengths(v)
    grad = tape.gradient(lengths, v).numpy()
    np.testing.assert_allclose(lengths.numpy(), [1e-6, 1.0], rtol=1e-6)  # sqrt(default epsilon 1e-12) at 0
    assert np.all(np.isfinite(grad))
    np.testing.assert_allclose(grad[1], [0.6, 0.8], rtol=1e-5)


# ----------------------------------------------------------------- PrimaryCaps

def test_primary_caps_ordering_and_squash():
    layer = PrimaryCaps(num_types=3, dim=4, kernel_size=3, strides=2)
    u = layer(FEATURES).numpy()
    conv = layer.conv(FEATURES).numpy()                  # (2, 5, 5, 12), the pre-activation
    kernel, bias = (w.numpy() for w in layer.conv.weights)
    # the conv itself vs NumPy, at one output position (stride 2, valid)
    patch = FEATURES[:, 2 * 1:2 * 1 + 3, 2 * 4:2 * 4 + 3, :]
    np.testing.assert_allclose(conv[:, 1, 4], np.einsum("bhwc,hwcf->bf", patch, kernel) + bias,
                               rtol=1e-5, atol=1e-6)
    # documented ordering: capsule (h·W' + w)·num_types + t holds channels [t·dim, (t+1)·dim)
    for h, w, t in [(0, 0, 0), (0, 0, 2), (1, 4, 1), (4, 3, 2)]:
        i = (h * 5 + w) * 3 + t
        np.testing.assert_allclose(u[:, i], np_squash(conv[:, h, w, 4 * t:4 * t + 4], epsilon=EPSILON),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("conv_form", ["strided", "space_to_depth"])
def test_primary_caps_scale_and_bias_are_the_authors_pre_activation(conv_form):
    """kernel_scale s and bias_init b (the authors' conv_slim_capsule: 1/32 and 0.1): each
    capsule squashes s · (patch ∗ kernel) + bias, against NumPy at several grid positions
    and inside XLA; the bias starts at b, the kernel at the initializer's draw / s (from
    the same seed, the capsules start as the unscaled layer's with that bias); the
    kernel's gradient is s times that of the unscaled layer computing the same capsules
    (whose kernel is s times as large)."""
    s, b = 1 / 32, 0.1
    keras.utils.set_random_seed(4)
    layer = PrimaryCaps(num_types=3, dim=4, kernel_size=3, strides=2, kernel_scale=s, bias_init=b,
                        conv_form=conv_form)
    u = layer(FEATURES).numpy()
    keras.utils.set_random_seed(4)
    plain = PrimaryCaps(num_types=3, dim=4, kernel_size=3, strides=2, bias_init=b, conv_form=conv_form)
    np.testing.assert_allclose(plain(FEATURES).numpy(), u, rtol=1e-5, atol=1e-6)  # the same start
    np.testing.assert_array_equal(layer.conv.kernel.numpy(), plain.conv.kernel.numpy() / s)
    kernel, bias = (w.numpy() for w in layer.conv.weights)
    np.testing.assert_array_equal(bias, np.full(12, b, np.float32))
    for h, w in [(0, 0), (1, 4), (4, 3)]:
        patch = FEATURES[:, 2 * h:2 * h + 3, 2 * w:2 * w + 3, :]
        pre = s * np.einsum("bhwc,hwcf->bf", patch.astype(np.float64), kernel) + bias       # (2, 12)
        for t in range(3):
            np.testing.assert_allclose(u[:, (h * 5 + w) * 3 + t], np_squash(pre[:, 4 * t:4 * t + 4], epsilon=EPSILON),
                                       rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tf.function(layer, jit_compile=True)(FEATURES).numpy(), u, rtol=1e-5, atol=1e-6)
    # The unscaled layer with kernel s · K computes the same capsules; the gradient with
    # respect to K is s times its gradient with respect to s · K.
    plain.conv.kernel.assign(layer.conv.kernel * s)
    plain.conv.bias.assign(layer.conv.bias)
    weights = tf.constant(rng.normal(size=u.shape), tf.float32)
    grads = []
    for each in (layer, plain):
        with tf.GradientTape() as tape:
            capsules = each(FEATURES)
            loss = tf.reduce_sum(weights * capsules)
        grads.append(tape.gradient(loss, each.conv.kernel).numpy())
        np.testing.assert_allclose(capsules.numpy(), u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads[0], s * grads[1], rtol=1e-4, atol=1e-9)
    assert PrimaryCaps.from_config(layer.get_config()).kernel_scale == s


def test_primary_caps_has_no_relu():
    layer = PrimaryCaps(num_types=3, dim=4, kernel_size=3, strides=2)
    assert np.any(layer(FEATURES).numpy() < 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_types=0), "num_types must be a positive integer, got 0"),
    (dict(dim=2.5), "dim must be a positive integer, got 2.5"),
    (dict(kernel_size=(3, 3, 3)), r"kernel_size must be 2 positive integers, got \(3, 3, 3\)"),
    (dict(strides=0), "strides must be 2 positive integers"),
    (dict(padding="full"), "padding must be 'valid' or 'same', got 'full'"),
    (dict(kernel_scale=0), "kernel_scale must be a positive number, got 0"),
    (dict(bias_init=float("nan")), "bias_init must be a finite number, got nan"),
])
def test_primary_caps_rejects_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrimaryCaps(**kwargs)


def test_primary_caps_rejects_small_or_wrong_rank_input():
    with pytest.raises(ValueError, match=r"\(2, 8, 8, 6\) is smaller than kernel_size \(9, 9\)"):
        PrimaryCaps()(np.zeros((2, 8, 8, 6), np.float32))
    with pytest.raises(ValueError, match=r"expected feature maps \(batch, H, W, C\), got shape \(2, 12, 6\)"):
        PrimaryCaps(kernel_size=3)(np.zeros((2, 12, 6), np.float32))


# ----------------------------------------------------------------- DigitCaps

@pytest.mark.parametrize("iterations", [1, 3])
def test_digit_caps_matches_numpy(iterations):
    layer = legacy_digit_caps(num_caps=5, dim=6, routing_iterations=iterations,
                      kernel_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=1))
    v_j, c_ij = layer(CAPSULES)
    (W,) = layer.get_weights()
    assert W.shape == (18, 5, 6, 4)  # (in_caps, num_caps, dim, in_dim): the op's and checkpoints' layout
    v_ref, c_ref = np_dynamic_routing(np_capsule_prediction(CAPSULES, W), iterations)  # in float64
    np.testing.assert_allclose(v_j.numpy(), v_ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(c_ij.numpy(), c_ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("routing", ["matmul", "matmul_xla", "op", "op_xla"])
def test_digit_caps_with_a_bias_matches_numpy_on_every_unfused_path(routing):
    """bias_init: b_j starts at that value and is added to s_j in every iteration (the
    authors' code); every path but the fused op routes with it, to the NumPy reference."""
    layer = legacy_digit_caps(num_caps=5, dim=6, routing_iterations=3, routing=routing, bias_init=0.1,
                      kernel_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=1))
    layer.build(CAPSULES.shape)
    np.testing.assert_array_equal(layer.b_j.numpy(), np.full((5, 6), 0.1, np.float32))
    bias = np.random.default_rng(2).normal(scale=0.2, size=(5, 6)).astype(np.float32)
    layer.b_j.assign(bias)
    v_j, c_ij = layer(CAPSULES)
    v_ref, c_ref = np_dynamic_routing(np_capsule_prediction(CAPSULES, layer.W.numpy()), 3, bias=bias)
    np.testing.assert_allclose(v_j.numpy(), v_ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(c_ij.numpy(), c_ref, rtol=1e-4, atol=1e-6)
    config = layer.get_config()
    assert config["bias_init"] == 0.1 and DigitCaps.from_config(config).bias_init == 0.1


@pytest.mark.parametrize("routing", ["matmul", "matmul_xla"])
def test_digit_caps_bias_stays_float32_under_mixed_precision(routing):
    """Under mixed_bfloat16 the bias reaches the float32 routing sums unrounded: with W = 0
    (u_hat = 0) s_j is the bias alone, and v_j = squash(b_j) to float32 precision (a bias
    rounded to bfloat16 would be off by ~1e-3 relative)."""
    layer = legacy_digit_caps(num_caps=5, dim=6, routing=routing, bias_init=0.1, kernel_initializer="zeros",
                      dtype="mixed_bfloat16")
    layer.build(CAPSULES.shape)
    bias = np.full((5, 6), 0.1234567, np.float32) * np.arange(1, 7, dtype=np.float32)
    layer.b_j.assign(bias)
    v_j, _ = layer(CAPSULES)
    assert v_j.dtype == tf.float32
    np.testing.assert_allclose(v_j.numpy(), np.broadcast_to(np_squash(bias.astype(np.float64), epsilon=EPSILON),
                                                            (2, 5, 6)), rtol=2e-6)


def test_digit_caps_default_initializer_scale():
    layer = DigitCaps(num_caps=10, dim=16)
    layer(np.zeros((1, 1152, 8), np.float32))
    assert abs(float(np.std(layer.W.numpy())) - 0.1) < 0.01


def test_digit_caps_stop_gradient_flag_reaches_routing():
    grads = {}
    for flag in (True, False):
        layer = legacy_digit_caps(num_caps=5, dim=6, routing_iterations=3, stop_gradient_routing=flag,
                          kernel_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=1))
        layer.build(CAPSULES.shape)
        with tf.GradientTape() as tape:
            v_j, _ = layer(CAPSULES)
            loss = tf.reduce_sum(v_j * tf.range(6.0))
        grads[flag] = tape.gradient(loss, layer.W).numpy()
    # same W (same seed), different gradient: the flag changes what backprop sees
    assert np.abs(grads[True] - grads[False]).max() > 1e-4 * np.abs(grads[False]).max()


def test_digit_caps_uses_the_selected_prediction(spy_on_op):
    calls = spy_on_op(through=ops.capsule_prediction_matmul)  # the op library is not needed here
    legacy_digit_caps(num_caps=5, dim=6, routing="op")(CAPSULES)
    assert calls == [((2, 18, 4), (18, 5, 6, 4))]


@pytest.mark.parametrize("iterations", [1, 3])
def test_digit_caps_fused_routing_matches_numpy(iterations):
    layer = legacy_digit_caps(num_caps=5, dim=6, routing_iterations=iterations, routing="fused_op",
                      kernel_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=1))
    v_j, c_ij = layer(CAPSULES)
    (W,) = layer.get_weights()
    assert W.shape == (18, 5, 6, 4)  # the same weight as the unfused paths
    v_ref, c_ref = np_dynamic_routing(np_capsule_prediction(CAPSULES, W), iterations)
    np.testing.assert_allclose(v_j.numpy(), v_ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(c_ij.numpy(), c_ref, rtol=1e-4, atol=1e-6)


def test_digit_caps_fused_routing_uses_only_the_fused_op(spy_on_op, monkeypatch):
    prediction_calls = spy_on_op()
    routing_calls = []
    real_routing = ops.capsule_routing

    def spy(u, W, iterations, leaky=False):
        routing_calls.append((tuple(u.shape), tuple(W.shape), iterations, leaky))
        return real_routing(u, W, iterations, leaky=leaky)

    monkeypatch.setattr(ops, "capsule_routing", spy)
    legacy_digit_caps(num_caps=5, dim=6, routing_iterations=2, routing="fused_op")(CAPSULES)
    assert routing_calls == [((2, 18, 4), (18, 5, 6, 4), 2, False)] and prediction_calls == []
    DigitCaps(num_caps=5, dim=6, router=DynamicRouting(2, leaky=True, backend="fused_op"))(CAPSULES)
    assert routing_calls[1:] == [((2, 18, 4), (18, 5, 6, 4), 2, True)] and prediction_calls == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(router=DynamicRouting(backend="fused_op"), bias_init=0.1),
     r"^DigitCaps: the fused_op backend routes without a capsule bias, got bias_init=0\.1: use backend op or op_xla, "
     r"or no bias$"),
    (dict(router="dynamic"), "DigitCaps: router must be a capsnet.routing.Router, got 'dynamic'"),
    (dict(num_caps=0), "num_caps must be a positive integer, got 0"),
    (dict(bias_init=float("nan")), "bias_init must be a finite number, got nan"),
])
def test_digit_caps_rejects_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DigitCaps(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(backend="fused_op", stop_gradient=False), "fused_op needs stop_gradient=True"),
    (dict(backend="yes"), "backend must be one of matmul, matmul_xla, op, op_xla, fused_op, got 'yes'"),
    (dict(iterations=0), "iterations must be a positive integer, got 0"),
    (dict(stop_gradient="yes"), "stop_gradient must be true or false, got 'yes'"),
])
def test_dynamic_routing_router_rejects_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicRouting(**kwargs)


def test_digit_caps_rejects_bad_input_shapes():
    with pytest.raises(ValueError, match=r"expected capsules \(batch, in_caps, in_dim\).*got shape \(2, 72\)"):
        DigitCaps()(np.zeros((2, 72), np.float32))
    layer = DigitCaps(num_caps=5, dim=6)
    layer(CAPSULES)
    with pytest.raises(ValueError, match="incompatible"):
        layer(np.zeros((2, 17, 4), np.float32))  # built for 18 input capsules


# ----------------------------------------------------------------- Decoder

def test_decoder_matches_numpy_on_masked_capsules(no_tf32):
    # no_tf32: on a GPU the Dense layers would run in TF32 (~1e-5 relative off NumPy here).
    layer = Decoder(units=(7, 9), output_shape=(4, 3, 2))
    labels = np.array([1, 4])
    out = layer(V_J, labels).numpy()
    W1, b1, W2, b2, W3, b3 = layer.get_weights()
    masked = V_J * np.eye(5)[labels][:, :, None]       # only the labelled capsule survives
    x = np.maximum(masked.reshape(2, 30) @ W1 + b1, 0)
    x = np.maximum(x @ W2 + b2, 0)
    x = 1 / (1 + np.exp(-(x @ W3 + b3)))
    np.testing.assert_allclose(out, x.reshape(2, 4, 3, 2), rtol=1e-5, atol=1e-6)


def test_decoder_ignores_unselected_capsules():
    layer = Decoder(units=(7, 9), output_shape=(4, 3, 2))
    labels = np.array([1, 4])
    changed = V_J.copy()
    changed[0, [0, 2, 3, 4]] = 0.3
    changed[1, :4] = -0.2
    np.testing.assert_array_equal(layer(V_J, labels).numpy(), layer(changed, labels).numpy())
    assert not np.allclose(layer(V_J, labels).numpy(), layer(V_J, np.array([0, 0])).numpy())


@pytest.mark.parametrize("kwargs, match", [
    (dict(units=()), "units must be a non-empty sequence of positive integers, got ()"),
    (dict(units=(512, 0)), r"units must be .*got \(512, 0\)"),
    (dict(output_shape=(28, -28, 1)), r"output_shape must be .*got \(28, -28, 1\)"),
])
def test_decoder_rejects_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Decoder(**kwargs)


def test_decoder_rejects_bad_labels():
    with pytest.raises(ValueError, match=r"mask_labels must be integer class ids of shape \(batch,\), got float32"):
        Decoder()(V_J, np.array([1.0, 2.0], np.float32))


@pytest.mark.usefixtures("no_tf32")  # on a GPU: TF32 would differ by ~2e-4 between the two
@pytest.mark.parametrize("size", [20, 19, 21])
@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_primary_caps_crop_keeps_the_convolution_and_its_gradient(size, mode):
    """Under XLA PrimaryCaps(conv_form="strided") crops the rows/columns no 'valid' window
    reaches (20×20, 9×9, stride 2: the last); eagerly and in a plain tf.function it does not:
    in every mode its output and input gradient are those of the uncropped convolution."""
    layer = PrimaryCaps(num_types=2, dim=4, kernel_size=9, strides=2, conv_form="strided")
    x = tf.random.stateless_normal((2, size, size, 3), seed=(1, 2))
    layer.build(x.shape)
    weights = tf.random.stateless_normal((2, ((size - 9) // 2 + 1) ** 2 * 2, 4), seed=(3, 4))

    def forward_backward(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            u = layer(x)
            loss = tf.reduce_sum(u * weights)
        return u, tape.gradient(loss, x)

    if mode != "eager":
        forward_backward = tf.function(forward_backward, jit_compile=mode == "jit")
    u, grad = forward_backward(x)
    kernel, bias = layer.conv.kernel, layer.conv.bias
    with tf.GradientTape() as tape:
        tape.watch(x)
        full = tf.nn.conv2d(x, kernel, strides=2, padding="VALID") + bias  # no crop
        want = squash(tf.reshape(full, (2, -1, 4)))
        loss_want = tf.reduce_sum(want * weights)
    np.testing.assert_allclose(u.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    grad_want = tape.gradient(loss_want, x)
    np.testing.assert_allclose(grad.numpy(), grad_want.numpy(), rtol=1e-5, atol=1e-5)
    if size % 2 == 0:  # the last row and column are outside every window
        assert not np.any(grad.numpy()[:, -1]) and not np.any(grad.numpy()[:, :, -1])


def test_primary_caps_crops_only_inside_xla():
    """The crop (a slice of the input) is in the XLA computation's graph and not in a plain
    tf.function's: TensorFlow's own convolution kernels run faster without it."""
    layer = PrimaryCaps(num_types=2, dim=4, kernel_size=9, strides=2, conv_form="strided")
    spec = tf.TensorSpec((2, 20, 20, 3), tf.float32)
    for jit in (False, True):
        graph = tf.function(layer, jit_compile=jit).get_concrete_function(spec).graph
        slices = [op for op in graph.get_operations() if op.type == "StridedSlice"
                  and op.inputs[0].shape.rank == 4]
        assert len(slices) == (1 if jit else 0), (jit, [op.name for op in slices])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_relu_one_buffer_matches_relu_and_its_gradient(dtype):
    """Inside an XLA computation conv1's ReLU is relu_one_buffer: the values and the
    gradient of max(x, 0) (dy where x > 0; 0 at x = 0, as TensorFlow's ReluGrad), checked
    against NumPy, with exact zeros and negative inputs in the batch."""
    rng = np.random.RandomState(0)
    x = rng.randn(3, 5, 5, 8).astype(np.float32)
    x[0, 0, 0, :4] = 0.0
    dy = rng.randn(*x.shape).astype(np.float32)

    @tf.function(jit_compile=True)
    def forward_backward(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = relu_one_buffer(x)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * dy)
        return y, tape.gradient(loss, x)

    xt = tf.cast(x, dtype)
    y, grad = forward_backward(xt, dy)
    x_seen = tf.cast(xt, tf.float32).numpy()  # x as rounded to dtype
    np.testing.assert_array_equal(tf.cast(y, tf.float32).numpy(), np.maximum(x_seen, 0))
    want = np.where(x_seen > 0, tf.cast(tf.cast(dy, dtype), tf.float32).numpy(), 0)
    np.testing.assert_array_equal(tf.cast(grad, tf.float32).numpy(), want)
    # The backward pass reads a boolean mask that passed the barrier, not y: the barrier
    # returns (y, y > 0) and the gradient's select takes its condition from there.
    graph = forward_backward.get_concrete_function(xt, dy).graph
    barrier, = [op for op in graph.get_operations() if op.type == "XlaOptimizationBarrier"]
    assert [t.dtype for t in barrier.outputs] == [tf.as_dtype(dtype), tf.bool]
    selects = [op for op in graph.get_operations() if op.type in ("Select", "SelectV2")]
    assert selects and all(op.inputs[0] is barrier.outputs[1] for op in selects)


def test_conv2d_relu_goes_behind_the_barrier_only_under_xla():
    """Conv2D(activation="relu") computes relu_one_buffer in an XLA computation (the
    XlaOptimizationBarrier op is in its graph) and tf.nn.relu elsewhere (a plain
    tf.function has no XLA kernel for the barrier), with the same outputs in both."""
    layer = Conv2D(4, 3, activation="relu")
    x = tf.random.stateless_normal((2, 6, 6, 3), seed=(5, 6))
    layer.build(x.shape)
    outputs = {}
    for jit in (True, False):
        fn = tf.function(lambda x: layer(x), jit_compile=jit)
        outputs[jit] = fn(x).numpy()
        op_types = {op.type for op in fn.get_concrete_function(x).graph.get_operations()}
        assert ("XlaOptimizationBarrier" in op_types) is jit
    np.testing.assert_allclose(outputs[True], outputs[False], rtol=1e-6, atol=1e-6)
