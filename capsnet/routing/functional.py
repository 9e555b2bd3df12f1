"""Routing by agreement (Sabour et al. 2017, Procedure 1) and the squash non-linearity.

Pure TensorFlow math, no layers, weights or config: the routers of capsnet.routing
(capsnet.routing.dynamic.DynamicRouting) call it, tests/test_routing.py compares it with
an independent NumPy version. `squash` lives here (and is re-exported by capsnet.layers)
because routing applies it every iteration.
"""
import tensorflow as tf

from capsnet.precision import float32_math
from capsnet.validation import boolean, positive_float, positive_int
from capsnet.xla_context import in_xla_computation

__all__ = ["squash", "routing_softmax", "dynamic_routing"]


def squash(s, axis=-1, epsilon=1e-7):
    """Eq. 1: v = |s|² / (1 + |s|²) · s / |s|, along `axis`.

    Short vectors shrink to almost zero length, long ones to just below 1; the
    direction is kept. |s| is computed as sqrt(|s|² + epsilon): at s = 0 the exact
    |s| has an infinite derivative (NaN gradient) and s / |s| is 0 / 0, while this
    gives v = 0 with a finite gradient. The relative change of |v| is below
    epsilon / (2|s|²), i.e. under 1e-5 for |s| ≥ 0.1. The fused routing op
    (capsnet.ops.capsule_routing) squashes its inner iterations with this default
    compiled in (kSquashEpsilon in ops/capsnet_kernels.h); tests/test_routing_op.py
    checks that the two agree.
    """
    positive_float("squash: epsilon", epsilon)
    s = tf.convert_to_tensor(s)
    # 16-bit s (mixed precision): the math in float32, v in s's dtype (capsnet.precision).
    s_math = float32_math(s)
    squared_norm = tf.reduce_sum(tf.square(s_math), axis=axis, keepdims=True)
    scale = squared_norm / (1.0 + squared_norm) / tf.sqrt(squared_norm + epsilon)
    return tf.cast(scale * s_math, s.dtype)


def routing_softmax(b_ij, leaky=False):
    """c_ij = softmax_j(b_ij) (Eq. 3) over the last axis, in a form chosen for where it
    runs: tf.nn.softmax, one kernel, in TensorFlow; exp(b_ij − logsumexp_j(b_ij)) inside an
    XLA computation. XLA's GPU compiler makes a softmax a Triton kernel of its own (0.27 ms a
    step for the MultiMNIST preset's 320,000 rows of 10 on an H100, far more than its bytes
    take to move), and the routing's fusions split around it. The second form XLA fuses with
    the routing's other math: that step went from 4.30 to 3.16 ms of GPU time, its epoch
    from 3.27 to 2.54 s (profiled with scripts/profile_train.py). On
    the paper MNIST model's stop-gradient routing it gained nothing (bfloat16 1-8% slower at
    batch 512; not profiled); what that model trains with by default, the fused op, has no
    softmax of XLA's. The two agree to within rounding, gradients
    included (tests/test_routing.py); the second rounds b_ij − logsumexp at b_ij's
    magnitude, a relative error of up to ~|b_ij|·2⁻²⁴ in float32 (softmax's b_ij − max is
    exact), far below the bfloat16 rounding of the u_hat that b_ij sums.

    leaky=True: the softmax over [0, b_i1, ..., b_iJ] with the first ("none of the above",
    a parent whose logit stays 0) left out, c_ij = exp(b_ij) / (1 + Σ_k exp(b_ik)): the
    authors' CIFAR-10 routing (Sabour et al. 2017 Sec. 7; research/capsules
    `_leaky_routing` in github.com/Sarasra/models). A child that agrees with no parent
    then sends less than all of its vote; the rows sum to below 1."""
    if leaky:
        zero = tf.zeros_like(b_ij[..., :1])
        return routing_softmax(tf.concat([zero, b_ij], axis=-1))[..., 1:]
    if in_xla_computation():
        return tf.exp(b_ij - tf.reduce_logsumexp(b_ij, axis=-1, keepdims=True))
    return tf.nn.softmax(b_ij, axis=-1)


def dynamic_routing(u_hat, iterations=3, stop_gradient=True, bias=None, leaky=False):
    """Route predictions u_hat to output capsules; returns (v_j, c_ij).

    Procedure 1 of the paper, per sample: b_ij = 0; then `iterations` times:
    c_ij = softmax_j(b_ij); s_j = Σ_i c_ij u_hat_j|i (+ bias_j); v_j = squash(s_j); and,
    except after the last iteration, b_ij += u_hat_j|i · v_j (agreement). The bias
    (None: none, as in the paper) is the authors' code's (github.com/Sarasra/models,
    research/capsules, `_update_routing`): one learned vector per output capsule, added to
    s_j before the squash in every iteration, so it also moves the agreements. `iterations` is a
    static int, so the loop is unrolled: no tf.while_loop, XLA compiles it whole.

    stop_gradient (default True): the inner iterations see tf.stop_gradient(u_hat),
    so the coupling coefficients are constants for backprop and only the final
    s_j = Σ_i c_ij u_hat_j|i carries a gradient to u_hat (and W). Reference
    implementations differ: the seed's tf.while_loop backpropagates through every
    iteration; naturomics/CapsNet-Tensorflow and several later ports stop the
    gradient as here; the paper does not say. We default to stopping because
    (1) routing is an inference step, like an EM E-step, that decides which
    predictions agree: the training signal should make the predictions right given
    that assignment, not reward W for steering its own routing, a feedback loop
    through b_ij += agreement; (2) backprop skips the r − 1 inner iterations, each of
    which multiplies and reduces all of u_hat (batch·in_caps·out_caps·out_dim, 94 MB
    at the paper's batch 128) twice, so a step is cheaper in time and memory.
    With iterations = 1 there are no inner iterations and the flag changes nothing.
    Pass stop_gradient=False for the fully differentiable variant.
    `capsnet.ops.capsule_routing` computes the same from u and W in one compiled op
    (stop_gradient=True, no bias; leaky or not), without materialising u_hat.
    leaky=True: every c_ij is routing_softmax(b_ij, leaky=True), the first round's too
    (1 / (out_caps + 1), as the authors' code, whose b_ij also start at 0).

    Args:
        u_hat: predictions (batch, in_caps, out_caps, out_dim).
        iterations: routing rounds r ≥ 1 (paper: 3).
        stop_gradient: see above.
        bias: None, or (out_caps, out_dim) added to every s_j (carries a gradient from the
            final s_j; the inner iterations see it like u_hat, through stop_gradient).

    Returns (float32 for a 16-bit u_hat):
        v_j: output capsules (batch, out_caps, out_dim).
        c_ij: the coupling coefficients used for the final v_j (batch, in_caps,
            out_caps); each row sums to 1 over j (below 1 with leaky=True).
    """
    iterations = positive_int("dynamic_routing: iterations", iterations, expected="an integer >= 1")
    boolean("dynamic_routing: stop_gradient", stop_gradient, expected="a bool")
    boolean("dynamic_routing: leaky", leaky, expected="a bool")
    u_hat = tf.convert_to_tensor(u_hat)
    if u_hat.shape.rank != 4:
        raise ValueError(
            "dynamic_routing: u_hat must be (batch, in_caps, out_caps, out_dim), "
            f"got shape {tuple(u_hat.shape)}")

    # 16-bit u_hat (mixed precision): b_ij, its softmax and the sums s_j in float32; v_j and
    # c_ij come out float32 (capsnet.precision). Under XLA the cast fuses into the reductions.
    u_hat = float32_math(u_hat)
    u_hat_routing = tf.stop_gradient(u_hat) if stop_gradient else u_hat
    if bias is not None:
        bias = tf.cast(bias, u_hat.dtype)  # the routing's math dtype (float32 for 16-bit u_hat)
        if bias.shape != u_hat.shape[2:]:
            raise ValueError(f"dynamic_routing: bias must be (out_caps, out_dim) = {tuple(u_hat.shape[2:])}, got "
                             f"shape {tuple(bias.shape)}")
    bias_routing = tf.stop_gradient(bias) if stop_gradient and bias is not None else bias
    # b_ij starts at zero for every sample (routing is per example, never learned), so the
    # first round's c_ij = softmax_j(0) = 1/out_caps: written as that constant, not as the
    # softmax of a zero tensor, which XLA constant-folds element by element at compile time
    # (a step's compile grew with the batch: 1.7 s at 128, 13.6 s at 1,024 on a CPU).
    parents = tf.shape(u_hat)[2] + 1 if leaky else tf.shape(u_hat)[2]  # leaky: and "none of the above"
    parents = tf.cast(parents, u_hat.dtype)
    uniform = tf.constant(1.0, u_hat.dtype) / parents  # as softmax rounds it
    c_ij = tf.fill(tf.shape(u_hat)[:3], uniform)                     # (B, in_caps, out_caps)
    for r in range(iterations):
        last = r == iterations - 1
        votes = u_hat if last else u_hat_routing
        s_j = tf.reduce_sum(c_ij[..., None] * votes, axis=1)          # (B, out_caps, out_dim)
        if bias is not None:
            s_j = s_j + (bias if last else bias_routing)
        v_j = squash(s_j)                                             # (B, out_caps, out_dim)
        if not last:
            # Agreement u_hat_j|i · v_j: predictions that match the output gain weight.
            agreement = tf.reduce_sum(votes * v_j[:, None], axis=-1)  # (B, in_caps, out_caps)
            b_ij = agreement if r == 0 else b_ij + agreement
            c_ij = routing_softmax(b_ij, leaky)                       # the next round's
    return v_j, c_ij
