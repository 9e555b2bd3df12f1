"""One split of a dataset as NumPy arrays: from a directory of IDX files (offline; the file
format is capsnet.idx's), from tensorflow-datasets (the online default; capsnet.data.tfds), or,
where tensorflow-datasets cannot provide MNIST, the bundled sample. Each checked against the
dataset's facts (capsnet.datasets: DatasetSpec and DATASETS, without TensorFlow).
"""
import contextlib
import hashlib
import os

import numpy as np

from capsnet.console import count, say
from capsnet.data.tfds import is_network_error, load_tfds, quiet_tfds, shorten
from capsnet.datasets import DATASETS
from capsnet.errors import ConfigError, DataError
from capsnet.idx import SPLITS, idx_files, read_idx
from capsnet.validation import integer


def load_split(name, split, data_dir=None, limit=None, *, tfds_data_dir=None):
    """Loads one split of a dataset as NumPy arrays.

    Args:
      name: a key of `DATASETS` ("mnist", "fashion_mnist").
      split: "train" or "test".
      data_dir: a directory with the IDX files (`train-images-idx3-ubyte[.gz]`,
        `train-labels-idx1-ubyte[.gz]`, `t10k-…`); None: tensorflow-datasets.
      limit: keep only the first `limit` examples (≥ 1; more than there are: all);
        None: all.
      tfds_data_dir: where tensorflow-datasets keeps its data (None: its default,
        $TFDS_DATA_DIR or ~/tensorflow_datasets).

    Returns:
      images uint8 (N, H, W, C) and labels int64 (N,), labels in [0, num_classes).
    """
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r} (known: {', '.join(sorted(DATASETS))})")
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r} (known: {', '.join(SPLITS)})")
    if limit is not None:
        limit = integer("limit", limit, minimum=1, hint=" (null: all examples)", error=ConfigError)
    spec = DATASETS[name]
    if data_dir is None:
        images, labels, source = _load_tfds_or_sample(name, spec, split, tfds_data_dir)
        images_src = labels_src = source
    else:
        images, labels, images_src, labels_src = _load_idx_dir(split, data_dir)
    images, labels = _check_split(name, spec, images, labels, images_src, labels_src)
    if data_dir is not None:
        _check_not_other_dataset(name, spec, split, images, os.path.abspath(os.path.expanduser(os.fspath(data_dir))),
                                 images_src)
    if limit is not None and limit < len(labels):
        # Copies, so the full arrays can be freed.
        images, labels = images[:limit].copy(), labels[:limit].copy()
    return images, labels


def _load_idx_dir(split, data_dir):
    paths = []
    for found in idx_files(data_dir, split):
        if len(found) == 2:
            _check_same_idx(*found)
        paths.append(found[0])
    images_path, labels_path = paths
    return read_idx(images_path), read_idx(labels_path), images_path, labels_path


# The known datasets stored as IDX files, told apart by their first images: the SHA-256 of
# the first _FINGERPRINT_IMAGES images (uint8, row-major) of each split of the official
# files, so that a data dir of one read under the other's name is refused, and a prefix
# of them (data.limit_*, a copy of the first N) is still recognised. A user's own data,
# which starts with neither's images, passes.
_FINGERPRINT_IMAGES = 8
_FINGERPRINTS = {
    ("mnist", "train"): "64c9d187751d1b31177d60eb4124a8f090f66a9340340d1c53fdfe580c4d2698",
    ("mnist", "test"): "66c532a3e0b7eda723be653dd98d511b10a78d7d3e5b29271469af530d53b641",
    ("fashion_mnist", "train"): "8a6fbd6eff9f489549edbf60bd50c26e12f0c5551542f37a433fa879a7b283d5",
    ("fashion_mnist", "test"): "8ffd77e71248ff36ca6971e3e84fd894053f181e437e47bec5fcc5e4ca758830",
}
_TITLES = {"mnist": "MNIST", "fashion_mnist": "Fashion-MNIST"}


def known_dataset(images):
    """Which known dataset's split `images` (uint8 (N, H, W[, C])) starts with, as
    (name, split), or None: by the fingerprint of its first images (_FINGERPRINTS)."""
    if len(images) < _FINGERPRINT_IMAGES or images.dtype != np.uint8:
        return None
    digest = hashlib.sha256(np.ascontiguousarray(images[:_FINGERPRINT_IMAGES]).tobytes()).hexdigest()
    return next((known for known, fingerprint in _FINGERPRINTS.items() if fingerprint == digest), None)


def _check_not_other_dataset(name, spec, split, images, data_dir, images_src):
    """DataError (one line) if the IDX files read for dataset `name` are another known
    dataset's (Fashion-MNIST's under data.name=mnist, or the reverse): it would train and
    score without a word on the wrong images."""
    known = known_dataset(images)
    expected = spec.tfds_name or name  # whose files `name` reads: multimnist is made of mnist's
    if known is None or known[0] == expected:
        return
    other = known[0]
    made_of = "" if expected == name else f" (data.name={name} is made of {_TITLES.get(expected, expected)}'s)"
    fix = f"data.name={other} for them, or " if other in DATASETS and expected == name else ""
    raise DataError(f"data dir {data_dir} holds {_TITLES.get(other, other)}'s files, not "
                    f"{_TITLES.get(expected, expected)}'s{made_of}: {images_src} starts with {_TITLES.get(other, other)}'s "
                    f"{known[1]} images; use {fix}a data.dir of the {_TITLES.get(expected, expected)} files")


def _check_same_idx(plain, gz):
    """Both `X` and `X.gz`: the plain file is read (no decompression), which is right only
    if it is the .gz's content (a gunzipped copy beside its archive, as MNIST downloads
    often leave). gzip stores the content's size (mod 2**32) in its last 4 bytes: sizes
    that differ mean two different datasets under one name, and which one a run trains
    on must not depend on a file-lookup order: DataError."""
    with open(gz, "rb") as f:
        f.seek(-4, os.SEEK_END)
        content_size = int.from_bytes(f.read(4), "little")
    if os.path.getsize(plain) % 2**32 != content_size:
        raise DataError(f"{plain} and {gz} are both there but hold different data ({os.path.getsize(plain)} bytes "
                        f"vs {content_size} bytes unpacked): remove the one that is not the dataset")


# --------------------------------------------------------------------------- the bundled sample
# MNIST without tensorflow-datasets or a data dir (offline, nothing downloaded yet): the first
# 6,000 training and 1,000 test images of the official files, in the package
# (capsnet/sample_data/), so that a first `make train` trains on real digits anywhere.
# name -> (file in capsnet/sample_data, the full dataset's {split: examples}, what to say).
SAMPLES = {"mnist": ("mnist_sample.npz", {"train": 60_000, "test": 10_000}, "MNIST")}
# (tfds name, tfds data dir) -> why tensorflow-datasets could not provide it: asked once a
# process (offline the attempt costs seconds), and the notice is said once.
_TFDS_UNAVAILABLE = {}


def _load_tfds_or_sample(name, spec, split, tfds_data_dir):
    """tensorflow-datasets' split; where it cannot provide it and the dataset has a bundled
    sample (SAMPLES), the sample's split, with one notice line (the first time) saying so
    and how to train on the full dataset."""
    key = (spec.tfds_name, tfds_data_dir)
    if key not in _TFDS_UNAVAILABLE:
        try:
            with quiet_tfds() if name in SAMPLES else contextlib.nullcontext():
                return load_tfds(name, spec, split, tfds_data_dir)
        except DataError as err:
            if name not in SAMPLES:
                raise
            _TFDS_UNAVAILABLE[key] = err
            images, labels, source = load_sample(name, split)
            say(sample_notice(name, err))
            return images, labels, source
    if name not in SAMPLES:
        raise _TFDS_UNAVAILABLE[key]
    return load_sample(name, split)


def load_sample(name, split):
    """The bundled sample's `split` of dataset `name` (SAMPLES): uint8 images (N, 28, 28),
    int labels (N,), and where they came from."""
    import importlib.resources

    filename = SAMPLES[name][0]
    resource = importlib.resources.files("capsnet") / "sample_data" / filename
    try:
        with importlib.resources.as_file(resource) as path, np.load(path) as sample:
            return sample[f"{split}_images"], sample[f"{split}_labels"], f"the {name} sample {path}"
    except (OSError, KeyError, ValueError) as err:
        raise DataError(f"the {name} sample capsnet/sample_data/{filename} cannot be read ({err}): "
                        "reinstall capsnet, or point data.dir at a directory of the IDX files") from err


def sample_notice(name, err):
    """The one line said when `name` falls back to its bundled sample because
    tensorflow-datasets could not provide it (`err`, its DataError)."""
    filename, full, title = SAMPLES[name]
    sizes = {split: len(load_sample(name, split)[1]) for split in SPLITS}
    cause = err.__cause__
    why = "no network" if cause is not None and is_network_error(cause) else shorten(str(err), 120)
    return (f"notice: tensorflow-datasets cannot provide {name} ({why}): using the {title} sample in the capsnet "
            f"package ({sizes['train']:,} of the {full['train']:,} training images, {sizes['test']:,} of the "
            f"{full['test']:,} test images); for the full dataset, data.dir=<folder with the {title} IDX files> "
            "offline, or online tensorflow-datasets downloads it")


def _check_split(name, spec, images, labels, images_src, labels_src):
    """Validates a loaded split against `spec`; returns (N, H, W, C) uint8, (N,) int64."""
    h, w, c = spec.image_shape
    ok_shape = (images.ndim == 3 and images.shape[1:] == (h, w) and c == 1) or (
        images.ndim == 4 and images.shape[1:] == spec.image_shape)
    if not ok_shape or images.dtype != np.uint8:
        raise DataError(f"{images_src}: images are {images.dtype} {images.shape}, {name} needs "
                        f"uint8 (N, {h}, {w}) or (N, {h}, {w}, {c})")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{labels_src}: labels are {labels.dtype} {labels.shape}, "
                        f"need integers of shape (N,)")
    if len(images) != len(labels):
        raise DataError(f"{images_src} has {count(len(images), 'image')} but {labels_src} has "
                        f"{count(len(labels), 'label')}")
    if len(labels) == 0:
        raise DataError(f"{images_src}: no examples")
    low, high = labels.min(), labels.max()
    if low < 0 or high >= spec.num_classes:
        raise DataError(f"{labels_src}: labels span {low}..{high}, {name} has classes "
                        f"0..{spec.num_classes - 1}")
    images = images.reshape(len(images), h, w, c)  # (N, H, W, C)
    return images, labels.astype(np.int64)
