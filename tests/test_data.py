"""capsnet.data, capsnet.idx, capsnet.augment: IDX files, split loading, the augmentation
math and the tf.data pipeline.

References are independent of the code under test: IDX bytes built by hand with
`struct`, shifts computed by NumPy slicing, permutations checked by sorting.
"""
import gzip
import re
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from capsnet.augment import elastic_distort, elastic_noise, fold_in_seed, rotate_zoom
from capsnet.data import load_split, make_dataset
from capsnet.data.pipeline import ELASTIC_STREAM, epoch_order
from capsnet.errors import ConfigError, DataError
from capsnet.idx import read_idx, write_idx
from conftest import collect, load_script, numpy_shift

REAL_MNIST = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mnist"


def idx_bytes(array, code):
    """A hand-built IDX encoding: the reference for write_idx and input for read_idx."""
    header = bytes((0, 0, code, array.ndim)) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def tiny_images(n, seed=0, size=28):
    # Values 1..255, never 0: a shifted-in zero border is always distinguishable.
    return np.random.default_rng(seed).integers(1, 256, size=(n, size, size), dtype=np.uint8)


def write_split(directory, prefix, images, labels, gz=True):
    suffix = ".gz" if gz else ""
    write_idx(directory / f"{prefix}-images-idx3-ubyte{suffix}", images)
    write_idx(directory / f"{prefix}-labels-idx1-ubyte{suffix}", labels)


# ----------------------------------------------------------------------------- IDX
@pytest.mark.parametrize("dtype, code", [
    (np.uint8, 0x08), (np.int8, 0x09), (np.int16, 0x0B), (np.int32, 0x0C),
    (np.float32, 0x0D), (np.float64, 0x0E)])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip_matches_numpy_and_hand_built_bytes(tmp_path, dtype, code, suffix):
    rng = np.random.default_rng(1)
    array = (rng.normal(size=(3, 5, 7)) * 100).astype(dtype)
    path = tmp_path / f"a.idx{suffix}"
    write_idx(path, array)

    raw = path.read_bytes()
    if suffix:
        assert raw[:2] == b"\x1f\x8b"
        raw = gzip.decompress(raw)
    assert raw == idx_bytes(array, code)

    back = read_idx(path)
    assert back.dtype == np.dtype(dtype) and back.dtype.isnative
    assert back.shape == array.shape
    np.testing.assert_array_equal(back, array)
    back[0, 0, 0] = 0  # a writable copy, not a view of the file buffer


def test_read_idx_detects_gzip_by_magic_not_name(tmp_path):
    labels = np.arange(10, dtype=np.uint8)
    gz_without_suffix = tmp_path / "labels-idx1-ubyte"
    gz_without_suffix.write_bytes(gzip.compress(idx_bytes(labels, 0x08)))
    plain_with_suffix = tmp_path / "labels-idx1-ubyte.gz"
    plain_with_suffix.write_bytes(idx_bytes(labels, 0x08))
    np.testing.assert_array_equal(read_idx(gz_without_suffix), labels)
    np.testing.assert_array_equal(read_idx(str(plain_with_suffix)), labels)


def test_read_idx_mnist_magic_numbers(tmp_path):
    images = tiny_images(2)
    path = tmp_path / "img"
    write_idx(path, images)
    assert struct.unpack(">I", path.read_bytes()[:4])[0] == 0x00000803
    write_idx(path, np.zeros(4, np.uint8))
    assert struct.unpack(">I", path.read_bytes()[:4])[0] == 0x00000801


GOOD = idx_bytes(np.arange(24, dtype=np.uint8).reshape(2, 3, 4), 0x08)


@pytest.mark.parametrize("content, gz, words", [
    (GOOD[:-1], False, "truncated payload"),
    (GOOD[:20], False, "truncated payload"),
    (GOOD[:10], False, "truncated header"),
    (b"", False, "truncated header"),
    (GOOD + b"\x00", False, "after the payload"),
    (b"\x12\x34" + GOOD[2:], False, "bad magic 0x12340803"),
    (b"\x00\x00\x07\x03" + GOOD[4:], False, "unknown type code 0x07"),
    (b"\x00\x00\x08\x00", False, "rank 0"),
    # Wrong dims: the header claims 2x3x5 but the payload holds 2x3x4.
    (GOOD[:4] + struct.pack(">3I", 2, 3, 5) + GOOD[16:], False, "truncated payload"),
    (GOOD[:4] + struct.pack(">3I", 2, 3, 3) + GOOD[16:], False, "after the payload"),
    (gzip.compress(GOOD, mtime=0)[:-12], True, "gzip"),
    (gzip.compress(GOOD[:-3], mtime=0), True, "truncated payload"),
    (b"\x1f\x8b" + b"garbage" * 5, True, "gzip"),
])
def test_corrupt_idx_raises_data_error_naming_file(tmp_path, content, gz, words):
    path = tmp_path / ("broken.gz" if gz else "broken")
    path.write_bytes(content)
    with pytest.raises(DataError) as err:
        read_idx(path)
    assert str(path) in str(err.value)
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def test_read_idx_missing_or_directory(tmp_path):
    with pytest.raises(DataError, match="does not exist") as err:
        read_idx(tmp_path / "nope-idx3-ubyte")
    assert str(tmp_path / "nope-idx3-ubyte") in str(err.value)
    with pytest.raises(DataError, match="directory"):
        read_idx(tmp_path)


def test_write_idx_rejects_unsupported_arrays(tmp_path):
    with pytest.raises(DataError, match="float16"):
        write_idx(tmp_path / "x", np.zeros(3, np.float16))
    with pytest.raises(DataError, match=r"shape \(\)"):
        write_idx(tmp_path / "x", np.uint8(3))


# ----------------------------------------------------------------------------- load_split
@pytest.fixture
def idx_dir(tmp_path):
    """A tiny MNIST-format dir: train gzip, test plain (both spellings are accepted)."""
    train_x, train_y = tiny_images(12, seed=1), (np.arange(12) % 10).astype(np.uint8)
    test_x, test_y = tiny_images(5, seed=2), np.array([3, 1, 4, 1, 5], np.uint8)
    write_split(tmp_path, "train", train_x, train_y, gz=True)
    write_split(tmp_path, "t10k", test_x, test_y, gz=False)
    return tmp_path, (train_x, train_y), (test_x, test_y)


@pytest.mark.parametrize("split", ["train", "test"])
def test_load_split_from_idx_dir(idx_dir, split):
    directory, train, test = idx_dir
    want_x, want_y = train if split == "train" else test
    for name in ("mnist", "fashion_mnist"):
        images, labels = load_split(name, split, data_dir=str(directory))
        assert images.dtype == np.uint8 and images.shape == (len(want_y), 28, 28, 1)
        assert labels.dtype == np.int64 and labels.shape == (len(want_y),)
        np.testing.assert_array_equal(images[..., 0], want_x)
        np.testing.assert_array_equal(labels, want_y)


def test_load_split_limit(idx_dir):
    directory, (train_x, train_y), _ = idx_dir
    images, labels = load_split("mnist", "train", directory, limit=3)
    np.testing.assert_array_equal(images[..., 0], train_x[:3])
    np.testing.assert_array_equal(labels, train_y[:3])
    images, labels = load_split("mnist", "train", directory, limit=np.int64(1000))  # > N: all
    assert len(images) == len(labels) == 12
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(ConfigError, match="limit"):
            load_split("mnist", "train", directory, limit=bad)


def test_load_split_rejects_unknown_name_or_split(idx_dir):
    directory = idx_dir[0]
    with pytest.raises(ConfigError, match="cifar.*fashion_mnist, folder, mnist"):
        load_split("cifar", "train", directory)
    with pytest.raises(ConfigError, match="'validation'.*train, test"):
        load_split("mnist", "validation", directory)


def test_load_split_missing_dir_names_path_and_files(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(DataError) as err:
        load_split("mnist", "train", missing)
    message = str(err.value)
    assert str(missing) in message and "does not exist" in message
    assert "train-images-idx3-ubyte" in message and "t10k-labels-idx1-ubyte" in message


def test_load_split_missing_file_names_dir_and_file(tmp_path):
    write_split(tmp_path, "train", tiny_images(3), np.zeros(3, np.uint8))
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", tiny_images(3))
    load_split("mnist", "train", tmp_path)  # the complete split loads
    with pytest.raises(DataError) as err:
        load_split("mnist", "test", tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message and "t10k-labels-idx1-ubyte" in message


def test_load_split_relative_dir(idx_dir, monkeypatch):
    directory = idx_dir[0]
    monkeypatch.chdir(directory.parent)
    images, _ = load_split("mnist", "test", directory.name)
    assert len(images) == 5


@pytest.mark.parametrize("images, labels, words", [
    (tiny_images(4), np.zeros(3, np.uint8), "has 4 images but"),
    (tiny_images(1), np.zeros(2, np.uint8), "has 1 image but"),
    (tiny_images(2), np.zeros(1, np.uint8), "has 1 label"),
    (tiny_images(3, size=32), np.zeros(3, np.uint8), "(3, 32, 32)"),
    (tiny_images(3).astype(np.float32), np.zeros(3, np.uint8), "float32"),
    (tiny_images(3)[:, :, :, None, None], np.zeros(3, np.uint8), "(3, 28, 28, 1, 1)"),
    (tiny_images(3), np.zeros((3, 1), np.uint8), "(3, 1)"),
    (tiny_images(3), np.array([0, 10, 2], np.uint8), "0..10"),
    (tiny_images(0), np.zeros(0, np.uint8), "no examples"),
])
def test_load_split_rejects_inconsistent_files(tmp_path, images, labels, words):
    write_split(tmp_path, "train", images, labels, gz=False)
    with pytest.raises(DataError) as err:
        load_split("mnist", "train", tmp_path)
    assert words in str(err.value)
    assert str(tmp_path / "train-") in str(err.value)


def test_load_split_corrupt_file_names_it(tmp_path):
    write_split(tmp_path, "train", tiny_images(3), np.zeros(3, np.uint8))
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(DataError, match="gzip") as err:
        load_split("mnist", "train", tmp_path)
    assert str(path) in str(err.value)


@pytest.mark.skipif(not REAL_MNIST.is_dir(), reason=f"{REAL_MNIST} absent")
def test_real_mnist_files():
    train_x, train_y = load_split("mnist", "train", REAL_MNIST)
    test_x, test_y = load_split("mnist", "test", REAL_MNIST)
    # The full official training set (shared/data/README: sha256 equal to tfds' records).
    assert train_x.shape == (60000, 28, 28, 1) and train_y.shape == (60000,)
    # Its published per-class counts (LeCun et al.'s distribution: 5,421 fives ... 6,742 ones).
    assert np.bincount(train_y).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert test_x.shape == (10000, 28, 28, 1) and test_y.shape == (10000,)
    for labels in (train_y, test_y):
        assert set(np.unique(labels)) == set(range(10))
    # Digits are dark backgrounds with bright strokes: real images, not noise.
    assert test_x.max() == 255 and 0.05 < (test_x > 128).mean() < 0.3
    # The official test set is balanced to within a few hundred per class.
    assert np.bincount(test_y).min() > 850


@pytest.mark.timeout(120)  # unbounded tfds retries would take minutes
def test_tfds_offline_fails_fast_naming_data_dir(tmp_path, monkeypatch):
    # A proxy on a closed local port makes every download fail at once, whether or
    # not this machine has internet; the empty data dir has nothing prepared.
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    start = time.monotonic()
    with pytest.raises(DataError) as err:  # fashion_mnist: offline mnist is the bundled sample (test_first_run.py)
        load_split("fashion_mnist", "train", tfds_data_dir=str(tmp_path))
    elapsed = time.monotonic() - start
    message = str(err.value)
    assert "data.dir=" in message and "tensorflow-datasets" in message
    assert "\n" not in message
    assert elapsed < 60, f"took {elapsed:.0f}s: tfds retried for too long"


@pytest.mark.timeout(120)
def test_tfds_offline_error_is_short_and_says_no_network(tmp_path, monkeypatch, capfd):
    # The closed-port proxy of the test above: the message names the cause in words (not
    # the urllib3 retry report, cut mid-word), and no progress bars or retry warnings
    # are printed before it.
    import logging

    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    urllib3_log = logging.getLogger("urllib3")
    level = urllib3_log.level
    try:
        with pytest.raises(DataError) as err:  # fashion_mnist: offline mnist is the bundled sample
            load_split("fashion_mnist", "test", tfds_data_dir=str(tmp_path))
    finally:
        urllib3_log.setLevel(level)  # a failed download leaves it at ERROR
    message = str(err.value)
    assert message.startswith("could not download fashion_mnist with tensorflow-datasets (no network); offline, use "
                              "data.dir=/path/to/idx")
    assert len(message) < 200 and "Error" not in message
    printed = capfd.readouterr()
    assert "Dl Completed" not in printed.err and "Retrying" not in printed.err + printed.out


def test_tfds_path_converts_and_validates(tmp_path, monkeypatch):
    # No network here, so tfds.load itself is replaced: this checks what load_split
    # asks of it and does with its answer.
    tfds = pytest.importorskip("tensorflow_datasets")
    images, labels = tiny_images(6, seed=4)[..., None], np.array([0, 1, 2, 3, 4, 9])
    calls = []

    def fake_load(name, **kwargs):
        calls.append((name, kwargs))
        return tf.constant(images), tf.constant(labels, tf.int64)

    monkeypatch.setattr(tfds, "load", fake_load)
    got_x, got_y = load_split("fashion_mnist", "test", limit=4, tfds_data_dir=str(tmp_path))
    assert calls == [("fashion_mnist", dict(split="test", as_supervised=True, batch_size=-1,
                                            data_dir=str(tmp_path)))]
    assert got_x.dtype == np.uint8 and got_y.dtype == np.int64
    np.testing.assert_array_equal(got_x, images[:4])
    np.testing.assert_array_equal(got_y, labels[:4])

    labels[5] = 10  # out of range for 10 classes
    with pytest.raises(DataError, match="tensorflow-datasets fashion_mnist/test.*0..10"):
        load_split("fashion_mnist", "test", tfds_data_dir=str(tmp_path))


# ----------------------------------------------------------------------------- make_dataset
@pytest.fixture(scope="module")
def examples():
    """60 noise images with unique labels (= index), so outputs map back to sources."""
    return tiny_images(60, seed=3)[..., None], np.arange(60, dtype=np.int64)


def test_eval_dataset_shapes_order_and_values(examples):
    images, labels = examples
    dataset = make_dataset(images, labels, batch_size=16, training=False)
    assert dataset.element_spec[0].dtype == tf.float32
    assert dataset.element_spec[1].dtype == tf.int32
    batches = list(dataset)
    assert [len(y) for _, y in batches] == [16, 16, 16, 12]
    assert all(x.shape[1:] == (28, 28, 1) for x, _ in batches)
    got_x, got_y = collect(dataset)
    np.testing.assert_array_equal(got_y, labels)  # order preserved
    np.testing.assert_array_equal(got_x, images.astype(np.float32) / np.float32(255))
    assert got_x.min() >= 0 and got_x.max() <= 1


def test_drop_remainder(examples):
    images, labels = examples
    dataset = make_dataset(images, labels, batch_size=16, training=True, drop_remainder=True)
    assert [len(y) for _, y in dataset] == [16, 16, 16]
    assert dataset.element_spec[0].shape.as_list() == [16, 28, 28, 1]


def test_training_order_is_reproducible_permutation(examples):
    images, labels = examples
    def run(seed, epoch, batch_size=16):
        return collect(make_dataset(images, labels, batch_size=batch_size, training=True,
                                    seed=seed, epoch=epoch))
    x0, y0 = run(seed=7, epoch=0)
    np.testing.assert_array_equal(np.sort(y0), labels)
    assert not np.array_equal(y0, labels)

    x0_again, y0_again = run(seed=7, epoch=0)  # what a resumed run rebuilds
    np.testing.assert_array_equal(y0_again, y0)
    np.testing.assert_array_equal(x0_again, x0)

    # Batching does not change which example comes when, nor its shift.
    x0_b7, y0_b7 = run(seed=7, epoch=0, batch_size=7)
    np.testing.assert_array_equal(y0_b7, y0)
    np.testing.assert_array_equal(x0_b7, x0)

    _, y1 = run(seed=7, epoch=1)
    _, y_other_seed = run(seed=8, epoch=0)
    np.testing.assert_array_equal(np.sort(y1), labels)
    assert not np.array_equal(y1, y0)
    assert not np.array_equal(y_other_seed, y0)


def test_training_batches_independent_of_parallelism(examples):
    images, labels = examples
    dataset = make_dataset(images, labels, batch_size=8, training=True, seed=3, epoch=2)
    options = tf.data.Options()
    options.threading.private_threadpool_size = 1
    options.autotune.enabled = False
    serial = dataset.with_options(options)
    for (xa, ya), (xb, yb) in zip(dataset, serial, strict=True):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa, xb)


def find_shift(augmented, source, max_shift):
    """The (dy, dx) with |dy|, |dx| <= max_shift that turns source into augmented, or None."""
    for dy in range(-max_shift, max_shift + 1):
        for dx in range(-max_shift, max_shift + 1):
            if np.array_equal(numpy_shift(source, dy, dx), augmented):
                return dy, dx
    return None


@pytest.mark.parametrize("shift_pixels", [1, 2, 3])
def test_augmented_images_are_zero_filled_shifts(examples, shift_pixels):
    images, labels = examples
    dataset = make_dataset(images, labels, batch_size=32, training=True, seed=1, epoch=0,
                           shift_pixels=shift_pixels)
    got_x, got_y = collect(dataset)
    shifts = []
    for augmented, index in zip(got_x, got_y):
        pixels = np.rint(augmented * 255)
        np.testing.assert_allclose(augmented * 255, pixels, atol=1e-4)  # exactly v / 255
        shift = find_shift(pixels.astype(np.uint8), images[index], shift_pixels)
        assert shift is not None, f"example {index} is not a shift of its source"
        shifts.append(shift)
    dys, dxs = zip(*shifts)
    # Every offset is used and the shifts vary: 60 draws from (2s + 1) values each.
    assert set(dys) == set(dxs) == set(range(-shift_pixels, shift_pixels + 1))


def test_edge_fill_repeats_the_border_and_draws_the_zero_fills_shifts(examples):
    images, labels = examples
    kwargs = dict(batch_size=32, training=True, seed=1, epoch=3, shift_pixels=2)
    zero_x, zero_y = collect(make_dataset(images, labels, **kwargs))
    edge_x, edge_y = collect(make_dataset(images, labels, shift_fill="edge", **kwargs))
    np.testing.assert_array_equal(edge_y, zero_y)
    s, moved = 2, 0
    for zero, edge, index in zip(zero_x, edge_x, edge_y):
        dy, dx = find_shift(np.rint(zero * 255).astype(np.uint8), images[index], s)
        # NumPy's edge padding, cropped where the zero fill's shift puts the image.
        padded = np.pad(images[index], [(s, s), (s, s), (0, 0)], mode="edge")
        expected = padded[s - dy:s - dy + 28, s - dx:s - dx + 28]
        np.testing.assert_array_equal(np.rint(edge * 255).astype(np.uint8), expected)
        moved += (dy, dx) != (0, 0)
    assert moved > 40


def test_shifts_change_with_epoch(examples):
    images, labels = examples
    def shifts(epoch):
        got_x, got_y = collect(make_dataset(images, labels, batch_size=60, training=True,
                                            seed=1, epoch=epoch))
        by_index = {}
        for augmented, index in zip(got_x, got_y):
            by_index[index] = find_shift(np.rint(augmented * 255).astype(np.uint8),
                                         images[index], 2)
        return [by_index[i] for i in range(len(labels))]
    epoch0, epoch1 = shifts(0), shifts(1)
    assert None not in epoch0 and None not in epoch1
    # 25 possible shifts: about 1/25 of the examples keep theirs by chance.
    assert sum(a != b for a, b in zip(epoch0, epoch1)) > len(labels) // 2


def test_shift_zero_is_identity(examples):
    images, labels = examples
    got_x, got_y = collect(make_dataset(images, labels, batch_size=32, training=True, seed=5,
                                        shift_pixels=0))
    assert not np.array_equal(got_y, labels)  # still shuffled
    np.testing.assert_array_equal(got_x, images[got_y].astype(np.float32) / np.float32(255))


def numpy_bilinear(image, ys, xs):
    """`image` (H, W) sampled at the points (ys, xs) (float arrays), bilinear, written out
    in NumPy; taps outside the image count as 0."""
    h, w = image.shape
    x0, y0 = np.floor(xs).astype(int), np.floor(ys).astype(int)
    out = np.zeros(np.shape(xs))
    for oy, ox in ((0, 0), (0, 1), (1, 0), (1, 1)):
        xi, yi = x0 + ox, y0 + oy
        weight = (1 - np.abs(xs - xi)) * (1 - np.abs(ys - yi))
        inside = (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h)
        out += np.where(inside, weight * image[np.clip(yi, 0, h - 1), np.clip(xi, 0, w - 1)], 0)
    return out


def numpy_rotate_zoom(image, angle, scale):
    """Inverse mapping: output pixel (x, y) samples the input at R(−angle)·((x, y) − c)/scale
    + c, counter-clockwise as displayed (rows down)."""
    h, w = image.shape
    cy, cx = (h - 1) / 2, (w - 1) / 2
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    dx, dy = (x - cx) / scale, (y - cy) / scale
    xs = np.cos(angle) * dx - np.sin(angle) * dy + cx
    ys = np.sin(angle) * dx + np.cos(angle) * dy + cy
    return numpy_bilinear(image, ys, xs)


def test_rotate_zoom_quarter_turn_is_rot90():
    image = tiny_images(1, seed=4)[0].astype(np.float32)
    got = rotate_zoom(tf.constant(image[..., None]), tf.constant(np.pi / 2, tf.float32),
                      tf.constant(1.0))
    np.testing.assert_allclose(got[..., 0], np.rot90(image), atol=1e-3)  # counter-clockwise


@pytest.mark.parametrize("degrees, scale", [(0.0, 1.0), (13.0, 1.0), (-27.0, 0.9), (8.0, 1.15)])
def test_rotate_zoom_matches_numpy_bilinear(degrees, scale):
    image = tiny_images(1, seed=5)[0].astype(np.float32)
    angle = np.deg2rad(degrees)
    got = rotate_zoom(tf.constant(image[..., None]), tf.constant(angle, tf.float32),
                      tf.constant(scale, tf.float32))
    np.testing.assert_allclose(got[..., 0], numpy_rotate_zoom(image, angle, scale), atol=0.05)


def numpy_elastic(image, noise, alpha, sigma):
    """Simard et al.'s elastic distortion written out: the noise (H, W, 2) smoothed by a 2-D
    Gaussian (cut at a radius of ceil(3σ), normalised, zero beyond the border) tap by tap,
    times alpha, is the (dy, dx) at which each output pixel samples the image."""
    h, w = image.shape
    r = int(np.ceil(3 * sigma))
    oy, ox = np.mgrid[-r:r + 1, -r:r + 1]
    kernel = np.exp(-(oy ** 2 + ox ** 2) / (2 * sigma ** 2))
    kernel /= kernel.sum()
    padded = np.pad(noise.astype(np.float64), [(r, r), (r, r), (0, 0)])
    field = np.zeros((h, w, 2))
    for i in range(2 * r + 1):
        for j in range(2 * r + 1):
            field += kernel[i, j] * padded[i:i + h, j:j + w]
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    return numpy_bilinear(image, y + alpha * field[..., 0], x + alpha * field[..., 1])


@pytest.mark.parametrize("alpha, sigma", [(0.0, 4.0), (8.0, 3.0), (34.0, 4.0), (60.0, 1.5)])
def test_elastic_distort_matches_numpy(alpha, sigma):
    images = tiny_images(3, seed=6).astype(np.float32)
    noise = np.random.default_rng(7).uniform(-1, 1, size=(3, 28, 28, 2)).astype(np.float32)
    got = elastic_distort(tf.constant(images[..., None]), tf.constant(noise), alpha, sigma)
    assert got.shape == (3, 28, 28, 1) and got.dtype == tf.float32
    for b in range(3):  # each image with its own noise
        np.testing.assert_allclose(got[b, ..., 0], numpy_elastic(images[b], noise[b], alpha, sigma), atol=0.05)
    if alpha == 0:
        np.testing.assert_array_equal(got[..., 0], images)  # no displacement: the images themselves


@pytest.mark.slow
@pytest.mark.parametrize("height, width", [(28, 28), (5, 7), (1, 1)])
def test_elastic_noise_is_the_per_example_draw(height, width):
    """elastic_noise's batch (Philox computed in vectorised ops, for H·W·2 words: 1,568 for
    MNIST, and counts not a multiple of a block's four) equals the per-example
    stateless_uniform draw keyed by stateless_fold_in(key, index), bit for bit, eagerly and
    inside XLA (where train.data_on_device draws it)."""
    key = tf.constant([5, 9], tf.int64)
    indices = tf.constant([0, 3, 59_999, 2**40], tf.int64)
    seeds = tf.fill([4], fold_in_seed(key))
    want = np.stack([tf.random.stateless_uniform([height, width, 2], minval=-1.0, maxval=1.0, alg="philox",
                                                 seed=tf.random.experimental.stateless_fold_in(key, i, alg="philox"))
                     for i in indices])
    np.testing.assert_array_equal(elastic_noise(seeds, indices, height, width).numpy(), want)
    compiled = tf.function(lambda s, i: elastic_noise(s, i, height, width), jit_compile=True, autograph=False)
    np.testing.assert_array_equal(compiled(seeds, indices).numpy(), want)


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [dict(), dict(rotate_degrees=10)], ids=["batched", "per-example"])
def test_elastic_batches_are_the_per_example_formula(kwargs):
    """make_dataset with elastic distortion, whole batches drawn at once (alone, or after
    the per-example rotation), equals what it computed before the noise was batched: the
    same epoch without it (same order, shifts, rotations), then elastic_distort with each
    example's noise drawn by its own stateless_uniform op, keyed by stateless_fold_in of
    the epoch's elastic stream and the example's index. Bit for bit: earlier runs replay."""
    n, seed, epoch = 40, 11, 3
    images = tiny_images(n, seed=4)[..., None]
    labels = np.arange(n) % 10
    common = dict(batch_size=16, training=True, seed=seed, epoch=epoch, shift_pixels=2, **kwargs)
    plain, _ = collect(make_dataset(images, labels, **common))
    got, got_y = collect(make_dataset(images, labels, elastic_alpha=20, elastic_sigma=3, **common))
    order = epoch_order(n, True, seed, epoch)[0].numpy()
    stream = tf.random.experimental.stateless_fold_in(tf.constant([seed, epoch], tf.int64), ELASTIC_STREAM,
                                                      alg="philox")
    fold_in = tf.random.experimental.stateless_fold_in
    noise = np.stack([tf.random.stateless_uniform([28, 28, 2], minval=-1.0, maxval=1.0, alg="philox",
                                                  seed=fold_in(stream, i, alg="philox")) for i in order])
    want = np.concatenate([elastic_distort(tf.constant(plain[b:b + 16]), tf.constant(noise[b:b + 16]), 20, 3).numpy()
                           for b in range(0, n, 16)])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_y, labels[order])
    assert np.abs(got - plain).max() > 0.1  # distorted


def test_elastic_augmentation_moves_strokes_locally():
    """Simard's setting on a centred blob: every image is distorted (differently), and the
    blob stays where it was to within a few pixels (the field is smooth and zero-mean:
    not a shift)."""
    n = 60
    images = blob_images(n, offset=0.0)
    got_x, got_y = collect(make_dataset(images, np.arange(n), batch_size=32, training=True, seed=2,
                                        shift_pixels=0, elastic_alpha=34, elastic_sigma=4))
    source = images[0, ..., 0].astype(np.float32) / 255
    moved = [np.abs(x[..., 0] - source).max() for x in got_x]
    assert min(moved) > 0.05  # each one distorted
    assert len({x.tobytes() for x in got_x}) == n  # each its own way
    shifts = np.array([centroid_polar(x)[1] for x in got_x])  # centroid distance from the centre
    assert shifts.max() < 4.0 and np.median(shifts) < 2.0


def blob_images(n, offset=8.0, size=28):
    """n copies of a Gaussian blob `offset` px right of the centre: its centroid's polar
    angle and radius about the centre read off the rotation and the zoom."""
    c = (size - 1) / 2
    y, x = np.mgrid[0:size, 0:size]
    blob = 255 * np.exp(-((x - c - offset) ** 2 + (y - c) ** 2) / (2 * 1.5 ** 2))
    return np.repeat(np.rint(blob).astype(np.uint8)[None, ..., None], n, axis=0)


def centroid_polar(image):
    size = image.shape[0]
    c = (size - 1) / 2
    y, x = np.mgrid[0:size, 0:size]
    m = image[..., 0]
    dx, dy = (m * (x - c)).sum() / m.sum(), (m * (y - c)).sum() / m.sum()
    return np.rad2deg(np.arctan2(-dy, dx)), np.hypot(dx, dy)  # rows down: −dy is up


def test_rotation_and_zoom_augmentation_ranges():
    n, degrees, zoom = 200, 20.0, 0.2
    images = blob_images(n)
    got_x, _ = collect(make_dataset(images, np.arange(n), batch_size=50, training=True, seed=2,
                                    shift_pixels=0, rotate_degrees=degrees, zoom=zoom))
    angles, radii = np.array([centroid_polar(x) for x in got_x]).T
    scales = radii / centroid_polar(images[0].astype(np.float64))[1]
    assert np.all(np.abs(angles) <= degrees + 0.5)
    assert np.all((scales >= 1 - zoom - 0.02) & (scales <= 1 + zoom + 0.02))
    # Uniform draws: both directions and both zoom sides, spread over the range.
    assert angles.min() < -0.8 * degrees and angles.max() > 0.8 * degrees
    assert scales.min() < 1 - 0.8 * zoom and scales.max() > 1 + 0.8 * zoom
    # A rotation does not depend on the zoom draw: the angles and scales are uncorrelated.
    assert abs(np.corrcoef(angles, scales)[0, 1]) < 0.3


def test_flip_mirrors_about_half_the_examples(examples):
    images, labels = examples
    got_x, got_y = collect(make_dataset(images, labels, batch_size=32, training=True, seed=3,
                                        shift_pixels=0, flip=True))
    flipped = []
    for augmented, index in zip(got_x, got_y):
        pixels = np.rint(augmented * 255).astype(np.uint8)
        if np.array_equal(pixels, images[index][:, ::-1]):
            flipped.append(True)
        else:
            np.testing.assert_array_equal(pixels, images[index])
            flipped.append(False)
    assert 15 <= sum(flipped) <= 45  # 60 fair coins


@pytest.mark.slow
def test_augmentations_reproducible_and_independent_of_batching(examples):
    images, labels = examples
    kwargs = dict(training=True, seed=4, epoch=1, shift_pixels=2, flip=True, rotate_degrees=15,
                  zoom=0.1, elastic_alpha=20, elastic_sigma=3, shift_fill="edge")
    x16, y16 = collect(make_dataset(images, labels, batch_size=16, **kwargs))
    x7, y7 = collect(make_dataset(images, labels, batch_size=7, **kwargs))
    np.testing.assert_array_equal(y7, y16)
    np.testing.assert_array_equal(x7, x16)
    x_next, _ = collect(make_dataset(images, labels, batch_size=16, **{**kwargs, "epoch": 2}))
    assert not np.array_equal(x_next, x16)


def test_default_augmentation_unchanged_by_the_new_options(examples):
    """flip/rotate/zoom/elastic/erase off and zero fill must replay the shift-only pipeline bit
    for bit: runs made before these options existed resume onto the same batches."""
    images, labels = examples
    x_default, y_default = collect(make_dataset(images, labels, batch_size=16, training=True, seed=9))
    x_off, y_off = collect(make_dataset(images, labels, batch_size=16, training=True, seed=9,
                                        flip=False, rotate_degrees=0, zoom=0.0, elastic_alpha=0,
                                        elastic_sigma=2.5, shift_fill="zero", erase_probability=0,
                                        erase_max_area=0.9))
    np.testing.assert_array_equal(y_off, y_default)
    np.testing.assert_array_equal(x_off, x_default)
    for augmented, index in zip(x_default, y_default):
        assert find_shift(np.rint(augmented * 255).astype(np.uint8), images[index], 2) is not None


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(batch_size=8, flip="yes"), ConfigError, "flip must be true or false"),
    (dict(batch_size=8, rotate_degrees=-5), ConfigError, "rotate_degrees must be a number in [0, 180]"),
    (dict(batch_size=8, rotate_degrees="10"), ConfigError, "rotate_degrees"),
    (dict(batch_size=8, zoom=0.7), ConfigError, "zoom must be a number in [0, 0.5], got 0.7"),
    (dict(batch_size=8, elastic_alpha=-1), ConfigError, "elastic_alpha must be a number in [0, 100], got -1"),
    (dict(batch_size=8, elastic_sigma=0), ConfigError, "elastic_sigma must be a number in [0.5, 10], got 0"),
    (dict(batch_size=8, shift_fill="reflect"), ConfigError, "shift_fill must be one of zero, edge, got 'reflect'"),
    (dict(batch_size=8, erase_probability=1.5), ConfigError, "erase_probability must be a number in [0, 1], got 1.5"),
    (dict(batch_size=8, erase_probability=True), ConfigError, "erase_probability"),
    (dict(batch_size=8, erase_max_area=0), ConfigError, "erase_max_area must be a number in [0.02, 1], got 0"),
    (dict(batch_size=0), ConfigError, "batch_size must be ≥ 1, got 0"),
    (dict(batch_size=-4), ConfigError, "batch_size"),
    (dict(batch_size=2.0), ConfigError, "batch_size must be an integer"),
    (dict(batch_size=True), ConfigError, "batch_size must be an integer"),
    (dict(batch_size=8, shift_pixels=-1), ConfigError, "shift_pixels"),
    (dict(batch_size=8, shift_pixels=28), ConfigError, "shift_pixels must be in [0, 27]"),
    (dict(batch_size=8, epoch=-1), ConfigError, "epoch"),
    (dict(batch_size=8, seed="1"), ConfigError, "seed must be an integer"),
    (dict(batch_size=8, training="yes"), ConfigError, "training"),
    (dict(batch_size=61, drop_remainder=True), ConfigError, "leaves no batch"),
])
def test_make_dataset_rejects_bad_arguments(examples, kwargs, error, words):
    images, labels = examples
    kwargs = {"training": True, **kwargs}
    with pytest.raises(error) as err:
        make_dataset(images, labels, **kwargs)
    assert words in str(err.value)


@pytest.mark.parametrize("images, labels, words", [
    (np.zeros((4, 28, 28), np.uint8), np.zeros(4), "(4, 28, 28)"),
    (np.zeros((4, 28, 28, 1), np.float32), np.zeros(4, np.int64), "float32"),
    (np.zeros((4, 28, 28, 1), np.uint8), np.zeros(3, np.int64), "4 images"),
    (np.zeros((1, 28, 28, 1), np.uint8), np.zeros(2, np.int64), "1 image (1, 28, 28, 1) but 2 labels"),
    (np.zeros((2, 28, 28, 1), np.uint8), np.zeros(1, np.int64), "but 1 label (1,)"),
    (np.zeros((4, 28, 28, 1), np.uint8), np.zeros(4, np.float32), "labels must be integers"),
    (np.zeros((0, 28, 28, 1), np.uint8), np.zeros(0, np.int64), "no examples"),
])
def test_make_dataset_rejects_bad_arrays(images, labels, words):
    with pytest.raises(DataError) as err:
        make_dataset(images, labels, batch_size=2, training=False)
    assert words in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("seed, epoch", [(0, 0), (5, 3), (-7, 2**33)])
def test_shift_corners_and_flip_mask_draw_what_the_per_example_ops_draw(seed, epoch):
    """shift_corners and flip_mask compute Philox in TensorFlow ops: for any stream key and
    example index (beyond 2^32 too) they return what random_shift's and random_flip's
    per-example draws give, tf.random.stateless_uniform under stateless_fold_in(key, index)."""
    from capsnet.augment import flip_mask, shift_corners

    key = tf.constant([seed, epoch], tf.int64)
    indices = np.concatenate([np.arange(5), np.random.RandomState(seed % 97).randint(0, 2**62, size=60)])
    for shift in (1, 2, 4):
        got = shift_corners(key, tf.constant(indices, tf.int64), shift).numpy()
        want = [tf.random.stateless_uniform([2], seed=tf.random.experimental.stateless_fold_in(
                    key, tf.constant(i, tf.int64), alg="philox"), minval=0, maxval=2 * shift + 1,
                    dtype=tf.int32, alg="philox").numpy() for i in indices]
        np.testing.assert_array_equal(got, np.stack(want))
    with pytest.raises(TypeError, match="int64"):  # fold_in's draw depends on the index dtype
        shift_corners(key, tf.constant([1, 2], tf.int32), 2)
    mirrors = flip_mask(key, tf.constant(indices, tf.int64)).numpy()
    want = [tf.random.stateless_uniform([], seed=tf.random.experimental.stateless_fold_in(
                key, tf.constant(i, tf.int64), alg="philox"), alg="philox").numpy() < 0.5 for i in indices]
    np.testing.assert_array_equal(mirrors, want)
    assert 0 < mirrors.sum() < len(mirrors)


@pytest.mark.parametrize("shift, fill, flip, rotate", [(2, "zero", False, 0), (3, "edge", False, 0),
                                                       (0, "zero", False, 0), (2, "zero", True, 0),
                                                       (2, "edge", True, 10)])
def test_batched_pipeline_gives_the_per_example_augmentation(shift, fill, flip, rotate):
    """With flips and shifts, make_dataset draws and transforms whole batches at once: the
    same images and labels, bit for bit, as random_flip then random_shift applied to each
    example with its own keys (the per-example pipeline's ops), in the epoch's order, the
    short last batch too. With a rotation (one example at a time, between the flip and the
    shift) the epoch's flip and shift draws are the same too."""
    from conftest import random_flip, random_shift
    from capsnet.augment import random_rotate_zoom
    from capsnet.data.pipeline import epoch_order

    rng = np.random.RandomState(1)
    images = rng.randint(0, 256, (37, 28, 28, 1)).astype(np.uint8)
    labels = rng.randint(0, 10, 37)
    batches = list(make_dataset(images, labels, batch_size=8, training=True, seed=5, epoch=3, shift_pixels=shift,
                                shift_fill=fill, flip=flip, rotate_degrees=rotate))
    assert [len(y) for _, y in batches] == [8, 8, 8, 8, 5]
    got_x = np.concatenate([x.numpy() for x, _ in batches])
    got_y = np.concatenate([y.numpy() for _, y in batches])
    order, _, shift_key = epoch_order(37, True, 5, 3)
    flip_key, affine_key = tf.unstack(tf.random.experimental.stateless_split(shift_key, 2, alg="philox"))  # as make_dataset
    want = []
    for i in order.numpy():
        image = tf.constant(images[i])
        if flip:
            image = random_flip(image, tf.random.experimental.stateless_fold_in(flip_key, i, alg="philox"))
        if rotate:
            image = random_rotate_zoom(tf.cast(image, tf.float32), rotate, 0.0,
                                       tf.random.experimental.stateless_fold_in(affine_key, i, alg="philox"))
        if shift:
            image = random_shift(image, shift, tf.random.experimental.stateless_fold_in(shift_key, i, alg="philox"),
                                 fill=fill)
        want.append(tf.cast(image, tf.float32).numpy() / 255.0)
    np.testing.assert_array_equal(got_y, labels[order.numpy()])
    np.testing.assert_array_equal(got_x, np.stack(want))


# ----------------------------------------------------------------------------- random erasing

def op_uniforms(key, index):
    """The five float32 uniforms erase_boxes reads for one example: the per-example op."""
    return tf.random.stateless_uniform([5], seed=tf.random.experimental.stateless_fold_in(
        key, tf.constant(index, tf.int64), alg="philox"), alg="philox").numpy()


def numpy_erase_box(u, height, width, probability, max_area):
    """Zhong et al.'s box, one attempt clipped (erase_boxes' docstring), from the uniforms
    u (float32 (5,)) in float64 NumPy: [top, left, h, w], zeros when not erased."""
    u = u.astype(np.float64)
    if not u[0] < probability:
        return [0, 0, 0, 0]
    area = height * width * (0.02 + u[1] * (max_area - 0.02))
    aspect = np.exp(np.log(0.3) + u[2] * (np.log(1 / 0.3) - np.log(0.3)))
    h = int(np.clip(np.round(np.sqrt(area * aspect)), 1, height))
    w = int(np.clip(np.round(np.sqrt(area / aspect)), 1, width))
    return [min(int(np.floor(u[3] * (height - h + 1))), height - h),
            min(int(np.floor(u[4] * (width - w + 1))), width - w), h, w]


def numpy_erase(images, boxes):
    """images (B, H, W, C) with each box [top, left, h, w] set to 0, slice by slice."""
    out = images.copy()
    for image, (top, left, h, w) in zip(out, boxes):
        image[top:top + h, left:left + w] = 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("seed, epoch", [(0, 0), (5, 3), (-7, 2**33)])
def test_erase_boxes_draw_what_the_per_example_op_draws(seed, epoch):
    """erase_boxes reads the five float32 uniforms of stateless_uniform([5]) under
    stateless_fold_in(key, index) (bit for bit: each is (word & 0x7FFFFF) / 2^23 of
    example_words' blocks) and makes Zhong et al.'s box of them, for any index (beyond
    2^32 too) and any image size."""
    from capsnet.augment import erase_boxes, example_words

    key = tf.constant([seed, epoch], tf.int64)
    indices = np.concatenate([np.arange(5), np.random.RandomState(seed % 97).randint(0, 2**62, size=200)])
    uniforms = np.stack([op_uniforms(key, i) for i in indices])  # (B, 5) float32
    blocks = [[word.numpy() for word in block] for block in example_words(key, tf.constant(indices, tf.int64), 2)]
    words = np.stack([*blocks[0], blocks[1][0]], axis=1)
    np.testing.assert_array_equal((words & 0x7FFFFF).astype(np.float32) / np.float32(2**23), uniforms)
    for height, width, probability, max_area in [(28, 28, 0.5, 0.4), (36, 20, 1.0, 1.0), (28, 28, 0.3, 0.02),
                                                 (5, 40, 0.9, 0.7)]:
        got = erase_boxes(key, tf.constant(indices, tf.int64), height, width, probability, max_area).numpy()
        assert got.dtype == np.int32 and got.shape == (len(indices), 4)
        want = [numpy_erase_box(u, height, width, probability, max_area) for u in uniforms]
        np.testing.assert_array_equal(got, np.array(want))
        erased = got[:, 2] > 0
        assert 0 < erased.sum() <= len(indices) and (got[~erased] == 0).all()
        assert (got[erased, :2] >= 0).all() and (got[erased, 2:] >= 1).all()
        assert (got[erased, 0] + got[erased, 2] <= height).all() and (got[erased, 1] + got[erased, 3] <= width).all()
    with pytest.raises(TypeError, match="int64"):
        erase_boxes(key, tf.constant([1, 2], tf.int32), 28, 28, 0.5, 0.4)


def test_erase_batch_zeroes_exactly_the_boxes():
    from capsnet.augment import erase_batch

    rng = np.random.default_rng(0)
    boxes = np.array([[0, 0, 0, 0], [3, 5, 10, 2], [0, 0, 28, 28], [27, 27, 1, 1], [20, 0, 8, 28]], np.int32)
    for dtype in (np.uint8, np.float32):
        images = rng.integers(1, 256, (5, 28, 28, 3)).astype(dtype)
        got = erase_batch(tf.constant(images), tf.constant(boxes)).numpy()
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, numpy_erase(images, boxes))


ERASE_SEED, ERASE_EPOCH = 2, 5


@pytest.fixture(scope="module")
def erase_examples():
    """2000 images of pixels 1..255 (an erased pixel is a new zero) and the epoch's
    reference boxes (op uniforms + NumPy box math) by example index, for probability 0.5
    and area up to 0.4 (Zhong's)."""
    from capsnet.data.pipeline import _ERASE_STREAM

    n = 2000
    images = np.random.default_rng(7).integers(1, 256, (n, 28, 28, 1), dtype=np.uint8)
    labels = np.arange(n, dtype=np.int64) % 10
    erase_key = tf.random.experimental.stateless_fold_in(
        tf.constant([ERASE_SEED, ERASE_EPOCH], tf.int64), _ERASE_STREAM, alg="philox")  # as make_dataset
    boxes = np.array([numpy_erase_box(op_uniforms(erase_key, i), 28, 28, 0.5, 0.4) for i in range(n)])
    return images, labels, boxes


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [dict(), dict(flip=True, shift_fill="edge"), dict(shift_pixels=0),
                                    dict(rotate_degrees=10, zoom=0.1), dict(elastic_alpha=20, elastic_sigma=3)])
def test_erasing_zeroes_each_images_box_after_the_other_augmentations(erase_examples, kwargs):
    """Training with random erasing: every image is what the same epoch gives without it
    (same order, same flips, shifts, rotations, elastic fields), with exactly its
    reference box zeroed, last, in the batched and the per-example (rotation, elastic)
    pipelines; about half the images erased, the boxes inside the image, their area in
    [0.02, 0.4] of it up to rounding."""
    images, labels, boxes = erase_examples
    n = len(labels)
    if kwargs.get("rotate_degrees") or kwargs.get("elastic_alpha"):  # the per-example map: slower
        n = 500
        images, labels = images[:n], labels[:n]
    kwargs = dict(batch_size=128, training=True, seed=ERASE_SEED, epoch=ERASE_EPOCH, **kwargs)
    plain_x, _ = collect(make_dataset(images, labels, **kwargs))
    batches = list(make_dataset(images, labels, erase_probability=0.5, erase_max_area=0.4, **kwargs))
    got_x = np.concatenate([x.numpy() for x, _ in batches])
    got_y = np.concatenate([y.numpy() for _, y in batches])
    order = _epoch_order_indices(n)
    np.testing.assert_array_equal(got_y, labels[order])
    np.testing.assert_array_equal(got_x, numpy_erase(plain_x, boxes[order]))
    if n == len(boxes):
        erased = boxes[:, 2] > 0
        # 2000 fair coins: the mean within 4 standard deviations (0.011) of 1/2.
        assert abs(erased.mean() - 0.5) < 4 * np.sqrt(0.25 / n)
        top, left, h, w = boxes[erased].T
        assert (top >= 0).all() and (left >= 0).all() and (top + h <= 28).all() and (left + w <= 28).all()
        # Rounding h and w (each ≥ 2 at the smallest area) moves the area by < 25%.
        fraction = h * w / 784
        assert fraction.min() >= 0.02 * 0.75 and fraction.max() <= 0.4 * 1.15
        assert fraction.min() < 0.04 and fraction.max() > 0.3  # the range is covered
    if kwargs.get("shift_pixels") == 0 or kwargs.get("shift_fill") == "edge":
        # No zero fill, pixels 1..255: the zero pixels are the boxes'.
        np.testing.assert_array_equal((got_x == 0).sum(axis=(1, 2, 3)), boxes[order, 2] * boxes[order, 3])


def _epoch_order_indices(n):
    from capsnet.data.pipeline import epoch_order

    return epoch_order(n, True, ERASE_SEED, ERASE_EPOCH)[0].numpy()


def test_erasing_changes_with_the_epoch_and_not_with_batching(examples):
    images, labels = examples
    kwargs = dict(training=True, seed=4, epoch=1, flip=True, erase_probability=1.0, erase_max_area=0.6)
    x16, y16 = collect(make_dataset(images, labels, batch_size=16, **kwargs))
    x7, y7 = collect(make_dataset(images, labels, batch_size=7, **kwargs))
    np.testing.assert_array_equal(y7, y16)
    np.testing.assert_array_equal(x7, x16)
    x_next, y_next = collect(make_dataset(images, labels, batch_size=16, **{**kwargs, "epoch": 2}))
    by_index = lambda x, y: (x[np.argsort(y)] == 0).reshape(len(y), -1)  # noqa: E731  the zero pixels
    assert (by_index(x16, y16) != by_index(x_next, y_next)).any(axis=1).mean() > 0.9
    x_eval, _ = collect(make_dataset(images, labels, batch_size=16, training=False, erase_probability=1.0))
    np.testing.assert_array_equal(x_eval, images.astype(np.float32) / np.float32(255))  # not in evaluation


def test_benchmark_input_times_every_image_of_each_epoch(tiny_idx_dir, capsys):
    """scripts/benchmark_input.py runs the epochs train() builds and counts every training
    image of each (320 here), with a rate per epoch and the time to its first batch, a part of
    the epoch's."""
    script = load_script("benchmark_input")
    assert script.main(["--data-dir", str(tiny_idx_dir), "--batch-size", "32", "--epochs", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1", "epoch 2"]
    for line in lines:
        match = re.fullmatch(r"epoch \d: 320 images in ([\d.]+) s: [\d,]+ images/s "
                             r"\(ready for its first batch after ([\d.]+) s\)", line)
        assert match, line


def _rss_mib():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def test_every_epochs_dataset_reads_one_host_copy_of_the_training_set():
    """A dataset an epoch around a new tf.constant of the images kept every epoch's copy alive
    (a 200-epoch CIFAR-10 run was killed for memory past 30 GB): the epochs share one."""
    import gc

    from capsnet.data.pipeline import _HOST_TENSORS, host_tensor

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (20000, 40, 40, 1), dtype=np.uint8)  # 32 MB
    labels = rng.integers(0, 10, 20000)
    assert host_tensor(images) is host_tensor(images)
    assert host_tensor(labels, np.sort) is not host_tensor(labels)
    np.testing.assert_array_equal(host_tensor(labels, np.sort).numpy(), np.sort(labels))

    def epoch(e):
        for _ in make_dataset(images, labels, batch_size=256, training=True, seed=0, epoch=e).take(2):
            pass

    epoch(0)
    before = _rss_mib()
    for e in range(1, 7):
        epoch(e)
    # Six more epochs held six more copies (~190 MB) before; now well under one copy.
    assert _rss_mib() - before < images.nbytes / 2**20, (before, _rss_mib())
    # The copies go with their arrays.
    entries = len(_HOST_TENSORS)
    del images
    gc.collect()
    assert len(_HOST_TENSORS) == entries - 1
