"""Datasets: one split as NumPy arrays in, a reproducible tf.data pipeline out.

- `sources`: `load_split(name, split, data_dir, limit)`, from an IDX directory, from
  tensorflow-datasets (`tfds`: the one module that touches its internals) or the bundled
  MNIST sample.
- `pipeline`: `make_dataset(images, labels, ...)`, an epoch of batches keyed by (seed, epoch)
  (`epoch_draws`, `batch_from_draws`).
- `multimnist`: `make_multimnist_dataset`, MultiMNIST's pairs made on the fly
  (`multimnist_draws`, `pairs_from_draws`).
- `make_split_dataset(name, ...)` (here) picks the pipeline or the pairs by dataset name.
"""
from capsnet.config import AUGMENTATION_OFF, OVERLAY_AUGMENTATION, check_overlay_augmentation
from capsnet.data.multimnist import (MULTIMNIST_TEST_KEY, check_pair_elastic, check_pair_shifts,  # noqa: F401
                                     make_multimnist_dataset, multimnist_draws, pairs_from_draws)
from capsnet.data.pipeline import (AUGMENTATION_KEYS, batch_from_draws, epoch_draws, host_tensor,  # noqa: F401
                                   int32_labels, make_dataset, uint8_levels)
from capsnet.data.sources import SAMPLES, known_dataset, load_sample, load_split, sample_notice  # noqa: F401
from capsnet.datasets import check_canvas_border, is_overlay


def make_split_dataset(name, images, labels, *, batch_size, training, seed=0, epoch=0, shift_pixels=2,
                       pad_pixels=None, drop_remainder=False, **augmentation):
    """make_dataset (with the `augmentation` keywords of AUGMENTATION_OFF), or
    make_multimnist_dataset for an overlay dataset (`name`), which takes of them only
    OVERLAY_AUGMENTATION's (each digit's elastic distortion; ConfigError naming any other
    set). pad_pixels: the overlay's canvas border (make_multimnist_dataset); other datasets
    shift on their own canvas (None)."""
    unknown = sorted(set(augmentation) - set(AUGMENTATION_OFF))
    if unknown:
        raise TypeError(f"make_split_dataset: unknown augmentation argument(s) {', '.join(unknown)}")
    check_canvas_border(name, pad_pixels)
    if not is_overlay(name):
        return make_dataset(images, labels, batch_size=batch_size, training=training, seed=seed, epoch=epoch,
                            shift_pixels=shift_pixels, drop_remainder=drop_remainder, **augmentation)
    check_overlay_augmentation(name, augmentation)
    elastic = {key: augmentation[key] for key in OVERLAY_AUGMENTATION if key in augmentation}
    return make_multimnist_dataset(images, labels, batch_size=batch_size, training=training, seed=seed,
                                   epoch=epoch, shift_pixels=shift_pixels, pad_pixels=pad_pixels,
                                   drop_remainder=drop_remainder, **elastic)
