"""Datasets: IDX files or tensorflow-datasets in, a reproducible tf.data pipeline out.

- `read_idx` / `write_idx`: the IDX format of the MNIST-family files (plain or gzip).
- `load_split(name, split, data_dir, limit)`: one split as NumPy arrays, from an IDX
  directory (offline) or from tensorflow-datasets (the online default).
- `make_dataset(images, labels, ...)`: batches of (float32 images in [0, 1], int32
  labels). Training batches are shuffled and augmented (the paper's random shifts;
  optionally flips, rotations and zoom, elastic distortions) with stateless RNG keyed by (seed, epoch), so
  an epoch's batches depend on nothing else: a run resumed at epoch e sees exactly
  what an uninterrupted run saw, whatever the parallelism.
- `make_multimnist_dataset(images, labels, ...)`: MultiMNIST (paper Sec. 6), pairs of
  shifted digits of different classes overlaid on a 36×36 canvas, generated on the fly
  from the MNIST arrays with the same stateless keying; `make_split_dataset(name, ...)`
  picks one or the other by dataset name.
"""
import contextlib
import gzip
import logging
import math
import os
import socket
import struct
import zlib

import numpy as np
import tensorflow as tf

from capsnet.config import AUGMENTATION_OFF, SHIFT_FILLS, check_augmentation  # noqa: F401  (re-exported)
from capsnet.datasets import DATASETS, DatasetSpec, example_shape, is_overlay  # noqa: F401  (re-exported)
from capsnet.errors import ConfigError, DataError
from capsnet.validation import boolean, float_in_range, integer

# --------------------------------------------------------------------------- IDX files
# An IDX file is a 4-byte magic (0x00, 0x00, type code, rank), `rank` big-endian uint32
# dims, then the C-order payload in big-endian. MNIST images are 0x00000803 (uint8,
# rank 3: N, rows, cols), labels 0x00000801 (uint8, rank 1: N).
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {dtype.newbyteorder("="): code for code, dtype in _IDX_DTYPES.items()}
_GZIP_MAGIC = b"\x1f\x8b"  # an IDX file starts with 0x0000, so this cannot be one


def read_idx(path):
    """Reads an IDX file, plain or gzip (told apart by the first bytes, not the name).

    Returns an array in native byte order with the header's dtype and shape. Any
    inconsistency (unreadable file, corrupt gzip, bad magic, unknown type code, a
    header or payload shorter or longer than the header says) raises `DataError`
    naming the file and the problem.
    """
    path = os.fspath(path)
    raw = _read_bytes(path)
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as err:
            # EOFError: the gzip stream was cut off; OSError/zlib.error: bad data.
            raise DataError(f"IDX file {path}: corrupt or truncated gzip data ({err})") from err

    if len(raw) < 4:
        raise DataError(f"IDX file {path}: truncated header ({len(raw)} bytes, need at least 4)")
    magic = struct.unpack(">I", raw[:4])[0]
    if raw[0] != 0 or raw[1] != 0:
        raise DataError(
            f"IDX file {path}: bad magic 0x{magic:08x} (IDX magic is 0x0000 + type code + rank, "
            f"e.g. 0x00000803 for images, 0x00000801 for labels)")
    code, rank = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        known = ", ".join(f"0x{c:02x}" for c in _IDX_DTYPES)
        raise DataError(f"IDX file {path}: unknown type code 0x{code:02x} in magic 0x{magic:08x} "
                        f"(known: {known})")
    if rank == 0:
        raise DataError(f"IDX file {path}: rank 0 in magic 0x{magic:08x} (need at least 1 dim)")

    header_len = 4 + 4 * rank
    if len(raw) < header_len:
        raise DataError(f"IDX file {path}: truncated header ({len(raw)} bytes, rank {rank} "
                        f"needs {header_len})")
    dims = struct.unpack(f">{rank}I", raw[4:header_len])
    dtype = _IDX_DTYPES[code]
    count = math.prod(dims)
    expected, actual = count * dtype.itemsize, len(raw) - header_len
    if actual < expected:
        raise DataError(f"IDX file {path}: truncated payload (header says shape {dims} of "
                        f"{dtype.newbyteorder('=').name}: {expected} bytes, file has {actual})")
    if actual > expected:
        raise DataError(f"IDX file {path}: {actual - expected} bytes after the payload that "
                        f"header shape {dims} describes (corrupt header?)")
    array = np.frombuffer(raw, dtype=dtype, count=count, offset=header_len).reshape(dims)
    return array.astype(dtype.newbyteorder("="))  # a writable native-order copy


def _read_bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError as err:
        raise DataError(f"IDX file {path} does not exist") from err
    except IsADirectoryError as err:
        raise DataError(f"IDX file {path} is a directory, not a file") from err
    except OSError as err:
        raise DataError(f"cannot read IDX file {path}: {err.strerror or err}") from err


def write_idx(path, array):
    """Writes `array` as an IDX file; gzip-compressed when `path` ends in `.gz`.

    Supported dtypes: uint8, int8, int16, int32, float32, float64 (the IDX types).
    """
    path = os.fspath(path)
    array = np.asarray(array)
    code = _IDX_CODES.get(array.dtype.newbyteorder("="))
    if code is None:
        names = ", ".join(d.name for d in _IDX_CODES)
        raise DataError(f"cannot write IDX file {path}: dtype {array.dtype} has no IDX type "
                        f"(supported: {names})")
    if not 1 <= array.ndim <= 255 or any(d >= 2**32 for d in array.shape):
        raise DataError(f"cannot write IDX file {path}: shape {array.shape} does not fit IDX "
                        f"(rank 1..255, dims < 2**32)")
    header = bytes((0, 0, code, array.ndim)) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + np.ascontiguousarray(array, dtype=_IDX_DTYPES[code]).tobytes()
    if path.endswith(".gz"):
        data = gzip.compress(data, mtime=0)  # mtime=0: the same array gives the same bytes
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as err:
        raise DataError(f"cannot write IDX file {path}: {err.strerror or err}") from err


# --------------------------------------------------------------------------- datasets
# DatasetSpec and DATASETS (what each name means) live in capsnet.datasets, without TensorFlow.

# split → IDX file-name prefix (the MNIST distribution calls the test split "t10k").
_IDX_PREFIX = {"train": "train", "test": "t10k"}

# tfds retries each URL 10 times with exponential backoff, so offline it takes minutes
# to report that there is no network. Two retries ride out a transient failure and
# give up within a second or two when there is no network at all.
_TFDS_MAX_RETRIES = 2


def idx_file_names(split):
    """The (images, labels) IDX base names of `split`; each may also end in `.gz`."""
    prefix = _IDX_PREFIX[split]
    return f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"


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
    if split not in _IDX_PREFIX:
        raise ConfigError(f"unknown split {split!r} (known: {', '.join(_IDX_PREFIX)})")
    if limit is not None:
        limit = integer("limit", limit, minimum=1, hint=" (null: all examples)", error=ConfigError)
    spec = DATASETS[name]
    if data_dir is None:
        images, labels, source = _load_tfds(name, spec, split, tfds_data_dir)
        images_src = labels_src = source
    else:
        images, labels, images_src, labels_src = _load_idx_dir(split, data_dir)
    images, labels = _check_split(name, spec, images, labels, images_src, labels_src)
    if limit is not None and limit < len(labels):
        # Copies, so the full arrays can be freed.
        images, labels = images[:limit].copy(), labels[:limit].copy()
    return images, labels


def _load_idx_dir(split, data_dir):
    data_dir = os.path.abspath(os.path.expanduser(os.fspath(data_dir)))
    bases = idx_file_names(split)
    if not os.path.isdir(data_dir):
        expected = ", ".join(f"{b}[.gz]" for s in _IDX_PREFIX for b in idx_file_names(s))
        raise DataError(f"data dir {data_dir} does not exist or is not a directory "
                        f"(it should hold the IDX files {expected})")
    paths = []
    for base in bases:
        candidates = [os.path.join(data_dir, base + suffix) for suffix in ("", ".gz")]
        found = [p for p in candidates if os.path.isfile(p)]
        if not found:
            raise DataError(f"data dir {data_dir} has no {base} or {base}.gz "
                            f"(the {split} split needs {bases[0]}[.gz] and {bases[1]}[.gz])")
        paths.append(found[0])
    images_path, labels_path = paths
    return read_idx(images_path), read_idx(labels_path), images_path, labels_path


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
_ELASTIC_STREAM = 3
AUGMENTATION_KEYS = ("shift_pixels", *AUGMENTATION_OFF)


def augmentation_options(data_cfg):
    """The AUGMENTATION_OFF keys of a `data` config section, each at its default where the
    section lacks it (a run saved before the key existed trained without it)."""
    return {key: data_cfg.get(key, off) for key, off in AUGMENTATION_OFF.items()}


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
                 shift_fill="zero", drop_remainder=False):
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
      Augmentations apply in the order flip, rotate/zoom, shift, elastic (the last on
        whole batches: its noise is drawn per example, so batching does not change it).

    Returns:
      A `tf.data.Dataset` of (images float32 (B, H, W, C) in [0, 1], labels int32 (B,)).
    """
    images, labels, batch_size, seed, epoch = _check_epoch_arguments(
        images, labels, batch_size=batch_size, training=training, seed=seed, epoch=epoch,
        drop_remainder=drop_remainder)
    n, h, w, c = images.shape
    shift_pixels = integer("shift_pixels", shift_pixels, minimum=0, maximum=min(h, w) - 1, error=ConfigError)
    flip, rotate_degrees, zoom, elastic_alpha, elastic_sigma, shift_fill = check_augmentation(
        flip=flip, rotate_degrees=rotate_degrees, zoom=zoom, elastic_alpha=elastic_alpha,
        elastic_sigma=elastic_sigma, shift_fill=shift_fill).values()

    # Pinned to the CPU: the arrays stay in host memory (tf.data runs there anyway) and
    # the shuffle is computed by the same kernel whether or not a GPU is visible.
    with tf.device("/CPU:0"):
        images_t = tf.constant(images)                    # (N, H, W, C) uint8
        labels_t = tf.constant(labels.astype(np.int32))   # (N,)
        order, key, shift_key = _epoch_order(n, training, seed, epoch)
        if training:
            # More independent streams from the (seed, epoch) key: the flips and the
            # rotation/zoom split from the shifts' key, the elastic noise folded into it.
            flip_key, affine_key = tf.unstack(
                tf.random.experimental.stateless_split(shift_key, 2, alg="philox"))
            elastic_key = tf.random.experimental.stateless_fold_in(key, _ELASTIC_STREAM, alg="philox")
        def example_key(stream_key, index):
            # Keyed by the example's index in `images`, not by its position in a batch
            # or thread, so its augmentation is the same however the map runs.
            return tf.random.experimental.stateless_fold_in(stream_key, index, alg="philox")

        def load_example(index):
            image = tf.gather(images_t, index)  # (H, W, C) uint8
            if training and flip:
                image = random_flip(image, example_key(flip_key, index))
            if training and (rotate_degrees > 0 or zoom > 0):
                image = random_rotate_zoom(tf.cast(image, tf.float32), rotate_degrees, zoom,
                                           example_key(affine_key, index))
            if training and shift_pixels > 0:
                image = random_shift(image, shift_pixels, example_key(shift_key, index), fill=shift_fill)
            example = (tf.cast(image, tf.float32) / 255.0, tf.gather(labels_t, index))
            if training and elastic_alpha > 0:
                # The example's displacement noise (keyed by its index, like the other
                # draws), applied below to whole batches: one chain of ops per batch
                # instead of one per image.
                example += (tf.random.stateless_uniform([h, w, 2], seed=example_key(elastic_key, index),
                                                        minval=-1.0, maxval=1.0, alg="philox"),)
            return example

        dataset = tf.data.Dataset.from_tensor_slices(order)
        dataset = dataset.map(load_example, num_parallel_calls=tf.data.AUTOTUNE,
                              deterministic=True)
        dataset = dataset.batch(batch_size, drop_remainder=drop_remainder)
        if training and elastic_alpha > 0:
            dataset = dataset.map(
                lambda x, y, noise: (elastic_distort(x, noise, elastic_alpha, elastic_sigma), y),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        # Prefetch the next batches while the model trains on this one.
        return dataset.prefetch(tf.data.AUTOTUNE)


# --------------------------------------------------------------------------- MultiMNIST
# The key of the MultiMNIST test split: fixed (not the run's seed), so that every run and
# every evaluation scores the same test pairs.
MULTIMNIST_TEST_KEY = (2017, 6)


def make_split_dataset(name, images, labels, *, batch_size, training, seed=0, epoch=0, shift_pixels=2,
                       drop_remainder=False, **augmentation):
    """make_dataset (with the `augmentation` keywords of AUGMENTATION_OFF), or
    make_multimnist_dataset for an overlay dataset (`name`), which takes none of them but
    their defaults (ConfigError naming the ones set)."""
    unknown = sorted(set(augmentation) - set(AUGMENTATION_OFF))
    if unknown:
        raise TypeError(f"make_split_dataset: unknown augmentation argument(s) {', '.join(unknown)}")
    if not is_overlay(name):
        return make_dataset(images, labels, batch_size=batch_size, training=training, seed=seed, epoch=epoch,
                            shift_pixels=shift_pixels, drop_remainder=drop_remainder, **augmentation)
    on = [f"data.{k}={v}" for k, v in augmentation.items() if v != AUGMENTATION_OFF[k]]
    if on:
        raise ConfigError(f"{name} takes no flip/rotate/zoom/elastic/shift_fill augmentation (its digits are "
                          f"shifted by data.shift_pixels on a zero canvas): set {', '.join(on)} to the default")
    return make_multimnist_dataset(images, labels, batch_size=batch_size, training=training, seed=seed,
                                   epoch=epoch, shift_pixels=shift_pixels, drop_remainder=drop_remainder)


def make_multimnist_dataset(images, labels, *, batch_size, training, seed=0, epoch=0, shift_pixels=4,
                            drop_remainder=False):
    """One epoch of MultiMNIST batches (Sabour et al. 2017, Sec. 6), generated on the fly.

    Each example of `images` (the base) is paired with a partner of a different class,
    drawn uniformly from the examples of the other classes; both are zero-padded by
    `shift_pixels` on every side (28 → 36 for the paper's 4), each is shifted by
    (dy, dx), each uniform in [-shift_pixels, shift_pixels], and the image is their sum
    clipped to 255 (then scaled to [0, 1]). One pair per base example per epoch.

    The partner and the two shifts are stateless functions of (key, base index): key =
    (seed, epoch) in training (a new pairing every epoch; the order is shuffled as in
    make_dataset), MULTIMNIST_TEST_KEY otherwise (training=False: the same pairs in the
    same order for every run and every evaluation). Independent of batching and of
    tf.data's parallelism.

    Args:
      images: uint8 (N, H, W, C) source digits; labels: integer (N,), at least two classes.
      batch_size, drop_remainder: as in make_dataset.
      shift_pixels: the largest shift (paper: 4), also the canvas border (≥ 0).

    Returns:
      A `tf.data.Dataset` of (images float32 (B, H', W', C) in [0, 1], labels int32 (B, 2)
      (base class, partner class), digits float32 (B, 2, H', W', C): each digit alone,
      shifted as in the image (the reconstruction targets)), H' = H + 2·shift_pixels.
    """
    images, labels, batch_size, seed, epoch = _check_epoch_arguments(
        images, labels, batch_size=batch_size, training=training, seed=seed, epoch=epoch,
        drop_remainder=drop_remainder)
    n = len(labels)
    shift_pixels = integer("shift_pixels", shift_pixels, minimum=0, maximum=64, error=ConfigError)
    if len(np.unique(labels)) < 2:
        raise DataError(f"MultiMNIST pairs digits of different classes: the {n} examples have only class "
                        f"{labels[0]}")
    s = shift_pixels
    # Indices sorted by class: class k's examples are by_class[start[k]:start[k] + count[k]],
    # so the examples of every other class are by_class without that block.
    by_class = np.argsort(labels, kind="stable")                          # (N,)
    classes = np.arange(int(labels.min()), int(labels.max()) + 1)
    count = np.array([np.sum(labels == k) for k in classes])              # (K,)
    start = np.concatenate([[0], np.cumsum(count)[:-1]])                  # (K,)
    low = int(classes[0])

    with tf.device("/CPU:0"):  # as in make_dataset
        images_t = tf.constant(images)                                    # (N, H, W, C) uint8
        labels_t = tf.constant(labels.astype(np.int32))                   # (N,)
        by_class_t = tf.constant(by_class.astype(np.int64))
        count_t, start_t = tf.constant(count.astype(np.int64)), tf.constant(start.astype(np.int64))
        order, _, pair_key = _epoch_order(n, training, seed, epoch)
        if not training:
            pair_key = tf.constant(MULTIMNIST_TEST_KEY, tf.int64)

        def load_pair(index):
            # Keyed by the base example's index: the same pair however the map runs.
            key = tf.random.experimental.stateless_fold_in(pair_key, index, alg="philox")
            partner_key, shift_a_key, shift_b_key = tf.unstack(
                tf.random.experimental.stateless_split(key, 3, alg="philox"))
            label = tf.gather(labels_t, index)
            k = tf.cast(label, tf.int64) - low
            # Uniform over the N - count[k] examples of the other classes: the j-th of
            # by_class with class k's block cut out.
            j = tf.random.stateless_uniform([], seed=partner_key, minval=0, maxval=n - count_t[k],
                                            dtype=tf.int64, alg="philox")
            partner = tf.gather(by_class_t, j + tf.where(j >= start_t[k], count_t[k], 0))
            digits = []
            for source, shift_key in ((index, shift_a_key), (partner, shift_b_key)):
                canvas = tf.pad(tf.gather(images_t, source), [[s, s], [s, s], [0, 0]])  # (H', W', C) uint8
                digits.append(tf.cast(random_shift(canvas, s, shift_key), tf.int32) if s else
                              tf.cast(canvas, tf.int32))
            overlay = tf.minimum(digits[0] + digits[1], 255)                            # clipped sum
            pair_labels = tf.stack([label, tf.gather(labels_t, partner)])               # (2,)
            return (tf.cast(overlay, tf.float32) / 255.0, pair_labels,
                    tf.cast(tf.stack(digits), tf.float32) / 255.0)                      # (2, H', W', C)

        dataset = tf.data.Dataset.from_tensor_slices(order)
        dataset = dataset.map(load_pair, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        dataset = dataset.batch(batch_size, drop_remainder=drop_remainder)
        return dataset.prefetch(tf.data.AUTOTUNE)


def random_shift(image, shift_pixels, key, fill="zero"):
    """Shifts one (H, W, C) image by (dy, dx), each uniform in [-shift_pixels, shift_pixels],
    drawn from the stateless RNG `key` (int64 (2,)); the uncovered border is zero
    (fill="zero") or repeats the nearest border pixel (fill="edge"). Both fills draw the
    same shift from the same key."""
    h, w, c = image.shape
    s = shift_pixels
    # A crop at corner (oy, ox) of the image padded by s is the image shifted by (s - oy, s - ox).
    corner = tf.random.stateless_uniform([2], seed=key, minval=0, maxval=2 * s + 1,
                                         dtype=tf.int32, alg="philox")
    if fill == "edge":
        # out[y, x] = image[clip(y - dy), clip(x - dx)] with (dy, dx) = s - corner.
        rows = tf.clip_by_value(tf.range(h) + corner[0] - s, 0, h - 1)
        cols = tf.clip_by_value(tf.range(w) + corner[1] - s, 0, w - 1)
        return tf.gather(tf.gather(image, rows, axis=0), cols, axis=1)  # (H, W, C)
    padded = tf.pad(image, [[s, s], [s, s], [0, 0]])  # (H + 2s, W + 2s, C), zero border
    return tf.slice(padded, [corner[0], corner[1], 0], [h, w, c])  # (H, W, C)


def random_flip(image, key):
    """Mirrors one (H, W, C) image left-right with probability 1/2 (stateless RNG `key`)."""
    mirror = tf.random.stateless_uniform([], seed=key, alg="philox") < 0.5
    return tf.cond(mirror, lambda: tf.reverse(image, axis=[1]), lambda: image)


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
