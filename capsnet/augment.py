"""Augmentation math on single images or batches, stateless-RNG keyed: random shifts
(the paper's), flips, rotation and zoom, elastic distortion (Simard et al. 2003), random
erasing (Zhong et al. 2017). Pure TensorFlow functions without a pipeline:
capsnet.data.make_dataset and make_multimnist_dataset apply them. Shifts, flips and erased
boxes are drawn for a whole epoch at once (`flip_mask`, `shift_corners`, `erase_boxes`:
per-example draws keyed by each example's index, from TensorFlow's Philox computed in
vectorised ops) and applied to batches (`shift_batch`, `erase_batch`); the elastic noise
likewise, a batch at a time (`elastic_noise`, for `elastic_distort`).
"""
import math

import numpy as np
import tensorflow as tf


def shift_batch(images, corners, shift_pixels, fill="zero"):
    """Shifts a batch: (B, H, W, C) images, each cropped at its own corner of `corners`
    (B, 2) int32 (shift_corners' draws) in the image padded by shift_pixels, i.e. shifted by
    (shift_pixels - corner): the uncovered border zero (fill="zero") or the nearest border
    pixel repeated (fill="edge"). A few ops for the whole batch."""
    _, h, w, _ = images.shape
    s = shift_pixels
    rows = corners[:, :1] + tf.range(h)[None, :]  # (B, H): rows of the padded image
    cols = corners[:, 1:] + tf.range(w)[None, :]  # (B, W)
    if fill == "edge":
        # The padded image's row r is the image's row clip(r - s).
        rows, cols = tf.clip_by_value(rows - s, 0, h - 1), tf.clip_by_value(cols - s, 0, w - 1)
    else:
        images = tf.pad(images, [[0, 0], [s, s], [s, s], [0, 0]])  # zero border
    images = tf.gather(images, rows, axis=1, batch_dims=1)    # (B, H, W or W + 2s, C)
    return tf.gather(images, cols, axis=2, batch_dims=1)      # (B, H, W, C)


def shift_corners(stream_key, indices, shift_pixels):
    """The crop corners of the examples `indices` (int64 (B,)) under the stream key
    `stream_key` (int64 (2,)), each shift uniform in [-shift_pixels, shift_pixels]: (B, 2)
    int32, equal to the per-example draws
        tf.random.stateless_uniform([2], seed=tf.random.experimental.stateless_fold_in(
            stream_key, index), minval=0, maxval=2 * shift_pixels + 1, dtype=tf.int32, alg="philox")
    for each index (example_words: how), for a whole batch at once."""
    return corners_from_words(example_words(stream_key, indices)[0], shift_pixels)


def corners_from_words(words, shift_pixels):
    """A shift's crop corners from the Philox block its draw reads (seed_words'):
    (B, 2) int32. An int32 draw in [lo, hi) is lo + word % (hi - lo)."""
    span = tf.constant(2 * shift_pixels + 1, tf.uint64)
    return tf.stack([tf.cast(words[0] % span, tf.int32), tf.cast(words[1] % span, tf.int32)], axis=1)


def flip_mask(stream_key, indices):
    """Which of the examples `indices` are mirrored left-right (probability 1/2) under
    `stream_key`: (B,) bool, equal to the per-example draws
        tf.random.stateless_uniform([], seed=stateless_fold_in(stream_key, index), alg="philox") < 0.5
    for each index (example_words), for a whole batch at once."""
    return float_draws(example_words(stream_key, indices)[0][:1])[0] < 0.5


def float_draws(words):
    """The float32 uniform draws in [0, 1) that TensorFlow makes of Philox words (a list of
    uint64 (B,)), one a word: 1.m − 1 with m the word's low 23 bits, i.e. m / 2^23, here
    as float64 (exact)."""
    return [tf.cast(tf.bitwise.bitwise_and(word, tf.constant(0x7FFFFF, tf.uint64)), tf.float64) / 2.0**23
            for word in words]


# Random erasing's box shapes (Zhong et al. 2017, sec. 3.1): area at least s_l = 0.02 of
# the image, aspect ratio log-uniform in [r1, 1/r1] with r1 = 0.3 (as torchvision draws it).
ERASE_MIN_AREA = 0.02
ERASE_MIN_ASPECT = 0.3


def erase_boxes(stream_key, indices, height, width, probability, max_area):
    """Random erasing's rectangles (Zhong et al. 2017) for the examples `indices` (int64
    (B,)) of `height` x `width` images under `stream_key`: (B, 4) int32 [top, left, h, w],
    all four 0 for an example not erased. From five uniforms u0..u4 per example, equal to
    the per-example draw
        tf.random.stateless_uniform([5], seed=stateless_fold_in(stream_key, index), alg="philox")
    (example_words: words 0-3 of the first Philox block, word 0 of the second):
      erased iff u0 < probability;
      area = H·W·(0.02 + u1·(max_area − 0.02)), aspect = exp(log 0.3 + u2·(log(1/0.3) − log 0.3));
      h = clip(round(√(area·aspect)), 1, H), w = clip(round(√(area/aspect)), 1, W);
      top = floor(u3·(H − h + 1)), left = floor(u4·(W − w + 1)).
    One attempt, clipped to the image, where Zhong et al. redraw until the box fits: no
    loop of data-dependent length, and a box too tall or wide for the image (a large area
    with an extreme aspect) is cut to it instead, so its area can fall below the drawn one.
    The box math runs in float64 on the float32 uniforms (exact there)."""
    blocks = example_words(stream_key, indices, blocks=2)
    u0, u1, u2, u3, u4 = float_draws([*blocks[0], blocks[1][0]])
    log_low, log_high = math.log(ERASE_MIN_ASPECT), math.log(1 / ERASE_MIN_ASPECT)
    area = float(height * width) * (ERASE_MIN_AREA + u1 * (float(max_area) - ERASE_MIN_AREA))
    aspect = tf.exp(log_low + u2 * (log_high - log_low))
    h = tf.clip_by_value(tf.round(tf.sqrt(area * aspect)), 1.0, float(height))
    w = tf.clip_by_value(tf.round(tf.sqrt(area / aspect)), 1.0, float(width))
    top = tf.clip_by_value(tf.floor(u3 * (height - h + 1.0)), 0.0, height - h)
    left = tf.clip_by_value(tf.floor(u4 * (width - w + 1.0)), 0.0, width - w)
    boxes = tf.cast(tf.stack([top, left, h, w], axis=1), tf.int32)      # (B, 4)
    return tf.where((u0 < float(probability))[:, None], boxes, tf.zeros_like(boxes))


def erase_batch(images, boxes):
    """`images` (B, H, W, C), any dtype, with the pixels inside each example's box of
    `boxes` (B, 4) int32 [top, left, h, w] (erase_boxes') set to 0: a few comparisons for
    the whole batch. Zero, not Zhong et al.'s per-pixel random values (their default):
    zero is the background of MNIST and Fashion-MNIST, so an erased patch reads as a
    missing part, as an occlusion would, and random values would need H·W draws per
    image. Whether the fill matters here was not measured."""
    _, h, w, _ = images.shape
    top, left, height, width = tf.unstack(boxes[:, :, None], axis=1)    # (B, 1) each
    rows, cols = tf.range(h)[None, :], tf.range(w)[None, :]
    in_rows = (rows >= top) & (rows < top + height)                     # (B, H)
    in_cols = (cols >= left) & (cols < left + width)                    # (B, W)
    inside = in_rows[:, :, None, None] & in_cols[:, None, :, None]       # (B, H, W, 1)
    return tf.where(inside, tf.zeros_like(images), images)


def example_words(stream_key, indices, blocks=1):
    """The Philox blocks (seed_words': `blocks` lists of four 32-bit words, uint64 (B,)
    each) that TensorFlow's stateless draws read for the seeds
    stateless_fold_in(stream_key, index), index in `indices` (int64 (B,)).

    Why: the input pipeline drew each example's augmentation with a few ops per example,
    most of its work (the map over single examples ran at ~24,000 MNIST images/s on this
    project's 2-core machine; with the epoch's draws made at once and whole batches
    cropped, ~150,000: scripts/benchmark_input.py). TensorFlow has
    no batched form of a per-example stateless draw (tf.vectorized_map has no rule for its
    ops), so this computes what those ops compute: fold_in(key, index) is the seed
    (c, index) with c a full-range int64 draw from key; a seed becomes Philox's key and
    counter by one Philox-4x32-10 block (StatelessRandomGetKeyCounter), and a draw takes
    the words of the next block (StatelessRandomUniform*V2). Philox runs on uint32 words
    held in uint64 (TensorFlow's uint32 has no multiply-high); tests check it against the
    ops.
    """
    indices = tf.convert_to_tensor(indices)
    if indices.dtype != tf.int64:
        # fold_in draws c in the data's dtype: only int64 indices give the seeds computed here.
        raise TypeError(f"example_words: indices must be int64 (as the pipelines' example order), got {indices.dtype}")
    return seed_words(tf.fill(tf.shape(indices), fold_in_seed(stream_key)), indices, blocks)


def fold_in_seed(stream_key):
    """c of stateless_fold_in(stream_key, index) = (c, index): a full-range int64 draw from
    `stream_key`, the same for every index (int64 scalar)."""
    return tf.random.stateless_uniform([], seed=stream_key, dtype=tf.int64, minval=None, maxval=None, alg="philox")


def seed_words(seed0, seed1, blocks=1):
    """What TensorFlow's stateless draws read for the seeds (seed0, seed1) (int64 (B,)
    each, or uint64 holding their bits): `blocks` consecutive Philox-4x32-10 blocks, each
    four 32-bit words (uint64 (B,)), from the key and counter the seed gives
    (StatelessRandomGetKeyCounter). A draw of k values takes the words in order, a block
    after another (example_words: why)."""
    words = seed_word_stream(seed0, seed1, 4 * blocks)                       # (B, 4·blocks)
    return [tf.unstack(words[:, 4 * block:4 * block + 4], axis=1) for block in range(blocks)]


def seed_word_stream(seed0, seed1, count):
    """The first `count` words (uint64 (B, count)) that a stateless draw reads for the
    seeds (seed0, seed1) (int64 (B,) each, or uint64 holding their bits), in order:
    seed_words' blocks as one array, all computed at once (one Philox over a (B, blocks)
    grid), for draws of hundreds of values too (elastic_noise)."""
    seed0, seed1 = (seed if seed.dtype == tf.uint64 else tf.bitcast(tf.cast(seed, tf.int64), tf.uint64)
                    for seed in (tf.convert_to_tensor(seed0), tf.convert_to_tensor(seed1)))
    # StatelessRandomGetKeyCounter: one Philox block of the seeds gives the key (mix 0-1)
    # and the counter's high words (mix 2-3).
    counter = [_low32(seed0), _high32(seed0), _low32(seed1), _high32(seed1)]
    mix = _philox4x32(counter, [_word(0x3EC8F720, seed0), _word(0x02461E29, seed0)])
    blocks = -(-int(count) // 4)
    if blocks > 2**31:  # the counter's low word counts the blocks: no carry into the next
        raise ValueError(f"seed_word_stream: {count} words need more than 2^31 blocks")
    mix, zero = [word[:, None] for word in mix], tf.zeros_like(seed0)[:, None]  # (B, 1)
    block = zero + tf.constant(np.arange(blocks, dtype=np.uint64)[None, :])    # (B, blocks)
    words = _philox4x32([block, zero, mix[2], mix[3]], [mix[0], mix[1]])       # 4 × (B, blocks)
    return tf.reshape(tf.stack(words, axis=2), [-1, blocks * 4])[:, :count]


def words_to_int64(low, high):
    """One 64-bit draw from two 32-bit words (low first), as TensorFlow's 64-bit
    distributions combine them: uint64 (B,)."""
    return tf.bitwise.bitwise_or(low, tf.bitwise.left_shift(high, tf.constant(32, tf.uint64)))


# Philox-4x32-10 (Salmon et al. 2011), as TensorFlow's random::PhiloxRandom computes it.
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # key increments (Weyl sequence)


def _word(value, like):
    return tf.fill(tf.shape(like), tf.constant(value, tf.uint64))


def _low32(x):
    return tf.bitwise.bitwise_and(x, tf.constant(0xFFFFFFFF, tf.uint64))


def _high32(x):
    return tf.bitwise.right_shift(x, tf.constant(32, tf.uint64))


def _philox4x32(counter, key):
    """One Philox-4x32-10 block: four 32-bit counter words and two key words (uint64
    tensors holding 32-bit values) → four 32-bit output words."""
    xor = tf.bitwise.bitwise_xor
    for round_ in range(10):
        product0 = counter[0] * tf.constant(_PHILOX_M[0], tf.uint64)
        product1 = counter[2] * tf.constant(_PHILOX_M[1], tf.uint64)
        counter = [xor(xor(_high32(product1), counter[1]), key[0]), _low32(product1),
                   xor(xor(_high32(product0), counter[3]), key[1]), _low32(product0)]
        if round_ < 9:
            key = [_low32(key[0] + tf.constant(_PHILOX_W[0], tf.uint64)),
                   _low32(key[1] + tf.constant(_PHILOX_W[1], tf.uint64))]
    return counter


def random_rotate_zoom(image, rotate_degrees, zoom, key):
    """Rotates one float (H, W, C) image by an angle uniform in ±rotate_degrees and scales
    it by a factor uniform in [1 − zoom, 1 + zoom] about its centre (stateless RNG
    `key`); bilinear, zero outside. Returns float32 on the input's 0..255 scale."""
    angle_key, scale_key = tf.unstack(tf.random.experimental.stateless_split(key, 2, alg="philox"))
    angle = tf.random.stateless_uniform([], seed=angle_key, minval=-rotate_degrees,
                                        maxval=rotate_degrees, alg="philox") * (math.pi / 180.0)
    scale = tf.random.stateless_uniform([], seed=scale_key, minval=1.0 - zoom,
                                        maxval=1.0 + zoom, alg="philox")
    return rotate_zoom(image, angle, scale)


def rotate_zoom(image, angle, scale):
    """`image` (H, W, C) float rotated by `angle` radians (counter-clockwise as displayed,
    rows running down) and scaled by `scale` about its centre, bilinear, zero outside.

    ImageProjectiveTransformV3 maps each output pixel (x, y) to the input point it
    samples; for a rotation by θ and a scaling by s about the centre (cx, cy) that is
    the inverse map p_in = R(−θ)(p_out − c)/s + c.
    """
    h, w = int(image.shape[0]), int(image.shape[1])
    cx, cy = (w - 1) / 2.0, (h - 1) / 2.0
    cos, sin = tf.cos(angle) / scale, tf.sin(angle) / scale
    # Rows grow downwards, so a counter-clockwise turn on screen is a clockwise one in
    # (x, y): x_in = cos·x' − sin·y' and y_in = sin·x' + cos·y' about the centre.
    a0, a1, b0, b1 = cos, -sin, sin, cos
    a2 = cx - a0 * cx - a1 * cy
    b2 = cy - b0 * cx - b1 * cy
    transform = tf.stack([a0, a1, a2, b0, b1, b2, 0.0, 0.0])[None]     # (1, 8)
    out = tf.raw_ops.ImageProjectiveTransformV3(
        images=tf.cast(image, tf.float32)[None], transforms=transform,
        output_shape=tf.constant([h, w], tf.int32), fill_value=0.0,
        interpolation="BILINEAR", fill_mode="CONSTANT")
    return out[0]


def gaussian_kernel(sigma):
    """The normalised 1-D Gaussian of standard deviation `sigma` pixels, cut at 3σ."""
    radius = max(1, math.ceil(3 * sigma))
    taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    return (taps / taps.sum()).astype(np.float32)


def elastic_noise(fold_in_seeds, indices, height, width):
    """The displacement noise of the examples `indices` (int64 (B,)): float32 (B, height,
    width, 2), uniform in [-1, 1), equal to the per-example draws
        tf.random.stateless_uniform([height, width, 2], seed=stateless_fold_in(stream_key, index),
                                    minval=-1, maxval=1, alg="philox")
    where `fold_in_seeds` (int64 (B,)) holds fold_in_seed(stream_key) for each example
    (example_words: why a batch computes what those ops compute). A few ops for the whole
    batch, so the noise can be drawn inside a compiled step (train.data_on_device).
    A float32 draw is 1.m − 1 with m a word's low 23 bits (float_draws), then scaled
    to [minval, maxval) as 2u − 1: exact in float32."""
    count = int(height) * int(width) * 2
    words = seed_word_stream(fold_in_seeds, indices, count)                  # (B, H·W·2)
    u = tf.cast(tf.bitwise.bitwise_and(words, tf.constant(0x7FFFFF, tf.uint64)), tf.float64) / 2.0**23
    return tf.reshape(tf.cast(2.0 * u - 1.0, tf.float32), [-1, int(height), int(width), 2])


def elastic_distort(images, noise, alpha, sigma):
    """Simard, Steinkraus & Platt (2003), sec. 2, on a batch: output pixel (y, x) of image b
    samples `images` (B, H, W, C) at (y + dy, x + dx), bilinear, zero outside, where
    (dy, dx) = alpha × (`noise` (B, H, W, 2) smoothed by a Gaussian of `sigma` pixels, zero
    beyond the border). The smoothing makes neighbouring pixels move together: strokes bend
    and thicken locally, as handwriting varies, instead of being scattered. Returns
    float32 on the input's scale."""
    images = tf.cast(images, tf.float32)
    h, w = int(images.shape[1]), int(images.shape[2])
    kernel = tf.constant(gaussian_kernel(sigma))
    k = int(kernel.shape[0])
    # Separable blur of every component as a (2B, H, W, 1) batch: 'SAME' pads with zeros.
    field = tf.reshape(tf.transpose(tf.cast(noise, tf.float32), [0, 3, 1, 2]), [-1, h, w, 1])
    field = tf.nn.conv2d(field, tf.reshape(kernel, [k, 1, 1, 1]), 1, "SAME")
    field = tf.nn.conv2d(field, tf.reshape(kernel, [1, k, 1, 1]), 1, "SAME")
    field = alpha * tf.reshape(field, [-1, 2, h, w])                     # (B, 2, H, W)
    ys = tf.range(h, dtype=tf.float32)[:, None] + field[:, 0]            # (B, H, W)
    xs = tf.range(w, dtype=tf.float32)[None, :] + field[:, 1]            # (B, H, W)
    y0, x0 = tf.floor(ys), tf.floor(xs)
    out = tf.zeros_like(images)
    for oy in (0.0, 1.0):
        for ox in (0.0, 1.0):
            yi, xi = y0 + oy, x0 + ox
            weight = (1.0 - tf.abs(ys - yi)) * (1.0 - tf.abs(xs - xi))
            inside = (yi >= 0) & (yi <= h - 1) & (xi >= 0) & (xi <= w - 1)
            index = tf.stack([tf.clip_by_value(yi, 0, h - 1), tf.clip_by_value(xi, 0, w - 1)], -1)
            taps = tf.gather_nd(images, tf.cast(index, tf.int32), batch_dims=1)  # (B, H, W, C)
            out += tf.where(inside, weight, 0.0)[..., None] * taps
    return out


def natural_image_batch(images, stream_key, positions, *, training, crop, flip, brightness, contrast, standardize,
                        padding=0, cutout=0):
    """A batch of natural images (uint8 (B, H, W, C)) as the model's float32 input: a random
    `crop` x `crop` window (the centre one at test) of the image with its border reflected
    by `padding` pixels (training; `crop` None: the image's size), a left-right flip (`flip`), a brightness
    delta uniform in ±`brightness`, a contrast factor uniform in [1 − contrast, 1 + contrast)
    (tf.image.adjust_contrast's: each channel's deviation from its image mean scaled), then
    per-image standardisation (`standardize`) or a clip to [0, 1]: the authors' CIFAR-10
    input (Sarasra/models, research/capsules, input_data/cifar10/cifar10_input.py), in that
    order; last a `cutout` x `cutout` square of zeros (clipped at the edges) at a random
    centre (DeVries & Taylor 2017; training). The draws of example `positions` (int64 (B,): its place in the epoch) are the
    Philox words of stateless_fold_in(stream_key, position) (example_words), so the whole
    batch is a few ops: per example, tf.data's map ran at ~2,400 CIFAR images/s on a core."""
    images = tf.convert_to_tensor(images)
    _, h, w, _ = images.shape
    block0, block1 = example_words(stream_key, positions, blocks=2) if training else (None, None)
    crop_h, crop_w = (crop, crop) if crop else (h, w)
    if training and padding:
        images = tf.pad(images, [[0, 0], [padding, padding], [padding, padding], [0, 0]], mode="REFLECT")
        _, h, w, _ = images.shape
    if crop or (training and padding):
        if training:
            rows = tf.cast(block0[0] % (h - crop_h + 1), tf.int32)[:, None] + tf.range(crop_h)[None, :]
            cols = tf.cast(block0[1] % (w - crop_w + 1), tf.int32)[:, None] + tf.range(crop_w)[None, :]
            images = tf.gather(tf.gather(images, rows, axis=1, batch_dims=1), cols, axis=2, batch_dims=1)
        else:
            top, left = (h - crop_h) // 2, (w - crop_w) // 2
            images = images[:, top:top + crop_h, left:left + crop_w]
    images = tf.cast(images, tf.float32) / 255.0
    if training:
        u_flip, u_brightness, u_contrast = [tf.cast(u, tf.float32)[:, None, None, None]
                                            for u in float_draws([block0[2], block0[3], block1[0]])]
        if flip:
            images = tf.where(u_flip < 0.5, images[:, :, ::-1], images)
        if brightness:
            images = images + (2.0 * u_brightness - 1.0) * brightness
        if contrast:
            mean = tf.reduce_mean(images, axis=[1, 2], keepdims=True)
            images = (images - mean) * ((1.0 - contrast) + 2.0 * contrast * u_contrast) + mean
    if standardize:
        # tf.image.per_image_standardization: the std floored at 1/sqrt(pixels) (flat images).
        mean, var = tf.nn.moments(images, axes=[1, 2, 3], keepdims=True)
        floor = 1.0 / math.sqrt(float(np.prod(images.shape[1:])))
        images = (images - mean) / tf.maximum(tf.sqrt(var), floor)
    else:
        images = tf.clip_by_value(images, 0.0, 1.0)
    if training and cutout:
        _, out_h, out_w, _ = images.shape
        centre_row = tf.cast(block1[1] % out_h, tf.int32)[:, None]   # (B, 1)
        centre_col = tf.cast(block1[2] % out_w, tf.int32)[:, None]
        top, left = centre_row - cutout // 2, centre_col - cutout // 2
        rows, cols = tf.range(out_h)[None, :], tf.range(out_w)[None, :]
        inside_rows = (rows >= top) & (rows < top + cutout)             # (B, H)
        inside_cols = (cols >= left) & (cols < left + cutout)           # (B, W)
        inside = inside_rows[:, :, None, None] & inside_cols[:, None, :, None]  # (B, H, W, 1)
        images = tf.where(inside, tf.zeros_like(images), images)
    return images
