"""Natural images, one label each: an image folder (data=folder: capsnet.folder's
layout) or tensorflow-datasets' cifar10, svhn_cropped and smallnorb.

Loading. A folder's files are decoded by tf.data in parallel (JPEG/PNG/BMP/GIF; grey or RGB
to data.channels; the shorter side resized to data.image_size, then the centre cropped to
a square) once, at load. Where the decoded split fits data.cache_memory_mb
(data.cache=auto) or with data.cache=memory it is kept in memory as a uint8 array; else
(data.cache=disk) tf.data writes it to a file cache (a capsnet-cache-* folder in
data.cache_dir, or in the system's temporary folder, removed at exit) that every epoch reads,
so a folder larger than memory trains; data.cache=none decodes the files every epoch. A file
that does not decode is skipped: the load says how many in one notice line (corrupt files in
a folder of thousands should not stop a run, and the count says that some were left out); so
is a file whose header declares more than data.max_pixels pixels, before any of it is decoded.
A disk cache that cannot be written, and a file that goes while data.cache=none reads the
folder every epoch, are one-line DataErrors; the cache folder of a process that died
without removing it (kill -9) is removed by the next process making a cache there
(`remove_orphaned_caches`).

Pipeline (`dataset`): training shuffles (an in-memory split by a stateless permutation of
(seed, epoch), as capsnet.data.make_dataset; a streamed one through a shuffle buffer seeded
by (seed, epoch)), then a batch at a time (capsnet.augment.natural_image_batch), each
example's draws keyed by (seed, epoch, position in the epoch): a random
data.crop x data.crop crop (the centre at test) of the image with its border reflected by
data.crop_padding pixels (training only), a left-right flip (data.flip), a random
brightness delta in ±data.brightness and contrast factor in [1 - c, 1 + c]
(data.contrast), then data.standardize's per-image standardisation (else pixels clipped
to [0, 1]): the authors' CIFAR-10 input (Sarasra/models, research/capsules,
input_data/cifar10/cifar10_input.py); then data.cutout's zeroed square (DeVries & Taylor
2017). Padding, crop, flip and cutout are the ResNet CIFAR-10 recipe (experiment=deep_cifar10)."""
import atexit
import datetime
import fcntl
import hashlib
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import numpy as np

from capsnet import folder
from capsnet.augment import natural_image_batch
from capsnet.console import count, say
from capsnet.data.pipeline import host_tensor, int32_labels
from capsnet.data.tfds import fail_fast_downloads, is_network_error, shorten
from capsnet.datasets import DEFAULT_MAX_PIXELS, source_shape, spec_class_names
from capsnet.errors import ConfigError, DataError
from capsnet.tasks.base import Split, Task, check_labels
from capsnet.tasks.holdout import validation_indices

_MB = 2 ** 20


class NaturalImages(Task):
    kind = "images"

    @property
    def num_classes(self):
        return len(self.class_names()) if self.name == "folder" else self.spec.num_classes

    def class_names(self, num_classes=None):
        if self.name != "folder":
            return spec_class_names(self.name, num_classes or self.spec.num_classes)
        names = self.cfg.get("class_names")
        if names is None:
            names = folder.class_names(self.cfg.get("dir"), self.cfg.get("test_fraction") or 0.0)
        return tuple(names)

    def example_shape(self, source_shape):
        h, w, c = source_shape
        crop = self.cfg.get("crop")
        return (crop, crop, c) if crop else (h, w, c)

    # ----------------------------------------------------------------- loading
    def load(self, split, *, limit=None):
        if self.name == "folder" or self.cfg.get("dir") is not None:  # cifar10 etc. from a folder of their images
            return self._load_folder(split, limit)
        images, labels, origin = load_tfds(self.name, split)
        size = self.cfg.get("image_size")
        if size and images.shape[1:3] != (size, size):
            images = _resize_array(images, size)
        if limit is not None and limit < len(labels):
            images, labels = images[:limit].copy(), labels[:limit].copy()
        return Split(labels=labels, images=images, shape=tuple(images.shape[1:]), origin=origin)

    def load_train_validation(self, *, limit=None, fraction=0.0):
        if not fraction or not (self.name == "folder" or self.cfg.get("dir") is not None):
            return super().load_train_validation(limit=limit, fraction=fraction)
        # A folder's files split before they are decoded: each part decoded (and cached) alone.
        return (self._load_folder("train", limit, validation_fraction=fraction),
                self._load_folder("train", limit, validation_fraction=fraction, held_out=True))

    def _load_folder(self, split, limit, validation_fraction=0.0, held_out=False):
        """`split` of the folder; with `validation_fraction`, the training files less the
        validation split's (capsnet.tasks.holdout), or with `held_out` the validation split's."""
        import tensorflow as tf

        cfg = self.cfg
        paths, labels = folder.split_files(cfg.get("dir"), split, cfg.get("test_fraction") or 0.0,
                                           classes=cfg.get("class_names") or self.spec.class_names)
        if limit is not None and limit < len(labels):
            # The first N of a shuffled (fixed) order, so that every class is in a small limit.
            keep = np.sort(np.random.default_rng(folder.SPLIT_SEED).permutation(len(labels))[:limit])
            paths, labels = [paths[i] for i in keep], labels[keep]
        if validation_fraction:
            kept, held = validation_indices(labels, validation_fraction, where=f"the training files of {cfg.get('dir')}")
            chosen = held if held_out else kept
            paths, labels = [paths[i] for i in chosen], labels[chosen]
            split = "validation" if held_out else split
        shape = source_shape(cfg)
        size, channels = shape[0], shape[2]
        # Files whose header declares more than data.max_pixels are never decoded (a few
        # hundred bytes can declare gigabytes of pixels); _skipped_notice names them.
        max_pixels = cfg.get("max_pixels", DEFAULT_MAX_PIXELS)
        candidates = [i for i, path in enumerate(paths) if folder.oversized(path, max_pixels) is None]
        decoded = (tf.data.Dataset.from_tensor_slices((tf.constant(candidates, tf.int64),
                                                       tf.constant([paths[i] for i in candidates], tf.string)))
                   .map(lambda i, p: (i, decode_image(p, size, channels)), num_parallel_calls=tf.data.AUTOTUNE,
                        deterministic=True)
                   .ignore_errors())
        mode = cache_mode(cfg, len(paths), shape)
        root = folder.root_dir(cfg.get("dir"))
        if mode == "memory":
            indices, images = [], []
            for i, image in decoded.batch(256):
                indices.append(i.numpy())
                images.append(image.numpy())
            kept = np.concatenate(indices) if indices else np.zeros((0,), np.int64)
            array = np.concatenate(images) if images else np.zeros((0, *shape), np.uint8)
            _skipped_notice(root, split, paths, kept)
            return Split(labels=labels[kept], images=array, shape=shape, origin=f"{root} ({split})")
        source = {"labels": labels}
        if mode == "disk":
            directory = _cache_dir(cfg, len(paths) * int(np.prod(shape)), root, split)
            stream = decoded.cache(f"{directory}/{split}")
            try:  # this pass writes the cache whole
                kept = np.concatenate([i.numpy() for i, _ in stream.batch(256)] or [np.zeros((0,), np.int64)])
            except tf.errors.OpError as exc:  # the decode's own errors are ignored above: the cache's write
                _remove_cache(directory)
                # TensorFlow's message ends in the OS's reason: "...tempstate123; File too large [Op:...]"
                reason = str(exc).strip().split(" [Op:")[0].split("; ")[-1].strip() or type(exc).__name__
                raise cache_write_error(cfg, root, split, len(paths) * int(np.prod(shape)), reason) from None
            _skipped_notice(root, split, paths, kept)
        else:  # none: decode every epoch
            kept = np.concatenate([i.numpy() for i, _ in decoded.batch(256)] or [np.zeros((0,), np.int64)])
            _skipped_notice(root, split, paths, kept)  # none decoded: an error here
            # The files that decoded, every epoch, nothing skipped silently: a file gone since
            # the load is an error (files_gone; dataset checks them at each epoch's start), not an
            # epoch cut short.
            source["paths"] = kept_paths = [paths[i] for i in kept]
            stream = (tf.data.Dataset.from_tensor_slices((tf.constant(kept, tf.int64), tf.constant(kept_paths)))
                      .map(lambda i, p: (i, decode_image(p, size, channels)), num_parallel_calls=tf.data.AUTOTUNE,
                           deterministic=True))
        return Split(labels=labels[kept], images=None, shape=shape, origin=f"{root} ({split}, {mode} cache)",
                     source={**source, "stream": stream})

    # ----------------------------------------------------------------- pipeline
    def dataset(self, data, *, batch_size, training, seed=0, epoch=0, drop_remainder=False):
        import tensorflow as tf

        n = len(data)
        if n == 0:
            raise DataError(f"{self.name}: no image in the split ({data.origin})")
        key = tf.constant([seed, epoch], tf.int64)
        with tf.device("/CPU:0"):
            if data.images is not None:
                images_t = host_tensor(data.images)  # once per split: see host_tensor
                labels_t = host_tensor(data.labels, int32_labels)
                if training:
                    shuffle_key = tf.random.experimental.stateless_fold_in(key, 0, alg="philox")
                    order = tf.random.experimental.stateless_shuffle(tf.range(n, dtype=tf.int64), seed=shuffle_key,
                                                                     alg="philox")
                else:
                    order = tf.range(n, dtype=tf.int64)
                # Whole batches gathered at once: a map per example costs more than its gather.
                batches = tf.data.Dataset.from_tensor_slices(order).batch(batch_size, drop_remainder=drop_remainder).map(
                    lambda i: (tf.gather(images_t, i), tf.gather(labels_t, i)))
            else:
                if "paths" in data.source:  # data.cache=none: read again now
                    _check_still_there(data)
                all_labels = host_tensor(data.source["labels"], int32_labels)
                examples = data.source["stream"].map(lambda i, image: (image, tf.gather(all_labels, i)))
                if training:
                    h, w, c = data.shape
                    buffer = int(min(n, max(1024, int(self.cfg.get("cache_memory_mb", 2048)) * _MB // 4 // (h * w * c))))
                    shuffle_seed = int(hashlib.sha256(f"{seed}/{epoch}".encode()).hexdigest()[:15], 16)
                    examples = examples.shuffle(buffer, seed=shuffle_seed, reshuffle_each_iteration=False)
                batches = examples.batch(batch_size, drop_remainder=drop_remainder)
            options = self._augmentation(training)

            def prepared(batch_index, batch):
                images, labels = batch
                positions = batch_index * batch_size + tf.range(tf.shape(labels, out_type=tf.int64)[0])
                return natural_image_batch(images, key, positions, **options), labels

            return batches.enumerate().map(prepared, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).prefetch(
                tf.data.AUTOTUNE)

    def _augmentation(self, training):
        cfg = self.cfg
        return {"training": training, "crop": cfg.get("crop"), "flip": bool(cfg.get("flip")) and training,
                "brightness": float(cfg.get("brightness") or 0) if training else 0.0,
                "contrast": float(cfg.get("contrast") or 0) if training else 0.0,
                "standardize": bool(cfg.get("standardize")),
                "padding": int(cfg.get("crop_padding") or 0) if training else 0,
                "cutout": int(cfg.get("cutout") or 0) if training else 0}

    def file_image(self, data, image_shape):
        """The model's input of an image file's bytes as the test pipeline makes it: decoded
        to the stored square (folder.decode_image_bytes: data.image_size, data.channels), the centre
        data.crop (natural_image_batch at test), scaled to [0, 1]; the standardisation is
        serving_images' (the export's signature's)."""
        size, _, channels = source_shape(self.cfg)
        stored = folder.decode_image_bytes(data, size, channels)[None]
        return natural_image_batch(stored, None, None, **{**self._augmentation(False), "standardize": False})[0]

    def serving_images(self, images):
        """The export's and predict's images (float32 [0, 1], resized to the model's input):
        per-image standardised where the run's pipeline did."""
        import tensorflow as tf

        return tf.image.per_image_standardization(images) if self.cfg.get("standardize") else images

    def check(self, data, model, split):
        check_labels(data.labels, None, model=model, split=f"{self.name} {split}",
                     image_shape=self.example_shape(data.shape))


def cache_mode(cfg, n, shape):
    """memory | disk | none: data.cache, auto deciding by the decoded size against
    data.cache_memory_mb."""
    mode = cfg.get("cache") or "auto"
    if mode != "auto":
        return mode
    decoded_mb = n * int(np.prod(shape)) / _MB
    return "memory" if decoded_mb <= cfg.get("cache_memory_mb", 2048) else "disk"


# --------------------------------------------------------------------------- the disk cache

CACHE_PREFIX = "capsnet-cache-"
_OWNER = "owner"  # in each cache folder: who made it; flock-held by that process for its life
_UNMARKED_AGE_S = 24 * 3600  # a cache folder without an owner file (older versions made them) this old goes
_CACHE_DIRS = {}  # this process's cache folders: {path: its owner file, open and locked}


def cache_write_error(cfg, root, split, size, reason):
    """The one-line DataError for a disk cache of `size` bytes that cannot be written."""
    where = (f"data.cache_dir={cfg['cache_dir']}" if cfg.get("cache_dir") is not None
             else f"data.cache_dir=null: {tempfile.gettempdir()}")
    return DataError(f"cannot write the disk cache of {root} ({split}, {size / _MB:.1f} MB decoded) in {where}: "
                     f"{reason}; free space there, set data.cache_dir to a folder on a disk with room, or "
                     "data.cache=memory (data.cache_memory_mb) or data.cache=none (decode the files every epoch); "
                     "the run's checkpoints are as they were: rerun the same command once fixed")


def _cache_dir(cfg, size, root, split):
    """A new cache folder (CACHE_PREFIX*) of this process in data.cache_dir (or the system's
    temporary folder), for a split of `size` bytes decoded: removed at exit, or, if the
    process dies first, by the next one making a cache there (its owner file's lock is gone:
    remove_orphaned_caches). A new folder each time: an incomplete cache is never read as a
    complete one. DataError at once if the disk has less room than the split."""
    parent = Path(os.path.expanduser(str(cfg.get("cache_dir") or tempfile.gettempdir())))
    making = None
    try:
        remove_orphaned_caches(parent)
        free = shutil.disk_usage(parent).free
        if free < size:
            raise cache_write_error(cfg, root, split, size, f"{free / _MB:.1f} MB free there")
        # Made under another name and locked before it is renamed into the pattern that
        # remove_orphaned_caches looks at: another process never sees it unlocked.
        making = Path(tempfile.mkdtemp(prefix="." + CACHE_PREFIX, dir=parent))
        owner = open(making / _OWNER, "w")
        fcntl.flock(owner, fcntl.LOCK_EX)
        owner.write(f"pid {os.getpid()}\nhost {socket.gethostname()}\nsince {datetime.datetime.now().isoformat()}\n")
        owner.flush()
        directory = parent / making.name[1:]
        os.rename(making, directory)
    except OSError as exc:  # the folder gone or read-only since the config's check, or full
        if making is not None:
            shutil.rmtree(making, ignore_errors=True)
        raise cache_write_error(cfg, root, split, size, exc.strerror or str(exc)) from None
    if not _CACHE_DIRS:
        atexit.register(lambda: [_remove_cache(d) for d in list(_CACHE_DIRS)])
    _CACHE_DIRS[directory] = owner
    return directory


def _remove_cache(directory):
    shutil.rmtree(directory, ignore_errors=True)
    owner = _CACHE_DIRS.pop(directory, None)
    if owner is not None:
        owner.close()


def remove_orphaned_caches(parent):
    """Remove the cache folders in `parent` whose process is gone: their owner file is not
    locked (the kernel drops a dead process's flock, kill -9 included), and names this host
    (another host's lock is not seen over every network file system: left alone); a folder
    without an owner file (an older version's) once untouched for a day. One notice line
    says what went."""
    removed, size = [], 0
    for directory in sorted(Path(parent).glob(CACHE_PREFIX + "*")):
        if directory in _CACHE_DIRS or not directory.is_dir():
            continue
        try:
            if not _owner_gone(directory):
                continue
            size += sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        except OSError:  # removed meanwhile, or not ours to read
            continue
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory.name)
    if removed:
        say(f"notice: removed {len(removed)} disk cache folder(s) in {parent} left by runs that ended without "
            f"removing them ({size / _MB:.0f} MB): {', '.join(removed)}")


def _owner_gone(directory):
    owner = directory / _OWNER
    if not owner.is_file():
        newest = max([directory.stat().st_mtime, *(f.stat().st_mtime for f in directory.rglob("*"))])
        return time.time() - newest > _UNMARKED_AGE_S
    lines = dict(line.split(" ", 1) for line in owner.read_text().splitlines() if " " in line)
    if lines.get("host") != socket.gethostname():
        return False
    with open(owner) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its process holds it
        return True


def _check_still_there(data):
    """DataError naming the files of a data.cache=none split that are gone since the load."""
    missing = [p for p in data.source["paths"] if not os.path.exists(p)]
    if missing:
        raise DataError(f"{len(missing)} image file(s) of {data.origin} are gone since the run started "
                        f"(data.cache=none reads them every epoch): {_named(missing)}; {_GONE_REMEDY}")


_GONE_REMEDY = ("the epoch is not saved; put the file(s) back (or leave them out: a rerun lists the folder again) and "
                "rerun the same command: the run resumes from its last saved epoch")


def files_gone(exc):
    """The one-line DataError for TensorFlow's error `exc` where it is an image file that a
    data.cache=none pipeline found gone (deleted or moved mid-epoch), else None."""
    import tensorflow as tf

    text = str(getattr(exc, "message", "")).split("\n")[0]
    if not isinstance(exc, tf.errors.NotFoundError) or "; No such file" not in text:
        return None
    # "... transformation with iterator: Iterator::Root::...::ParallelMapV2: /abs/path.png; No such file ...":
    # the folder's paths are absolute; the shortest such tail is the file.
    before = text[:text.index("; No such file")]
    tails = [before[i + 2:] for i in range(len(before) - 2, -1, -1) if before.startswith(": ", i)]
    path = next((tail for tail in tails if tail.startswith("/")), before)
    if Path(path).suffix.lower() not in folder.IMAGE_SUFFIXES or os.path.exists(path):
        return None
    return DataError(f"image file {path} is gone (deleted or moved while the run read it: data.cache=none reads the "
                     f"files every epoch); {_GONE_REMEDY}")


def _named(paths):
    return ", ".join(str(p) for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _skipped_notice(root, split, paths, kept):
    """`paths`: the split's files; `kept`: the indices of those that decoded (and were within
    data.max_pixels). The notice names the first few skipped, so that a user can find and
    mend them."""
    listed = len(paths)
    if len(kept) == 0:
        raise DataError(f"no image of {root} ({split}) could be decoded ({count(listed, 'file')})")
    if len(kept) < listed:
        skipped = sorted(set(range(listed)) - {int(i) for i in kept})
        named = ", ".join(str(paths[i]) for i in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        say(f"notice: {len(skipped)} of the {listed} {split} images of {root} could not be decoded (or have more "
            f"than data.max_pixels pixels) and are skipped: {named}")


def decode_image(path, size, channels):
    """folder.decode_image_bytes of the image file `path` (the folder pipeline's decoding)."""
    import tensorflow as tf

    return folder.decode_image_bytes(tf.io.read_file(path), size, channels)


def _resize_array(images, size):
    import tensorflow as tf

    return np.asarray(tf.cast(tf.clip_by_value(tf.round(tf.image.resize(images, (size, size), method="area")), 0, 255),
                              tf.uint8))


# --------------------------------------------------------------------------- tensorflow-datasets

def load_tfds(name, split):
    """(images uint8 (N, H, W, C), labels int64 (N,), origin) of tensorflow-datasets'
    `name`; smallnorb: the stereo pair (image, image2) as 2 channels, downsampled to
    48x48, labelled by label_category (5 classes). DataError (one line) where tfds cannot
    provide it (offline: no download)."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise DataError(f"tensorflow-datasets cannot be imported ({err}): install it, or train on an image folder "
                        "(data=folder data.dir=PATH)") from err
    try:
        with fail_fast_downloads():
            # Batches of a streamed split (not batch_size=-1: one tensor of the whole split).
            batches = list(tfds.as_numpy(tfds.load(name, split=split, data_dir=None).batch(4096)))
        if not batches:
            raise DataError(f"tensorflow-datasets' {name}/{split} has no examples")
        if name == "smallnorb":
            images = np.concatenate([np.concatenate([_resize_array(b[k], 48) for k in ("image", "image2")], -1)
                                     for b in batches])
            labels = np.concatenate([b["label_category"] for b in batches])
        else:
            images = np.concatenate([b["image"] for b in batches])
            labels = np.concatenate([b["label"] for b in batches])
    except Exception as err:  # tfds raises many types (requests, OSError, AssertionError, ...)
        why = "no network" if is_network_error(err) else shorten(
            f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}", 160)
        raise DataError(f"tensorflow-datasets cannot provide {name}/{split} ({why}); offline, train on a folder of "
                        f"its images: data=folder data.dir=PATH") from err
    return images.astype(np.uint8), labels.astype(np.int64), f"tensorflow-datasets {name}/{split}"
