"""Tests of the compiled capsule-prediction op (capsnet.ops.capsule_prediction).

References: NumPy einsum in float64, finite differences (tf.test.compute_gradient)
and the plain TensorFlow matmul path. The tests assume the library was built
(`make ops`); if it is missing they fail with the OpLibraryError, they do not skip.
Tests marked `gpu` run the same checks on /GPU:0 with soft placement off, plus
compute-sanitizer over the standalone CUDA driver; they skip without a GPU.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from capsnet import ops
from capsnet.errors import OpLibraryError
from conftest import REPO, np_capsule_prediction, repo_env

# (batch, in_caps, out_caps, out_dim, in_dim). Size-1 dims, odd sizes, the paper's
# 10 x 16 <- 8 rows, in_dim up to 17 (past the GPU's register tiles), and few
# capsules with a larger batch (the batch-split gradient paths).
SHAPES = [
    (1, 1, 1, 1, 1),
    (2, 3, 4, 5, 6),
    (3, 5, 2, 16, 8),
    (4, 7, 3, 5, 3),
    (2, 2, 1, 6, 16),
    (5, 9, 10, 16, 8),
    (3, 4, 3, 3, 11),
    (2, 3, 2, 4, 17),
    (70, 2, 10, 16, 8),
]
GRAD_SHAPES = [(1, 1, 1, 1, 1), (2, 3, 2, 4, 5), (3, 2, 3, 3, 3), (2, 4, 1, 2, 7)]


@pytest.fixture(autouse=True)
def _device(request):
    """Tests without the gpu marker run on the CPU, also on a machine with a GPU."""
    if request.node.get_closest_marker("gpu"):
        yield
    else:
        with tf.device("/CPU:0"):
            yield


def inputs(shape, dtype=np.float64, seed=0):
    B, I, J, D, K = shape
    rng = np.random.default_rng(seed)
    u = rng.uniform(-1, 1, (B, I, K)).astype(dtype)
    W = rng.uniform(-1, 1, (I, J, D, K)).astype(dtype)
    return u, W


def tolerance(dtype, K):
    # Sums of K products of numbers in [-1, 1]: relative error ~ K * eps.
    eps = {np.float32: 1.2e-7, np.float64: 2.3e-16}[dtype]
    return 8 * max(K, 1) * eps


def grads(fn, u, W, g):
    u, W, g = (tf.convert_to_tensor(x) for x in (u, W, g))
    with tf.GradientTape() as tape:
        tape.watch([u, W])
        u_hat = fn(u, W)
    grad_u, grad_W = tape.gradient(u_hat, [u, W], output_gradients=g)
    return u_hat, grad_u, grad_W


# ----------------------------------------------------------------------------
# Forward and gradients on CPU.


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_numpy(shape, dtype):
    u, W = inputs(shape, dtype)
    u_hat = ops.capsule_prediction(u, W)
    assert u_hat.dtype == tf.as_dtype(dtype)
    assert u_hat.shape == shape[:2] + shape[2:4]
    np.testing.assert_allclose(u_hat.numpy(), np_capsule_prediction(u, W), rtol=0, atol=tolerance(dtype, shape[4]))


@pytest.mark.parametrize("dtype,atol", [(tf.float16, 2e-2), (tf.bfloat16, 1.5e-1)])
def test_forward_16bit(dtype, atol):
    u, W = inputs((3, 5, 10, 16, 8), np.float32)
    u16, W16 = tf.cast(u, dtype), tf.cast(W, dtype)
    u_hat = ops.capsule_prediction(u16, W16)
    assert u_hat.dtype == dtype
    # Reference on the rounded inputs: only the accumulation/rounding differs.
    want = np_capsule_prediction(tf.cast(u16, tf.float64).numpy(), tf.cast(W16, tf.float64).numpy())
    np.testing.assert_allclose(tf.cast(u_hat, tf.float64).numpy(), want, rtol=0, atol=atol)


@pytest.mark.parametrize("shape", GRAD_SHAPES)
def test_gradients_match_finite_differences(shape):
    u, W = inputs(shape, np.float64, seed=1)
    theoretical, numerical = tf.test.compute_gradient(ops.capsule_prediction, [u, W])
    for t, n in zip(theoretical, numerical):
        np.testing.assert_allclose(t, n, rtol=1e-6, atol=1e-8)


def test_second_order_gradients_match_finite_differences():
    u, W = inputs((2, 3, 2, 3, 4), np.float64, seed=2)

    def first_order(u, W):
        with tf.GradientTape() as tape:
            tape.watch([u, W])
            loss = tf.reduce_sum(tf.sin(ops.capsule_prediction(u, W)))
        grad_u, grad_W = tape.gradient(loss, [u, W])
        return tf.concat([tf.reshape(grad_u, [-1]), tf.reshape(grad_W, [-1])], 0)

    theoretical, numerical = tf.test.compute_gradient(first_order, [u, W])
    for t, n in zip(theoretical, numerical):
        # Central differences of sin'' carry O(delta^2) ~ 1e-7 error; a wrong
        # second-order rule would be off by O(1).
        np.testing.assert_allclose(t, n, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(8, 32, 10, 16, 8), (3, 5, 3, 5, 3), (70, 2, 10, 16, 8), (2, 3, 2, 4, 17)])
def test_forward_and_gradients_match_matmul_path(shape):
    u, W = inputs(shape, np.float32, seed=3)
    g = np.random.default_rng(4).uniform(-1, 1, shape[:2] + shape[2:4]).astype(np.float32)
    got = grads(ops.capsule_prediction, u, W, g)
    want = grads(ops.capsule_prediction_matmul, u, W, g)
    for name, a, b in zip(("u_hat", "grad_u", "grad_W"), got, want):
        assert a.shape == b.shape, name
        scale = max(1.0, float(np.abs(b.numpy()).max()))
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5 * scale, err_msg=name)


def test_gradient_is_deterministic():
    u, W = inputs((70, 2, 10, 16, 8), np.float32, seed=5)
    g = np.random.default_rng(6).uniform(-1, 1, (70, 2, 10, 16)).astype(np.float32)
    first = grads(ops.capsule_prediction, u, W, g)
    second = grads(ops.capsule_prediction, u, W, g)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# ----------------------------------------------------------------------------
# Edge cases and bad inputs.


def test_empty_batch():
    u, W = inputs((0, 4, 3, 5, 6))
    u_hat, grad_u, grad_W = grads(ops.capsule_prediction, u, W, np.zeros((0, 4, 3, 5)))
    assert u_hat.shape == (0, 4, 3, 5)
    assert grad_u.shape == (0, 4, 6)
    np.testing.assert_array_equal(grad_W.numpy(), np.zeros(W.shape))


def test_empty_in_dim_gives_zeros():
    u, W = inputs((2, 3, 4, 5, 0))
    np.testing.assert_array_equal(ops.capsule_prediction(u, W).numpy(), np.zeros((2, 3, 4, 5)))


def test_nan_stays_in_its_capsule():
    u, W = inputs((4, 6, 3, 5, 7))
    u[2, 3, 1] = np.nan
    u_hat = ops.capsule_prediction(u, W).numpy()
    nan = np.isnan(u_hat)
    assert nan[2, 3].all()
    nan[2, 3] = False
    assert not nan.any()


def _both_shapes_named(err, u_shape, w_shape):
    text = str(err)
    fmt = lambda s: "[" + ",".join(str(d) for d in s) + "]"  # noqa: E731
    return fmt(u_shape) in text and fmt(w_shape) in text


@pytest.mark.parametrize(
    "u_shape,w_shape,what",
    [((2, 3, 8), (4, 2, 5, 8), "in_caps"), ((2, 3, 8), (3, 2, 5, 7), "in_dim"), ((2, 3), (3, 2, 5, 3), "rank")],
)
def test_bad_shapes_at_trace_time(u_shape, w_shape, what):
    # Known shapes: the shape function rejects them while tracing.
    f = tf.function(ops.capsule_prediction)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)) as info:
        f(np.ones(u_shape, np.float32), np.ones(w_shape, np.float32))
    assert what in str(info.value)
    assert _both_shapes_named(info.value, u_shape, w_shape), str(info.value)


@pytest.mark.parametrize(
    "u_shape,w_shape,what",
    [((2, 3, 8), (4, 2, 5, 8), "in_caps"), ((2, 3, 8), (3, 2, 5, 7), "in_dim")],
)
def test_bad_shapes_at_run_time(u_shape, w_shape, what):
    # Unknown shapes while tracing: the kernel checks again when it runs.
    f = tf.function(
        ops.capsule_prediction,
        input_signature=[tf.TensorSpec([None, None, None], tf.float32), tf.TensorSpec([None] * 4, tf.float32)],
    )
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        f(np.ones(u_shape, np.float32), np.ones(w_shape, np.float32))
    assert what in info.value.message
    assert _both_shapes_named(info.value.message, u_shape, w_shape), info.value.message


def test_bad_rank_eagerly():
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        ops.capsule_prediction(np.ones((2, 3), np.float32), np.ones((3, 2, 5, 3), np.float32))
    assert _both_shapes_named(info.value.message, (2, 3), (3, 2, 5, 3)), info.value.message


def test_grad_op_checks_grad_shape():
    lib = ops.load_op_library()
    u, W = inputs((2, 3, 4, 5, 6))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\[2,3,4,5\]"):
        lib.capsnet_capsule_prediction_grad(grad=np.ones((2, 3, 4, 4)), u=u, weights=W)


def test_dtype_mismatch_is_a_clear_error():
    u, W = inputs((2, 3, 4, 5, 6))
    with pytest.raises(TypeError, match="same dtype.*float32.*float64"):
        ops.capsule_prediction(u.astype(np.float32), W)


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(TypeError, match="int32 is not supported"):
        ops.capsule_prediction(np.ones((2, 3, 4), np.int32), np.ones((3, 2, 2, 4), np.int32))


# ----------------------------------------------------------------------------
# Shapes the op cannot hold and scratch it cannot get: errors, never an abort.
# Each case runs in one subprocess per module (a CHECK failure or an exception
# thrown through the thread pool kills the process), which prints one JSON line
# per finished case; a case whose line is missing fails with the process's
# exit status and stderr.

_CASE_RUNNER = textwrap.dedent("""
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tensorflow as tf
    from capsnet import ops
    lib = ops.load_op_library()

    for case_id, code in json.load(sys.stdin):
        result = {"id": case_id, "error": None, "message": ""}
        try:
            with tf.device("/CPU:0"):
                exec(code, {"tf": tf, "np": np, "ops": ops, "lib": lib})
        except Exception as err:
            result.update(error=type(err).__name__, message=str(getattr(err, "message", err)))
        print(json.dumps(result), flush=True)
""")


def run_cases(cases, env=None):
    """{case id: {"error": exception class name or None, "message": ...}} from one
    subprocess running `cases` ((id, code) pairs) with `env` added to its environment; a
    missing id means it died there, and maps to {"died": its exit status and stderr}."""
    # GPUs hidden: the cases test the CPU kernels (and checks made before any device code).
    proc = subprocess.run([sys.executable, "-c", _CASE_RUNNER], input=json.dumps(cases), capture_output=True,
                          text=True, env={**repo_env(), "CUDA_VISIBLE_DEVICES": "", **(env or {})}, timeout=600)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            results[result.pop("id")] = result
    log = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith(("I0000", "W0000", "WARNING:")))
    died = {"died": f"exit status {proc.returncode}: {log[-3000:]}"}
    return {case_id: results.get(case_id, died) for case_id, _ in cases}


def assert_error(result, error, *fragments):
    assert "died" not in result, result["died"]
    assert result["error"] == error, result
    for fragment in fragments:
        assert fragment in result["message"], (fragment, result["message"])


def _fmt(shape):
    return "[" + ",".join(str(d) for d in shape) + "]"


# u_hat (batch, in_caps, out_caps, out_dim) overflows int64 though u and W are
# empty: 2^80 elements; and 2^93 with a zero only after the overflow (TensorShape
# multiplies in order, so that is no shape either).
BIG = 2**20
OVERFLOW_SHAPES = [((BIG, BIG, 0), (BIG, BIG, BIG, 0)), ((2**31, 2**31, 0), (2**31, 2**31, 0, 0))]
OVERFLOW_DTYPES = ["float16", "bfloat16", "float32", "float64"]
UNKNOWN = "[tf.TensorSpec([None] * 3, {dt}), tf.TensorSpec([None] * 4, {dt})]"


def _overflow_cases():
    cases = []
    for n, (u_shape, w_shape) in enumerate(OVERFLOW_SHAPES):
        for dt in OVERFLOW_DTYPES:
            args = f"tf.zeros({u_shape}, tf.{dt}), tf.zeros({w_shape}, tf.{dt})"
            cases += [
                (f"forward-{dt}-{n}", f"ops.capsule_prediction({args})"),
                (f"gradient-{dt}-{n}", f"lib.capsnet_capsule_prediction_grad(grad=tf.zeros((0, 0, 0, 0), tf.{dt}), "
                                       f"u=tf.zeros({u_shape}, tf.{dt}), weights=tf.zeros({w_shape}, tf.{dt}))"),
                (f"matmul-{dt}-{n}", f"ops.capsule_prediction_matmul({args})"),
            ]
        args = f"tf.zeros({u_shape}), tf.zeros({w_shape})"
        unknown = UNKNOWN.format(dt="tf.float32")
        cases += [
            (f"trace-{n}", f"tf.function(ops.capsule_prediction)({args})"),
            (f"run-{n}", f"tf.function(ops.capsule_prediction, input_signature={unknown})({args})"),
            (f"matmul-run-{n}", f"tf.function(ops.capsule_prediction_matmul, input_signature={unknown})({args})"),
        ]
    return cases


@pytest.fixture(scope="module")
def overflow_results():
    return run_cases(_overflow_cases())


@pytest.mark.slow
@pytest.mark.parametrize("n", range(len(OVERFLOW_SHAPES)))
@pytest.mark.parametrize("dtype", OVERFLOW_DTYPES)
def test_overflowing_shapes_are_invalid_argument(overflow_results, dtype, n):
    u_shape, w_shape = OVERFLOW_SHAPES[n]
    named = (_fmt(u_shape), _fmt(w_shape))
    for what in ("forward", "gradient"):
        assert_error(overflow_results[f"{what}-{dtype}-{n}"], "InvalidArgumentError", "capsule_prediction: u_hat",
                     "int64", *named)
    assert_error(overflow_results[f"matmul-{dtype}-{n}"], "ValueError", "capsule_prediction_matmul: u_hat",
                 "int64", str(list(u_shape)), str(list(w_shape)))


@pytest.mark.slow
@pytest.mark.parametrize("n", range(len(OVERFLOW_SHAPES)))
def test_overflowing_shapes_in_tf_function(overflow_results, n):
    u_shape, w_shape = OVERFLOW_SHAPES[n]
    # Known shapes: the shape function rejects them while tracing; unknown: the kernel.
    assert_error(overflow_results[f"trace-{n}"], "ValueError", "capsule_prediction: u_hat", "int64",
                 _fmt(u_shape), _fmt(w_shape))
    assert_error(overflow_results[f"run-{n}"], "InvalidArgumentError", "capsule_prediction: u_hat", "int64",
                 _fmt(u_shape), _fmt(w_shape))
    assert_error(overflow_results[f"matmul-run-{n}"], "InvalidArgumentError", "capsule_prediction_matmul: u_hat",
                 "int64")


def test_matmul_path_checks_only_what_it_must():
    # Shapes that fit: no error, the same result with static and unknown shapes.
    u, W = inputs((3, 4, 2, 5, 6), np.float32)
    unknown = [tf.TensorSpec([None] * 3, tf.float32), tf.TensorSpec([None] * 4, tf.float32)]
    f = tf.function(ops.capsule_prediction_matmul, input_signature=unknown)
    np.testing.assert_array_equal(f(u, W).numpy(), ops.capsule_prediction_matmul(u, W).numpy())
    empty = ops.capsule_prediction_matmul(np.zeros((0, BIG, 0), np.float32), np.zeros((BIG, 1, 1, 0), np.float32))
    assert empty.shape == (0, BIG, 1, 1)


# A failing scratch allocation. The case's process gets TensorFlow's CPU allocator with
# a memory limit (its BFC allocator: TF_CPU_ALLOCATOR_USE_BFC, TF_CPU_BFC_MEM_LIMIT_IN_MB),
# which only tensors allocate from: the inputs and outputs fit under it, the kernel's
# per-thread scratch (allocate_temp) does not. The error must name the scratch: a 1-D
# tensor of at least `min_values` values of the accumulation type.
#
# Why not an address-space limit (RLIMIT_AS): it refuses every mmap of the process, so
# threads of TensorFlow's own and abseil's low_level_alloc die beside the refused scratch
# (SIGSEGV, "mmap error: 12", 3 of 3 attempts in CI); the allocator's limit refuses only
# tensors, deterministically.
def scratch_limit_env(limit_bytes):
    return {"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(-(-limit_bytes // 2**20))}


def accumulation_dtype(dtype):
    """The type the CPU kernels accumulate a `dtype` op in (and hold their scratch in)."""
    return tf.float64 if dtype == "float64" else tf.float32


def assert_scratch_refused(result, dtype, min_values):
    assert_error(result, "ResourceExhaustedError", "OOM when allocating tensor")
    found = re.search(r"with shape\[(\d+)\] and type (\w+)", result["message"])
    assert found, result["message"]
    accumulation = {tf.float64: "double", tf.float32: "float"}[accumulation_dtype(dtype)]
    assert found.group(2) == accumulation and int(found.group(1)) >= min_values, (min_values, result["message"])


def run_with_limits(cases):
    """run_cases for (id, code, limit in bytes) triples, each in its own process (the
    allocator, and its limit, is the process's)."""
    results = {}
    for case_id, code, limit in cases:
        results.update(run_cases([(case_id, code)], env=scratch_limit_env(limit)))
    return results


# W (1, 64, 64, 4096): 32 to 128 MiB. Forward: the limit holds W and half W's values in
# the accumulation type; the scratch (W_i transposed in the accumulation type) does not
# fit. Gradient: the limit holds W, grad_W and W's values in the accumulation type; the
# scratch (W_i transposed and its gradient: twice that) does not.
SCRATCH_SHAPE = (1, 1, 64, 64, 4096)


# The scratch sizes follow the element and accumulation sizes, which float16 shares with
# bfloat16: one 16-bit type (two processes with TensorFlow each, ~30 s on 2 cores a dtype).
SCRATCH_DTYPES = ["bfloat16", "float32", "float64"]


def _scratch_cases(dt):
    B, I, J, D, K = SCRATCH_SHAPE
    w_values = I * J * D * K
    w_bytes, acc_bytes = w_values * tf.as_dtype(dt).size, w_values * accumulation_dtype(dt).size
    setup = (f"u = tf.ones({(B, I, K)}, tf.{dt}); W = tf.ones({(I, J, D, K)}, tf.{dt}); "
             f"g = tf.ones({(B, I, J, D)}, tf.{dt})\n")
    return [
        (f"forward-{dt}", setup + "ops.capsule_prediction(u, W)", w_bytes + acc_bytes // 2),
        (f"gradient-{dt}", setup + "lib.capsnet_capsule_prediction_grad(grad=g, u=u, weights=W)",
         2 * w_bytes + acc_bytes),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", SCRATCH_DTYPES)
def test_failing_scratch_allocation_is_resource_exhausted(dtype):
    results = run_with_limits(_scratch_cases(dtype))
    B, I, J, D, K = SCRATCH_SHAPE
    assert_scratch_refused(results[f"forward-{dtype}"], dtype, J * D * K)
    assert_scratch_refused(results[f"gradient-{dtype}"], dtype, 2 * J * D * K)


@pytest.mark.slow
def test_scratch_limit_is_what_refuses():
    """The control: the same forward case, the allocator's limit far above it, runs."""
    code = _scratch_cases("float32")[0][1]
    result = run_with_limits([("forward", code + "\nassert float(tf.reduce_min(ops.capsule_prediction(u, W))) == 4096", 2**40)])
    assert result["forward"] == {"error": None, "message": ""}, result


# ----------------------------------------------------------------------------
# tf.function, tf.distribute, SavedModel.


def test_tf_function_matches_eager():
    u, W = inputs((6, 5, 4, 3, 2), np.float32)
    f = tf.function(ops.capsule_prediction)
    np.testing.assert_array_equal(f(u, W).numpy(), ops.capsule_prediction(u, W).numpy())


@pytest.mark.parametrize("make_strategy", [
    lambda: tf.distribute.OneDeviceStrategy("/cpu:0"),
    lambda: tf.distribute.MirroredStrategy(["/cpu:0"]),
], ids=["one_device", "mirrored"])
def test_under_tf_distribute(make_strategy):
    strategy = make_strategy()
    u, W0 = inputs((4, 5, 3, 2, 6), np.float32)
    with strategy.scope():
        W = tf.Variable(W0)

    @tf.function
    def step(u):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ops.capsule_prediction(u, W) ** 2)
        return loss, tape.gradient(loss, W)

    loss, grad_W = strategy.run(step, args=(tf.constant(u),))
    loss = strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)
    grad_W = strategy.reduce(tf.distribute.ReduceOp.SUM, grad_W, axis=None)
    u_hat = np_capsule_prediction(u, W0)
    np.testing.assert_allclose(loss.numpy(), (u_hat**2).sum(), rtol=1e-5)
    want = 2 * np.einsum("bijd,bik->ijdk", u_hat, u.astype(np.float64))
    np.testing.assert_allclose(grad_W.numpy(), want, rtol=1e-5, atol=1e-5)


class _Prediction(tf.Module):
    def __init__(self, W):
        super().__init__()
        self.W = tf.Variable(W)

    @tf.function(input_signature=[tf.TensorSpec([None, 5, 6], tf.float32)])
    def __call__(self, u):
        return ops.capsule_prediction(u, self.W)


@pytest.mark.slow
def test_saved_model_round_trip(tmp_path):
    u, W = inputs((3, 5, 4, 2, 6), np.float32)
    path = str(tmp_path / "model")
    tf.saved_model.save(_Prediction(W), path)
    np.save(tmp_path / "u.npy", u)
    # A fresh interpreter: importing capsnet.ops must not load the library (the
    # matmul path works without it); load_op_library() must come before
    # tf.saved_model.load.
    script = textwrap.dedent(f"""
        import os
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
        import numpy as np
        import tensorflow as tf
        loads = []
        real_load = tf.load_op_library
        tf.load_op_library = lambda p: loads.append(p) or real_load(p)
        from capsnet import ops
        assert ops._lib is None and not loads, "importing capsnet.ops loaded the library"
        u = np.load({str(tmp_path / "u.npy")!r})
        ops.capsule_prediction_matmul(u, np.ones((5, 4, 2, 6), np.float32))
        assert not loads, "the matmul path loaded the library"
        ops.load_op_library()
        model = tf.saved_model.load({path!r})
        np.save({str(tmp_path / "out.npy")!r}, model(u).numpy())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=repo_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), np_capsule_prediction(u, W), rtol=1e-5, atol=1e-5)

    # In this process: the restored function is differentiable through the op.
    restored = tf.saved_model.load(path)
    with tf.GradientTape() as tape:
        out = tf.reduce_sum(restored(tf.constant(u)))
    grad_W = tape.gradient(out, restored.W)
    want = np.einsum("bik->ik", u.astype(np.float64))[:, None, None, :] * np.ones(W.shape)
    np.testing.assert_allclose(grad_W.numpy(), want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# Library loading errors.


def test_missing_library_raises_op_library_error(fresh_op_loader):
    u, W = inputs((2, 3, 4, 5, 6))
    with pytest.raises(OpLibraryError, match="not built.*make ops"):
        ops.capsule_prediction(u, W)
    # The matmul path does not need the library.
    np.testing.assert_allclose(ops.capsule_prediction_matmul(u, W).numpy(), np_capsule_prediction(u, W), atol=1e-12)


def test_library_for_another_tensorflow_raises(fresh_op_loader):
    shutil.copy(REPO / "capsnet" / "lib" / "_capsnet_ops.so", fresh_op_loader)
    fresh_op_loader.with_suffix(".json").write_text(json.dumps({"tensorflow": "2.0.0", "cuda": False}))
    with pytest.raises(OpLibraryError, match=r"built for TensorFlow 2\.0\.0.*make ops"):
        ops.load_op_library()


def test_unloadable_library_raises(fresh_op_loader):
    fresh_op_loader.write_bytes(b"not a shared library")
    fresh_op_loader.with_suffix(".json").write_text(json.dumps({"tensorflow": tf.__version__, "cuda": False}))
    with pytest.raises(OpLibraryError, match="cannot be loaded.*make ops"):
        ops.load_op_library()


def test_library_from_older_sources_raises(fresh_op_loader, monkeypatch):
    """A library built before the fused routing op (same TensorFlow) loads, but lacks it:
    one line at load time, not an AttributeError at the first fused call."""
    import types

    fresh_op_loader.write_bytes(b"stands in for an old build")
    fresh_op_loader.with_suffix(".json").write_text(json.dumps({"tensorflow": tf.__version__, "cuda": False}))
    old = types.SimpleNamespace(capsnet_capsule_prediction=None, capsnet_capsule_prediction_grad=None)
    monkeypatch.setattr(tf, "load_op_library", lambda path: old)
    with pytest.raises(OpLibraryError, match=r"lacks capsnet_capsule_routing, capsnet_capsule_routing_grad: "
                                             r"it was built from older sources; rebuild it with `make ops`") as err:
        ops.capsule_routing(tf.zeros((1, 1, 1)), tf.zeros((1, 1, 1, 1)), 3)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------
# GPU (skipped without one).

HAS_GPU = bool(tf.config.list_physical_devices("GPU"))
gpu = pytest.mark.skipif(not HAS_GPU, reason="no GPU visible to TensorFlow")


@pytest.fixture
def on_gpu(no_tf32):
    """/GPU:0 with soft placement off (no silent CPU fallback) and TF32 off."""
    soft = tf.config.get_soft_device_placement()
    tf.config.set_soft_device_placement(False)
    try:
        with tf.device("/GPU:0"):
            yield
    finally:
        tf.config.set_soft_device_placement(soft)


GPU_SHAPES = SHAPES + [(2, 1, 5, 820, 4), (3, 4, 0, 4, 8)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_forward_matches_numpy(on_gpu, shape, dtype):
    u, W = inputs(shape, dtype)
    u_hat = ops.capsule_prediction(tf.constant(u), tf.constant(W))
    assert "GPU:0" in u_hat.device, u_hat.device
    np.testing.assert_allclose(u_hat.numpy(), np_capsule_prediction(u, W), rtol=0, atol=tolerance(dtype, shape[4]))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(tf.float16, 2e-2), (tf.bfloat16, 1.5e-1)])
def test_gpu_forward_16bit(on_gpu, dtype, atol):
    u, W = inputs((3, 5, 10, 16, 8), np.float32)
    u16, W16 = tf.cast(u, dtype), tf.cast(W, dtype)
    u_hat = ops.capsule_prediction(u16, W16)
    assert "GPU:0" in u_hat.device
    want = np_capsule_prediction(tf.cast(u16, tf.float64).numpy(), tf.cast(W16, tf.float64).numpy())
    np.testing.assert_allclose(tf.cast(u_hat, tf.float64).numpy(), want, rtol=0, atol=atol)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", GRAD_SHAPES + [(40, 2, 10, 16, 8)])
def test_gpu_gradients_match_finite_differences(on_gpu, shape):
    u, W = inputs(shape, np.float64, seed=1)
    theoretical, numerical = tf.test.compute_gradient(ops.capsule_prediction, [u, W])
    for t, n in zip(theoretical, numerical):
        np.testing.assert_allclose(t, n, rtol=1e-6, atol=1e-8)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(128, 1152, 10, 16, 8), (8, 32, 10, 16, 8), (300, 2, 10, 16, 8),
                                   (3, 5, 3, 5, 3), (2, 3, 2, 4, 17), (2, 1, 5, 820, 4)])
def test_gpu_matches_matmul_path(on_gpu, shape):
    u, W = inputs(shape, np.float32, seed=3)
    g = np.random.default_rng(4).uniform(-1, 1, shape[:2] + shape[2:4]).astype(np.float32)
    got = grads(ops.capsule_prediction, u, W, g)
    want = grads(ops.capsule_prediction_matmul, u, W, g)
    for name, a, b in zip(("u_hat", "grad_u", "grad_W"), got, want):
        assert "GPU:0" in a.device, (name, a.device)
        scale = max(1.0, float(np.abs(b.numpy()).max()))
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5 * scale, err_msg=name)


@gpu
@pytest.mark.gpu
def test_gpu_deterministic_empty_nan_and_bad_shapes(on_gpu):
    u, W = inputs((300, 2, 10, 16, 8), np.float32, seed=5)
    g = np.random.default_rng(6).uniform(-1, 1, (300, 2, 10, 16)).astype(np.float32)
    first, second = grads(ops.capsule_prediction, u, W, g), grads(ops.capsule_prediction, u, W, g)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.numpy(), b.numpy())

    u0, W0 = inputs((0, 4, 3, 5, 6))
    u_hat, grad_u, grad_W = grads(ops.capsule_prediction, u0, W0, np.zeros((0, 4, 3, 5)))
    assert u_hat.shape == (0, 4, 3, 5) and grad_u.shape == (0, 4, 6)
    np.testing.assert_array_equal(grad_W.numpy(), np.zeros(W0.shape))

    u1, W1 = inputs((4, 6, 3, 5, 7))
    u1[2, 3, 1] = np.nan
    nan = np.isnan(ops.capsule_prediction(u1, W1).numpy())
    assert nan[2, 3].all()
    nan[2, 3] = False
    assert not nan.any()

    f = tf.function(
        ops.capsule_prediction,
        input_signature=[tf.TensorSpec([None, None, None], tf.float32), tf.TensorSpec([None] * 4, tf.float32)],
    )
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        f(np.ones((2, 3, 8), np.float32), np.ones((4, 2, 5, 8), np.float32))
    assert _both_shapes_named(info.value.message, (2, 3, 8), (4, 2, 5, 8))


@pytest.mark.slow
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_gpu_kernels_under_compute_sanitizer(tool):
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(sanitizer):
        pytest.skip("compute-sanitizer not found")
    build = subprocess.run([sys.executable, str(REPO / "scripts" / "build_ops.py"), "--driver-only"],
                           capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout + build.stderr
    proc = subprocess.run([sanitizer, "--tool", tool, "--error-exitcode", "3",
                           str(REPO / "build" / "sanitize_driver")],
                          capture_output=True, text=True, timeout=1200)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    summary = {"memcheck": "ERROR SUMMARY: 0 errors", "racecheck": "RACECHECK SUMMARY: 0 hazards"}[tool]
    assert "checks passed" in proc.stdout and summary in proc.stdout + proc.stderr, tail


@pytest.mark.slow
def test_build_up_to_date_check_does_not_import_tensorflow(tmp_path):
    """`make ops` on a built tree answers from the stamp's quick key: no TensorFlow import,
    so none of its CUDA/oneDNN notices; a changed source would change the key (the full
    check then imports TensorFlow)."""
    lib = tmp_path / "_capsnet_ops.so"
    shutil.copy(ops.library_path(), lib)
    stamp = json.loads((Path(ops.library_path()).with_suffix(".json")).read_text())
    if "quick_key" not in stamp:
        pytest.skip("the library was built before quick keys (a rebuild adds one)")
    (tmp_path / "_capsnet_ops.json").write_text(json.dumps(stamp))
    env = {**os.environ, "PYTHONPATH": ""}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    variant = [] if stamp.get("cuda") else ["--cpu-only"]  # as it was built (CI tests a CPU-only one too)
    # A library copied from the machine that built it (built against another TensorFlow, e.g.
    # an unpacked one rather than an installed distribution) is not up to date here by design.
    probe = subprocess.run([sys.executable, "-c", "import build_ops as b; "
                            f"print(b.quick_key({'None' if variant else 'b.find_nvcc()'}))"],
                           env={**env, "PYTHONPATH": str(REPO / "scripts")}, capture_output=True, text=True,
                           timeout=120)
    if probe.stdout.strip() != stamp["quick_key"]:
        pytest.skip("the library was built on another machine or by another TensorFlow: "
                    f"quick key here {probe.stdout.strip()[:12] or probe.stderr[-200:]}, stamp's {stamp['quick_key'][:12]}")
    run = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "scripts" / "build_ops.py"), "--out", str(lib),
                          *variant],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "is up to date (" in run.stderr + run.stdout
    assert "| tensorflow" not in run.stderr  # -X importtime lists every module imported
    assert "cuda drivers" not in run.stderr
