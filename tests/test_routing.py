"""squash and dynamic routing against an independent NumPy version of the paper's Procedure 1.

The NumPy reference (np_squash, np_dynamic_routing) is also used by test_layers.py.
"""
import numpy as np
import pytest
import tensorflow as tf

from capsnet.routing import dynamic_routing, routing_softmax, squash


# ----------------------------------------------------------------- NumPy reference

EPSILON = 1e-7  # squash's default, documented in capsnet.routing.squash

def np_squash(s, axis=-1, epsilon=0.0):
    """Eq. 1; epsilon=0 is the exact formula, capsnet's squash documents epsilon=1e-7
    inside the norm: v = |s|²/(1+|s|²) · s/sqrt(|s|² + epsilon)."""
    squared = np.sum(s * s, axis=axis, keepdims=True)
    return squared / (1 + squared) * s / np.sqrt(squared + epsilon)


def np_softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def np_dynamic_routing(u_hat, iterations, c_fixed=None, bias=None):
    """Procedure 1, one sample at a time: returns v (B, J, D) and the final c (B, I, J).

    With c_fixed (B, I, J), the coupling coefficients are those constants (the
    function stop_gradient=True differentiates: routing decided, then s_j = Σ c u_hat).
    bias (J, D): added to every s_j, as the authors' code's `_update_routing` does.
    """
    batch, in_caps, out_caps, _ = u_hat.shape
    v_all, c_all = [], []
    for b in range(batch):
        u = u_hat[b]                                    # (I, J, D)
        logits = np.zeros((in_caps, out_caps))
        for r in range(iterations):
            c = np_softmax(logits, axis=1)              # softmax over parent capsules j
            if c_fixed is not None:
                c = c_fixed[b]
            s = np.einsum("ij,ijd->jd", c, u) + (0.0 if bias is None else bias)
            v = np_squash(s, epsilon=EPSILON)
            if r < iterations - 1:
                logits = logits + np.einsum("ijd,jd->ij", u, v)
        v_all.append(v)
        c_all.append(c)
    return np.stack(v_all), np.stack(c_all)


def numeric_gradient(f, x, h=1e-6):
    """Central finite differences of the scalar f at x (float64)."""
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[idx] = h
        grad[idx] = (f(x + step) - f(x - step)) / (2 * h)
    return grad


# ----------------------------------------------------------------- squash

@pytest.mark.parametrize("dtype, rtol", [(np.float32, 1e-5), (np.float64, 1e-12)])
def test_squash_matches_numpy(dtype, rtol):
    rng = np.random.default_rng(0)
    # lengths from ~1e-3 to ~100: the short-vector shrink and the saturation near 1
    s = rng.normal(size=(4, 7, 8)) * np.logspace(-3, 2, 7)[None, :, None] / np.sqrt(8)
    s = s.astype(dtype)
    for axis in (-1, 1):
        np.testing.assert_allclose(
            squash(s, axis=axis).numpy(), np_squash(s, axis=axis, epsilon=EPSILON), rtol=rtol, atol=0)
    assert np.all(np.linalg.norm(squash(s).numpy(), axis=-1) < 1)


def test_squash_epsilon_changes_length_by_less_than_documented_bound():
    # documented: relative change of |v| below epsilon / (2|s|²) against the exact Eq. 1
    rng = np.random.default_rng(1)
    s = rng.normal(size=(200, 8)) * np.logspace(-2, 1, 200)[:, None] / np.sqrt(8)
    exact = np.linalg.norm(np_squash(s), axis=-1)
    ours = np.linalg.norm(squash(s).numpy(), axis=-1)
    bound = EPSILON / (2 * np.sum(s * s, axis=-1))
    assert np.all(np.abs(ours - exact) <= exact * bound * (1 + 1e-6))
    big = np.linalg.norm(s, axis=-1) >= 0.1
    np.testing.assert_allclose(ours[big], exact[big], rtol=1e-5)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_squash_zero_is_zero_with_finite_gradient(dtype):
    s = tf.concat([tf.zeros((1, 8), dtype), tf.fill((1, 8), tf.constant(0.5, dtype))], axis=0)
    with tf.GradientTape() as tape:
        tape.watch(s)
        v = squash(s)
        loss = tf.reduce_sum(v * tf.range(1, 9, dtype=dtype))
    grad = tape.gradient(loss, s).numpy()
    assert np.all(v.numpy()[0] == 0)
    assert np.all(np.isfinite(grad))
    # d squash / d s at 0 is 0 (squash is O(|s|^2)), so the zero row's gradient is 0
    np.testing.assert_allclose(grad[0], 0, atol=1e-3)
    assert np.abs(grad[1]).max() > 0.1


def test_squash_gradient_matches_finite_differences():
    rng = np.random.default_rng(1)
    s0 = rng.normal(size=(3, 5))
    weights = rng.normal(size=(3, 5))
    s = tf.constant(s0)
    with tf.GradientTape() as tape:
        tape.watch(s)
        loss = tf.reduce_sum(squash(s) * weights)
    expected = numeric_gradient(lambda x: np.sum(np_squash(x) * weights), s0)
    np.testing.assert_allclose(tape.gradient(loss, s).numpy(), expected, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("epsilon", [0, -1e-7, "1e-7"])
def test_squash_rejects_bad_epsilon(epsilon):
    with pytest.raises(ValueError, match="epsilon"):
        squash(tf.ones((2, 3)), epsilon=epsilon)


# ----------------------------------------------------------------- routing forward

def random_u_hat(shape=(3, 7, 4, 5), seed=0, scale=0.5):
    return np.random.default_rng(seed).normal(scale=scale, size=shape)


@pytest.mark.parametrize("iterations", [1, 2, 3])
@pytest.mark.parametrize("stop_gradient", [True, False])
def test_routing_matches_numpy(iterations, stop_gradient):
    u_hat = random_u_hat()
    v_j, c_ij = dynamic_routing(tf.constant(u_hat), iterations, stop_gradient)
    v_ref, c_ref = np_dynamic_routing(u_hat, iterations)
    assert v_j.shape == (3, 4, 5) and c_ij.shape == (3, 7, 4)
    np.testing.assert_allclose(v_j.numpy(), v_ref, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(c_ij.numpy(), c_ref, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(c_ij.numpy().sum(axis=-1), 1.0, rtol=1e-12)


@pytest.mark.parametrize("stop_gradient", [True, False])
def test_routing_with_a_capsule_bias_matches_numpy_and_its_gradients(stop_gradient):
    """The bias is added to s_j in every iteration, so it moves the agreements (c_ij differ
    from the unbiased routing's); its gradient: finite differences of the NumPy routing,
    through every iteration without stop-gradient, through the final s_j alone (c_ij
    frozen) with it."""
    u_hat = random_u_hat(shape=(2, 5, 4, 3), seed=7)
    bias = np.random.default_rng(8).normal(scale=0.3, size=(4, 3))
    weights = np.random.default_rng(9).normal(size=(2, 4, 3))
    b = tf.constant(bias)
    with tf.GradientTape() as tape:
        tape.watch(b)
        v_j, c_ij = dynamic_routing(tf.constant(u_hat), 3, stop_gradient, bias=b)
        loss = tf.reduce_sum(v_j * weights)
    v_ref, c_ref = np_dynamic_routing(u_hat, 3, bias=bias)
    np.testing.assert_allclose(v_j.numpy(), v_ref, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(c_ij.numpy(), c_ref, rtol=1e-9, atol=1e-12)
    assert np.abs(c_ref - np_dynamic_routing(u_hat, 3)[1]).max() > 1e-3
    c_frozen = c_ref if stop_gradient else None
    expected = numeric_gradient(lambda x: np.sum(np_dynamic_routing(u_hat, 3, c_fixed=c_frozen, bias=x)[0] * weights),
                                bias)
    np.testing.assert_allclose(tape.gradient(loss, b).numpy(), expected, rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match=r"bias must be \(out_caps, out_dim\) = \(4, 3\), got shape \(3, 4\)"):
        dynamic_routing(tf.constant(u_hat), 3, bias=tf.zeros((3, 4), tf.float64))


def test_routing_float32_matches_numpy():
    u_hat = random_u_hat(shape=(2, 11, 10, 16), seed=3)
    v_j, c_ij = dynamic_routing(tf.constant(u_hat, tf.float32), 3)
    v_ref, c_ref = np_dynamic_routing(u_hat, 3)
    np.testing.assert_allclose(v_j.numpy(), v_ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(c_ij.numpy(), c_ref, rtol=1e-4, atol=1e-6)


def test_routing_one_iteration_couples_uniformly():
    _, c_ij = dynamic_routing(tf.constant(random_u_hat()), 1)
    np.testing.assert_allclose(c_ij.numpy(), 0.25)


def test_routing_moves_coupling_towards_agreeing_parent():
    # Every child predicts parent 0 in one shared direction and parent 1 in small
    # random directions: each iteration should route more of every child to parent 0.
    rng = np.random.default_rng(4)
    u_hat = np.zeros((1, 20, 2, 4))
    u_hat[0, :, 0] = [0.5, 0.5, 0, 0]
    u_hat[0, :, 1] = rng.normal(scale=0.2, size=(20, 4))
    c_to_0 = [dynamic_routing(tf.constant(u_hat), r)[1].numpy()[0, :, 0] for r in (1, 2, 3)]
    np.testing.assert_allclose(c_to_0[0], 0.5)
    assert np.all(c_to_0[1] > 0.5) and np.all(c_to_0[2] > c_to_0[1])


def test_routing_is_per_sample():
    u_hat = random_u_hat()
    v_all, c_all = dynamic_routing(tf.constant(u_hat), 3)
    v_one, c_one = dynamic_routing(tf.constant(u_hat[1:2]), 3)
    np.testing.assert_allclose(v_all.numpy()[1:2], v_one.numpy(), rtol=1e-12)
    np.testing.assert_allclose(c_all.numpy()[1:2], c_one.numpy(), rtol=1e-12)


def test_routing_compiles_with_xla_and_unknown_batch():
    fn = tf.function(lambda x: dynamic_routing(x, 3), jit_compile=True,
                     input_signature=[tf.TensorSpec((None, 7, 4, 5), tf.float32)])
    u_hat = random_u_hat().astype(np.float32)
    v_j, c_ij = fn(tf.constant(u_hat))
    v_ref, c_ref = np_dynamic_routing(u_hat.astype(np.float64), 3)
    np.testing.assert_allclose(v_j.numpy(), v_ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(c_ij.numpy(), c_ref, rtol=1e-4, atol=1e-6)


def softmax_ops(fn, spec):
    return [op.type for op in fn.get_concrete_function(spec).graph.get_operations()].count("Softmax")


# exp(b − logsumexp(b)) rounds b − logsumexp(b) at b's magnitude: a relative error of up to
# ~|b|·2⁻²⁴ in float32 (≤ 1.2e-4 for the row near 1000 below), where softmax's b − max(b) is exact.
@pytest.mark.parametrize("dtype, rtol", [(np.float32, 2e-4), (np.float64, 1e-12)])
def test_routing_softmax_inside_xla_is_the_softmax_without_a_softmax_op(dtype, rtol):
    """Inside XLA c_ij is exp(b − logsumexp(b)) (no Softmax op for XLA's GPU compiler to
    make its own kernel of), outside tf.nn.softmax; both against NumPy's softmax, with a
    row of logits near 1000, where an unshifted exp overflows, and the gradient of Σ c·w
    against softmax's Jacobian."""
    rng = np.random.default_rng(11)
    b = rng.normal(scale=5.0, size=(3, 6, 10)).astype(dtype)
    b[0, 0] += 1000.0
    w = rng.normal(size=b.shape).astype(dtype)

    def value_and_gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            c = routing_softmax(x)
            loss = tf.reduce_sum(c * w)
        return c, tape.gradient(loss, x)

    spec = tf.TensorSpec(b.shape, dtype)
    compiled, plain = tf.function(value_and_gradient, jit_compile=True), tf.function(value_and_gradient)
    assert softmax_ops(compiled, spec) == 0 and softmax_ops(plain, spec) == 1
    expected = np_softmax(b.astype(np.float64), axis=-1)
    # d Σ c·w / d b_j = c_j (w_j − Σ_k c_k w_k): softmax's Jacobian applied to w.
    expected_gradient = expected * (w - np.sum(expected * w, axis=-1, keepdims=True))
    for fn in (compiled, plain):
        c, gradient = fn(tf.constant(b))
        assert c.dtype == dtype and np.all(np.isfinite(c.numpy()))
        np.testing.assert_allclose(c.numpy(), expected, rtol=rtol, atol=rtol * 1e-3)
        np.testing.assert_allclose(gradient.numpy(), expected_gradient, rtol=rtol * 10, atol=rtol * 1e-2)
        np.testing.assert_allclose(c.numpy().sum(axis=-1), 1.0, rtol=rtol)


def test_routing_compiled_by_xla_has_the_routing_gradients():
    """Through every iteration (no stop-gradient) with a capsule bias, the routing compiled
    by XLA (its softmax the logsumexp form) against the NumPy routing's finite differences."""
    u_hat = random_u_hat(shape=(2, 5, 4, 3), seed=12)
    weights = np.random.default_rng(13).normal(size=(2, 4, 3))
    bias = np.random.default_rng(14).normal(scale=0.3, size=(4, 3))

    @tf.function(jit_compile=True)
    def loss_and_gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            v_j, _ = dynamic_routing(x, 3, stop_gradient=False, bias=tf.constant(bias))
            loss = tf.reduce_sum(v_j * weights)
        return loss, tape.gradient(loss, x)

    loss, gradient = loss_and_gradient(tf.constant(u_hat))
    reference = lambda x: np.sum(np_dynamic_routing(x, 3, bias=bias)[0] * weights)  # noqa: E731
    np.testing.assert_allclose(loss.numpy(), reference(u_hat), rtol=1e-12)
    np.testing.assert_allclose(gradient.numpy(), numeric_gradient(reference, u_hat), rtol=1e-5, atol=1e-8)


def test_routing_first_round_is_no_softmax_of_a_constant():
    # A softmax over the zero b_ij is constant-folded, element by element, when XLA
    # compiles the step, so a step's compile time grew with the batch (1.7 s at 128,
    # 13.6 s at 1,024 on a CPU): the first round's c_ij must be the constant 1/out_caps and
    # only the later rounds a softmax (of the agreement).
    graph = tf.function(lambda x: dynamic_routing(x, 3)).get_concrete_function(
        tf.TensorSpec((None, 7, 4, 5), tf.float32)).graph
    assert [op.type for op in graph.get_operations()].count("Softmax") == 2  # rounds 2 and 3
    # ... with the softmax's value: exactly 1/out_caps, float32 and float64, which is what a
    # softmax of zeros gives to within rounding (TensorFlow's CPU softmax, vectorised, returns
    # 0.25 - 2^-26 in some lanes: not bit-exact across machines).
    for dtype in (np.float32, np.float64):
        _, c_ij = dynamic_routing(tf.constant(random_u_hat().astype(dtype)), 1)
        assert c_ij.dtype == dtype
        np.testing.assert_array_equal(c_ij.numpy(), np.full(c_ij.shape, 1 / c_ij.shape[-1], dtype))
        np.testing.assert_allclose(c_ij.numpy(), tf.nn.softmax(tf.zeros(c_ij.shape, dtype)).numpy(), rtol=1e-7)


# ----------------------------------------------------------------- routing gradients

def routing_gradients(u_hat, weights, iterations, stop_gradient):
    """d Σ(v_j · weights) / d u_hat and d Σ(c_ij) / d u_hat from TensorFlow."""
    x = tf.constant(u_hat)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        v_j, c_ij = dynamic_routing(x, iterations, stop_gradient)
        loss_v = tf.reduce_sum(v_j * weights)
        loss_c = tf.reduce_sum(c_ij * tf.range(1.0, 5.0, dtype=tf.float64))
    return tape.gradient(loss_v, x), tape.gradient(loss_c, x)


@pytest.mark.parametrize("iterations", [2, 3])
def test_routing_gradient_without_stop_is_full_derivative(iterations):
    u_hat = random_u_hat(shape=(2, 5, 4, 3), seed=5)
    weights = np.random.default_rng(6).normal(size=(2, 4, 3))
    grad_v, grad_c = routing_gradients(u_hat, weights, iterations, stop_gradient=False)
    expected_v = numeric_gradient(lambda x: np.sum(np_dynamic_routing(x, iterations)[0] * weights), u_hat)
    expected_c = numeric_gradient(
        lambda x: np.sum(np_dynamic_routing(x, iterations)[1] * np.arange(1.0, 5.0)), u_hat)
    np.testing.assert_allclose(grad_v.numpy(), expected_v, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(grad_c.numpy(), expected_c, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("iterations", [2, 3])
def test_routing_gradient_with_stop_treats_coupling_as_constant(iterations):
    u_hat = random_u_hat(shape=(2, 5, 4, 3), seed=5)
    weights = np.random.default_rng(6).normal(size=(2, 4, 3))
    grad_v, grad_c = routing_gradients(u_hat, weights, iterations, stop_gradient=True)
    # Expected: the derivative of s_j = Σ_i c_ij u_hat with c_ij frozen at its routed value.
    _, c_routed = np_dynamic_routing(u_hat, iterations)
    expected_v = numeric_gradient(
        lambda x: np.sum(np_dynamic_routing(x, iterations, c_fixed=c_routed)[0] * weights), u_hat)
    np.testing.assert_allclose(grad_v.numpy(), expected_v, rtol=1e-5, atol=1e-8)
    assert grad_c is None  # no gradient path from the coupling coefficients to u_hat
    # ...and that is a different gradient from the full derivative.
    full_v, _ = routing_gradients(u_hat, weights, iterations, stop_gradient=False)
    assert np.abs(grad_v.numpy() - full_v.numpy()).max() > 1e-3


def test_routing_gradient_single_iteration_is_the_same_either_way():
    u_hat = random_u_hat(shape=(2, 5, 4, 3), seed=7)
    weights = np.random.default_rng(8).normal(size=(2, 4, 3))
    stopped, _ = routing_gradients(u_hat, weights, 1, stop_gradient=True)
    full, _ = routing_gradients(u_hat, weights, 1, stop_gradient=False)
    np.testing.assert_allclose(stopped.numpy(), full.numpy(), rtol=1e-12)


# ----------------------------------------------------------------- bad input

@pytest.mark.parametrize("iterations", [0, -1, 1.5, True, "3"])
def test_routing_rejects_bad_iterations(iterations):
    with pytest.raises(ValueError, match="iterations must be an integer >= 1"):
        dynamic_routing(tf.zeros((1, 2, 3, 4)), iterations)


def test_routing_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"got shape \(2, 3, 4\)"):
        dynamic_routing(tf.zeros((2, 3, 4)), 3)


def test_routing_rejects_non_bool_stop_gradient():
    with pytest.raises(ValueError, match="stop_gradient"):
        dynamic_routing(tf.zeros((1, 2, 3, 4)), 3, stop_gradient="no")
