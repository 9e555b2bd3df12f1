"""Natural images, one label each: an image folder (data=folder: capsnet.folder's
layout) or tensorflow-datasets' cifar10, svhn_cropped and smallnorb.

Loading. A folder's files are decoded by tf.data in parallel (JPEG/PNG/BMP/GIF; grey or RGB
to data.channels; the shorter side resized to data.image_size, then the centre cropped to
a square) once, at load. Where the decoded split fits data.cache_memory_mb
(data.cache=auto) or with data.cache=memory it is kept in memory as a uint8 array; else
(data.cache=disk) tf.data writes it to a file cache (data.cache_dir, or a temporary folder
removed at exit) that every epoch reads, so a folder larger than memory trains;
data.cache=none decodes the files every epoch. A file that does not decode is skipped: the
load says how many in one notice line (corrupt files in a folder of thousands should not
stop a run, and the count says that some were left out); so is a file whose header declares
more than data.max_pixels pixels, before any of it is decoded.

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
import hashlib
import shutil
import tempfile

import numpy as np

from capsnet import folder
from capsnet.augment import natural_image_batch
from capsnet.console import say
from capsnet.data import _fail_fast_downloads, _is_network_error, _shorten, host_tensor, int32_labels
from capsnet.datasets import DEFAULT_MAX_PIXELS, source_shape, spec_class_names
from capsnet.errors import ConfigError, DataError
from capsnet.tasks.base import Split, Task, check_labels

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
            names = folder.class_names(self.cfg.get("dir"), self.cfg.get("validation_fraction") or 0.0)
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

    def _load_folder(self, split, limit):
        import tensorflow as tf

        cfg = self.cfg
        paths, labels = folder.split_files(cfg.get("dir"), split, cfg.get("validation_fraction") or 0.0,
                                           classes=cfg.get("class_names") or self.spec.class_names)
        if limit is not None and limit < len(labels):
            # The first N of a shuffled (fixed) order, so that every class is in a small limit.
            keep = np.sort(np.random.default_rng(folder.SPLIT_SEED).permutation(len(labels))[:limit])
            paths, labels = [paths[i] for i in keep], labels[keep]
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
        if mode == "disk":
            stream = decoded.cache(_cache_file(cfg, split, paths))
        else:  # none: decode every epoch
            stream = decoded
        kept = np.concatenate([i.numpy() for i, _ in stream.batch(256)] or [np.zeros((0,), np.int64)])
        _skipped_notice(root, split, paths, kept)
        if mode == "none" and len(kept) < len(paths):
            kept_paths = [paths[i] for i in kept]
            stream = (tf.data.Dataset.from_tensor_slices((tf.constant(kept, tf.int64), tf.constant(kept_paths)))
                      .map(lambda i, p: (i, decode_image(p, size, channels)), num_parallel_calls=tf.data.AUTOTUNE,
                           deterministic=True))
        return Split(labels=labels[kept], images=None, shape=shape, origin=f"{root} ({split}, {mode} cache)",
                     source={"stream": stream, "labels": labels})

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


_CACHE_DIRS = []


def _cache_file(cfg, split, paths):
    """A new file-cache path for this process (removed at exit): an incomplete cache left
    by a killed run is never read as a complete one."""
    directory = tempfile.mkdtemp(prefix="capsnet-cache-", dir=cfg.get("cache_dir"))
    if not _CACHE_DIRS:
        atexit.register(lambda: [shutil.rmtree(d, ignore_errors=True) for d in _CACHE_DIRS])
    _CACHE_DIRS.append(directory)
    return f"{directory}/{split}"


def _skipped_notice(root, split, paths, kept):
    """`paths`: the split's files; `kept`: the indices of those that decoded (and were within
    data.max_pixels). The notice names the first few skipped, so that a user can find and
    mend them."""
    listed = len(paths)
    if len(kept) == 0:
        raise DataError(f"no image of {root} ({split}) could be decoded ({listed} files)")
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
        with _fail_fast_downloads():
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
        why = "no network" if _is_network_error(err) else _shorten(
            f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}", 160)
        raise DataError(f"tensorflow-datasets cannot provide {name}/{split} ({why}); offline, train on a folder of "
                        f"its images: data=folder data.dir=PATH") from err
    return images.astype(np.uint8), labels.astype(np.int64), f"tensorflow-datasets {name}/{split}"
