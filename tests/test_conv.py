"""capsnet.conv: a strided 'valid' convolution as a stride-1 one on space-to-depth blocks,
against tf.nn.conv2d (values and both gradients) and a NumPy regrouping of the kernel;
PrimaryCaps' conv_form (model.primary_caps_conv) and a resume that switches it.

TF32 is off here (conftest.no_tf32): on a GPU TensorFlow runs float32 convolutions in TF32
by default, whose 10-bit mantissa would hide what these tests compare (the float types
are compared in their own test)."""
import shutil

import numpy as np
import pytest
import tensorflow as tf

from capsnet.conv import block_kernel, block_output_kernel, conv2d_to_blocks, space_to_depth, space_to_depth_conv2d
from capsnet.layers import PrimaryCaps
from capsnet.training import train

pytestmark = pytest.mark.usefixtures("no_tf32")

# (H, W, kernel, stride): the paper's PrimaryCaps (20×20, 9×9, 2); odd sizes (a padded
# block row); stride 3 (one output row more on blocks, sliced off); an even kernel; stride 1.
SHAPES = [(20, 20, 9, 2), (21, 19, 9, 2), (20, 20, 9, 3), (28, 28, 8, 2), (7, 9, 3, 1), (12, 12, 5, 4)]


def _conv_and_gradients(fn, x, kernel, dy):
    with tf.GradientTape() as tape:
        tape.watch([x, kernel])
        y = fn(x, kernel)
    return (y, *tape.gradient(y, [x, kernel], output_gradients=dy))


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
@pytest.mark.parametrize("h, w, k, s", SHAPES)
def test_space_to_depth_conv2d_is_the_strided_convolution(h, w, k, s, mode):
    """Outputs, input gradient and kernel gradient equal tf.nn.conv2d's (float64: to
    rounding), in eager mode, a tf.function and under XLA."""
    rng = np.random.default_rng(h * 100 + k * 10 + s)
    x = tf.constant(rng.normal(size=(2, h, w, 3)))
    kernel = tf.constant(rng.normal(size=(k, k, 3, 4)))
    want = _conv_and_gradients(lambda x, f: tf.nn.conv2d(x, f, s, "VALID"), x, kernel, None)
    dy = tf.constant(rng.normal(size=want[0].shape))
    want = _conv_and_gradients(lambda x, f: tf.nn.conv2d(x, f, s, "VALID"), x, kernel, dy)
    fn = lambda x, f, dy: _conv_and_gradients(lambda x, f: space_to_depth_conv2d(x, f, (s, s)), x, f, dy)  # noqa: E731
    if mode != "eager":
        fn = tf.function(fn, jit_compile=mode == "jit")
    for name, got, expected in zip(("output", "input gradient", "kernel gradient"), fn(x, kernel, dy), want):
        assert got.shape == expected.shape, name
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-10, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("dtype, tolerance", [(tf.float32, 1e-5), (tf.bfloat16, 3e-2), (tf.float16, 3e-3)])
def test_space_to_depth_conv2d_in_every_float_type(dtype, tolerance):
    """16-bit inputs give the float64 convolution of the same (rounded) values to within
    the type's rounding: the regrouping moves values, it does not round them."""
    rng = np.random.default_rng(1)
    x = tf.cast(rng.normal(size=(2, 20, 20, 8)), dtype)
    kernel = tf.cast(rng.normal(size=(9, 9, 8, 6)) / 30, dtype)
    got = tf.cast(space_to_depth_conv2d(x, kernel, (2, 2)), tf.float64).numpy()
    want = tf.nn.conv2d(tf.cast(x, tf.float64), tf.cast(kernel, tf.float64), 2, "VALID").numpy()
    assert space_to_depth_conv2d(x, kernel, (2, 2)).dtype == dtype
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * np.abs(want).max())


def test_space_to_depth_and_block_kernel_against_numpy():
    """The input regrouping is tf.nn.space_to_depth's; the kernel's puts tap (s·a + p, s·b + q)
    of the zero-padded kernel at block tap (a, b), channel (p·s + q)·C + c (NumPy loops)."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 6, 8, 3)).astype(np.float32)
    np.testing.assert_array_equal(space_to_depth(tf.constant(x), 2).numpy(), tf.nn.space_to_depth(x, 2).numpy())
    kernel = rng.normal(size=(5, 5, 3, 2))
    s, c = 2, 3
    padded = np.zeros((6, 6, 3, 2))
    padded[:5, :5] = kernel
    want = np.zeros((3, 3, s * s * c, 2))
    for a in range(3):
        for b in range(3):
            for p in range(s):
                for q in range(s):
                    want[a, b, (p * s + q) * c:(p * s + q + 1) * c] = padded[s * a + p, s * b + q]
    np.testing.assert_array_equal(block_kernel(tf.constant(kernel), (2, 2)).numpy(), want)


# (H, W, kernel, block): conv1's paper shape (28×28, 9×9: a 20×20 map, 2×2 blocks); odd maps
# (a last half block past the map); an even kernel; 3×3 blocks; a 1×1 kernel.
BLOCK_OUTPUT_SHAPES = [(28, 28, 9, 2), (29, 27, 9, 2), (28, 30, 8, 2), (13, 14, 3, 3), (10, 11, 1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
@pytest.mark.parametrize("h, w, k, b", BLOCK_OUTPUT_SHAPES)
def test_conv2d_to_blocks_is_the_convolution_in_blocks(h, w, k, b, mode):
    """Its blocks, put back in place (tf.nn.depth_to_space) and cut to the map, are
    tf.nn.conv2d's output, and the input and kernel gradients through them equal
    tf.nn.conv2d's (float64: to rounding)."""
    rng = np.random.default_rng(h * 100 + k * 10 + b)
    x = tf.constant(rng.normal(size=(2, h, w, 3)))
    kernel = tf.constant(rng.normal(size=(k, k, 3, 4)))
    out_h, out_w = h - k + 1, w - k + 1
    want = _conv_and_gradients(lambda x, f: tf.nn.conv2d(x, f, 1, "VALID"), x, kernel, None)
    dy = tf.constant(rng.normal(size=want[0].shape))
    want = _conv_and_gradients(lambda x, f: tf.nn.conv2d(x, f, 1, "VALID"), x, kernel, dy)

    def in_place(x, f):
        blocks = conv2d_to_blocks(x, f, b)
        assert tuple(blocks.shape) == (2, -(-out_h // b), -(-out_w // b), b * b * 4)
        return tf.nn.depth_to_space(blocks, b)[:, :out_h, :out_w, :]

    fn = lambda x, f, dy: _conv_and_gradients(in_place, x, f, dy)  # noqa: E731
    if mode != "eager":
        fn = tf.function(fn, jit_compile=mode == "jit")
    for name, got, expected in zip(("output", "input gradient", "kernel gradient"), fn(x, kernel, dy), want):
        assert got.shape == expected.shape, name
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-10, atol=1e-10, err_msg=name)


def test_block_output_kernel_against_numpy():
    """Output channel group (p, q) of block tap (a, c), input group (r, t), holds tap
    (b·a + r − p, b·c + t − q) of the kernel, or zero where that is outside it (NumPy loops)."""
    rng = np.random.default_rng(5)
    kernel = rng.normal(size=(3, 4, 2, 5))
    b, ci, co = 2, 2, 5
    got = block_output_kernel(tf.constant(kernel), b).numpy()
    assert got.shape == (2, 3, b * b * ci, b * b * co)
    want = np.zeros(got.shape)
    for a in range(2):
        for c in range(3):
            for p in range(b):
                for q in range(b):
                    for r in range(b):
                        for t in range(b):
                            i, j = b * a + r - p, b * c + t - q
                            if 0 <= i < 3 and 0 <= j < 4:
                                want[a, c, (r * b + t) * ci:(r * b + t + 1) * ci,
                                     (p * b + q) * co:(p * b + q + 1) * co] = kernel[i, j]
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("size", [28, 29])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_model_on_blocks_gives_the_strided_models_outputs_and_gradients(size, mode):
    """A CapsNet whose PrimaryCaps computes on blocks takes conv1's output as blocks
    (conv1's output_blocks): the same outputs and the same gradient for every weight as
    the strided model's, with an odd conv1 map too (size 29: 21×21, a half block past it)."""
    from capsnet.model import build_model

    kwargs = {"input_shape": (size, size, 1), "conv1_filters": 8, "primary_caps_types": 2, "digit_caps_dim": 4,
              "decoder_units": (16, 32)}
    strided = build_model(**kwargs, primary_caps_conv="strided")
    blocks = build_model(**kwargs, primary_caps_conv="space_to_depth")
    blocks.set_weights(strided.get_weights())
    images = tf.random.stateless_uniform((3, size, size, 1), seed=(5, 6))
    labels = tf.constant([1, 2, 3])

    def forward_backward(model):
        with tf.GradientTape() as tape:
            out = model(images, labels)
            loss = tf.reduce_sum(out["lengths"] * tf.range(1.0, 11.0)) + tf.reduce_sum(out["reconstructions"])
        return [out["lengths"], out["reconstructions"], *tape.gradient(loss, model.trainable_variables)]

    results = [(tf.function(lambda m=m: forward_backward(m), jit_compile=True) if mode == "jit"
                else lambda m=m: forward_backward(m))() for m in (strided, blocks)]
    names = ["lengths", "reconstructions", *(v.path for v in strided.trainable_variables)]
    for name, a, b in zip(names, *results):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("form, maps_inside_xla", [("auto", False), ("strided", True)])
def test_conv1_maps_are_never_formed_on_blocks(form, maps_inside_xla):
    """On blocks (auto under XLA) no tensor of conv1's (B, 20, 20, 256)-shaped maps is
    built, forward or backward: conv1 writes the blocks PrimaryCaps reads."""
    from capsnet.model import build_model

    model = build_model(conv1_filters=16, primary_caps_conv=form)
    images = tf.TensorSpec((2, 28, 28, 1), tf.float32)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, tf.constant([1, 2]))["lengths"])
        return tape.gradient(loss, model.trainable_variables)

    graph = tf.function(step, jit_compile=True).get_concrete_function(images).graph
    shapes = {tuple(t.shape.as_list()) for op in graph.get_operations() for t in op.outputs if t.shape.rank == 4}
    assert ((2, 20, 20, 16) in shapes) is maps_inside_xla
    assert ((2, 10, 10, 64) in shapes) is not maps_inside_xla


def test_space_to_depth_conv2d_needs_equal_strides():
    with pytest.raises(ValueError, match=r"space_to_depth_conv2d: strides must be equal, got \(2, 3\)"):
        space_to_depth_conv2d(tf.zeros((1, 12, 12, 1)), tf.zeros((3, 3, 1, 1)), (2, 3))


@pytest.mark.parametrize("kwargs, match", [
    ({"conv_form": "blocks"}, "PrimaryCaps: conv_form must be one of auto, strided, space_to_depth, got 'blocks'"),
    ({"conv_form": "space_to_depth", "padding": "same"},
     r"PrimaryCaps: conv_form 'space_to_depth' needs padding 'valid' and equal strides, got padding 'same', "
     r"strides \(2, 2\)"),
    ({"conv_form": "space_to_depth", "strides": (2, 3)},
     r"needs padding 'valid' and equal strides, got padding 'valid', strides \(2, 3\)"),
])
def test_primary_caps_rejects_a_conv_form_it_cannot_run(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrimaryCaps(**kwargs)


def _graph_ops(layer, jit):
    spec = tf.TensorSpec((2, 20, 20, 3), tf.float32)
    return {op.type for op in tf.function(layer, jit_compile=jit).get_concrete_function(spec).graph.get_operations()}


@pytest.mark.parametrize("form, blocks_outside_xla, blocks_inside_xla", [
    ("auto", False, True), ("strided", False, False), ("space_to_depth", True, True)])
def test_primary_caps_conv_form_picks_the_kernels(form, blocks_outside_xla, blocks_inside_xla):
    """Which convolution each form builds, in a plain tf.function and in an XLA one: the
    blocks' is a stride-1 Conv2D after a Transpose of the input; 'auto' takes it inside XLA
    only; 'same' padding keeps the strided one under 'auto'."""
    layer = PrimaryCaps(num_types=2, dim=4, kernel_size=9, strides=2, conv_form=form)
    for jit, want in ((False, blocks_outside_xla), (True, blocks_inside_xla)):
        assert ("Transpose" in _graph_ops(layer, jit)) is want, (form, jit)
    same = PrimaryCaps(num_types=2, dim=4, kernel_size=9, strides=2, padding="same", conv_form="auto")
    assert "Transpose" not in _graph_ops(same, True)


@pytest.mark.slow
@pytest.mark.parametrize("size", [20, 19, 21])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_primary_caps_forms_give_the_same_capsules_and_gradients(size, mode):
    """Every conv_form with the same weights: the same capsules and the same gradients for
    the input and the kernel, eagerly and under XLA (where 'strided' crops and 'auto' takes
    the blocks)."""
    x = tf.random.stateless_normal((2, size, size, 3), seed=(1, 2))
    layers = [PrimaryCaps(num_types=2, dim=4, kernel_size=9, strides=2, conv_form=f)
              for f in ("strided", "space_to_depth", "auto")]
    for layer in layers:
        layer.build(x.shape)
        layer.set_weights(layers[0].get_weights())
    weights = tf.random.stateless_normal((2, ((size - 9) // 2 + 1) ** 2 * 2, 4), seed=(3, 4))

    def forward_backward(layer, x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            u = layer(x)
            loss = tf.reduce_sum(u * weights)
        return (u, *tape.gradient(loss, [x, layer.conv.kernel]))

    results = []
    for layer in layers:
        fn = (lambda x, layer=layer: forward_backward(layer, x))
        results.append((tf.function(fn, jit_compile=True) if mode == "jit" else fn)(x))
    for other in results[1:]:
        for name, a, b in zip(("capsules", "input gradient", "kernel gradient"), results[0], other):
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


def test_model_config_reaches_the_layer(tiny_config):
    from capsnet.training.model_setup import build_capsnet

    for form in ("auto", "strided", "space_to_depth"):
        model = build_capsnet(tiny_config(f"model.primary_caps_conv={form}")["model"], custom_op=False)
        assert model.primary_caps.conv_form == form and model.get_config()["primary_caps_conv"] == form
    from capsnet.errors import ConfigError

    with pytest.raises(ConfigError, match="model: CapsNet: primary_caps_conv must be one of auto, strided, space_to_depth"):
        build_capsnet({**tiny_config()["model"], "primary_caps_conv": "blocks"}, custom_op=False)


@pytest.mark.slow
def test_training_with_another_conv_form_matches_and_a_resume_may_switch(trained_run, tiny_config, tmp_path):
    """A run resumed with model.primary_caps_conv=space_to_depth (how PrimaryCaps computes,
    not what) continues the run; its epoch's loss is the strided run's to float32 rounding."""
    original_dir, original = trained_run
    strided, blocks = tmp_path / "strided", tmp_path / "blocks"
    shutil.copytree(original_dir, strided)
    shutil.copytree(original_dir, blocks)
    want = train(tiny_config("train.epochs=5", "model.primary_caps_conv=strided", run_dir=strided))
    got = train(tiny_config("train.epochs=5", "model.primary_caps_conv=space_to_depth", run_dir=blocks))
    assert got["resumed_from"].endswith("ckpt-4") and got["history"][:4] == original["history"]
    for key in ("train_loss", "test_loss", "test_accuracy"):
        np.testing.assert_allclose(got["history"][4][key], want["history"][4][key], rtol=1e-3, err_msg=key)
