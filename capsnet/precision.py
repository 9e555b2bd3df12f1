"""Mixed precision (train.precision): what runs in 16 bits and what stays float32.

The precisions (capsnet.config.PRECISIONS) are Keras' dtype-policy names: "float32",
"mixed_bfloat16" and "mixed_float16". Under a mixed policy the layers keep float32 variables and compute in
16 bits (Keras casts their inputs and reads their variables in the compute dtype): the
convolutions (94% of the paper model's FLOPs, on tensor cores), the capsule prediction
(the op reads u and W in 16 bits and accumulates in float32), the decoder's matmuls.
What must stay float32 is computed there, each place casting with `float32_math`:
squash's |s|² (a float16 square overflows past |s| = 256, and bfloat16's 8-bit mantissa
would make 1 + |s|² equal 1 for short capsules), the routing logits b_ij and their
softmax, the routing sums s_j, the capsule lengths that are the class scores, and both
losses. mixed_float16 also needs dynamic loss scaling (`build_optimizer` wraps Adam in
Keras' LossScaleOptimizer); bfloat16 has float32's exponent range and does not.
Checkpoints hold float32 variables in every precision, so a run may resume in another.

train.tf32 (`set_tensor_float_32`) is the other half of float32: on Ampere and later GPUs
TensorFlow runs float32 matmuls and convolutions in TensorFloat-32 (10-bit mantissa inputs,
float32 sums) unless told not to. It decides XLA's dots and convolutions (their precision
config) and the compiled op's float32 kernels as well (ops/capsnet_kernels.h, RoutingAlgo).
"""
import tensorflow as tf

_SIXTEEN_BIT = (tf.float16, tf.bfloat16)


def float32_math(x):
    """`x` as float32 if it is a 16-bit float tensor, else unchanged (float64 stays float64)."""
    x = tf.convert_to_tensor(x)
    return tf.cast(x, tf.float32) if x.dtype in _SIXTEEN_BIT else x


def set_tensor_float_32(enabled):
    """TensorFloat-32 for float32 matmuls and convolutions (train.tf32) on or off for this
    PROCESS, set every run: a sweep's jobs share one process, so a `false` job must not
    leave it off for the next. Nothing to set on a CPU, where there is no TF32."""
    tf.config.experimental.enable_tensor_float_32_execution(bool(enabled))


def needs_loss_scaling(precision):
    """Whether `precision` needs dynamic loss scaling: float16's exponent reaches only
    6e-5 (normal numbers), where small gradients of this model underflow to zero."""
    return precision == "mixed_float16"


def bias_add(x, bias):
    """x + bias over the last axis, as Keras' Conv2D and Dense add theirs (tf.nn.bias_add),
    but for 16-bit x with the bias gradient summed by a matmul.

    Why: TensorFlow's BiasAddGrad for bfloat16 and float16 on the GPU sums with atomic adds
    on 16-bit values (BiasGradNHWC_SharedAtomics): measured on an H100 at batch 512 in
    mixed_bfloat16 it took 2.05 ms of an 8.6 ms step (scripts/profile_train.py,
    docs/benchmarks.md), more than the convolutions' 2.6 ms. A (1, N) x (N, C) matmul of
    ones reads the gradient once on the tensor cores and accumulates in float32.
    """
    x = tf.convert_to_tensor(x)
    bias = tf.cast(bias, x.dtype)
    if x.dtype in _SIXTEEN_BIT:
        return _bias_add_16(x, bias)
    return tf.nn.bias_add(x, bias)


@tf.custom_gradient
def _bias_add_16(x, bias):
    def grad(dy):
        channels = tf.shape(dy)[-1]
        flat = tf.reshape(dy, (-1, channels))                              # (N, C)
        ones = tf.ones((1, tf.shape(flat)[0]), dy.dtype)                   # (1, N)
        return dy, tf.reshape(tf.matmul(ones, flat), (channels,))          # Σ over N, float32 sums
    return tf.nn.bias_add(x, bias), grad
