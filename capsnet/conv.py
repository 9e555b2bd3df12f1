"""A strided "valid" convolution computed as a stride-1 convolution on space-to-depth blocks.

    y = conv2d(x, w, stride s)  ==  conv2d(space_to_depth(x, s), blocks(w, s), stride 1)

Input rows s·i + p (p < s) become block row i, channel group p; the kernel, zero-padded
to a multiple of s taps, is regrouped the same way (its taps k = s·a + p go to block tap
a, group p). Every product of the strided convolution appears once, the padded taps add
zeros: for PrimaryCaps (9×9, stride 2 on 20×20×256) a 5×5 convolution over 10×10×1024,
(10/9)² = 1.23× the multiply-adds.

Why: a strided convolution's input gradient is a convolution over a dilated input, which
XLA lowers badly (its CPU backend: 86× TensorFlow's kernel), and under XLA on an H100 all
three parts of PrimaryCaps' convolution ran faster as stride-1 ones on blocks (2.0 against
3.1 ms at batch 512 in bfloat16); outside XLA TensorFlow's own strided kernels are the
faster ones (scripts/benchmark_conv.py `--form`; docs/benchmarks.md).
PrimaryCaps picks by that (its conv_form). The kernel variable keeps its (kh, kw, C, O)
shape, so checkpoints do not depend on the form; its gradient flows back through the
regrouping (a pad, reshape and transpose).
"""
import tensorflow as tf

__all__ = ["space_to_depth", "block_kernel", "block_output_kernel", "space_to_depth_conv2d", "conv2d_to_blocks"]


def _blocks(size, stride):
    return -(-size // stride)  # ceil(size / stride)


def _regroup(padded, sh, sw):
    """(bh·sh, bw·sw, C, O) taps → (bh, bw, sh·sw·C, O): tap k = s·a + p goes to block tap
    a, channel group p, in tf.nn.space_to_depth's channel order (p·sw + q)·C + c."""
    h, w, c, o = (int(d) for d in padded.shape)
    grouped = tf.reshape(padded, (h // sh, sh, w // sw, sw, c, o))
    return tf.reshape(tf.transpose(grouped, (0, 2, 1, 3, 4, 5)), (h // sh, w // sw, sh * sw * c, o))


def block_kernel(kernel, strides):
    """The (kh, kw, C, O) kernel of a stride-(sh, sw) convolution as the
    (⌈kh/sh⌉, ⌈kw/sw⌉, sh·sw·C, O) kernel of the stride-1 convolution on space-to-depth
    blocks, channel order (p·sw + q)·C + c for the tap offset (p, q), as
    tf.nn.space_to_depth orders an input's."""
    kh, kw = int(kernel.shape[0]), int(kernel.shape[1])
    sh, sw = strides
    bh, bw = _blocks(kh, sh), _blocks(kw, sw)
    return _regroup(tf.pad(kernel, [[0, bh * sh - kh], [0, bw * sw - kw], [0, 0], [0, 0]]), sh, sw)


def block_output_kernel(kernel, block):
    """The (kh, kw, C, O) kernel of a stride-1 convolution as the (m, n, b·b·C, b·b·O)
    kernel of the stride-1 convolution from the input's b×b blocks to the output's
    (m = ⌊(kh + b − 2)/b⌋ + 1): output (b·P + p, b·Q + q) is block (P, Q), channel group
    p·b + q, and reads input rows b·P + p .. b·P + p + kh − 1, i.e. the kernel shifted by
    (p, q) taps inside b·m × b·n, regrouped as block_kernel does."""
    kh, kw = int(kernel.shape[0]), int(kernel.shape[1])
    bh, bw = (kh + block - 2) // block + 1, (kw + block - 2) // block + 1
    shifted = [_regroup(tf.pad(kernel, [[p, bh * block - kh - p], [q, bw * block - kw - q], [0, 0], [0, 0]]),
                        block, block)
               for p in range(block) for q in range(block)]       # each (m, n, b·b·C, O)
    c, o = int(kernel.shape[2]), int(kernel.shape[3])
    return tf.reshape(tf.stack(shifted, axis=3), (bh, bw, block * block * c, block * block * o))


def space_to_depth(x, block):
    """tf.nn.space_to_depth(x, block) for NHWC `x` with static H, W, C divisible by `block`,
    as a reshape and a transpose: every backend has those for every dtype (TensorFlow's GPU
    SpaceToDepth kernel is not registered for every 16-bit type)."""
    _, h, w, c = x.shape
    blocks = tf.reshape(x, (-1, h // block, block, w // block, block, c))   # row = block·i + p
    return tf.reshape(tf.transpose(blocks, (0, 1, 3, 2, 4, 5)), (-1, h // block, w // block, block * block * c))


def space_to_depth_conv2d(x, kernel, strides, map_size=None):
    """conv2d(x, kernel, strides, "VALID") for NHWC `x` with static H, W, C and equal
    strides (tf.nn.space_to_depth's one block size), as a stride-1 convolution on blocks.
    map_size=(H, W): `x` is already the blocks of an (H, W) map (conv2d_to_blocks'
    output; rows past H or W meet only the kernel's zero taps, whatever they hold)."""
    sh, sw = strides
    if sh != sw:
        raise ValueError(f"space_to_depth_conv2d: strides must be equal, got {tuple(strides)}")
    kh, kw = int(kernel.shape[0]), int(kernel.shape[1])
    if map_size is None:
        _, h, w, _ = x.shape
        # Pad H and W to whole blocks: the added rows meet only the kernel's zero taps.
        x = space_to_depth(tf.pad(x, [[0, 0], [0, _blocks(h, sh) * sh - h], [0, _blocks(w, sw) * sw - w], [0, 0]]),
                           sh)
    else:
        h, w = map_size
    out_h, out_w = (h - kh) // sh + 1, (w - kw) // sw + 1
    y = tf.nn.conv2d(x, block_kernel(kernel, strides), 1, "VALID")
    # The blocks can reach one output row or column past the strided convolution's last.
    return y[:, :out_h, :out_w, :] if tuple(y.shape[1:3]) != (out_h, out_w) else y


def conv2d_to_blocks(x, kernel, block):
    """conv2d(x, kernel, 1, "VALID") for NHWC `x` with static H, W, C, delivered as its
    output's b×b space-to-depth blocks: (B, ⌈H'/b⌉, ⌈W'/b⌉, b·b·O) for the (H', W') map,
    computed as a stride-1 convolution from the input's blocks (block_output_kernel), so
    that a strided convolution on blocks (space_to_depth_conv2d with map_size) reads it
    without a transpose of the map in between. An odd H' or W' leaves a last half block
    of values past the map (of the zero-padded input; finite), which that convolution
    meets only with zero taps."""
    _, h, w, _ = x.shape
    kh, kw = int(kernel.shape[0]), int(kernel.shape[1])
    blocked = block_output_kernel(kernel, block)
    bh, bw = int(blocked.shape[0]), int(blocked.shape[1])
    # Input rows for ⌈H'/b⌉ output blocks: never fewer than H (b·(bh − 1) >= kh − 1).
    in_h, in_w = (_blocks(h - kh + 1, block) + bh - 1) * block, (_blocks(w - kw + 1, block) + bw - 1) * block
    x = tf.pad(x, [[0, 0], [0, in_h - h], [0, in_w - w], [0, 0]])
    return tf.nn.conv2d(space_to_depth(x, block), blocked, 1, "VALID")
