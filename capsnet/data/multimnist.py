"""MultiMNIST (Sabour et al. 2017, Sec. 6): pairs of shifted digits of different classes
overlaid on a canvas, generated on the fly from the MNIST arrays with the per-epoch
pipeline's stateless keying (capsnet.data.pipeline). An epoch is its draws
(`multimnist_draws`) and batches made from slices of them (`pairs_from_draws`), in tf.data's
map or in train.data_on_device's compiled step.
"""
import numpy as np
import tensorflow as tf

from capsnet.augment import (corners_from_words, elastic_distort, elastic_noise, example_words, fold_in_seed,
                             seed_words, shift_batch, words_to_int64)
from capsnet.config import check_augmentation
from capsnet.data.pipeline import (ELASTIC_STREAM, check_epoch_arguments, epoch_order, host_tensor, int32_labels,
                                   parallel_map)
from capsnet.errors import ConfigError, DataError
from capsnet.validation import integer

# The key of the MultiMNIST test split: fixed (not the run's seed), so that every run and
# every evaluation scores the same test pairs.
MULTIMNIST_TEST_KEY = (2017, 6)
_ELASTIC_PARTNER_STREAM = 5  # the partner digits' elastic noise (the bases': pipeline's ELASTIC_STREAM)


def make_multimnist_dataset(images, labels, *, batch_size, training, seed=0, epoch=0, shift_pixels=4,
                            pad_pixels=None, drop_remainder=False, elastic_alpha=0.0, elastic_sigma=4.0):
    """One epoch of MultiMNIST batches (Sabour et al. 2017, Sec. 6), generated on the fly.

    Each example of `images` (the base) is paired with a partner of a different class,
    drawn uniformly from the examples of the other classes; both are zero-padded by
    `pad_pixels` (None: `shift_pixels`) on every side (28 → 36 for the paper's 4), each is
    shifted by (dy, dx), each uniform in [-shift_pixels, shift_pixels] (what a shift
    larger than the pad moves off the canvas is lost, as in the authors' generator,
    mnist_shift.py, whose README makes test pairs with shift 6, pad 4), and the image is
    their sum clipped to 255 (then scaled to [0, 1]). One pair per base example per epoch.

    The partner and the two shifts are stateless functions of (key, base index): key =
    (seed, epoch) in training (a new pairing every epoch; the order is shuffled as in
    make_dataset), MULTIMNIST_TEST_KEY otherwise (training=False: the same pairs in the
    same order for every run and every evaluation). Independent of batching and of
    tf.data's parallelism.

    Args:
      images: uint8 (N, H, W, C) source digits; labels: integer (N,), at least two classes.
      batch_size, drop_remainder: as in make_dataset.
      shift_pixels: the largest shift (paper: 4), ≥ 0.
      pad_pixels: the canvas border (≥ 0); None: shift_pixels.
      elastic_alpha, elastic_sigma: in training, each digit elastically distorted on its
        own frame (make_dataset's distortion, the base's and the partner's noise drawn
        apart) before it is padded and shifted; the pair is then the float sum of the two,
        clipped to 1. elastic_alpha 0 (default), or not training: none, and the pair is
        the integer clipped sum above.

    Returns:
      A `tf.data.Dataset` of (images float32 (B, H', W', C) in [0, 1], labels int32 (B, 2)
      (base class, partner class), digits float32 (B, 2, H', W', C): each digit alone,
      shifted as in the image (the reconstruction targets)), H' = H + 2·pad_pixels.
    """
    images, labels, batch_size, seed, epoch = check_epoch_arguments(
        images, labels, batch_size=batch_size, training=training, seed=seed, epoch=epoch,
        drop_remainder=drop_remainder)
    shift_pixels, pad_pixels = check_pair_shifts(shift_pixels, pad_pixels)
    elastic = check_pair_elastic(elastic_alpha, elastic_sigma)
    with tf.device("/CPU:0"):  # as in make_dataset
        images_t = host_tensor(images)                                    # (N, H, W, C) uint8
        labels_t = host_tensor(labels, int32_labels)                      # (N,)
        draws = multimnist_draws(labels, training=training, seed=seed, epoch=epoch, shift_pixels=shift_pixels,
                                 elastic=elastic["elastic_alpha"] > 0)
        dataset = tf.data.Dataset.from_tensor_slices(draws).batch(batch_size, drop_remainder=drop_remainder)
        dataset = parallel_map(dataset, lambda d: pairs_from_draws(images_t, labels_t, d, shift_pixels=shift_pixels,
                                                           pad_pixels=pad_pixels, **elastic))
        return dataset.prefetch(tf.data.AUTOTUNE)


def check_pair_shifts(shift_pixels, pad_pixels):
    """MultiMNIST's (shift_pixels, pad_pixels) checked (ConfigError naming the key), the
    pad's None resolved to shift_pixels."""
    shift_pixels = integer("data.shift_pixels", shift_pixels, minimum=0, maximum=64, error=ConfigError)
    pad_pixels = shift_pixels if pad_pixels is None else integer("data.pad_pixels", pad_pixels, minimum=0,
                                                                 maximum=64, error=ConfigError)
    return shift_pixels, pad_pixels


def check_pair_elastic(elastic_alpha, elastic_sigma):
    """MultiMNIST's elastic options checked as make_dataset checks them (ConfigError naming
    the key): {"elastic_alpha": float, "elastic_sigma": float}."""
    return check_augmentation(elastic_alpha=elastic_alpha, elastic_sigma=elastic_sigma, prefix="data.")


def multimnist_draws(labels, *, training, seed=0, epoch=0, shift_pixels=4, elastic=False):
    """An epoch's MultiMNIST pairs as make_multimnist_dataset draws them, for `labels` (N,):
    {"index": int64 (N,) the base examples in the epoch's order, "partner": int64 (N,)
    each one's partner, if shift_pixels "corner_a", "corner_b": int32 (N, 2) the two
    digits' crop corners, and if elastic (and training) "elastic_seed_a", "elastic_seed_b":
    int64 (N,) the seeds the base's and the partner's elastic noise are drawn from with
    their indices (capsnet.augment.elastic_noise; as epoch_draws' "elastic_seed")}, entry i
    for the epoch's i-th pair. pairs_from_draws makes a batch of any slice of it: what
    make_multimnist_dataset's batches are, and what train.data_on_device gathers on the
    device (capsnet.training.device_input)."""
    n = len(labels)
    if len(np.unique(labels)) < 2:
        raise DataError(f"MultiMNIST pairs digits of different classes: the {n} examples have only class "
                        f"{labels[0]}")
    # Indices sorted by class: class k's examples are by_class[start[k]:start[k] + count[k]],
    # so the examples of every other class are by_class without that block.
    classes = np.arange(int(labels.min()), int(labels.max()) + 1)
    count = np.array([np.sum(labels == k) for k in classes])              # (K,)
    start = np.concatenate([[0], np.cumsum(count)[:-1]])                  # (K,)
    low = int(classes[0])

    with tf.device("/CPU:0"):  # as in make_dataset
        labels_t = host_tensor(labels, int32_labels)                      # (N,)
        by_class_t = host_tensor(labels, _by_class)                       # (N,) indices sorted by class
        count_t, start_t = tf.constant(count.astype(np.int64)), tf.constant(start.astype(np.int64))
        order, key, pair_key = epoch_order(n, training, seed, epoch)
        if not training:
            pair_key = tf.constant(MULTIMNIST_TEST_KEY, tf.int64)

        # Every pair's draws, made up front for the whole epoch in one pass: what these
        # per-example draws give (keyed by the base example's index: the same pair however
        # the batches are made),
        #   key = stateless_fold_in(pair_key, index)
        #   partner_key, shift_a_key, shift_b_key = stateless_split(key, 3)
        #   j = stateless_uniform([], partner_key, 0, N - count[k], int64)
        #   corners = stateless_uniform([2], shift_key, 0, 2s + 1, int32)   (each digit's shift)
        # computed from their Philox words (capsnet.augment.example_words, seed_words;
        # tests/test_multimnist.py checks them against the per-example ops). A batch then
        # only gathers and crops.
        split = example_words(pair_key, order, blocks=3)  # three int64 seeds an example
        keys = [(words_to_int64(w[0], w[1]), words_to_int64(w[2], w[3])) for w in split]
        k = tf.cast(tf.gather(labels_t, order), tf.int64) - low
        count_k, start_k = tf.gather(count_t, k), tf.gather(start_t, k)
        # Uniform over the N - count[k] examples of the other classes: the j-th of by_class
        # with class k's block cut out.
        partner_words = seed_words(*keys[0])[0]
        j = tf.cast(words_to_int64(partner_words[0], partner_words[1]) % tf.cast(n - count_k, tf.uint64), tf.int64)
        draws = {"index": order, "partner": tf.gather(by_class_t, j + tf.where(j >= start_k, count_k, 0))}
        if shift_pixels:
            draws["corner_a"] = corners_from_words(seed_words(*keys[1])[0], shift_pixels)  # (N, 2) int32
            draws["corner_b"] = corners_from_words(seed_words(*keys[2])[0], shift_pixels)
        if elastic and training:
            # Two streams folded into the epoch's key, as make_dataset's elastic noise is: a
            # digit drawn as a base and as a partner in one epoch is distorted two ways.
            for name, stream in (("elastic_seed_a", ELASTIC_STREAM), ("elastic_seed_b", _ELASTIC_PARTNER_STREAM)):
                stream_key = tf.random.experimental.stateless_fold_in(key, stream, alg="philox")
                draws[name] = tf.fill([n], fold_in_seed(stream_key))  # (N,) int64
        return draws


def pairs_from_draws(images, labels, draws, *, shift_pixels, pad_pixels, levels=None, elastic_alpha=0.0,
                     elastic_sigma=4.0):
    """A MultiMNIST batch (make_multimnist_dataset's three tensors) from B entries of
    multimnist_draws (each of its tensors sliced alike), of `images` uint8 (N, H, W, C)
    and `labels` (N,): both digits padded by pad_pixels, shifted as drawn, and summed,
    clipped to 255. A pixel p becomes p / 255, or levels[p] (batch_from_draws: why).
    With draws' elastic seeds, each digit is first distorted on its own frame by
    elastic_alpha and elastic_sigma, and the pair is the float sum clipped to 1."""
    scale = ((lambda x: tf.cast(x, tf.float32) / 255.0) if levels is None
             else (lambda x: tf.gather(levels, tf.cast(x, tf.int32))))
    elastic = "elastic_seed_a" in draws
    p = pad_pixels
    digits = []
    for source, corner, seed in (("index", "corner_a", "elastic_seed_a"), ("partner", "corner_b", "elastic_seed_b")):
        digit = tf.gather(images, draws[source])                                        # (b, H, W, C) uint8
        if elastic:
            noise = elastic_noise(draws[seed], draws[source], digit.shape[1], digit.shape[2])
            digit = elastic_distort(scale(digit), noise, elastic_alpha, elastic_sigma)  # float from here
        canvas = tf.pad(digit, [[0, 0], [p, p], [p, p], [0, 0]])                        # (b, H', W', C)
        if shift_pixels:
            # int32 as drawn; int64 as the device keeps them (device_input).
            canvas = shift_batch(canvas, tf.cast(draws[corner], tf.int32), shift_pixels)
        # Without the distortion the digits stay integers until the end: the sum's clip at 255
        # is exact, and the pairs are the first releases' bit for bit.
        digits.append(canvas if elastic else tf.cast(canvas, tf.int32))
    pair_labels = tf.stack([tf.gather(labels, draws["index"]), tf.gather(labels, draws["partner"])],
                           axis=1)                                                      # (b, 2)
    if elastic:
        return tf.minimum(digits[0] + digits[1], 1.0), pair_labels, tf.stack(digits, axis=1)
    overlay = tf.minimum(digits[0] + digits[1], 255)                                    # clipped sum
    return scale(overlay), pair_labels, scale(tf.stack(digits, axis=1))                 # (b, 2, H', W', C)


def _by_class(labels):
    return np.argsort(labels, kind="stable").astype(np.int64)
