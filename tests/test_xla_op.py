"""The compiled ops inside XLA (ops/xla_kernels.cc, ops/xla_handlers.cc): under
tf.function(jit_compile=True) each op lowers to a custom call of our kernels. Checked
against the NumPy references, forward and gradient, in every dtype; against the op run
by TensorFlow (same kernels, so the same bits); and the lowering itself (custom calls in
the HLO, the library loaded after TensorFlow made its XLA kernels)."""
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from capsnet import ops
from conftest import REPO, entry_point_env, np_capsule_prediction
from test_routing_op import LEAKY, DEVICES, device, inputs, np_routing  # noqa: F401  (device: a fixture)


# (B, I, J, D, K): the paper's DigitCaps in small, odd sizes, a batch of one.
SHAPES = [(3, 7, 4, 5, 3), (1, 5, 2, 16, 8), (4, 9, 10, 4, 6)]
# dtype, relative tolerance against the float64 reference (16-bit: storage rounding of
# inputs, outputs and, for the gradient, of the incoming gradient; float32 sums).
DTYPES = [(tf.float64, 1e-10), (tf.float32, 2e-5), (tf.bfloat16, 3e-2), (tf.float16, 4e-3)]


@pytest.fixture(autouse=True)
def _on_cpu():
    """Tests without a device parameter run on the CPU, also on a machine with a GPU."""
    with tf.device("/CPU:0"):
        yield


def assert_close(got, want, rtol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=what)


def prediction_and_grads(u, W, g):
    """(u_hat, dL/du, dL/dW) of L = Σ u_hat · g through the op."""
    with tf.GradientTape() as tape:
        tape.watch([u, W])
        u_hat = ops.capsule_prediction(u, W)
        loss = tf.reduce_sum(tf.cast(u_hat, tf.float64) * g)
    return (u_hat, *tape.gradient(loss, [u, W]))


def routing_and_grads(u, W, g, iterations, leaky=False):
    """(s_j, c_ij, dL/du, dL/dW) of L = Σ s_j · g through the fused routing op."""
    with tf.GradientTape() as tape:
        tape.watch([u, W])
        s_j, c_ij = ops.capsule_routing(u, W, iterations, leaky=leaky)
        loss = tf.reduce_sum(tf.cast(s_j, tf.float64) * g)
    return (s_j, c_ij, *tape.gradient(loss, [u, W]))


def jit(fn):
    return tf.function(fn, jit_compile=True)


@pytest.mark.parametrize("dtype, rtol", DTYPES, ids=lambda v: getattr(v, "name", ""))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_prediction_under_jit_matches_numpy(device, shape, dtype, rtol):
    u, W = inputs(shape, seed=1)
    u, W = tf.cast(u, dtype), tf.cast(W, dtype)
    u64, W64 = u.numpy().astype(np.float64), W.numpy().astype(np.float64)  # what the op sees
    g = np.random.default_rng(2).normal(size=(shape[0], shape[1], shape[2], shape[3]))
    u_hat, grad_u, grad_W = jit(prediction_and_grads)(u, W, tf.constant(g))
    assert u_hat.dtype == grad_u.dtype == grad_W.dtype == dtype
    assert_close(u_hat, np_capsule_prediction(u64, W64), rtol, "u_hat")
    # dL/du_hat = g, in the op's dtype (the cast's gradient rounds it).
    g_t = tf.cast(tf.constant(g), dtype).numpy().astype(np.float64)
    assert_close(grad_u, np.einsum("ijdk,bijd->bik", W64, g_t), rtol, "grad_u")
    assert_close(grad_W, np.einsum("bijd,bik->ijdk", g_t, u64), rtol, "grad_W")


@pytest.mark.parametrize("dtype, rtol", DTYPES, ids=lambda v: getattr(v, "name", ""))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("iterations", [1, 3])
@pytest.mark.parametrize("leaky", LEAKY)
@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_routing_under_jit_matches_numpy(device, leaky, shape, dtype, rtol, iterations):
    u, W = inputs(shape, seed=3)
    u, W = tf.cast(u, dtype), tf.cast(W, dtype)
    u64, W64 = u.numpy().astype(np.float64), W.numpy().astype(np.float64)
    g = np.random.default_rng(4).normal(size=(shape[0], shape[2], shape[3]))
    s_j, c_ij, grad_u, grad_W = jit(lambda u, W, g: routing_and_grads(u, W, g, iterations, leaky))(
        u, W, tf.constant(g))
    want_s, want_c, _ = np_routing(u64, W64, iterations, leaky)
    # 16-bit: the routing's logits come from rounded u_hat-sized sums; looser by 3x.
    tol = rtol if dtype in (tf.float64, tf.float32) else 3 * rtol
    assert_close(s_j, want_s, tol, "s_j")
    assert_close(c_ij, want_c, tol, "c_ij")
    # Stop-gradient routing: dL/du_hat = c_ij · g with the coupling the op returned.
    g_t = tf.cast(tf.constant(g), dtype).numpy().astype(np.float64)
    g_hat = c_ij.numpy().astype(np.float64)[..., None] * g_t[:, None]  # (B, I, J, D)
    assert_close(grad_u, np.einsum("ijdk,bijd->bik", W64, g_hat), tol, "grad_u")
    assert_close(grad_W, np.einsum("bijd,bik->ijdk", g_hat, u64), tol, "grad_W")


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
@pytest.mark.parametrize("leaky", LEAKY)
@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_jit_runs_the_same_kernels_as_tensorflow(device, leaky, dtype):
    """Inside XLA the op runs the OpKernel's code and units: the same bits as eager, and the
    same bits on every call (deterministic); the custom call gets the op's `leaky` attr."""
    u, W = inputs((5, 11, 10, 16, 8), seed=5)
    u, W = tf.cast(u, dtype), tf.cast(W, dtype)
    g = tf.constant(np.random.default_rng(6).normal(size=(5, 10, 16)))
    fn = lambda u, W, g: routing_and_grads(u, W, g, 3, leaky)  # noqa: E731
    eager, compiled, again = fn(u, W, g), jit(fn)(u, W, g), jit(fn)(u, W, g)
    for name, a, b, c in zip(("s_j", "c_ij", "grad_u", "grad_W"), eager, compiled, again):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)
        np.testing.assert_array_equal(b.numpy(), c.numpy(), err_msg=name)
    u_hat = ops.capsule_prediction(u, W)
    np.testing.assert_array_equal(jit(ops.capsule_prediction)(u, W).numpy(), u_hat.numpy())


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_empty_batch_under_jit(device):
    u, W = inputs((0, 3, 2, 4, 5))
    s_j, c_ij = jit(lambda u, W: ops.capsule_routing(u, W, 3))(u, W)
    assert s_j.shape == (0, 2, 4) and c_ij.shape == (0, 3, 2)
    assert jit(ops.capsule_prediction)(u, W).shape == (0, 3, 2, 4)


def test_compiled_step_calls_our_kernels():
    """The jit-compiled function holds custom calls to our four targets, not a fallback."""
    u, W = inputs((2, 3, 2, 4, 5))
    g1, g2 = tf.ones((2, 3, 2, 4), tf.float64), tf.ones((2, 2, 4), tf.float64)

    def both(u, W, g1, g2):
        return prediction_and_grads(u, W, g1), routing_and_grads(u, W, g2, 2)

    hlo = jit(both).experimental_get_compiler_ir(tf.constant(u), tf.constant(W), g1, g2)(stage="hlo")
    for target in ("capsnet_capsule_prediction", "capsnet_capsule_prediction_grad", "capsnet_capsule_routing",
                   "capsnet_capsule_routing_grad"):
        assert f'custom_call_target="{target}"' in hlo, target
    assert "iterations = 2" in hlo and "leaky = false" in hlo

    # the op's leaky attr reaches the custom call's attributes
    leaky = jit(lambda u, W: ops.capsule_routing(u, W, 3, leaky=True)).experimental_get_compiler_ir(
        tf.constant(u), tf.constant(W))(stage="hlo")
    assert 'custom_call_target="capsnet_capsule_routing"' in leaky
    assert "iterations = 3" in leaky and "leaky = true" in leaky


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_custom_calls_pin_row_major_layouts(device):
    """Each custom call fixes its operands' and results' layouts to the row-major order the
    kernels index by, and they are still row-major after XLA's layout assignment (the
    optimized HLO). Unpinned, layout assignment may lay them out for their neighbours; on a
    GPU the unfused path below then trained into a collapsed model (docs/results.md)."""
    u, W = inputs((2, 3, 2, 4, 5))
    g1, g2 = tf.ones((2, 3, 2, 4), tf.float64), tf.ones((2, 2, 4), tf.float64)

    def both(u, W, g1, g2):
        return prediction_and_grads(u, W, g1), routing_and_grads(u, W, g2, 2)

    ir = jit(both).experimental_get_compiler_ir(tf.constant(u), tf.constant(W), g1, g2)
    shape = r"\w+\[([\d,]*)\]\{([\d,]*)\}"  # f64[2,3,5]{2,1,0}: dimensions, then minor-to-major
    for stage in ("hlo", "optimized_hlo"):
        calls = [line for line in ir(stage=stage).splitlines() if "custom_call_target=" in line]
        assert len(calls) == 4, (stage, calls)
        for line in calls:
            parts = re.match(r"\s*\S+ = \((.*?)\) custom-call\((.*?)\)", line)
            assert parts, (stage, line)
            result, operands = parts.groups()
            constraints = re.search(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}", line)
            assert constraints, (stage, line)
            # (the optimized HLO names operands without their shapes: the constraints bind them)
            shapes = {"result": re.findall(shape, result), "operands": re.findall(shape, operands),
                      "constraints": re.findall(shape, constraints.group(1))}
            assert len(shapes["result"]) == result.count("["), (stage, line)  # every element read
            assert len(shapes["constraints"]) == operands.count("%"), (stage, line)  # one per operand
            for dims, layout in (s for found in shapes.values() for s in found):
                rank = len(dims.split(",")) if dims else 0
                assert layout == ",".join(str(i) for i in reversed(range(rank))), (stage, line)


@pytest.mark.slow
@pytest.mark.parametrize("stop_gradient", [True, False])
@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_unfused_path_under_jit_matches_the_matmul_prediction(device, stop_gradient):
    """The op's prediction feeding TF routing (model.routing=tf, or a capsule bias) inside
    one XLA computation, at the paper's DigitCaps shape: the same v_j and gradients as the
    matmul prediction in its place. u_hat's consumers (the agreement's batched dot) are
    where XLA would pick another layout for an unpinned custom call's result."""
    from capsnet.routing import dynamic_routing

    u, W = inputs((8, 1152, 10, 16, 8), seed=7)
    g = tf.constant(np.random.default_rng(8).normal(size=(8, 10, 16)), tf.float32)
    bias = tf.constant(np.full((10, 16), 0.1), tf.float32)

    def step(u, W, prediction):
        with tf.GradientTape() as tape:
            tape.watch([u, W])
            v_j, c_ij = dynamic_routing(prediction(u, W), iterations=3, stop_gradient=stop_gradient, bias=bias)
            loss = tf.reduce_sum(v_j * g)
        return (v_j, c_ij, *tape.gradient(loss, [u, W]))

    u, W = tf.constant(u, tf.float32), tf.constant(W, tf.float32)
    got = jit(lambda u, W: step(u, W, ops.capsule_prediction))(u, W)
    want = jit(lambda u, W: step(u, W, ops.capsule_prediction_matmul))(u, W)
    for name, a, b in zip(("v_j", "c_ij", "grad_u", "grad_W"), got, want):
        assert_close(a, b, 1e-4, name)


@pytest.mark.slow
def test_library_loaded_after_tensorflow_ran_ops_still_compiles():
    """TensorFlow makes its XLA devices' kernels at its first op; our library loads later
    (at the first capsule op) and registers its XLA kernels itself then."""
    code = (
        "import numpy as np, tensorflow as tf\n"
        "print(float(tf.reduce_sum(tf.ones(3))))\n"  # TensorFlow's XLA kernels are made here
        "from capsnet import ops\n"
        "u = tf.ones((2, 3, 4)); W = tf.ones((3, 2, 5, 4))\n"
        "got = tf.function(ops.capsule_prediction, jit_compile=True)(u, W)\n"
        "print('ok', float(tf.reduce_max(tf.abs(got - ops.capsule_prediction(u, W)))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=entry_point_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok 0.0" in proc.stdout
