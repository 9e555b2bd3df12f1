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
faster ones (docs/benchmarks.md, eleventh session; scripts/benchmark_conv.py `--form`).
PrimaryCaps picks by that (its conv_form). The kernel variable keeps its (kh, kw, C, O)
shape, so checkpoints do not depend on the form; its gradient flows back through the
regrouping (a pad, reshape and transpose).
"""
import tensorflow as tf

__all__ = ["space_to_depth", "block_kernel", "space_to_depth_conv2d"]


def _blocks(size, stride):
    return -(-size // stride)  # ceil(size / stride)


def block_kernel(kernel, strides):
    """The (kh, kw, C, O) kernel of a stride-(sh, sw) convolution as the
    (⌈kh/sh⌉, ⌈kw/sw⌉, sh·sw·C, O) kernel of the stride-1 convolution on space-to-depth
    blocks, channel order (p·sw + q)·C + c for the tap offset (p, q), as
    tf.nn.space_to_depth orders an input's."""
    kh, kw, c, o = (int(d) for d in kernel.shape)
    sh, sw = strides
    bh, bw = _blocks(kh, sh), _blocks(kw, sw)
    padded = tf.pad(kernel, [[0, bh * sh - kh], [0, bw * sw - kw], [0, 0], [0, 0]])
    grouped = tf.reshape(padded, (bh, sh, bw, sw, c, o))        # tap k = s·a + p → (a, p)
    return tf.reshape(tf.transpose(grouped, (0, 2, 1, 3, 4, 5)), (bh, bw, sh * sw * c, o))


def space_to_depth(x, block):
    """tf.nn.space_to_depth(x, block) for NHWC `x` with static H, W, C divisible by `block`,
    as a reshape and a transpose: every backend has those for every dtype (TensorFlow's GPU
    SpaceToDepth kernel is not registered for every 16-bit type)."""
    _, h, w, c = x.shape
    blocks = tf.reshape(x, (-1, h // block, block, w // block, block, c))   # row = block·i + p
    return tf.reshape(tf.transpose(blocks, (0, 1, 3, 2, 4, 5)), (-1, h // block, w // block, block * block * c))


def space_to_depth_conv2d(x, kernel, strides):
    """conv2d(x, kernel, strides, "VALID") for NHWC `x` with static H, W, C and equal
    strides (tf.nn.space_to_depth's one block size), as a stride-1 convolution on blocks."""
    sh, sw = strides
    if sh != sw:
        raise ValueError(f"space_to_depth_conv2d: strides must be equal, got {tuple(strides)}")
    _, h, w, _ = x.shape
    kh, kw = int(kernel.shape[0]), int(kernel.shape[1])
    out_h, out_w = (h - kh) // sh + 1, (w - kw) // sw + 1
    # Pad H and W to whole blocks: the added rows meet only the kernel's zero taps.
    x = tf.pad(x, [[0, 0], [0, _blocks(h, sh) * sh - h], [0, _blocks(w, sw) * sw - w], [0, 0]])
    y = tf.nn.conv2d(space_to_depth(x, sh), block_kernel(kernel, strides), 1, "VALID")
    # The blocks can reach one output row or column past the strided convolution's last.
    return y[:, :out_h, :out_w, :] if tuple(y.shape[1:3]) != (out_h, out_w) else y
