"""capsnet.augment.natural_image_batch against tf.image applied to one image at a time with
the same per-example draws (tf.random.stateless_uniform seeded by
stateless_fold_in(key, position)): the batched pipeline of natural images computes what the
authors' per-image CIFAR-10 input does."""
import numpy as np
import pytest
import tensorflow as tf

from capsnet.augment import natural_image_batch

OPTIONS = {"crop": 24, "flip": True, "brightness": 0.25, "contrast": 0.8}


def reference(image, key, position, *, training, crop, flip, brightness, contrast, standardize):
    h, w = image.shape[:2]
    seed = tf.random.experimental.stateless_fold_in(key, tf.constant(position, tf.int64), alg="philox")
    if crop:
        if training:
            top, left = tf.random.stateless_uniform([2], seed=seed, minval=0, maxval=h - crop + 1, dtype=tf.int32,
                                                    alg="philox").numpy()
        else:
            top, left = (h - crop) // 2, (w - crop) // 2
        image = tf.image.crop_to_bounding_box(image, int(top), int(left), crop, crop)
    image = tf.cast(image, tf.float32) / 255.0
    if training:
        u = tf.random.stateless_uniform([5], seed=seed, alg="philox").numpy()
        if flip and u[2] < 0.5:
            image = tf.image.flip_left_right(image)
        if brightness:
            image = tf.image.adjust_brightness(image, (2 * u[3] - 1) * brightness)
        if contrast:
            image = tf.image.adjust_contrast(image, (1 - contrast) + 2 * contrast * u[4])
    return tf.image.per_image_standardization(image) if standardize else tf.clip_by_value(image, 0.0, 1.0)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("standardize", [True, False])
def test_batch_equals_per_image_tf_image(training, standardize):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(16, 32, 32, 3), dtype=np.uint8)
    key = tf.constant([7, 2], tf.int64)
    positions = tf.range(40, 56, dtype=tf.int64)  # a later batch of the epoch
    got = natural_image_batch(images, key, positions, training=training, standardize=standardize, **OPTIONS).numpy()
    want = np.stack([reference(images[i], key, 40 + i, training=training, standardize=standardize, **OPTIONS).numpy()
                     for i in range(16)])
    assert got.shape == (16, 24, 24, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_draws_vary_over_examples_and_cover_the_ranges():
    """Over many examples of one batch: every crop corner, both flips and brightness deltas
    of both signs occur (a constant draw would pass the equality test above only by luck)."""
    images = np.tile(np.arange(32, dtype=np.uint8)[None, None, :, None] * 8, (512, 32, 1, 3))  # a column ramp
    key = tf.constant([1, 0], tf.int64)
    out = natural_image_batch(images, key, tf.range(512, dtype=tf.int64), training=True, crop=24, flip=True,
                              brightness=0.0, contrast=0.0, standardize=False).numpy()
    first_column = out[:, 0, 0, 0] * 255 / 8  # the ramp's value = the crop's left edge, or its right one if flipped
    lefts = {round(v) for v in first_column if v <= 8.5}
    flipped_edges = {round(v) for v in first_column if v > 8.5}
    assert lefts == set(range(9)) and flipped_edges == set(range(23, 32))
    shifted = natural_image_batch(np.full((512, 32, 32, 3), 128, np.uint8), key, tf.range(512, dtype=tf.int64),
                                  training=True, crop=None, flip=False, brightness=0.25, contrast=0.0,
                                  standardize=False).numpy()[:, 0, 0, 0] - 128 / 255
    assert shifted.min() < -0.2 and shifted.max() > 0.2 and np.abs(shifted).max() <= 0.25 + 1e-6
