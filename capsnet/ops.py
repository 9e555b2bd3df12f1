"""Capsule prediction u_hat[b, i, j, :] = W[i, j] · u[b, i], two implementations.

- `capsule_prediction(u, W)`: the compiled op (ops/), with a registered gradient.
- `capsule_prediction_matmul(u, W)`: the plain TensorFlow transpose/matmul/reshape path.

Both take u (batch, in_caps, in_dim) and W (in_caps, out_caps, out_dim, in_dim) and
return u_hat (batch, in_caps, out_caps, out_dim), so a checkpoint trained with one
runs with the other. `get_capsule_prediction(custom_op)` picks one.
"""
import tensorflow as tf

from capsnet.errors import OpLibraryError


def capsule_prediction(u, W):
    # Placeholder until the op library lands (the [op] issue).
    raise OpLibraryError("the capsnet op library is not built: run `make ops`")


def capsule_prediction_matmul(u, W):
    """The plain TF path: one batched matmul over in_caps."""
    in_caps, out_caps, out_dim, in_dim = tf.unstack(tf.shape(W))
    u_t = tf.transpose(u, (1, 2, 0))                              # (in_caps, in_dim, B)
    W_flat = tf.reshape(W, (in_caps, out_caps * out_dim, in_dim))  # (in_caps, out_caps*out_dim, in_dim)
    u_hat = tf.matmul(W_flat, u_t)                                 # (in_caps, out_caps*out_dim, B)
    u_hat = tf.transpose(u_hat, (2, 0, 1))                         # (B, in_caps, out_caps*out_dim)
    return tf.reshape(u_hat, (-1, in_caps, out_caps, out_dim))     # (B, in_caps, out_caps, out_dim)


def get_capsule_prediction(custom_op):
    """The capsule-prediction function for `custom_op` (True: compiled op, False: matmul path)."""
    return capsule_prediction if custom_op else capsule_prediction_matmul
