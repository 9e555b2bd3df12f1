"""Self-attention routing (Mazzia, Salvetti & Chiaberge 2021, "Efficient-CapsNet: capsule
network with self-attention routing"; their code: github.com/EscVM/Efficient-CapsNet,
utils/layers.py `FCCaps`) as a Router.

One non-iterative pass over the predictions u_hat_j|i (batch, in_caps, out_caps, dim):

    a_ij = u_hat_j|i · Σ_k u_hat_j|k / sqrt(dim)     the row sums of the self-attention
                                                     matrix A_j = U_j U_jᵀ / sqrt(dim)
    c_ij = softmax_j(a_ij) + b_ij                    b: learned log priors (in_caps, out_caps),
                                                     zero at the start, added after the softmax
    s_j  = Σ_i c_ij u_hat_j|i (+ the layer's bias)
    v_j  = (1 − 1/exp(|s_j|)) · s_j / |s_j|          their squash

The softmax runs over the parents j (their axis 1 of (batch, j, i, 1)). |s| is
sqrt(|s|² + epsilon), as in capsnet.routing.squash, so v = 0 at s = 0 with a finite
gradient (their code adds 1e-20 to |s| instead). Every step carries a gradient (no
stop_gradient: the paper trains through the attention). Config:
configs/model/routing/self_attention.yaml (`model.routing.algorithm=self_attention`).
"""
import keras
import tensorflow as tf

from capsnet.precision import float32_math
from capsnet.routing.base import Router, register
from capsnet.validation import positive_float

__all__ = ["SelfAttentionRouting", "self_attention_routing", "efficient_squash"]


def efficient_squash(s, axis=-1, epsilon=1e-7):
    """Efficient-CapsNet's squash: v = (1 − exp(−|s|)) · s / |s|, |s| = sqrt(|s|² + epsilon)."""
    s = tf.convert_to_tensor(s)
    s_math = float32_math(s)
    norm = tf.sqrt(tf.reduce_sum(tf.square(s_math), axis=axis, keepdims=True) + epsilon)
    return tf.cast((1.0 - tf.exp(-norm)) * s_math / norm, s.dtype)


def self_attention_routing(u_hat, log_priors, bias=None, epsilon=1e-7):
    """(v_j, c_ij) of the module docstring's equations.

    u_hat: (batch, in_caps, out_caps, dim); log_priors: (in_caps, out_caps) or None
    (zeros); bias: None or (out_caps, dim) added to s_j. v_j (batch, out_caps, dim), c_ij
    (batch, in_caps, out_caps), float32 for a 16-bit u_hat.
    """
    u_hat = float32_math(tf.convert_to_tensor(u_hat))
    if u_hat.shape.rank != 4:
        raise ValueError("self_attention_routing: u_hat must be (batch, in_caps, out_caps, out_dim), "
                         f"got shape {tuple(u_hat.shape)}")
    dim = tf.cast(tf.shape(u_hat)[-1], u_hat.dtype)
    total = tf.reduce_sum(u_hat, axis=1, keepdims=True)                      # (B, 1, out_caps, dim)
    agreement = tf.reduce_sum(u_hat * total, axis=-1) / tf.sqrt(dim)          # (B, in_caps, out_caps)
    c_ij = tf.nn.softmax(agreement, axis=-1)
    if log_priors is not None:
        c_ij = c_ij + tf.cast(log_priors, u_hat.dtype)
    s_j = tf.reduce_sum(c_ij[..., None] * u_hat, axis=1)                     # (B, out_caps, dim)
    if bias is not None:
        s_j = s_j + tf.cast(bias, u_hat.dtype)
    return efficient_squash(s_j, epsilon=epsilon), c_ij


@register("self_attention")
class SelfAttentionRouting(Router):
    """Self-attention routing (module docstring). `epsilon`: inside |s_j|; `backend`:
    matmul, matmul_xla, op or op_xla (capsnet.routing.BACKENDS; no fused op)."""

    def __init__(self, epsilon=1e-7, backend="matmul"):
        self.epsilon = positive_float(f"{type(self).__name__}: epsilon", epsilon)
        super().__init__(backend)

    def weights(self, in_caps, out_caps, out_dim):
        # Their b: one log prior per (child, parent), starting at zero.
        return {"log_priors": ((in_caps, out_caps), keras.initializers.Zeros())}

    def route(self, u_hat, bias=None, log_priors=None):
        return self_attention_routing(u_hat, log_priors, bias, self.epsilon)

    def get_config(self):
        return {"epsilon": self.epsilon, **super().get_config()}
