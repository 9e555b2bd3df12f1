"""Datasets: IDX files or tensorflow-datasets in, a reproducible tf.data pipeline out.

- `load_split(name, split, data_dir, limit)`: one split as NumPy arrays, from an IDX
  directory (offline; the file format is capsnet.idx's) or from tensorflow-datasets
  (the online default).
- `make_dataset(images, labels, ...)`: batches of (float32 images in [0, 1], int32
  labels). Training batches are shuffled and augmented (the paper's random shifts;
  optionally flips, rotations and zoom, elastic distortions, random erasing) with
  stateless RNG keyed by (seed, epoch), so an epoch's batches depend on nothing else: a
  run resumed at epoch e sees exactly what an uninterrupted run saw, whatever the
  parallelism. The per-image augmentation
  math is capsnet.augment's; this module keys and applies it.
- `make_multimnist_dataset(images, labels, ...)`: MultiMNIST (paper Sec. 6), pairs of
  shifted digits of different classes overlaid on a 36×36 canvas, generated on the fly
  from the MNIST arrays with the same stateless keying; `make_split_dataset(name, ...)`
  picks one or the other by dataset name.
- Both are an epoch's draws made on the host (`epoch_draws`, `multimnist_draws`) and
  batches made from slices of them (`batch_from_draws`, `pairs_from_draws`): tf.data's map
  runs the latter, and so does train.data_on_device inside the compiled step.
"""
import contextlib
import hashlib
import io
import logging
import os
import socket
import sys
import weakref

import numpy as np
import tensorflow as tf

from capsnet.augment import (corners_from_words, elastic_distort, elastic_noise, erase_batch, erase_boxes,
                             example_words, flip_mask, fold_in_seed, random_rotate_zoom, seed_words, shift_batch,
                             shift_corners, words_to_int64)
from capsnet.config import (AUGMENTATION_OFF, PER_EXAMPLE_AUGMENTATION, SHIFT_FILLS,  # noqa: F401  (re-exported)
                            OVERLAY_AUGMENTATION, augmentation_options, check_augmentation, check_overlay_augmentation)
from capsnet.console import say
from capsnet.datasets import (DATASETS, DatasetSpec, check_canvas_border, example_shape,  # noqa: F401  (re-exported)
                              is_overlay)
from capsnet.errors import ConfigError, DataError
from capsnet.idx import SPLITS, idx_file_names, read_idx
from capsnet.validation import boolean, integer

# --------------------------------------------------------------------------- datasets
# DatasetSpec and DATASETS (what each name means) live in capsnet.datasets, without TensorFlow.

# tfds retries each URL 10 times with exponential backoff, so offline it takes minutes
# to report that there is no network. Two retries ride out a transient failure and
# give up within a second or two when there is no network at all.
_TFDS_MAX_RETRIES = 2


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
    data_dir = os.path.abspath(os.path.expanduser(os.fspath(data_dir)))
    bases = idx_file_names(split)
    if not os.path.isdir(data_dir):
        expected = ", ".join(f"{b}[.gz]" for s in SPLITS for b in idx_file_names(s))
        raise DataError(f"data dir {data_dir} does not exist or is not a directory "
                        f"(it should hold the IDX files {expected})")
    paths = []
    for base in bases:
        candidates = [os.path.join(data_dir, base + suffix) for suffix in ("", ".gz")]
        found = [p for p in candidates if os.path.isfile(p)]
        if not found:
            raise DataError(f"data dir {data_dir} has no {base} or {base}.gz "
                            f"(the {split} split needs {bases[0]}[.gz] and {bases[1]}[.gz])")
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
            with _quiet_tfds() if name in SAMPLES else contextlib.nullcontext():
                return _load_tfds(name, spec, split, tfds_data_dir)
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


@contextlib.contextmanager
def _quiet_tfds():
    """For the duration of an attempt that falls back to a bundled sample: tfds' own lines
    kept off the terminal (its "Downloading and preparing dataset ..." print on stdout, absl's
    warnings such as "Variant folder ... has no dataset_info.json"), which offline came before
    the sample's notice and said nothing it does not. What tfds printed is said after a
    success (online, the download it made); after a failure it is dropped."""
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        absl_log.setLevel(level)
    sys.stdout.write(printed.getvalue())


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
    why = "no network" if cause is not None and _is_network_error(cause) else _shorten(str(err), 120)
    return (f"notice: tensorflow-datasets cannot provide {name} ({why}): using the {title} sample in the capsnet "
            f"package ({sizes['train']:,} of the {full['train']:,} training images, {sizes['test']:,} of the "
            f"{full['test']:,} test images); for the full dataset, data.dir=<folder with the {title} IDX files> "
            "offline, or online tensorflow-datasets downloads it")


def _load_tfds(name, spec, split, tfds_data_dir):
    offline = ("point data.dir=/path/to/idx at a directory of IDX files "
               "(train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-…)")
    if spec.tfds_name is None:
        raise DataError(f"dataset {name} is not in tensorflow-datasets: {offline}")
    try:
        import tensorflow_datasets as tfds  # slow to import; only this path needs it
    except ImportError as err:
        raise DataError(f"tensorflow-datasets cannot be imported ({err}): install it, or "
                        f"{offline}") from err
    source = f"{spec.tfds_name}/{split}"
    try:
        with _fail_fast_downloads():
            images, labels = tfds.load(spec.tfds_name, split=split, as_supervised=True,
                                       batch_size=-1, data_dir=tfds_data_dir)
    except ImportError as err:
        # A dependency tfds forgot to declare (e.g. importlib_resources with
        # tensorflow-datasets 4.9.10) fails only once it prepares a dataset.
        raise DataError(f"tensorflow-datasets cannot prepare {source}: a module it needs is "
                        f"missing ({err}; pip install {err.name or 'it'}); or, offline, "
                        f"{offline}") from err
    except Exception as err:  # tfds raises many types (requests, OSError, AssertionError, ...)
        if _is_network_error(err):
            # The cause (a urllib3 retry report, hundreds of characters) says no more than this.
            raise DataError(f"could not download {spec.tfds_name} with tensorflow-datasets (no network); "
                            f"offline, use data.dir=/path/to/idx (a directory of the IDX files "
                            f"train-images-idx3-ubyte.gz, t10k-…)") from err
        reason = _shorten((str(err).strip().splitlines() or [""])[0], 160)
        raise DataError(f"tensorflow-datasets could not download or prepare {source} "
                        f"({type(err).__name__}: {reason}); offline, {offline}") from err
    return np.asarray(images), np.asarray(labels), f"tensorflow-datasets {source}"


@contextlib.contextmanager
def _fail_fast_downloads():
    """For the duration: lowers tfds' per-URL retry count (see _TFDS_MAX_RETRIES), and
    keeps tfds' progress bars and urllib3's retry warnings off the terminal; offline they
    were ~20 lines burying the one-line error. tfds still prints what it downloads.
    After a failed download urllib3 stays at ERROR (see the end)."""
    with contextlib.ExitStack() as stack:
        try:
            from tensorflow_datasets.core.download import downloader
        except ImportError:
            downloader = None
        old = getattr(downloader, "MAX_RETRIES", None)
        if old is not None:  # else another tfds layout: leave it alone
            downloader.MAX_RETRIES = min(old, _TFDS_MAX_RETRIES)
            stack.callback(setattr, downloader, "MAX_RETRIES", old)
        try:
            from tensorflow_datasets.core.utils import tqdm_utils
        except ImportError:
            tqdm_utils = None
        if isinstance(getattr(tqdm_utils, "_active", None), bool):
            stack.callback(tqdm_utils.display_progress_bar, tqdm_utils._active)
            tqdm_utils.display_progress_bar(False)
        urllib3_log = logging.getLogger("urllib3")
        level = urllib3_log.level
        urllib3_log.setLevel(logging.ERROR)
        yield
        # Restored only after a success: after a failure tfds' download threads go on
        # retrying (and warning) in the background while the error is reported.
        urllib3_log.setLevel(level)


def _is_network_error(err):
    """Whether `err`, or an exception it was raised from, is a failure to reach the server
    (no network, DNS, proxy, timeout)."""
    network = [ConnectionError, TimeoutError, socket.gaierror]
    try:
        import requests

        network += [requests.exceptions.ConnectionError, requests.exceptions.Timeout]
    except ImportError:
        pass
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, tuple(network)):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def _shorten(text, limit):
    """`text` cut at a word boundary to at most `limit` characters (… marks a cut)."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(" ,:;(") + " …"


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
        raise DataError(f"{images_src} has {len(images)} images but {labels_src} has "
                        f"{len(labels)} labels")
    if len(labels) == 0:
        raise DataError(f"{images_src}: no examples")
    low, high = labels.min(), labels.max()
    if low < 0 or high >= spec.num_classes:
        raise DataError(f"{labels_src}: labels span {low}..{high}, {name} has classes "
                        f"0..{spec.num_classes - 1}")
    images = images.reshape(len(images), h, w, c)  # (N, H, W, C)
    return images, labels.astype(np.int64)


# --------------------------------------------------------------------------- tf.data
# The `data.*` config keys that are make_dataset's augmentation arguments: AUGMENTATION_OFF
# (their defaults, the first release's pipeline) and SHIFT_FILLS come from capsnet.config,
# the augmentation config group's schema, as does check_augmentation.
# The elastic draws' stream: folded into the (seed, epoch) key, so the streams before it
# (order, shifts, flips, rotation/zoom) are what they were, and old runs replay unchanged.
# The erased boxes' stream likewise, after it.
_ELASTIC_STREAM = 3
_ERASE_STREAM = 4
_ELASTIC_PARTNER_STREAM = 5  # MultiMNIST: the partner digits' elastic noise (the bases': _ELASTIC_STREAM)
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


def _by_class(labels):
    return np.argsort(labels, kind="stable").astype(np.int64)


def _check_epoch_arguments(images, labels, *, batch_size, training, seed, epoch, drop_remainder):
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


def _epoch_order(n, training, seed, epoch):
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
    images, labels, batch_size, seed, epoch = _check_epoch_arguments(
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
            dataset = _map(dataset, load_batch)
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

        dataset = _map(dataset, load_example)
        dataset = dataset.batch(batch_size, drop_remainder=drop_remainder)
        if training and (elastic_alpha > 0 or erase_probability > 0):
            dataset = _map(dataset, finish_batch)
        # Prefetch the next batches while the model trains on this one.
        return dataset.prefetch(tf.data.AUTOTUNE)


def _map(dataset, fn):
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
    order, key, shift_key = _epoch_order(n, training, seed, epoch)
    draws = {"index": order}
    if not training:
        return draws, None
    # More independent streams from the (seed, epoch) key: the flips and the rotation/zoom
    # split from the shifts' key, the elastic noise and the erased boxes folded into it.
    flip_key, affine_key = tf.unstack(tf.random.experimental.stateless_split(shift_key, 2, alg="philox"))
    elastic_key = tf.random.experimental.stateless_fold_in(key, _ELASTIC_STREAM, alg="philox")
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


# --------------------------------------------------------------------------- MultiMNIST
# The key of the MultiMNIST test split: fixed (not the run's seed), so that every run and
# every evaluation scores the same test pairs.
MULTIMNIST_TEST_KEY = (2017, 6)


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
    images, labels, batch_size, seed, epoch = _check_epoch_arguments(
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
        dataset = _map(dataset, lambda d: pairs_from_draws(images_t, labels_t, d, shift_pixels=shift_pixels,
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
        order, key, pair_key = _epoch_order(n, training, seed, epoch)
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
            for name, stream in (("elastic_seed_a", _ELASTIC_STREAM), ("elastic_seed_b", _ELASTIC_PARTNER_STREAM)):
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


def _check_examples(images, labels):
    images, labels = np.asarray(images), np.asarray(labels)
    if images.ndim != 4 or images.dtype != np.uint8:
        raise DataError(f"images must be uint8 (N, H, W, C), got {images.dtype} {images.shape}")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"labels must be integers of shape (N,), got {labels.dtype} {labels.shape}")
    if len(images) != len(labels):
        raise DataError(f"{len(images)} images {images.shape} but {len(labels)} labels "
                        f"{labels.shape}")
    if len(labels) == 0:
        raise DataError(f"no examples: images {images.shape}")
    if labels.min() < np.iinfo(np.int32).min or labels.max() > np.iinfo(np.int32).max:
        raise DataError(f"labels span {labels.min()}..{labels.max()}, beyond int32")
    return images, labels
