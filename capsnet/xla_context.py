"""Whether the ops being built go into an XLA computation: some math is written one way
for XLA's compiler and another for TensorFlow's kernels (capsnet.layers, capsnet.routing)."""
import tensorflow as tf
from tensorflow.python.ops import control_flow_util


def in_xla_computation():
    """Whether the ops being built go into an XLA computation (a jit_compile function,
    or one nested in it). TensorFlow has no public query for it; its own while_v2 and
    cond_v2 ask this one."""
    if tf.executing_eagerly():
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
