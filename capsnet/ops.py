"""Capsule prediction u_hat[b, i, j, :] = W[i, j] · u[b, i], two implementations, and
the fused prediction + dynamic routing op.

- `capsule_prediction(u, W)`: the compiled op (ops/), with a registered gradient.
- `capsule_prediction_matmul(u, W)`: the plain TensorFlow transpose/matmul/reshape path.
- `capsule_routing(u, W, iterations, leaky=False)`: the compiled op that predicts and
  routes in one go, never writing u_hat to memory; its gradient is that of stop-gradient
  routing.

All take u (batch, in_caps, in_dim) and W (in_caps, out_caps, out_dim, in_dim); the
first two return u_hat (batch, in_caps, out_caps, out_dim), so a checkpoint trained
with one runs with the other (and with capsule_routing: same W). A Router's backend
(capsnet.routing.BACKENDS) picks among them.

The compiled op lives in capsnet/lib/_capsnet_ops.so (built by `make ops`, i.e.
scripts/build_ops.py, next to a JSON stamp naming the TensorFlow it was built
for). Importing this module does not load it: the first `capsule_prediction`
call does, through `load_op_library()`. A SavedModel that contains the op needs
the op registered before `tf.saved_model.load`, so call `load_op_library()` first.
"""
import json
import os
import threading
import warnings

import tensorflow as tf

from capsnet.errors import OpLibraryError
from capsnet.validation import boolean, positive_int

# Where the op library and its stamp live: the package's own build, unless
# CAPSNET_OP_LIBRARY names another (CI runs the op tests against the build variant
# `make test` did not build: CPU+CUDA on a runner without a GPU).
# Made absolute now: the library loads lazily, perhaps after a chdir.
_LIBRARY_PATH = os.path.abspath(os.environ.get("CAPSNET_OP_LIBRARY") or os.path.join(
    os.path.dirname(__file__), "lib", "_capsnet_ops.so"))
_REBUILD = "`make ops` (or `python scripts/build_ops.py`)"
_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

_lib = None  # the loaded op module, once loaded
_lock = threading.Lock()


def library_path():
    """Path of the compiled op library (it may not exist yet)."""
    return _LIBRARY_PATH


def build_stamp(path):
    """The build stamp next to the library ({} if missing or unreadable)."""
    stamp_path = os.path.splitext(path)[0] + ".json"
    try:
        with open(stamp_path) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


# The op wrappers the library must export (snake_case of the REGISTER_OP names).
_OP_NAMES = ("capsnet_capsule_prediction", "capsnet_capsule_prediction_grad",
             "capsnet_capsule_routing", "capsnet_capsule_routing_grad")


def _load(path):
    if not os.path.isfile(path):
        raise OpLibraryError(f"the capsnet op library is not built ({path} is missing): run {_REBUILD}")
    stamp = build_stamp(path)
    built_for = stamp.get("tensorflow")
    if built_for is not None and built_for != tf.__version__:
        raise OpLibraryError(
            f"the capsnet op library {path} was built for TensorFlow {built_for} but TensorFlow "
            f"{tf.__version__} is installed: rebuild it with {_REBUILD}"
        )
    try:
        lib = tf.load_op_library(path)
    except (tf.errors.OpError, OSError) as err:
        # An ABI mismatch shows up as an undefined symbol here.
        reason = str(getattr(err, "message", err)).strip().splitlines()
        reason = reason[0] if reason else type(err).__name__
        raise OpLibraryError(
            f"the capsnet op library {path} cannot be loaded ({reason}); it was built for "
            f"TensorFlow {built_for or 'an unknown version'} and this is TensorFlow "
            f"{tf.__version__}: rebuild it with {_REBUILD}"
        ) from err
    missing = [name for name in _OP_NAMES if not hasattr(lib, name)]
    if missing:
        # A library built from older sources (before the fused routing op) loads fine and
        # fails only at the first call of the op it lacks, as an AttributeError.
        raise OpLibraryError(f"the capsnet op library {path} lacks {', '.join(missing)}: it was built from "
                             f"older sources; rebuild it with {_REBUILD}")
    if stamp.get("cuda") is False and tf.config.list_physical_devices("GPU"):
        warnings.warn(
            f"the capsnet op library {path} was built without CUDA (no nvcc was found), so "
            "capsule_prediction cannot run on the visible GPUs: rebuild it with `make ops-cuda`",
            RuntimeWarning,
            stacklevel=3,
        )
    return lib


def load_op_library():
    """Loads the compiled op library once and returns its op module.

    Raises OpLibraryError (one line, with the rebuild command) when the library
    is missing, was built for another TensorFlow, or cannot be loaded.
    """
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _load(_LIBRARY_PATH)
    return _lib


def _check_inputs(name, u, W):
    """u and W as tensors of one supported dtype, else a TypeError naming both."""
    u = tf.convert_to_tensor(u)
    W = tf.convert_to_tensor(W)
    if u.dtype != W.dtype:
        raise TypeError(f"{name}: u and W must have the same dtype, got u {u.dtype.name} and W {W.dtype.name}")
    if u.dtype not in _DTYPES:
        raise TypeError(f"{name}: dtype {u.dtype.name} is not supported (one of {', '.join(d.name for d in _DTYPES)})")
    return u, W


def capsule_prediction(u, W):
    """u_hat[b, i, j, :] = W[i, j] · u[b, i] with the compiled op.

    Args:
      u: (batch, in_caps, in_dim) input capsules.
      W: (in_caps, out_caps, out_dim, in_dim) transformation matrices, same dtype
        as u (float16, bfloat16, float32 or float64).

    Returns:
      u_hat: (batch, in_caps, out_caps, out_dim).
    """
    u, W = _check_inputs("capsule_prediction", u, W)
    return load_op_library().capsnet_capsule_prediction(u=u, weights=W)


@tf.RegisterGradient("Capsnet>CapsulePrediction")
def _capsule_prediction_grad(op, grad):
    """(grad_u, grad_W) from one CapsulePredictionGrad op (reads grad once)."""
    u, W = op.inputs
    grad_u, grad_W = load_op_library().capsnet_capsule_prediction_grad(grad=grad, u=u, weights=W)
    return grad_u, grad_W


def _prediction_tangent(u, W, d_u, d_W):
    """P(d_u, W) + P(u, d_W) (P = capsule prediction, bilinear in u and W): what the
    second-order gradients of both gradient ops need. A missing (None) incoming gradient
    counts as zeros; returns (d_u, d_W, the sum) with those zeros filled in."""
    d_u = tf.zeros_like(u) if d_u is None else d_u
    d_W = tf.zeros_like(W) if d_W is None else d_W
    lib = load_op_library()
    return d_u, d_W, lib.capsnet_capsule_prediction(u=d_u, weights=W) + lib.capsnet_capsule_prediction(u=u, weights=d_W)


@tf.RegisterGradient("Capsnet>CapsulePredictionGrad")
def _capsule_prediction_grad_grad(op, d_grad_u, d_grad_W):
    """Second-order gradient: the Grad op is bilinear, so its gradients are the
    forward and Grad ops again. With grad_u = G(g, W) and grad_W = H(g, u):
      d g = P(d_grad_u, W) + P(u, d_grad_W)    (P = forward op)
      d u = G(g, d_grad_W)                     (grad_u of Grad(g, u, d_grad_W))
      d W = H(g, d_grad_u)                     (grad_W of Grad(g, d_grad_u, W))
    """
    g, u, W = op.inputs
    lib = load_op_library()
    d_grad_u, d_grad_W, d_g = _prediction_tangent(u, W, d_grad_u, d_grad_W)
    d_u = lib.capsnet_capsule_prediction_grad(grad=g, u=u, weights=d_grad_W)[0]
    d_W = lib.capsnet_capsule_prediction_grad(grad=g, u=d_grad_u, weights=W)[1]
    return d_g, d_u, d_W


def capsule_routing(u, W, iterations, leaky=False):
    """Capsule prediction and dynamic routing in one compiled op; returns (s_j, c_ij).

    Computes what `dynamic_routing(capsule_prediction(u, W), iterations, leaky=leaky)`
    does (capsnet.routing, Procedure 1 of the paper) without writing u_hat to memory: the
    GPU kernels recompute u_hat = W · u from u and W in every iteration instead of
    reading a (batch, in_caps, out_caps, out_dim) tensor several times. It stops
    before the last squash: v_j = squash(s_j) is left to the caller, so that
    gradient is TensorFlow's own.

    Gradient: that of stop-gradient routing (`dynamic_routing(..., stop_gradient=True)`),
    the only one this op has. The coupling coefficients are constants for backprop,
    so the loss reaches u and W only through the last s_j = Σ_i c_ij u_hat_j|i; the
    gradient with respect to the c_ij output is therefore dropped (zero), exactly as
    tf.stop_gradient makes it in the TensorFlow path. The gradient op forms
    c_ij · dL/ds_j on the fly rather than a u_hat-sized gradient. That holds for leaky
    routing too: s_j = Σ_i c_ij u_hat_j|i either way, only the c_ij differ.

    Args:
      u: (batch, in_caps, in_dim) input capsules.
      W: (in_caps, out_caps, out_dim, in_dim) transformation matrices, same dtype as
        u (float16, bfloat16, float32 or float64; 16-bit types route in float32).
      iterations: routing rounds r ≥ 1 (a Python int: it is compiled into the op).
      leaky: the authors' CIFAR-10 "none of the above" (capsnet.routing.routing_softmax):
        every c_ij, the first round's 1 / (out_caps + 1) included, is the softmax over
        [0, b_i1, ..., b_iJ] with the zero logit's share dropped (a Python bool, the op's
        `leaky` attr; False, its default, is the op as it was before the attr).

    Returns:
      s_j: (batch, out_caps, out_dim) the last iteration's weighted sum, not squashed.
      c_ij: (batch, in_caps, out_caps) the last iteration's coupling coefficients (rows
        sum to 1; below 1 with leaky=True).
    """
    iterations = positive_int("capsule_routing: iterations", iterations, expected="an integer >= 1")
    leaky = boolean("capsule_routing: leaky", leaky, expected="a bool")
    u, W = _check_inputs("capsule_routing", u, W)
    return tuple(load_op_library().capsnet_capsule_routing(u=u, weights=W, iterations=iterations, leaky=leaky))


@tf.RegisterGradient("Capsnet>CapsuleRouting")
def _capsule_routing_grad(op, grad_s, grad_c):
    """(grad_u, grad_W) through the last s_j only; grad_c is ignored: the c_ij are
    constants of stop-gradient routing (see capsule_routing)."""
    del grad_c
    u, W = op.inputs
    if grad_s is None:  # only c_ij reached the loss: no gradient path at all
        return tf.zeros_like(u), tf.zeros_like(W)
    return tuple(load_op_library().capsnet_capsule_routing_grad(u=u, weights=W, c_ij=op.outputs[1], grad_s=grad_s))


@tf.RegisterGradient("Capsnet>CapsuleRoutingGrad")
def _capsule_routing_grad_grad(op, d_grad_u, d_grad_W):
    """Second-order gradient. With c = c_ij held constant, the gradient op is
    grad_u = G(c·g, W), grad_W = H(c·g, u) with G, H the prediction gradient's two
    halves, bilinear in (g, W) and (g, u); so
      d g[b, j, d] = Σ_i c[b, i, j] (P(d_grad_u, W) + P(u, d_grad_W))[b, i, j, d]
      d u = grad_u of Grad(u, d_grad_W, c, g)
      d W = grad_W of Grad(d_grad_u, W, c, g)
    (P = capsule prediction) and nothing for c (a constant)."""
    u, W, c_ij, g = op.inputs
    lib = load_op_library()
    d_grad_u, d_grad_W, d_u_hat = _prediction_tangent(u, W, d_grad_u, d_grad_W)  # d_u_hat: (B, I, J, D)
    d_g = tf.einsum("bij,bijd->bjd", c_ij, d_u_hat)                    # (B, out_caps, out_dim)
    d_u = lib.capsnet_capsule_routing_grad(u=u, weights=d_grad_W, c_ij=c_ij, grad_s=g)[0]
    d_W = lib.capsnet_capsule_routing_grad(u=d_grad_u, weights=W, c_ij=c_ij, grad_s=g)[1]
    return d_u, d_W, None, d_g


_INT64_MAX = 2**63 - 1
_U_HAT = "u_hat (batch, in_caps, out_caps, out_dim)"


def _u_hat_fits(name, u, W):
    """Checks that u_hat's element count fits int64, as the compiled ops do (multiplied
    dimension by dimension, as TensorShape counts). TensorFlow's matmul does not: for
    such shapes (possible without memory when u or W is empty) it returns a wrong, empty
    u_hat. Static shapes are checked now (ValueError); otherwise the returned control
    dependencies check at run time (InvalidArgumentError; a no-op under XLA)."""
    if u.shape.rank != 3 or W.shape.rank != 4:
        return []  # tf.transpose / tf.reshape reject the ranks
    dims = [u.shape[0], u.shape[1] if u.shape[1] is not None else W.shape[0], W.shape[1], W.shape[2]]
    if all(d is not None for d in dims):
        count = 1
        for d in dims:
            count *= d
            if count > _INT64_MAX:
                raise ValueError(f"{name}: {_U_HAT} {dims} has more elements than int64 can count, "
                                 f"for u {u.shape.as_list()} and W {W.shape.as_list()}")
        return []
    u_shape, W_shape = tf.shape(u, out_type=tf.int64), tf.shape(W, out_type=tf.int64)
    count, fits = tf.constant(1, tf.int64), tf.constant(True)
    for d in (u_shape[0], u_shape[1], W_shape[1], W_shape[2]):
        ok = tf.equal(d, 0) | (count <= _INT64_MAX // tf.maximum(d, 1))
        fits = fits & ok
        count = tf.where(ok, count, tf.constant(0, tf.int64)) * d  # never overflows
    return [tf.debugging.Assert(fits, [f"{name}: {_U_HAT} has more elements than int64 can count, "
                                       "for u and W of shapes", u_shape, W_shape])]


def capsule_prediction_matmul(u, W):
    """The plain TF path: one batched matmul over in_caps.

    Raises ValueError (static shapes) or InvalidArgumentError (at run time) when
    u_hat's element count overflows int64, like the compiled op.
    """
    u, W = tf.convert_to_tensor(u), tf.convert_to_tensor(W)
    with tf.control_dependencies(_u_hat_fits("capsule_prediction_matmul", u, W)):
        return _prediction_matmul(u, W)


def _prediction_matmul(u, W):
    in_caps, out_caps, out_dim, in_dim = tf.unstack(tf.shape(W))
    u_t = tf.transpose(u, (1, 2, 0))                              # (in_caps, in_dim, B)
    W_flat = tf.reshape(W, (in_caps, out_caps * out_dim, in_dim))  # (in_caps, out_caps*out_dim, in_dim)
    u_hat = tf.matmul(W_flat, u_t)                                 # (in_caps, out_caps*out_dim, B)
    u_hat = tf.transpose(u_hat, (2, 0, 1))                         # (B, in_caps, out_caps*out_dim)
    return tf.reshape(u_hat, (-1, in_caps, out_caps, out_dim))     # (B, in_caps, out_caps, out_dim)

