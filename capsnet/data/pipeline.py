"""The per-epoch tf.data pipeline: batches of (float32 images in [0, 1], int32 labels).

`make_dataset(images, labels, ...)`: training batches are shuffled and augmented (the
paper's random shifts; optionally flips, rotations and zoom, elastic distortions, random
erasing) with stateless RNG keyed by (seed, epoch), so an epoch's batches depend on nothing
else: a run resumed at epoch e sees exactly what an uninterrupted run saw, whatever the
parallelism. The per-image augmentation math is capsnet.augment's; this module keys and
applies it. An epoch is its draws made on the host (`epoch_draws`) and batches made from
slices of them (`batch_from_draws`): tf.data's map runs the latter, and so does
train.data_on_device inside the compiled step. MultiMNIST's pairs (capsnet.data.multimnist)
build on the same keying, host tensors and checks.
"""
import weakref

import numpy as np
import tensorflow as tf

from capsnet.augment import (elastic_distort, elastic_noise, erase_batch, erase_boxes, flip_mask, fold_in_seed,
                             random_rotate_zoom, shift_batch, shift_corners)
from capsnet.config import AUGMENTATION_OFF, PER_EXAMPLE_AUGMENTATION, check_augmentation
from capsnet.console import count
from capsnet.errors import ConfigError, DataError
from capsnet.validation import boolean, integer

# The `data.*` config keys that are make_dataset's augmentation arguments: AUGMENTATION_OFF
# (their defaults, the first release's pipeline) and SHIFT_FILLS come from capsnet.config,
# the augmentation config group's schema, as does check_augmentation.
# The elastic draws' stream: folded into the (seed, epoch) key, so the streams before it
# (order, shifts, flips, rotation/zoom) are what they were, and old runs replay unchanged.
# The erased boxes' stream likewise, after it.
ELASTIC_STREAM = 3
_ERASE_STREAM = 4
AUGMENTATION_KEYS = ("shift_pixels", *AUGMENTATION_OFF)


# Host tensors of the NumPy arrays the epochs' datasets read, keyed by (id(array), transform).
_HOST_TENSORS = {}


def host_tensor(array, transform=None):
    """tf.constant(transform(array)) in host memory, made once per array and transform and
    reused by every epoch's dataset. A new constant an epoch is never freed: the epoch's
    tf.data graph keeps it (~one copy of the training set an epoch, which took a 200-epoch
    CIFAR-10 run past 30 GB). The arrays are read-only to the pipeline; an entry goes when
    its array does."""
    key = (id(array), transform)
    entry = _HOST_TENSORS.get(key)
    if entry is not None and entry[0]() is array:
        return entry[1]
    with tf.device("/CPU:0"):
        tensor = tf.constant(array if transform is None else transform(array))
    _HOST_TENSORS[key] = (weakref.ref(array), tensor)
    weakref.finalize(array, _HOST_TENSORS.pop, key, None)
    return tensor


def int32_labels(array):
    return np.asarray(array).astype(np.int32)


def check_epoch_arguments(images, labels, *, batch_size, training, seed, epoch, drop_remainder):
    """What make_dataset and make_multimnist_dataset both take, checked (ConfigError /
    DataError naming it): (images uint8 (N, H, W, C), labels (N,), batch_size, seed, epoch)."""
    boolean("training", training, expected="True or False", error=ConfigError)
    boolean("drop_remainder", drop_remainder, expected="True or False", error=ConfigError)
    images, labels = _check_examples(images, labels)
    batch_size = integer("batch_size", batch_size, minimum=1, error=ConfigError)
    seed = integer("seed", seed, minimum=-(2**63), maximum=2**63 - 1, error=ConfigError)
    epoch = integer("epoch", epoch, minimum=0, maximum=2**63 - 1, error=ConfigError)
    if drop_remainder and len(labels) < batch_size:
        raise ConfigError(f"batch_size {batch_size} with drop_remainder=True leaves no batch "
                          f"from {len(labels)} examples")
    return images, labels, batch_size, seed, epoch


def epoch_order(n, training, seed, epoch):
    """(order, key, stream): the example order of an epoch, int64 (n,), and in training
    the epoch's key [seed, epoch] and the stream split from it beside the shuffle's (the
    shifts' in make_dataset, the pairs' in make_multimnist_dataset: both as in their first
    versions, so earlier runs replay unchanged). Not training: range(n), None, None."""
    if not training:
        return tf.range(n, dtype=tf.int64), None, None
    key = tf.constant([seed, epoch], tf.int64)
    shuffle_key, stream = tf.unstack(tf.random.experimental.stateless_split(key, 2, alg="philox"))
    order = tf.random.experimental.stateless_shuffle(tf.range(n, dtype=tf.int64), seed=shuffle_key, alg="philox")
    return order, key, stream


def make_dataset(images, labels, *, batch_size, training, seed=0, epoch=0, shift_pixels=2,
                 flip=False, rotate_degrees=0.0, zoom=0.0, elastic_alpha=0.0, elastic_sigma=4.0,
                 shift_fill="zero", erase_probability=0.0, erase_max_area=0.4, drop_remainder=False):
    """Builds one epoch of batches.

    Args:
      images: uint8 (N, H, W, C), e.g. from `load_split`.
      labels: integer (N,).
      batch_size: examples per batch (≥ 1); the last batch is smaller unless
        `drop_remainder`.
      training: True: shuffle and augment; False: keep order, no augmentation.
      seed, epoch: key the shuffle order and the augmentation. The same (seed, epoch)
        gives the same batches every time, independent of tf.data's parallelism.
      shift_pixels: the largest shift in each direction (paper: 2). 0: no shift.
      shift_fill: what the shift uncovers: "zero" (the paper's; default) or "edge" (the
        nearest border pixel repeated, as Keras' ImageDataGenerator fills: no dark band
        where an object touches the border, as clothes in Fashion-MNIST do).
      flip: mirror each image left-right with probability 1/2 (label-preserving for
        clothing, not for digits).
      rotate_degrees, zoom: a random rotation by an angle uniform in
        ±rotate_degrees and a scaling by a factor uniform in [1 − zoom, 1 + zoom], about
        the image centre, bilinear, zero outside. 0 and 0 (default): none, and then
        every pixel stays an exact multiple of 1/255.
      elastic_alpha, elastic_sigma: Simard et al.'s (2003) elastic distortion
        (`elastic_distort`): a random displacement field, uniform in [-1, 1] per pixel,
        smoothed by a Gaussian of elastic_sigma pixels and scaled by elastic_alpha
        (Simard: 34 and 4), bilinear, zero outside. elastic_alpha 0 (default): none.
      erase_probability, erase_max_area: random erasing (Zhong et al. 2017;
        capsnet.augment.erase_boxes): with probability erase_probability an image gets one
        zero rectangle, its area uniform in [0.02, erase_max_area] of the image, its
        aspect ratio log-uniform in [0.3, 1/0.3] (Zhong: 0.5 and 0.4). erase_probability
        0 (default): none.
      Augmentations apply in the order flip, rotate/zoom, shift, elastic, erase (all but
        rotate/zoom on whole batches, batch_from_draws: their draws are per example, so
        batching does not change them).

    Returns:
      A `tf.data.Dataset` of (images float32 (B, H, W, C) in [0, 1], labels int32 (B,)).
    """
    images, labels, batch_size, seed, epoch = check_epoch_arguments(
        images, labels, batch_size=batch_size, training=training, seed=seed, epoch=epoch,
        drop_remainder=drop_remainder)
    n, h, w, c = images.shape
    # Named as the config key: that is where a user sets it (train.py, evaluate.py).
    shift_pixels = integer("data.shift_pixels", shift_pixels, minimum=0, maximum=min(h, w) - 1, error=ConfigError)
    flip, rotate_degrees, zoom, elastic_alpha, elastic_sigma, shift_fill, erase_probability, erase_max_area = (
        check_augmentation(flip=flip, rotate_degrees=rotate_degrees, zoom=zoom, elastic_alpha=elastic_alpha,
                           elastic_sigma=elastic_sigma, shift_fill=shift_fill,
                           erase_probability=erase_probability, erase_max_area=erase_max_area).values())

    # Pinned to the CPU: the arrays stay in host memory (tf.data runs there anyway) and
    # the shuffle is computed by the same kernel whether or not a GPU is visible.
    with tf.device("/CPU:0"):
        images_t = host_tensor(images)                    # (N, H, W, C) uint8
        labels_t = host_tensor(labels, int32_labels)      # (N,)
        draws, affine_key = _epoch_draws(images.shape, training=training, seed=seed, epoch=epoch,
                                   shift_pixels=shift_pixels, flip=flip, erase_probability=erase_probability,
                                   erase_max_area=erase_max_area, elastic=elastic_alpha > 0)
        dataset = tf.data.Dataset.from_tensor_slices(draws)
        elastic = {"elastic_alpha": elastic_alpha, "elastic_sigma": elastic_sigma}

        per_example = {"rotate_degrees": rotate_degrees, "zoom": zoom}
        if not (training and any(per_example[key] > 0 for key in PER_EXAMPLE_AUGMENTATION)):
            # Flips, shifts (the presets' augmentations), elastic distortion, erasing, or
            # none: the map gathers and crops whole batches, ~6x the per-example map's
            # speed (MNIST, 2 cores).
            def load_batch(draws):
                return batch_from_draws(images_t, labels_t, draws, shift_pixels=shift_pixels, shift_fill=shift_fill,
                                        **elastic)

            # Batched, then mapped: tf.distribute cannot read the batch size through the map
            # and splits the batches over replicas by its older rebatching; the slices are
            # the same (tests/test_distribute.py).
            dataset = dataset.batch(batch_size, drop_remainder=drop_remainder)
            dataset = parallel_map(dataset, load_batch)
            return dataset.prefetch(tf.data.AUTOTUNE)
        def example_key(stream_key, index):
            # Keyed by the example's index in `images`, not by its position in a batch
            # or thread, so its augmentation is the same however the map runs.
            return tf.random.experimental.stateless_fold_in(stream_key, index, alg="philox")

        def load_example(draws):
            # Rotation or zoom: one example at a time, in the order flip, rotate/zoom,
            # shift (the elastic distortion and the erasing on whole batches below, in that
            # order: what they need rides along in `later`).
            index = draws["index"]
            image = tf.gather(images_t, index)  # (H, W, C) uint8
            if "mirror" in draws:
                image = tf.where(draws["mirror"], tf.reverse(image, axis=[1]), image)
            if rotate_degrees > 0 or zoom > 0:
                image = random_rotate_zoom(tf.cast(image, tf.float32), rotate_degrees, zoom,
                                           example_key(affine_key, index))
            if "corner" in draws:
                image = shift_batch(image[None], draws["corner"][None], shift_pixels, fill=shift_fill)[0]
            example = (tf.cast(image, tf.float32) / 255.0, tf.gather(labels_t, index))
            later = {key: draws[key] for key in ("index", "elastic_seed", "erase") if key in draws}
            return (*example, later) if len(later) > 1 else example

        def finish_batch(x, y, later):
            return _distort_and_erase(x, later, **elastic), y

        dataset = parallel_map(dataset, load_example)
        dataset = dataset.batch(batch_size, drop_remainder=drop_remainder)
        if training and (elastic_alpha > 0 or erase_probability > 0):
            dataset = parallel_map(dataset, finish_batch)
        # Prefetch the next batches while the model trains on this one.
        return dataset.prefetch(tf.data.AUTOTUNE)


def parallel_map(dataset, fn):
    """dataset.map(fn) in parallel, in order, without AutoGraph: tf.data converts a map's
    function with AutoGraph by default, which rewrites the source of it and of everything it
    calls (~0.45 s of a 2-core CPU's start-up: the test split's map, then the first
    training epoch's). Nothing in these functions branches or loops on a tensor (their `if`s
    read the config and the draws' keys), so the ops are the same without it, as they are
    in train.data_on_device's compiled step, which runs batch_from_draws and
    pairs_from_draws under tf.function(autograph=False) (capsnet.training.device_input)."""
    return dataset.map(tf.autograph.experimental.do_not_convert(fn), num_parallel_calls=tf.data.AUTOTUNE,
                       deterministic=True)


def epoch_draws(images_shape, *, training, seed=0, epoch=0, shift_pixels=2, flip=False, erase_probability=0.0,
                erase_max_area=0.4, elastic=False):
    """An epoch's example order and its per-example flips, shifts, elastic noise seeds and
    erased boxes, as make_dataset draws them for images of `images_shape` (N, H, W, C):
    {"index": int64 (N,), "mirror": bool (N,) if flip, "corner": int32 (N, 2) if
    shift_pixels, "elastic_seed": int64 (N,) if elastic (the seed the example's noise is
    drawn from with its index, capsnet.augment.elastic_noise: the same for every example,
    a column so that a batch's slice carries it), "erase": int32 (N, 4) if
    erase_probability}, entry i for the epoch's i-th example (training; else range(N) and
    nothing drawn). batch_from_draws makes a batch of any slice of it: what make_dataset's
    batches are, and what train.data_on_device gathers on the device
    (capsnet.training.device_input). Arguments as make_dataset's (which checks them;
    `elastic`: whether elastic_alpha > 0)."""
    return _epoch_draws(images_shape, training=training, seed=seed, epoch=epoch, shift_pixels=shift_pixels,
                        flip=flip, erase_probability=erase_probability, erase_max_area=erase_max_area,
                        elastic=elastic)[0]


def _epoch_draws(images_shape, *, training, seed, epoch, shift_pixels, flip, erase_probability, erase_max_area,
                 elastic=False):
    """epoch_draws' dict, and the key of the stream drawn per example later (make_dataset's
    rotation/zoom), None when not training."""
    n, h, w, _ = images_shape
    order, key, shift_key = epoch_order(n, training, seed, epoch)
    draws = {"index": order}
    if not training:
        return draws, None
    # More independent streams from the (seed, epoch) key: the flips and the rotation/zoom
    # split from the shifts' key, the elastic noise and the erased boxes folded into it.
    flip_key, affine_key = tf.unstack(tf.random.experimental.stateless_split(shift_key, 2, alg="philox"))
    elastic_key = tf.random.experimental.stateless_fold_in(key, ELASTIC_STREAM, alg="philox")
    erase_key = tf.random.experimental.stateless_fold_in(key, _ERASE_STREAM, alg="philox")
    # The epoch's flips, shifts and erased boxes, drawn up front for every example in one
    # pass: flip_mask, shift_corners and erase_boxes give what a per-example draw keyed by
    # the example's index gives (stateless_fold_in(flip_key / shift_key / erase_key,
    # index); capsnet.augment.example_words: why), so the batches do not depend on how the
    # map runs.
    if flip:
        draws["mirror"] = flip_mask(flip_key, order)                      # (N,) bool
    if shift_pixels > 0:
        draws["corner"] = shift_corners(shift_key, order, shift_pixels)   # (N, 2) int32
    if elastic:
        draws["elastic_seed"] = tf.fill([n], fold_in_seed(elastic_key))    # (N,) int64
    if erase_probability > 0:
        draws["erase"] = erase_boxes(erase_key, order, h, w, erase_probability, erase_max_area)  # (N, 4) int32
    return draws, affine_key


def batch_from_draws(images, labels, draws, *, shift_pixels, shift_fill="zero", elastic_alpha=0.0, elastic_sigma=4.0,
                     levels=None):
    """A batch of (images float32 (B, H, W, C) in [0, 1], labels (B,)) from B entries of
    epoch_draws (each of its tensors sliced alike): the examples draws["index"] of
    `images` uint8 (N, H, W, C) and `labels` (N,), mirrored, shifted, elastically
    distorted (by elastic_alpha and elastic_sigma, as make_dataset's) and erased as drawn.
    A few ops for the whole batch, wherever they run (tf.data's map, or a compiled step).
    A pixel p becomes p / 255; inside XLA pass `levels`, float32 (256,) with levels[p] =
    p / 255 computed on the host (uint8_levels): XLA's p / 255 is not the host's (its CPU
    code multiplies by 1/255, its GPU code divides approximately), one ulp off in a
    quarter to half of the pixels."""
    batch = tf.gather(images, draws["index"])  # (B, H, W, C) uint8
    if "mirror" in draws:
        batch = tf.where(draws["mirror"][:, None, None, None], tf.reverse(batch, axis=[2]), batch)
    # int32 as drawn; a cast of no op in tf.data, int64 as the device keeps them (device_input).
    if "corner" in draws:
        batch = shift_batch(batch, tf.cast(draws["corner"], tf.int32), shift_pixels, fill=shift_fill)
    pixels = tf.cast(batch, tf.float32) / 255.0 if levels is None else tf.gather(levels, tf.cast(batch, tf.int32))
    return (_distort_and_erase(pixels, draws, elastic_alpha=elastic_alpha, elastic_sigma=elastic_sigma),
            tf.gather(labels, draws["index"]))


def _distort_and_erase(pixels, draws, *, elastic_alpha, elastic_sigma):
    """The batch's last two augmentations, on float pixels (B, H, W, C): the elastic
    distortion (if draws has "elastic_seed"), then the erasing (if "erase"; zero, as 0 / 255
    is, so erasing before or after the division is the same)."""
    if "elastic_seed" in draws:
        noise = elastic_noise(draws["elastic_seed"], draws["index"], pixels.shape[1], pixels.shape[2])
        pixels = elastic_distort(pixels, noise, elastic_alpha, elastic_sigma)
    if "erase" in draws:
        pixels = erase_batch(pixels, tf.cast(draws["erase"], tf.int32))  # last: after the elastic distortion
    return pixels


def uint8_levels():
    """float32 (256,): p / 255 for p = 0..255, rounded as the host's division rounds it."""
    return np.arange(256, dtype=np.float32) / np.float32(255.0)


def _check_examples(images, labels):
    images, labels = np.asarray(images), np.asarray(labels)
    if images.ndim != 4 or images.dtype != np.uint8:
        raise DataError(f"images must be uint8 (N, H, W, C), got {images.dtype} {images.shape}")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"labels must be integers of shape (N,), got {labels.dtype} {labels.shape}")
    if len(images) != len(labels):
        raise DataError(f"{count(len(images), 'image')} {images.shape} but "
                        f"{count(len(labels), 'label')} {labels.shape}")
    if len(labels) == 0:
        raise DataError(f"no examples: images {images.shape}")
    if labels.min() < np.iinfo(np.int32).min or labels.max() > np.iinfo(np.int32).max:
        raise DataError(f"labels span {labels.min()}..{labels.max()}, beyond int32")
    return images, labels
