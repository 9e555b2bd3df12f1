"""An image folder's classes and files, from the paths alone (no TensorFlow: the config's
resolvers list the classes before the TensorFlow import).

Layout: DIR/train/<class>/* and DIR/test/<class>/*, or DIR/<class>/* with
data.test_fraction > 0 (that share of each class's files, drawn with a fixed seed,
is the test split). Classes are the folder names, sorted; images are the files ending in
IMAGE_SUFFIXES (other files are ignored), in sorted order.

An image file's size is read from its header (image_dimensions, oversized: data.max_pixels)
without decoding it; decode_image_bytes is the one decoding of an image file to the stored
square, for the folder pipeline and for predict (it imports TensorFlow when called).
"""
import os
import struct
from pathlib import Path

import numpy as np

from capsnet.errors import ConfigError, DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
# JPEG's start-of-frame markers (SOF0-SOF15 but DHT, JPG and DAC): the frame's size follows.
_JPEG_FRAMES = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
SPLIT_SEED = 20170  # data.test_fraction's draw: the same test files in every run


def root_dir(data_dir):
    """The folder data.dir names, absolute: ConfigError where it is not given, DataError where
    it is not a directory."""
    if data_dir is None or str(data_dir).strip() == "":
        raise ConfigError("data=folder needs data.dir=PATH: a folder of class folders (PATH/train/<class>/*, "
                          "PATH/test/<class>/*, or PATH/<class>/* with data.test_fraction)")
    root = Path(os.path.expanduser(str(data_dir))).absolute()
    if not root.is_dir():
        raise DataError(f"data dir {root} does not exist or is not a directory (data=folder reads "
                        f"{root}/train/<class>/* and {root}/test/<class>/*)")
    return root


def _class_dirs(folder):
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _images(class_dir):
    return sorted(str(p) for p in class_dir.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def _split_folder(folder, what):
    """{class name: [files]} of `folder` (DataError for an empty folder or a class folder
    without images)."""
    classes = _class_dirs(folder)
    if not classes:
        raise DataError(f"{what} {folder} has no class folders (expected {folder}/<class>/<image files>)")
    files = {}
    for class_dir in classes:
        found = _images(class_dir)
        if not found:
            raise DataError(f"class folder {class_dir} has no images (looked for {', '.join(IMAGE_SUFFIXES)} files)")
        files[class_dir.name] = found
    return files


def layout(data_dir, test_fraction=0.0):
    """(root, classes, {"train": {class: files}, "test": {class: files}})."""
    root = root_dir(data_dir)
    train, test = root / "train", root / "test"
    if train.is_dir() or test.is_dir():
        if not (train.is_dir() and test.is_dir()):
            missing = test if train.is_dir() else train
            raise DataError(f"data dir {root} has {(train if train.is_dir() else test).name}/ but no {missing.name}/: "
                            f"give both, or put the class folders directly in {root} with data.test_fraction")
        if test_fraction:
            raise ConfigError(f"data.test_fraction={test_fraction}: {root} has its own test/ folder "
                              "(set it to 0)")
        splits = {"train": _split_folder(train, "the training folder"), "test": _split_folder(test, "the test folder")}
        if list(splits["train"]) != list(splits["test"]):
            only_train = sorted(set(splits["train"]) - set(splits["test"]))
            only_test = sorted(set(splits["test"]) - set(splits["train"]))
            raise DataError(f"{train} and {test} have different classes: "
                            + "; ".join(part for part in (f"only in train/: {', '.join(only_train)}" if only_train else "",
                                                         f"only in test/: {', '.join(only_test)}" if only_test else "")
                                        if part))
        return root, list(splits["train"]), splits
    if not test_fraction:
        if not _class_dirs(root):
            raise DataError(f"data dir {root} is empty: expected {root}/train/<class>/* and {root}/test/<class>/* "
                            "(or class folders with data.test_fraction)")
        raise ConfigError(f"data dir {root} has no train/ and test/ folders: split its class folders with "
                          "data.test_fraction=0.1 (say), or make train/ and test/ (data.validation_fraction holds out "
                          "validation images of the training split, not a test split)")
    files = _split_folder(root, "data dir")
    rng = np.random.default_rng(SPLIT_SEED)
    splits = {"train": {}, "test": {}}
    for name, found in files.items():
        order = rng.permutation(len(found))
        n_test = int(round(len(found) * test_fraction))
        if n_test < 1 or n_test >= len(found):
            raise DataError(f"class folder {root / name} has {len(found)} images: data.test_fraction="
                            f"{test_fraction} leaves {'no test' if n_test < 1 else 'no training'} image")
        splits["test"][name] = [found[i] for i in sorted(order[:n_test])]
        splits["train"][name] = [found[i] for i in sorted(order[n_test:])]
    return root, list(files), splits


def class_names(data_dir, test_fraction=0.0):
    """The folder's classes (sorted folder names)."""
    return layout(data_dir, test_fraction)[1]


def split_files(data_dir, split, test_fraction=0.0, classes=None):
    """(paths list, labels int64 array) of `split`; `classes` (the run's stored names):
    DataError if the folder's differ from them."""
    root, found, splits = layout(data_dir, test_fraction)
    if classes is not None and list(classes) != list(found):
        raise DataError(f"{root} has the classes {', '.join(found)}, but the run was trained on "
                        f"{', '.join(classes)} (data.class_names)")
    paths, labels = [], []
    for k, name in enumerate(found):
        paths += splits[split][name]
        labels += [k] * len(splits[split][name])
    return paths, np.asarray(labels, np.int64)


def image_dimensions(file):
    """(width, height) of the PNG, JPEG, GIF or BMP image in the binary `file` (an open file
    or io.BytesIO), read from its header without decoding it (a 300-byte PNG can declare
    200000 x 1 pixels); None for any other format or a header that names no size."""
    head = file.read(26)
    if head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR" and len(head) >= 24:
        return struct.unpack(">II", head[16:24])
    if head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 13:  # signature + logical screen descriptor
        return struct.unpack("<HH", head[6:10])
    if head.startswith(b"BM") and len(head) >= 26:
        if struct.unpack("<I", head[14:18])[0] == 12:  # BITMAPCOREHEADER: 16-bit sizes
            return struct.unpack("<HH", head[18:22])
        width, height = struct.unpack("<ii", head[18:26])
        return abs(width), abs(height)  # a negative height: rows stored top-down
    if head.startswith(b"\xff\xd8"):
        return _jpeg_dimensions(file)
    return None


def _jpeg_dimensions(file):
    """A JPEG's (width, height) from its first start-of-frame segment (after any APPn
    segments, an Exif thumbnail's included, which the walk skips by their lengths)."""
    file.seek(2)
    while True:
        if file.read(1) != b"\xff":  # not at a marker: not a JPEG this walk understands
            return None
        marker = file.read(1)
        while marker == b"\xff":  # fill bytes before the marker's code
            marker = file.read(1)
        if not marker:
            return None
        code = marker[0]
        if code in (0x01, *range(0xD0, 0xD8)):  # markers without a segment
            continue
        if code in (0xD9, 0xDA):  # end of image, start of scan: no frame before it
            return None
        length = file.read(2)
        if len(length) < 2:
            return None
        if code in _JPEG_FRAMES:
            frame = file.read(5)
            if len(frame) < 5:
                return None
            height, width = struct.unpack(">HH", frame[1:5])
            return width, height
        file.seek(struct.unpack(">H", length)[0] - 2, os.SEEK_CUR)


def oversized(path, max_pixels):
    """"WxH" where the image file at `path` declares more than `max_pixels` pixels, else None
    (a file that cannot be read or whose header names no size: left to the decoder)."""
    try:
        with open(path, "rb") as file:
            size = image_dimensions(file)
    except OSError:
        return None
    if size is None or size[0] * size[1] <= max_pixels:
        return None
    return f"{size[0]}x{size[1]}"


def decode_image_bytes(data, size, channels):
    """uint8 (size, size, channels) of an image file's bytes `data`: decoded (JPEG/PNG/BMP/GIF,
    its first frame), alpha dropped, grey and RGB converted to `channels`, the shorter
    side resized to `size` (area when shrinking, bilinear when enlarging) and the centre
    cropped to a square. An image already size x size keeps its pixels. What the folder
    pipeline stores (capsnet.tasks.images.decode_image) and predict gives a model
    (Task.file_image): one decoding for both."""
    import tensorflow as tf  # here, not at the top: the config's resolvers read this module before TensorFlow

    image = tf.io.decode_image(data, channels=0, dtype=tf.uint8, expand_animations=False)
    c = tf.shape(image)[-1]
    image = image[..., :tf.where((c == 2) | (c == 4), c - 1, c)]           # alpha dropped
    image = tf.cond(tf.shape(image)[-1] == 1, lambda: tf.tile(image, [1, 1, 3]), lambda: image)
    image = tf.ensure_shape(image, [None, None, 3])
    if channels == 1:
        image = tf.image.rgb_to_grayscale(image)
    elif channels == 2:
        raise ConfigError("data.channels=2: a folder's images are grey (1) or RGB (3)")
    h, w = tf.shape(image)[0], tf.shape(image)[1]

    def resized():
        scale = size / tf.cast(tf.minimum(h, w), tf.float32)
        new = tf.maximum(tf.cast(tf.round(tf.cast(tf.stack([h, w]), tf.float32) * scale), tf.int32), size)
        shrinking = scale < 1
        pixels = tf.cond(shrinking,
                         lambda: tf.image.resize(image, new, method="area"),
                         lambda: tf.image.resize(image, new, method="bilinear"))
        return tf.cast(tf.clip_by_value(tf.round(pixels), 0, 255), tf.uint8)

    image = tf.cond((h == size) & (w == size), lambda: image, resized)
    return tf.ensure_shape(tf.image.resize_with_crop_or_pad(image, size, size), [size, size, channels])


def looks_like_image_folder(path):
    """Whether `path` is laid out as data=folder reads it: class folders of image files,
    directly in it or in its train/ (the first image found is enough)."""
    root = Path(os.path.expanduser(str(path)))
    for parent in (root / "train", root):
        if parent.is_dir() and any(any(p.suffix.lower() in IMAGE_SUFFIXES for p in d.iterdir() if p.is_file())
                                   for d in _class_dirs(parent)):
            return True
    return False
