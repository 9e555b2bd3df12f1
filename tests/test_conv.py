"""capsnet.conv: a strided 'valid' convolution as a stride-1 one on space-to-depth blocks,
against tf.nn.conv2d (values and both gradients) and a NumPy regrouping of the kernel;
the layers that use it (Conv2D, PrimaryCaps, CapsNet) and a resume that switches it."""
import shutil

import numpy as np
import pytest
import tensorflow as tf

from capsnet.conv import block_kernel, space_to_depth, space_to_depth_conv2d
from capsnet.layers import Conv2D, PrimaryCaps
from capsnet.training import train

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


def test_space_to_depth_conv2d_needs_equal_strides():
    with pytest.raises(ValueError, match=r"space_to_depth_conv2d: strides must be equal, got \(2, 3\)"):
        space_to_depth_conv2d(tf.zeros((1, 12, 12, 1)), tf.zeros((3, 3, 1, 1)), (2, 3))


def test_conv2d_uses_blocks_only_where_they_apply():
    """Conv2D(space_to_depth=True) computes blocks for a strided 'valid' convolution only;
    stride 1, 'same' padding and unequal strides keep the plain one."""
    def layer(**kwargs):
        return Conv2D(4, 3, space_to_depth=True, **kwargs)
    assert layer(strides=2).computes_blocks
    assert not layer(strides=1).computes_blocks
    assert not layer(strides=2, padding="same").computes_blocks
    assert not layer(strides=(2, 3)).computes_blocks
    assert not Conv2D(4, 3, strides=2).computes_blocks
    with pytest.raises(ValueError, match="Conv2D: space_to_depth must be true or false"):
        Conv2D(4, 3, space_to_depth="yes")


@pytest.mark.parametrize("size", [20, 19, 21])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_primary_caps_on_blocks_equals_the_strided_layer(size, mode):
    """PrimaryCaps(space_to_depth=True) with the other's weights: the same capsules and the
    same gradients for its input and its kernel, eagerly and under XLA (where the other crops)."""
    x = tf.random.stateless_normal((2, size, size, 3), seed=(1, 2))
    layers = [PrimaryCaps(num_types=2, dim=4, kernel_size=9, strides=2, space_to_depth=b) for b in (False, True)]
    for layer in layers:
        layer.build(x.shape)
    layers[1].set_weights(layers[0].get_weights())
    weights = tf.random.stateless_normal((2, ((size - 9) // 2 + 1) ** 2 * 2, 4), seed=(3, 4))

    def forward_backward(layer, x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x) * weights)
        return (layer(x), *tape.gradient(loss, [x, layer.conv.kernel]))

    results = []
    for layer in layers:
        fn = (lambda x, layer=layer: forward_backward(layer, x))
        results.append((tf.function(fn, jit_compile=True) if mode == "jit" else fn)(x))
    for name, a, b in zip(("capsules", "input gradient", "kernel gradient"), *results):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


def test_model_config_reaches_the_layer(tiny_config):
    from capsnet.training.model_setup import build_capsnet

    for value in (False, True):
        cfg = tiny_config(f"model.primary_caps_space_to_depth={str(value).lower()}")
        model = build_capsnet(cfg["model"], custom_op=False)
        assert model.primary_caps.conv.computes_blocks is value
        assert model.get_config()["primary_caps_space_to_depth"] is value


def test_training_on_blocks_matches_and_a_resume_may_switch(trained_run, tiny_config, tmp_path):
    """A run resumed with model.primary_caps_space_to_depth=true (how PrimaryCaps computes,
    not what) continues the run; its epoch's loss is the strided run's to float32 rounding."""
    original_dir, original = trained_run
    strided, blocks = tmp_path / "strided", tmp_path / "blocks"
    shutil.copytree(original_dir, strided)
    shutil.copytree(original_dir, blocks)
    want = train(tiny_config("train.epochs=5", run_dir=strided))
    got = train(tiny_config("train.epochs=5", "model.primary_caps_space_to_depth=true", run_dir=blocks))
    assert got["resumed_from"].endswith("ckpt-4") and got["history"][:4] == original["history"]
    for key in ("train_loss", "test_loss", "test_accuracy"):
        np.testing.assert_allclose(got["history"][4][key], want["history"][4][key], rtol=1e-3, err_msg=key)
