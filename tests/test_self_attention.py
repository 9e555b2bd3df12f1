"""Self-attention routing (Efficient-CapsNet, Mazzia et al. 2021) and leaky dynamic routing
(Sabour et al. 2017's CIFAR-10 "none of the above") against independent NumPy references:
forward values, finite-difference gradients, and the routers built from the config."""
import numpy as np
import pytest
import tensorflow as tf

from capsnet.layers import DigitCaps
from capsnet.routing import DynamicRouting, SelfAttentionRouting, dynamic_routing, make_router
from capsnet.routing.self_attention import self_attention_routing
from test_routing import np_squash

pytestmark = pytest.mark.usefixtures("seeded")


def np_self_attention(u_hat, log_priors, bias=None, epsilon=1e-7):
    """EscVM/Efficient-CapsNet utils/layers.py FCCaps.call in NumPy (float64), u_hat laid out
    (B, i, j, d): A_j = U_j U_jᵀ / sqrt(d), c = softmax over j of A_j's row sums, + b."""
    B, I, J, D = u_hat.shape
    u = np.transpose(u_hat, (0, 2, 1, 3))                          # (B, j, i, d), theirs
    a = np.einsum("bjid,bjkd->bjik", u, u).sum(-1) / np.sqrt(D)    # (B, j, i)
    e = np.exp(a - a.max(axis=1, keepdims=True))
    c = e / e.sum(axis=1, keepdims=True) + log_priors.T[None]      # softmax over j, + b (j, i)
    s = np.einsum("bji,bjid->bjd", c, u)
    if bias is not None:
        s = s + bias
    n = np.sqrt((s * s).sum(-1, keepdims=True) + epsilon)
    return (1 - 1 / np.exp(n)) * s / n, np.transpose(c, (0, 2, 1))


def np_leaky_routing(u_hat, iterations):
    """Procedure 1 with the authors' _leaky_routing: softmax over [0, b_i1..b_iJ], leak dropped."""
    B, I, J, D = u_hat.shape
    b = np.zeros((B, I, J))
    for r in range(iterations):
        logits = np.concatenate([np.zeros((B, I, 1)), b], axis=-1)
        e = np.exp(logits - logits.max(-1, keepdims=True))
        c = (e / e.sum(-1, keepdims=True))[..., 1:]
        v = np_squash(np.einsum("bij,bijd->bjd", c, u_hat), epsilon=1e-7)
        if r < iterations - 1:
            b = b + np.einsum("bijd,bjd->bij", u_hat, v)
    return v, c


def random(shape, seed, scale=0.5):
    return np.random.default_rng(seed).normal(scale=scale, size=shape)


@pytest.mark.parametrize("with_bias", [False, True])
def test_self_attention_matches_numpy(with_bias):
    u_hat, priors = random((3, 7, 4, 5), 0), random((7, 4), 1, 0.1)
    bias = random((4, 5), 2, 0.1) if with_bias else None
    v, c = self_attention_routing(tf.constant(u_hat), tf.constant(priors), None if bias is None else tf.constant(bias))
    v_ref, c_ref = np_self_attention(u_hat, priors, bias)
    np.testing.assert_allclose(v.numpy(), v_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(c.numpy(), c_ref, rtol=1e-10, atol=1e-12)


def test_self_attention_gradient_matches_finite_differences():
    u_hat, priors = random((2, 3, 2, 3), 3), random((3, 2), 4, 0.1)
    weights = random((2, 2, 3), 5)  # a loss Σ w·v, so every output counts

    def loss(u, p):
        return float((np_self_attention(u, p)[0] * weights).sum())

    u_t, p_t = tf.Variable(u_hat), tf.Variable(priors)
    with tf.GradientTape() as tape:
        v, _ = self_attention_routing(u_t, p_t)
        out = tf.reduce_sum(v * weights)
    g_u, g_p = tape.gradient(out, [u_t, p_t])
    for x, g, other in ((u_hat, g_u, priors), (priors, g_p, u_hat)):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = x.copy(), x.copy()
            plus[idx] += 1e-6
            minus[idx] -= 1e-6
            args = (plus, other) if x is u_hat else (other, plus)
            args_m = (minus, other) if x is u_hat else (other, minus)
            numeric[idx] = (loss(*args) - loss(*args_m)) / 2e-6
        np.testing.assert_allclose(g.numpy(), numeric, rtol=1e-5, atol=1e-8)


def test_self_attention_router_in_digit_caps_has_its_log_priors_and_matches_numpy():
    u = tf.constant(random((2, 6, 4), 6).astype(np.float32))
    layer = DigitCaps(num_caps=3, dim=5, router=SelfAttentionRouting())
    v, c = layer(u)
    assert [w.name for w in layer.trainable_weights] == ["W", "log_priors"]
    assert layer.log_priors.shape == (6, 3)
    u_hat = np.einsum("bik,ijdk->bijd", u.numpy().astype(np.float64), layer.W.numpy().astype(np.float64))
    v_ref, c_ref = np_self_attention(u_hat, np.zeros((6, 3)))
    np.testing.assert_allclose(v.numpy(), v_ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(c.numpy(), c_ref, rtol=1e-4, atol=1e-6)
    clone = DigitCaps.from_config(layer.get_config())
    assert clone.router == layer.router and clone.get_config() == layer.get_config()


@pytest.mark.parametrize("iterations", [1, 3])
def test_leaky_routing_matches_numpy(iterations):
    u_hat = random((3, 7, 4, 5), 7)
    v, c = dynamic_routing(tf.constant(u_hat), iterations, leaky=True)
    v_ref, c_ref = np_leaky_routing(u_hat, iterations)
    np.testing.assert_allclose(v.numpy(), v_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(c.numpy(), c_ref, rtol=1e-10, atol=1e-12)
    assert np.all(c.numpy().sum(-1) < 1)  # "none of the above" keeps a share


@pytest.mark.parametrize("backend", ["matmul", "op", "matmul_xla", "fused_op"])
def test_leaky_router_matches_numpy_on_each_backend(backend):
    u = tf.constant(random((2, 6, 4), 8).astype(np.float32))
    layer = DigitCaps(num_caps=3, dim=5, router=DynamicRouting(leaky=True, backend=backend))
    v, c = layer(u)
    u_hat = np.einsum("bik,ijdk->bijd", u.numpy().astype(np.float64), layer.W.numpy().astype(np.float64))
    v_ref, c_ref = np_leaky_routing(u_hat, 3)
    np.testing.assert_allclose(v.numpy(), v_ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(c.numpy(), c_ref, rtol=1e-4, atol=1e-6)


def test_make_router_drops_switched_off_keys_of_another_algorithm_and_refuses_set_ones():
    assert make_router("self_attention", backend="matmul", leaky=False) == SelfAttentionRouting()
    with pytest.raises(ValueError, match="routing algorithm self_attention takes epsilon, backend, not leaky"):
        make_router("self_attention", backend="matmul", leaky=True)
    with pytest.raises(ValueError, match="routing algorithm must be one of dynamic, self_attention, got 'em'"):
        make_router("em")
