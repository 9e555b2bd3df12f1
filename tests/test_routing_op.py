"""Tests of the fused prediction + dynamic routing op (capsnet.ops.capsule_routing).

References: the NumPy version of Procedure 1 (test_routing.np_dynamic_routing on
conftest.np_capsule_prediction, float64; with leaky=True, the authors' "none of the
above" softmax, test_self_attention.np_leaky_routing), the unfused TensorFlow path
(capsule_prediction + dynamic_routing with stop_gradient=True, values and
gradients), and finite differences (tf.test.compute_gradient) of the function the
gradient claims to differentiate. The tests with a `leaky` parameter run both softmaxes. Every test runs on the CPU; the ones with a
`device` parameter run again on /GPU:0 (marker `gpu`, soft placement off, TF32 off)
where TensorFlow sees a GPU. The library must be built (`make ops`): a missing one
fails with OpLibraryError, it does not skip. The CUDA kernels' own checks (every plan
path and dtype, NaN-filled outputs and workspace, under compute-sanitizer memcheck
and racecheck) are in ops/sanitize_driver.cu, run by
test_ops.py::test_gpu_kernels_under_compute_sanitizer.
"""
import functools
import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from capsnet import ops
from capsnet.routing import dynamic_routing, squash
from conftest import REPO, TINY_MODEL, entry_point_env, np_capsule_prediction
from test_ops import accumulation_dtype, assert_error, assert_scratch_refused, run_cases, run_with_limits
from test_routing import EPSILON, np_dynamic_routing, np_squash
from test_self_attention import np_leaky_routing

HAS_GPU = bool(tf.config.list_physical_devices("GPU"))
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu",
                 marks=(pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no GPU visible to TensorFlow"))),
]

# (batch, in_caps, out_caps, out_dim, in_dim). Each line is a distinct path of the GPU
# launch plan (tiles of rows per thread 4/2/1, in_dim padded to 4/8/16, capsule
# chunks, batch stages of 32) or an odd size; on the CPU they are just shapes.
SHAPES = [
    (1, 1, 1, 1, 1),       # all ones
    (2, 3, 4, 5, 6),       # odd out_dim: one row per thread
    (3, 5, 2, 16, 8),      # paper capsule sizes, 4 rows per thread
    (4, 7, 3, 6, 3),       # out_dim 6: 2 rows per thread, in_dim padded 3 -> 4
    (2, 2, 1, 6, 16),      # a single output capsule (softmax of one logit)
    (5, 9, 10, 16, 8),     # paper rows, in_caps not a multiple of the capsule chunk
    (3, 4, 3, 3, 11),      # in_dim padded 11 -> 16
    (2, 3, 2, 4, 17),      # in_dim > 16: the generic GPU kernels
    (70, 2, 10, 16, 8),    # batch > one stage of 32 samples, few capsules
    (33, 37, 10, 16, 8),   # batch one past a stage, in_caps past several chunks
    (2, 5, 33, 2, 4),      # many output capsules
    (2, 3, 3, 40, 2),      # long output capsules
]
ITERATIONS = [1, 2, 3]
# The op's `leaky` attr: softmax_j(b_ij), or the softmax over [0, b_i1..b_iJ] with the zero
# logit's share dropped (the authors' CIFAR-10 routing).
LEAKY = [pytest.param(False, id="plain"), pytest.param(True, id="leaky")]


@pytest.fixture(autouse=True)
def _cpu_by_default():
    """Tests without a device parameter run on the CPU, also on a machine with a GPU."""
    with tf.device("/CPU:0"):
        yield


@pytest.fixture
def device(request, no_tf32):
    """'cpu' or 'gpu': the test body runs there; on the GPU with soft placement off, so
    a missing GPU kernel fails instead of silently running on the CPU."""
    soft = tf.config.get_soft_device_placement()
    tf.config.set_soft_device_placement(request.param == "cpu")
    try:
        with tf.device(f"/{request.param.upper()}:0"):
            yield request.param
    finally:
        tf.config.set_soft_device_placement(soft)


def on_device(device, *tensors):
    for t in tensors:
        assert f"{device.upper()}:0" in t.device, t.device


def inputs(shape, dtype=np.float64, seed=0):
    """u (|u| < 1 like squashed capsules) and W scaled so the agreements move the routing
    without saturating the softmax."""
    B, I, J, D, K = shape
    rng = np.random.default_rng(seed)
    u = rng.uniform(-1, 1, (B, I, K)) / np.sqrt(max(K, 1))
    W = rng.uniform(-1, 1, (I, J, D, K))
    return u.astype(dtype), W.astype(dtype)


def np_routing(u, W, iterations, leaky=False):
    """The NumPy reference: (s_j before the squash, c_ij, v_j) of the last iteration."""
    u_hat = np_capsule_prediction(u, W)
    v, c = np_leaky_routing(u_hat, iterations) if leaky else np_dynamic_routing(u_hat, iterations)
    return np.einsum("bij,bijd->bjd", c, u_hat), c, v


def unfused(u, W, iterations, leaky=False):
    """The unfused TensorFlow path the op replaces: (v_j, c_ij)."""
    return dynamic_routing(ops.capsule_prediction_matmul(u, W), iterations, stop_gradient=True, leaky=leaky)


def fused(u, W, iterations, leaky=False):
    """The op as DigitCaps uses it: (squash(s_j), c_ij)."""
    s_j, c_ij = ops.capsule_routing(u, W, iterations, leaky=leaky)
    return squash(s_j), c_ij


def value_and_grads(route, u, W, iterations, weights_v, weights_c):
    """(v_j, c_ij, dL/du, dL/dW) with L = Σ v_j·weights_v + Σ c_ij·weights_c."""
    u, W = tf.constant(u), tf.constant(W)
    with tf.GradientTape() as tape:
        tape.watch([u, W])
        v_j, c_ij = route(u, W, iterations)
        loss = tf.reduce_sum(v_j * weights_v) + tf.reduce_sum(c_ij * weights_c)
    grad_u, grad_W = tape.gradient(loss, [u, W])
    return v_j, c_ij, grad_u, grad_W


def loss_weights(shape, dtype, seed=7):
    B, I, J, D, _ = shape
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, J, D)).astype(dtype), rng.normal(size=(B, I, J)).astype(dtype)


def assert_close(got, want, rtol, atol_scale, what):
    """|got - want| <= rtol·|want| + atol_scale·max(1, max|want|)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol_scale * scale, err_msg=what)


# ----------------------------------------------------------------------------
# Forward against the NumPy reference.


def cases(float64_shapes, float32_shapes, float64_iterations):
    """(dtype, shape, iterations, seed) cases: float64 checks the math closely on every
    shape (only the summation order differs); float32, with looser tolerances, the sizes
    and sums the model runs at, with r = 3."""
    return ([pytest.param(np.float64, shape, r, 0, id=f"float64-{'x'.join(map(str, shape))}-r{r}")
             for shape in float64_shapes for r in float64_iterations]
            + [pytest.param(np.float32, shape, 3, 1, id=f"float32-{'x'.join(map(str, shape))}-r3")
               for shape in float32_shapes])


# (rtol, atol scale) of the op against NumPy: float32 sums over up to 2000 capsules.
FORWARD_TOLERANCE = {np.float64: (1e-10, 1e-12), np.float32: (2e-5, 2e-6)}


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("leaky", LEAKY)
@pytest.mark.parametrize("dtype, shape, iterations, seed", cases(
    SHAPES, [(5, 9, 10, 16, 8), (33, 37, 10, 16, 8), (3, 2000, 10, 16, 8), (2, 3, 3, 40, 2), (2, 3, 2, 4, 17)],
    ITERATIONS))
def test_forward_matches_numpy(device, dtype, shape, iterations, seed, leaky):
    u, W = inputs(shape, dtype, seed)
    s_j, c_ij = ops.capsule_routing(tf.constant(u), tf.constant(W), iterations, leaky=leaky)
    on_device(device, s_j, c_ij)
    B, I, J, D, _ = shape
    assert s_j.shape == (B, J, D) and c_ij.shape == (B, I, J)
    assert s_j.dtype == c_ij.dtype == tf.as_dtype(dtype)
    s_ref, c_ref, v_ref = np_routing(u, W, iterations, leaky)
    rtol, atol = FORWARD_TOLERANCE[dtype]
    assert_close(s_j, s_ref, rtol, atol, "s_j")
    assert_close(c_ij, c_ref, rtol, atol, "c_ij")
    assert_close(squash(s_j), v_ref, rtol, atol, "squash(s_j)")
    if leaky:  # "none of the above" keeps a share of every row
        assert np.all(c_ij.numpy().astype(np.float64).sum(-1) < 1)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("leaky", LEAKY)
def test_more_iterations_keep_matching(device, leaky):
    u, W = inputs((4, 6, 3, 5, 4), seed=2)
    s_j, c_ij = ops.capsule_routing(u, W, 6, leaky=leaky)
    s_ref, c_ref, _ = np_routing(u, W, 6, leaky)
    assert_close(s_j, s_ref, 1e-10, 1e-12, "s_j")
    assert_close(c_ij, c_ref, 1e-10, 1e-12, "c_ij")


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("shape", [(3, 5, 4, 6, 3), (2, 9, 10, 16, 8), (2, 3, 2, 4, 17)])
def test_leaky_first_round_is_uniform_over_the_parents_and_none_of_the_above(device, dtype, shape):
    """r = 1 routes with b_ij = 0: c_ij = 1 / (out_caps + 1) (the zero logit takes one
    share), exactly as the TensorFlow path writes it, and s_j = Σ_i u_hat / (out_caps + 1)."""
    u, W = inputs(shape, dtype.as_numpy_dtype, seed=19)
    B, I, J, D, _ = shape
    s_j, c_ij = ops.capsule_routing(u, W, 1, leaky=True)
    on_device(device, s_j, c_ij)
    _, c_tf = dynamic_routing(ops.capsule_prediction_matmul(u, W), 1, leaky=True)
    np.testing.assert_array_equal(c_ij.numpy(), np.full((B, I, J), 1 / (J + 1), dtype.as_numpy_dtype))
    np.testing.assert_array_equal(c_ij.numpy(), c_tf.numpy())
    s_ref = np_capsule_prediction(u.astype(np.float64), W.astype(np.float64)).sum(axis=1) / (J + 1)
    assert_close(s_j, s_ref, *FORWARD_TOLERANCE[dtype.as_numpy_dtype], "s_j")


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("leaky", LEAKY)
@pytest.mark.parametrize("dtype,atol", [(tf.float16, 1e-2), (tf.bfloat16, 6e-2)])
def test_forward_16bit(device, dtype, atol, leaky):
    # Routing runs in float32 on the rounded inputs: only the output rounding (and the
    # propagated input rounding, which the reference sees too) differs.
    u, W = inputs((3, 9, 10, 16, 8), np.float32, seed=3)
    u16, W16 = tf.cast(u, dtype), tf.cast(W, dtype)
    s_j, c_ij = ops.capsule_routing(u16, W16, 3, leaky=leaky)
    on_device(device, s_j, c_ij)
    assert s_j.dtype == dtype and c_ij.dtype == dtype
    s_ref, c_ref, _ = np_routing(tf.cast(u16, tf.float64).numpy(), tf.cast(W16, tf.float64).numpy(), 3, leaky)
    assert_close(tf.cast(s_j, tf.float64), s_ref, 0, atol, "s_j")
    assert_close(tf.cast(c_ij, tf.float64), c_ref, 0, atol, "c_ij")


def test_squash_epsilon_is_the_routing_default():
    # The op squashes its inner v_j with a compiled-in epsilon: it must be squash's.
    # A large epsilon relative to |s|² shows any difference.
    u, W = inputs((2, 3, 2, 4, 3), seed=4)
    W *= 1e-3  # |s|² ~ 1e-7: the epsilon term matters in the inner squashes
    s_j, c_ij = ops.capsule_routing(u, W, 3)
    s_ref, c_ref, _ = np_routing(u, W, 3)
    assert EPSILON == 1e-7
    assert_close(c_ij, c_ref, 1e-9, 1e-14, "c_ij")
    assert_close(s_j, s_ref, 1e-9, 1e-14, "s_j")


# ----------------------------------------------------------------------------
# Against the unfused TensorFlow path: values and gradients.


# (rtol, atol scale) of the op against the unfused path, values and gradients.
UNFUSED_TOLERANCE = {np.float64: (1e-10, 1e-12), np.float32: (1e-4, 1e-5)}


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("leaky", LEAKY)
@pytest.mark.parametrize("dtype, shape, iterations, seed", cases(
    [(3, 5, 2, 16, 8), (4, 7, 3, 6, 3), (70, 2, 10, 16, 8), (2, 3, 2, 4, 17)],
    [(8, 32, 10, 16, 8), (33, 37, 10, 16, 8), (3, 5, 3, 5, 3)], ITERATIONS))
def test_values_and_gradients_match_unfused_path(device, dtype, shape, iterations, seed, leaky):
    u, W = inputs(shape, dtype, seed + 5)  # other draws than the forward test's
    weights_v, weights_c = loss_weights(shape, dtype)
    got = value_and_grads(functools.partial(fused, leaky=leaky), u, W, iterations, weights_v, weights_c)
    want = value_and_grads(functools.partial(unfused, leaky=leaky), u, W, iterations, weights_v, weights_c)
    on_device(device, *got)
    rtol, atol = UNFUSED_TOLERANCE[dtype]
    for name, a, b in zip(("v_j", "c_ij", "grad_u", "grad_W"), got, want):
        assert_close(a, b, rtol, atol, name)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no GPU visible to TensorFlow")
@pytest.mark.parametrize("leaky", LEAKY)
@pytest.mark.parametrize("batch", [128, 512])
def test_gpu_paper_shape_matches_unfused_path(no_tf32, batch, leaky):
    """The training shape (1152 -> 10 x 16, in_dim 8), fused on /GPU:0 against the
    unfused op + TF routing on /GPU:0, values and gradients, float32."""
    shape = (batch, 1152, 10, 16, 8)
    u, W = inputs(shape, np.float32, seed=7)
    W *= 0.3  # the scale of a trained DigitCaps W (init N(0, 0.1²))
    weights_v, weights_c = loss_weights(shape, np.float32)
    soft = tf.config.get_soft_device_placement()
    tf.config.set_soft_device_placement(False)
    try:
        with tf.device("/GPU:0"):
            got = value_and_grads(functools.partial(fused, leaky=leaky), u, W, 3, weights_v, weights_c)
            want = value_and_grads(lambda u, W, r: dynamic_routing(ops.capsule_prediction(u, W), r, leaky=leaky),
                                   u, W, 3, weights_v, weights_c)
    finally:
        tf.config.set_soft_device_placement(soft)
    on_device("gpu", *got)
    for name, a, b in zip(("v_j", "c_ij", "grad_u", "grad_W"), got, want):
        # float32 sums over 1152 capsules (and, for grad_W, the batch) in different
        # orders: ~1e-6 relative to the largest element.
        assert_close(a, b, 1e-3, 1e-5, name)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no GPU visible to TensorFlow")
@pytest.mark.parametrize("leaky", LEAKY)
@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
@pytest.mark.parametrize("batch", [100, 512])
def test_gpu_16bit_tensor_cores_keep_float32_sums(no_tf32, dtype, batch, leaky):
    """At the paper shape the 16-bit op runs on tensor cores (ops/routing_mma.cuh), with
    v_j and c_ij u split into two 16-bit parts so that its sums stay float32-accurate.
    Against the float32 op on the same 16-bit values (CUDA cores with TF32 off, float32 sums), forward
    and gradient kernels, its outputs must be that op's results rounded once: equal bits
    but for the few near a rounding boundary, never more than one unit apart. Sums of
    16-bit products without the split would differ in a large share of the elements.
    (The gradient op is called with the same c_ij in both: the op's own gradient feeds
    it the forward's c_ij output, which is rounded to 16 bits.)"""
    shape = (batch, 1152, 10, 16, 8)
    u, W = inputs(shape, np.float32, seed=11)
    W *= 0.3
    u16, W16 = tf.cast(u, dtype), tf.cast(W, dtype)
    grad_s16 = tf.cast(np.random.default_rng(12).standard_normal((batch, 10, 16)), dtype)
    lib = ops.load_op_library()
    f32 = lambda x: tf.cast(x, tf.float32)
    with tf.device("/GPU:0"):
        s16, c16 = ops.capsule_routing(u16, W16, 3, leaky=leaky)
        s32, c32 = ops.capsule_routing(f32(u16), f32(W16), 3, leaky=leaky)
        gu16, gw16 = lib.capsnet_capsule_routing_grad(u=u16, weights=W16, c_ij=c16, grad_s=grad_s16)
        gu32, gw32 = lib.capsnet_capsule_routing_grad(u=f32(u16), weights=f32(W16), c_ij=f32(c16),
                                                      grad_s=f32(grad_s16))
    on_device("gpu", s16, c16, gu16, gw16)
    unit = 2.0 ** (-7 if dtype == tf.bfloat16 else -10)  # one unit in the last place, relative
    for name, a, b in (("s_j", s16, s32), ("c_ij", c16, c32), ("grad_u", gu16, gu32), ("grad_W", gw16, gw32)):
        assert a.dtype == dtype, name
        scale = float(tf.reduce_max(tf.abs(b)))
        a = tf.cast(a, tf.float64).numpy()
        b = tf.cast(tf.cast(b, dtype), tf.float64).numpy()  # the float32 result rounded once
        np.testing.assert_allclose(a, b, rtol=unit, atol=unit * 1e-3 * scale, err_msg=name)
        differ = np.mean(a != b)
        assert differ < 0.02, f"{name}: {differ:.1%} of the elements differ from the rounded float32 result"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no GPU visible to TensorFlow")
@pytest.mark.parametrize("leaky", LEAKY)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("shape", [(40, 6, 10, 16, 8), (33, 37, 7, 16, 8), (512, 1152, 10, 16, 8)])
def test_gpu_float32_tensor_cores_follow_tf32(shape, jit, leaky):
    """With TensorFloat-32 on (TensorFlow's default) the float32 op runs on tensor cores
    at these shapes, W and grad_s split into two bfloat16 parts (ops/routing_mma.cuh):
    products within ~3·2^-16 instead of float32's 2^-24. With TF32 off it keeps the
    float32 CUDA-core kernels. Forward and gradient op (the same c_ij in both), eager and
    under XLA: the two settings must differ (the switch works), and every element must be
    within 2^-13 of the sum of its terms' magnitudes of the other. TF32's own rounding
    (2^-11) or bfloat16 products without the split (2^-9) exceed that on the small shapes,
    where few terms average their errors out."""
    B, I, J, D, K = shape
    u, W = inputs(shape, np.float32, seed=13)
    W *= 0.3
    grad_s = np.random.default_rng(14).standard_normal((B, J, D)).astype(np.float32)
    _, c_ref, _ = np_routing(u.astype(np.float64), W.astype(np.float64), 3, leaky)
    c_in = c_ref.astype(np.float32)
    lib = ops.load_op_library()

    def route(u, W, c_ij, grad_s):
        s_j, c_out = ops.capsule_routing(u, W, 3, leaky=leaky)
        grad_u, grad_W = lib.capsnet_capsule_routing_grad(u=u, weights=W, c_ij=c_ij, grad_s=grad_s)
        return s_j, c_out, grad_u, grad_W

    if jit:
        route = tf.function(route, jit_compile=True)
    results = {}
    was = tf.config.experimental.tensor_float_32_execution_enabled()
    try:
        for tf32 in (True, False):
            tf.config.experimental.enable_tensor_float_32_execution(tf32)
            with tf.device("/GPU:0"):
                got = route(tf.constant(u), tf.constant(W), tf.constant(c_in), tf.constant(grad_s))
            on_device("gpu", *got)
            results[tf32] = [t.numpy().astype(np.float64) for t in got]
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(was)
    # Each element's sum of term magnitudes (float64).
    u64, w64, g64 = np.abs(u).astype(np.float64), np.abs(W).astype(np.float64), np.abs(grad_s).astype(np.float64)
    scales = {
        "s_j": np.einsum("bij,bik,ijdk->bjd", c_ref, u64, w64),
        "c_ij": np.ones_like(c_ref),  # probabilities: an absolute bound
        "grad_u": np.einsum("bij,bjd,ijdk->bik", c_in, g64, w64),
        "grad_W": np.einsum("bij,bjd,bik->ijdk", c_in, g64, u64),
    }
    for (name, scale), on, off in zip(scales.items(), results[True], results[False]):
        ratio = np.abs(on - off) / (scale + 1e-30)
        assert ratio.max() <= 2.0 ** -13, f"{name}: |TF32 on - off| reaches {ratio.max():.2e} of the terms' sum"
    assert np.any(results[True][0] != results[False][0]), "s_j: TF32 on and off gave the same bits"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no GPU visible to TensorFlow")
@pytest.mark.parametrize("leaky", LEAKY)
@pytest.mark.parametrize("shape", SHAPES + [(2, 1, 5, 820, 4), (3, 2000, 10, 16, 8), (129, 1152, 10, 16, 8)])
def test_gpu_matches_cpu_op(no_tf32, shape, leaky):
    """The CUDA kernels against the C++ ones, forward and gradient, float64 (so any
    difference beyond rounding is a kernel bug, not float32 noise)."""
    u, W = inputs(shape, seed=8)
    weights_v, weights_c = loss_weights(shape, np.float64)
    results = {}
    for where in ("CPU", "GPU"):
        with tf.device(f"/{where}:0"):
            results[where] = value_and_grads(functools.partial(fused, leaky=leaky), u, W, 3, weights_v, weights_c)
    on_device("gpu", *results["GPU"])
    for name, a, b in zip(("v_j", "c_ij", "grad_u", "grad_W"), results["GPU"], results["CPU"]):
        assert_close(a, b, 1e-10, 1e-12, name)


# ----------------------------------------------------------------------------
# Gradients against finite differences (float64).


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("leaky", LEAKY)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (2, 3, 2, 4, 5), (3, 2, 3, 3, 3), (2, 4, 1, 2, 7)])
def test_one_iteration_gradient_matches_finite_differences(device, shape, leaky):
    # With r = 1, c_ij = 1/J (leaky: 1/(J+1)) is constant, so the op's gradient is the full
    # derivative.
    u, W = inputs(shape, seed=9)
    theoretical, numerical = tf.test.compute_gradient(
        lambda u, W: ops.capsule_routing(u, W, 1, leaky=leaky)[0], [u, W])
    for t, n in zip(theoretical, numerical):
        np.testing.assert_allclose(t, n, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("leaky", LEAKY)
@pytest.mark.parametrize("iterations", [2, 3])
def test_gradient_is_the_derivative_with_coupling_frozen(device, iterations, leaky):
    """For r > 1 the op differentiates s_j = Σ_i c_ij W_ij u_i with c_ij held at its
    routed value (stop-gradient routing): finite differences of exactly that function.
    Leaky routing changes the c_ij, not that rule (the gradient op reads the c_ij output)."""
    u, W = inputs((2, 3, 3, 4, 3), seed=10)
    _, c_routed = ops.capsule_routing(u, W, iterations, leaky=leaky)

    def frozen(u, W):  # s_j with the coupling coefficients as constants
        return tf.einsum("bij,bijd->bjd", c_routed, ops.capsule_prediction_matmul(u, W))

    theoretical, full = tf.test.compute_gradient(
        lambda u, W: ops.capsule_routing(u, W, iterations, leaky=leaky)[0], [u, W])
    _, numerical = tf.test.compute_gradient(frozen, [u, W])
    for t, n in zip(theoretical, numerical):
        np.testing.assert_allclose(t, n, rtol=1e-6, atol=1e-8)
    # ...which is not the full derivative (the op's own finite differences): the
    # coupling does depend on u and W.
    assert max(np.abs(t - f).max() for t, f in zip(theoretical, full)) > 1e-4


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_second_order_gradients_match_finite_differences(device):
    u, W = inputs((2, 3, 2, 3, 4), seed=11)

    def first_order(u, W):
        with tf.GradientTape() as tape:
            tape.watch([u, W])
            loss = tf.reduce_sum(tf.sin(ops.capsule_routing(u, W, 1)[0]))
        grad_u, grad_W = tape.gradient(loss, [u, W])
        return tf.concat([tf.reshape(grad_u, [-1]), tf.reshape(grad_W, [-1])], 0)

    theoretical, numerical = tf.test.compute_gradient(first_order, [u, W])
    for t, n in zip(theoretical, numerical):
        # Central differences of sin'' carry O(delta²) ~ 1e-7 error; a wrong rule is O(1) off.
        np.testing.assert_allclose(t, n, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("leaky", LEAKY)
def test_second_order_gradients_match_unfused_path(leaky):
    # r = 3: both paths hold the coupling constant, so their second derivatives agree.
    u, W = inputs((2, 4, 3, 3, 4), seed=12)
    weights_v, _ = loss_weights((2, 4, 3, 3, 4), np.float64)

    def hessian_vector(route):
        u_t, W_t = tf.constant(u), tf.constant(W)
        with tf.GradientTape() as outer:
            outer.watch([u_t, W_t])
            with tf.GradientTape() as inner:
                inner.watch([u_t, W_t])
                v_j, _ = route(u_t, W_t, 3)
                loss = tf.reduce_sum(v_j * weights_v)
            grad_u, grad_W = inner.gradient(loss, [u_t, W_t])
            total = tf.reduce_sum(grad_u ** 2) + tf.reduce_sum(grad_W ** 2)
        return outer.gradient(total, [u_t, W_t])

    for name, a, b in zip(("d/du", "d/dW"), hessian_vector(functools.partial(fused, leaky=leaky)),
                          hessian_vector(functools.partial(unfused, leaky=leaky))):
        assert_close(a, b, 1e-9, 1e-11, name)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_coupling_output_carries_no_gradient(device):
    # Stop-gradient routing: c_ij are constants, so a loss of c_ij alone has a zero
    # gradient (the TF path has no gradient path at all there).
    u, W = (tf.constant(x) for x in inputs((3, 4, 3, 5, 2), seed=13))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([u, W])
        _, c_ij = ops.capsule_routing(u, W, 3)
        loss = tf.reduce_sum(c_ij * tf.range(1.0, 4.0, dtype=tf.float64))
        _, c_tf = unfused(u, W, 3)
        loss_tf = tf.reduce_sum(c_tf * tf.range(1.0, 4.0, dtype=tf.float64))
    grad_u, grad_W = tape.gradient(loss, [u, W])
    np.testing.assert_array_equal(grad_u.numpy(), 0)
    np.testing.assert_array_equal(grad_W.numpy(), 0)
    assert tape.gradient(loss_tf, [u, W]) == [None, None]


# ----------------------------------------------------------------------------
# Edge cases, determinism, bad inputs.


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_batch_of_one_and_empty_batch(device):
    u, W = inputs((5, 6, 3, 4, 5), seed=14)
    s_all, c_all = ops.capsule_routing(u, W, 3)
    s_one, c_one = ops.capsule_routing(u[2:3], W, 3)
    # Routing is per sample: sample 2 alone gives what it gave in the batch (to rounding:
    # the GPU's reduction over capsule chunks depends on the shape, not the batch).
    assert_close(s_one, s_all.numpy()[2:3], 1e-12, 1e-14, "s_j")
    assert_close(c_one, c_all.numpy()[2:3], 1e-12, 1e-14, "c_ij")

    u0 = np.zeros((0, 6, 5))
    weights_v, weights_c = np.zeros((0, 3, 4)), np.zeros((0, 6, 3))
    v_j, c_ij, grad_u, grad_W = value_and_grads(fused, u0, W, 3, weights_v, weights_c)
    assert v_j.shape == (0, 3, 4) and c_ij.shape == (0, 6, 3) and grad_u.shape == (0, 6, 5)
    np.testing.assert_array_equal(grad_W.numpy(), np.zeros(W.shape))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("leaky", LEAKY)
@pytest.mark.parametrize("shape", [(2, 3, 4, 5, 0), (2, 3, 4, 0, 5), (2, 0, 4, 5, 3)],
                         ids=["in_dim0", "out_dim0", "in_caps0"])
def test_empty_sums_follow_the_math(device, shape, leaky):
    # u_hat is zero or empty: s_j = 0, every agreement 0, so c_ij = softmax(0) = 1/J (leaky:
    # 1/(J+1)); the same as the unfused path, and the gradients are zero.
    u, W = inputs(shape)
    B, I, J, D, _ = shape
    s_j, c_ij = ops.capsule_routing(u, W, 3, leaky=leaky)
    # (einsum, not the matmul path: its reshape(-1, ...) cannot recover the batch of an
    # empty u_hat)
    _, c_ref = dynamic_routing(tf.einsum("bik,ijdk->bijd", u, W), 3, leaky=leaky)
    np.testing.assert_array_equal(s_j.numpy(), np.zeros((B, J, D)))
    np.testing.assert_array_equal(c_ij.numpy(), np.full((B, I, J), 1 / (J + 1 if leaky else J)))
    np.testing.assert_array_equal(c_ij.numpy(), c_ref.numpy())
    _, _, grad_u, grad_W = value_and_grads(functools.partial(fused, leaky=leaky), u, W, 3,
                                           *loss_weights(shape, np.float64))
    np.testing.assert_array_equal(grad_u.numpy(), np.zeros(u.shape))
    np.testing.assert_array_equal(grad_W.numpy(), np.zeros(W.shape))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_no_output_capsules(device):
    u, W = inputs((2, 3, 0, 4, 5))
    s_j, c_ij = ops.capsule_routing(u, W, 3)
    assert s_j.shape == (2, 0, 4) and c_ij.shape == (2, 3, 0)
    _, _, grad_u, _ = value_and_grads(fused, u, W, 3, np.zeros((2, 0, 4)), np.zeros((2, 3, 0)))
    np.testing.assert_array_equal(grad_u.numpy(), np.zeros(u.shape))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("leaky", LEAKY)
@pytest.mark.parametrize("shape", [(70, 2, 10, 16, 8), (33, 37, 10, 16, 8)])
def test_forward_and_gradient_are_deterministic(device, shape, leaky):
    u, W = inputs(shape, np.float32, seed=15)
    weights_v, weights_c = loss_weights(shape, np.float32)
    route = functools.partial(fused, leaky=leaky)
    first = value_and_grads(route, u, W, 3, weights_v, weights_c)
    second = value_and_grads(route, u, W, 3, weights_v, weights_c)
    for name, a, b in zip(("v_j", "c_ij", "grad_u", "grad_W"), first, second):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_nan_stays_in_its_sample(device):
    u, W = inputs((4, 6, 3, 5, 7), np.float32, seed=16)
    u[2, 3, 1] = np.nan
    s_j, c_ij = ops.capsule_routing(u, W, 3)
    s, c = s_j.numpy(), c_ij.numpy()
    assert np.isnan(s[2]).all()
    assert np.isfinite(np.delete(s, 2, axis=0)).all() and np.isfinite(np.delete(c, 2, axis=0)).all()


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_tf_function_with_unknown_batch_matches_eager(device):
    u, W = inputs((6, 5, 4, 3, 2), np.float32, seed=17)
    f = tf.function(lambda u, W: ops.capsule_routing(u, W, 3),
                    input_signature=[tf.TensorSpec([None, 5, 2], tf.float32), tf.TensorSpec([5, 4, 3, 2], tf.float32)])
    s_j, c_ij = f(u, W)
    assert f.get_concrete_function().structured_outputs[0].shape.as_list() == [None, 4, 3]
    eager_s, eager_c = ops.capsule_routing(u, W, 3)
    np.testing.assert_array_equal(s_j.numpy(), eager_s.numpy())
    np.testing.assert_array_equal(c_ij.numpy(), eager_c.numpy())


def _shapes_named(text, *shapes):
    fmt = lambda s: "[" + ",".join(str(d) for d in s) + "]"  # noqa: E731
    return all(fmt(s) in text for s in shapes)


BAD_SHAPES = [((2, 3, 8), (4, 2, 5, 8), "in_caps"), ((2, 3, 8), (3, 2, 5, 7), "in_dim"),
              ((2, 3), (3, 2, 5, 3), "rank"), ((2, 3, 8), (3, 2, 8), "rank")]


@pytest.mark.parametrize("u_shape,w_shape,what", BAD_SHAPES)
def test_bad_shapes_at_trace_time(u_shape, w_shape, what):
    f = tf.function(lambda u, W: ops.capsule_routing(u, W, 3))
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)) as info:
        f(np.ones(u_shape, np.float32), np.ones(w_shape, np.float32))
    assert "capsule_routing" in str(info.value) and what in str(info.value)
    assert _shapes_named(str(info.value), u_shape, w_shape), str(info.value)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("u_shape,w_shape,what", BAD_SHAPES[:2])
def test_bad_shapes_at_run_time(device, u_shape, w_shape, what):
    # Unknown shapes while tracing: the kernel checks again when it runs.
    f = tf.function(lambda u, W: ops.capsule_routing(u, W, 3),
                    input_signature=[tf.TensorSpec([None] * 3, tf.float32), tf.TensorSpec([None] * 4, tf.float32)])
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        f(np.ones(u_shape, np.float32), np.ones(w_shape, np.float32))
    assert "capsule_routing: " + what in info.value.message, info.value.message
    assert _shapes_named(info.value.message, u_shape, w_shape), info.value.message


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("c_shape,g_shape", [((2, 3, 4), (2, 4, 4)), ((2, 3, 3), (2, 4, 5)), ((1, 3, 4), (2, 4, 5))])
def test_grad_op_checks_its_shapes(device, c_shape, g_shape):
    u, W = inputs((2, 3, 4, 5, 6))
    grad = tf.function(
        lambda u, W, c, g: ops.load_op_library().capsnet_capsule_routing_grad(u=u, weights=W, c_ij=c, grad_s=g),
        input_signature=[tf.TensorSpec([None] * rank, tf.float64) for rank in (3, 4, 3, 3)])
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        grad(u, W, np.ones(c_shape), np.ones(g_shape))
    assert _shapes_named(info.value.message, c_shape, g_shape, (2, 3, 4), (2, 4, 5)), info.value.message
    # and with known shapes, the shape function already refuses them
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="capsule_routing"):
        tf.function(lambda: ops.load_op_library().capsnet_capsule_routing_grad(
            u=u, weights=W, c_ij=np.ones(c_shape), grad_s=np.ones(g_shape)))()


@pytest.mark.parametrize("iterations", [0, -1, 2.0, True, "3"])
def test_rejects_bad_iterations(iterations):
    u, W = inputs((2, 3, 4, 5, 6))
    with pytest.raises(ValueError, match="capsule_routing: iterations must be an integer >= 1"):
        ops.capsule_routing(u, W, iterations)


@pytest.mark.parametrize("leaky", [1, "true", None, np.bool_(True)])
def test_rejects_a_leaky_that_is_not_a_bool(leaky):
    u, W = inputs((2, 3, 4, 5, 6))
    with pytest.raises(ValueError, match="capsule_routing: leaky must be a bool"):
        ops.capsule_routing(u, W, 3, leaky=leaky)


def test_a_graph_written_before_the_leaky_attr_runs_as_before():
    """Graphs and SavedModels written before the op had `leaky` have nodes without it:
    the attr's default (false) fills in when they are imported, so they route with the
    plain softmax, to the bit."""
    u, W = (tf.constant(x, tf.float32) for x in inputs((3, 5, 4, 6, 3), np.float32, seed=20))
    graph = tf.function(lambda u, W: ops.capsule_routing(u, W, 3)).get_concrete_function(u, W).graph
    op_def = next(op.op_def for op in graph.get_operations() if op.type == "Capsnet>CapsuleRouting")
    attr = next(a for a in op_def.attr if a.name == "leaky")
    assert attr.type == "bool" and attr.default_value.b is False
    graph_def = graph.as_graph_def()
    routing = [node for node in graph_def.node if node.op == "Capsnet>CapsuleRouting"]
    assert len(routing) == 1 and routing[0].attr["leaky"].b is False
    del routing[0].attr["leaky"]  # as the node was written before the attr existed

    def imported(u, W):
        s_j, c_ij = tf.graph_util.import_graph_def(graph_def, input_map={"u:0": u, "W:0": W},
                                                   return_elements=[f"{routing[0].name}:0", f"{routing[0].name}:1"])
        return s_j, c_ij

    s_old, c_old = tf.compat.v1.wrap_function(imported, [tf.TensorSpec(u.shape), tf.TensorSpec(W.shape)])(u, W)
    s_new, c_new = ops.capsule_routing(u, W, 3)
    np.testing.assert_array_equal(s_old.numpy(), s_new.numpy())
    np.testing.assert_array_equal(c_old.numpy(), c_new.numpy())
    s_leaky, _ = ops.capsule_routing(u, W, 3, leaky=True)
    assert np.any(s_leaky.numpy() != s_new.numpy())


def test_dtype_errors_are_clear():
    u, W = inputs((2, 3, 4, 5, 6))
    with pytest.raises(TypeError, match="capsule_routing: u and W must have the same dtype.*float32.*float64"):
        ops.capsule_routing(u.astype(np.float32), W, 3)
    with pytest.raises(TypeError, match="capsule_routing: dtype int32 is not supported"):
        ops.capsule_routing(np.ones((2, 3, 4), np.int32), np.ones((3, 2, 2, 4), np.int32), 3)


# ----------------------------------------------------------------------------
# Shapes the op cannot hold and scratch it cannot get: errors, never an abort
# (each case in a subprocess: see test_ops.run_cases).

BIG = 2**20
# u_hat (batch, in_caps, out_caps, out_dim) overflows int64 (2^80 elements; 2^93
# with the zero only after the overflow), or only s_j (batch, out_caps, out_dim)
# does (in_caps 0: u_hat is empty).
OVERFLOW_SHAPES = [((BIG, BIG, 0), (BIG, BIG, BIG, 0), "u_hat"),
                   ((2**31, 2**31, 0), (2**31, 2**31, 0, 0), "u_hat"),
                   ((2**30, 0, 0), (0, 2**30, 2**30, 0), "s_j")]
OVERFLOW_DTYPES = ["float16", "bfloat16", "float32", "float64"]


def _overflow_cases():
    cases = []
    for n, (u_shape, w_shape, _) in enumerate(OVERFLOW_SHAPES):
        for dt in OVERFLOW_DTYPES:
            u, W = f"tf.zeros({u_shape}, tf.{dt})", f"tf.zeros({w_shape}, tf.{dt})"
            empty = f"tf.zeros((0, 0, 0), tf.{dt})"
            cases += [
                (f"forward-{dt}-{n}", f"ops.capsule_routing({u}, {W}, 3)"),
                (f"gradient-{dt}-{n}", f"lib.capsnet_capsule_routing_grad(u={u}, weights={W}, c_ij={empty}, "
                                       f"grad_s={empty})"),
            ]
        args = f"tf.zeros({u_shape}), tf.zeros({w_shape})"
        unknown = "[tf.TensorSpec([None] * 3), tf.TensorSpec([None] * 4)]"
        cases += [
            (f"trace-{n}", f"tf.function(lambda u, W: ops.capsule_routing(u, W, 3))({args})"),
            (f"run-{n}", f"tf.function(lambda u, W: ops.capsule_routing(u, W, 3), input_signature={unknown})({args})"),
        ]
    return cases


@pytest.fixture(scope="module")
def overflow_results():
    return run_cases(_overflow_cases())


@pytest.mark.slow
@pytest.mark.parametrize("n", range(len(OVERFLOW_SHAPES)))
@pytest.mark.parametrize("dtype", OVERFLOW_DTYPES)
def test_overflowing_shapes_are_invalid_argument(overflow_results, dtype, n):
    u_shape, w_shape, what = OVERFLOW_SHAPES[n]
    for op in ("forward", "gradient"):
        result = overflow_results[f"{op}-{dtype}-{n}"]
        assert_error(result, "InvalidArgumentError", f"capsule_routing: {what}", "int64")
        assert _shapes_named(result["message"], u_shape, w_shape), result["message"]


@pytest.mark.slow
@pytest.mark.parametrize("n", range(len(OVERFLOW_SHAPES)))
def test_overflowing_shapes_in_tf_function(overflow_results, n):
    # Known shapes: the shape function rejects them while tracing; unknown: the kernel.
    u_shape, w_shape, what = OVERFLOW_SHAPES[n]
    for case, error in ((f"trace-{n}", "ValueError"), (f"run-{n}", "InvalidArgumentError")):
        assert_error(overflow_results[case], error, f"capsule_routing: {what}", "int64")
        assert _shapes_named(overflow_results[case]["message"], u_shape, w_shape), overflow_results[case]


# A failing scratch allocation under the CPU allocator's limit (test_ops.scratch_limit_env).
# Forward: u (1, 4096, 1), W (4096, 4096, 1, 1); the limit holds W, c_ij (I x J values of
# T), W transposed (I x J accumulation values) and half as much again, not the per-thread
# scratch (u_hat, b_ij and c_ij of one sample: 3 x I x J accumulation values). Gradient: W
# (1, 64, 64, 4096) (32 to 128 MiB); the limit holds W, grad_W and half W's bytes (at least
# 32 MiB) more, not the scratch (W_i transposed and its gradient: twice W's values in the
# accumulation type).
# The scratch sizes follow the element and accumulation sizes, which float16 shares with
# bfloat16: one 16-bit type (two processes with TensorFlow each, ~30 s on 2 cores a dtype).
SCRATCH_DTYPES = ["bfloat16", "float32", "float64"]


def _scratch_cases(dt):
    size, acc = tf.as_dtype(dt).size, accumulation_dtype(dt).size
    forward = (f"u = tf.ones((1, 4096, 1), tf.{dt}); W = tf.ones((4096, 4096, 1, 1), tf.{dt})\n"
               "ops.capsule_routing(u, W, 3)")
    gradient = (f"u = tf.ones((1, 1, 4096), tf.{dt}); W = tf.ones((1, 64, 64, 4096), tf.{dt}); "
                f"c = tf.ones((1, 1, 64), tf.{dt}); g = tf.ones((1, 64, 64), tf.{dt})\n"
                "lib.capsnet_capsule_routing_grad(u=u, weights=W, c_ij=c, grad_s=g)")
    ij, w_bytes = 4096 * 4096, 64 * 64 * 4096 * size
    return [(f"forward-{dt}", forward, ij * (2 * size + acc * 3 // 2)),
            (f"gradient-{dt}", gradient, 2 * w_bytes + max(w_bytes // 2, 32 << 20))]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", SCRATCH_DTYPES)
def test_failing_scratch_allocation_is_resource_exhausted(dtype):
    results = run_with_limits(_scratch_cases(dtype))
    assert_scratch_refused(results[f"forward-{dtype}"], dtype, 3 * 4096 * 4096)
    assert_scratch_refused(results[f"gradient-{dtype}"], dtype, 2 * 64 * 64 * 4096)


def test_numpy_reference_is_procedure_one():
    """np_routing's s_j is the pre-squash sum the op returns: squashing it gives the
    reference's v_j (the tests above compare against both)."""
    u, W = inputs((3, 4, 3, 5, 2), seed=18)
    s_ref, _, v_ref = np_routing(u, W, 3)
    np.testing.assert_allclose(np_squash(s_ref, epsilon=EPSILON), v_ref, rtol=1e-12)


# ----------------------------------------------------------------------------
# The benchmarks' fused routing rows (CPU smoke runs of what runs on the GPU).


@pytest.mark.slow
def test_benchmark_scripts_time_the_fused_routing(tmp_path):
    ops_bench = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "benchmark_ops.py"), "--device", "cpu", "--shapes", "paper",
         "--impls", "none", "--routing-impls", "fused,op+routing", "--routing-passes", "forward+backward",
         "--iters", "2", "--repeats", "1"],
        env=entry_point_env(), capture_output=True, text=True, timeout=600)
    assert ops_bench.returncode == 0, ops_bench.stderr[-3000:]
    for impl in ("fused", "op+routing"):
        assert f"| paper (128, 1152, 10, 16, 8) | {impl} | forward+backward |" in ops_bench.stdout, ops_bench.stdout

    output = tmp_path / "bench.json"
    train_bench = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "benchmark_train.py"), "--device", "cpu", "--batch-sizes", "4",
         "--steps", "1", "--repeats", "1", "--warmup", "1", "--variants", "op+fused,matmul", "--json", str(output),
         *TINY_MODEL],
        env=entry_point_env(), capture_output=True, text=True, timeout=600)
    assert train_bench.returncode == 0, train_bench.stderr[-3000:]
    rows = {row["variant"]: row for row in json.loads(output.read_text())["results"]}
    assert rows["op+fused"]["fused_routing"] is True and rows["matmul"]["fused_routing"] is False
    # Same seed, weights and data in both processes: the fused model's first loss is the matmul path's.
    assert rows["op+fused"]["first_loss"] == pytest.approx(rows["matmul"]["first_loss"], rel=1e-5)
    assert "| custom_op=true xla=none fused_routing | float32 | 4 |" in train_bench.stdout
