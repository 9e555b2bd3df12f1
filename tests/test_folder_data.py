"""Image folders (data=folder: capsnet.folder and capsnet.tasks.images): the layout's
classes and one-line errors, decoding any size/mode to the configured square, a corrupt
file skipped with a count, and the file cache (a folder over the memory budget) giving
the same batches as the memory cache."""
import io
import json
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from capsnet.errors import DataError
from capsnet import folder
from capsnet.tasks import task_for


def make_folder(root, n_per_class=6, classes=("cat", "dog", "bird"), size=40, splits=("train", "test"), seed=0):
    """Class-dependent images: class k is bright in its own third of the image (with more
    classes than 3, the thirds repeat: classes k and k + 3 share a pattern)."""
    rng = np.random.default_rng(seed)
    for split in splits:
        for k, name in enumerate(classes):
            directory = root / split / name if split else root / name
            directory.mkdir(parents=True)
            for i in range(n_per_class):
                pixels = rng.integers(0, 60, (size, size + 8, 3), dtype=np.uint8)
                third = k % 3
                pixels[:, third * (size + 8) // 3:(third + 1) * (size + 8) // 3] = 230
                suffix = (".png", ".jpg", ".bmp", ".gif")[i % 4]
                image = Image.fromarray(pixels)
                (image.convert("L") if i % 3 == 0 else image).save(directory / f"{i}{suffix}")
    return root


def cfg(root, **extra):
    return {"name": "folder", "dir": str(root), "image_size": 32, "channels": 3, "shift_pixels": 0, **extra}


def test_classes_sorted_and_images_decoded_to_the_square(tmp_path):
    root = make_folder(tmp_path / "f")
    assert folder.class_names(root) == ["bird", "cat", "dog"]
    task = task_for(cfg(root))
    data = task.load("train")
    assert data.images.shape == (18, 32, 32, 3) and data.images.dtype == np.uint8
    assert list(np.bincount(data.labels)) == [6, 6, 6]
    # cat (label 1, generated first) is bright in the left third of its images.
    cat = data.images[data.labels == 1].mean(axis=(0, 1, 3))
    assert cat[:8].mean() > 150 > cat[24:].mean()
    images, labels = next(iter(task.dataset(data, batch_size=18, training=False)))
    np.testing.assert_allclose(images.numpy(), data.images / np.float32(255), atol=1e-6)


def test_layout_errors_are_one_line(tmp_path):
    with pytest.raises(DataError, match="is empty"):
        (tmp_path / "empty").mkdir()
        folder.layout(tmp_path / "empty")
    root = make_folder(tmp_path / "f", n_per_class=2)
    (root / "train" / "fish").mkdir()
    with pytest.raises(DataError, match="class folder .*fish has no images"):
        folder.layout(root)
    (root / "train" / "fish" / "1.png").write_bytes((root / "train" / "cat" / "1.jpg").read_bytes())
    with pytest.raises(DataError, match="different classes: only in train/: fish"):
        folder.layout(root)


def test_test_fraction_splits_one_folder(tmp_path):
    root = make_folder(tmp_path / "f", n_per_class=10, splits=(None,))
    _, classes, splits = folder.layout(root, 0.2)
    assert classes == ["bird", "cat", "dog"]
    assert all(len(splits["test"][c]) == 2 and len(splits["train"][c]) == 8 for c in classes)
    assert not set(splits["test"]["cat"]) & set(splits["train"]["cat"])


def test_corrupt_image_skipped_with_one_notice(tmp_path, capsys):
    root = make_folder(tmp_path / "f", n_per_class=4)
    (root / "train" / "cat" / "broken.png").write_bytes(b"not an image")
    data = task_for(cfg(root)).load("train")
    assert len(data) == 12
    out = capsys.readouterr().out
    assert "1 of the 13 train images" in out and f"skipped: {root / 'train' / 'cat' / 'broken.png'}" in out


def png_header_only(width, height):
    """A PNG whose IHDR declares width x height over a short, truncated IDAT: a header that a
    check must read without decoding (a decoder would allocate the declared pixels first)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_image_dimensions_are_read_from_the_header(tmp_path):
    """PNG, JPEG (after a 60 kB Exif segment), GIF and BMP, grey and RGB: (width, height) as
    PIL wrote them; a 200000 x 1 PNG of a hundred bytes; None for what is not an image."""
    for fmt in ("PNG", "JPEG", "GIF", "BMP"):
        for mode in ("L", "RGB"):
            buffer = io.BytesIO()
            extra = {"exif": b"Exif\0\0" + bytes(60_000)} if fmt == "JPEG" else {}
            Image.new(mode, (53, 37)).save(buffer, fmt, **extra)
            buffer.seek(0)
            assert folder.image_dimensions(buffer) == (53, 37), (fmt, mode)
    (tmp_path / "wide.png").write_bytes(png_header_only(200_000, 1))
    assert (tmp_path / "wide.png").stat().st_size < 300
    assert folder.oversized(tmp_path / "wide.png", 199_999) == "200000x1"
    assert folder.oversized(tmp_path / "wide.png", 200_000) is None
    assert folder.image_dimensions(io.BytesIO(b"not an image")) is None
    assert folder.image_dimensions(io.BytesIO(b"\xff\xd8\xff")) is None  # a JPEG cut short
    assert folder.image_dimensions(io.BytesIO(b"GIF89a? no")) is None  # shorter than a GIF's header: the decoder's


def test_an_image_over_max_pixels_is_skipped_unread_with_the_decoding_notice(tmp_path, capsys):
    root = make_folder(tmp_path / "f", n_per_class=4)  # 40 x 48 images: 1920 pixels
    Image.new("RGB", (48, 41)).save(root / "train" / "cat" / "big.png")
    (root / "train" / "dog" / "huge.png").write_bytes(png_header_only(3000, 3000))  # no pixel data to decode
    data = task_for(cfg(root, max_pixels=1920)).load("train")
    assert len(data) == 12
    out = capsys.readouterr().out
    assert "2 of the 14 train images" in out and "more than data.max_pixels pixels" in out
    assert str(root / "train" / "cat" / "big.png") in out and str(root / "train" / "dog" / "huge.png") in out


@pytest.mark.slow
def test_file_cache_over_the_memory_budget_gives_the_same_batches(tmp_path):
    """A folder larger than data.cache_memory_mb streams from a file cache: the same test
    batches as the memory cache, and training epochs of every example."""
    root = make_folder(tmp_path / "f", n_per_class=8)
    memory = task_for(cfg(root, cache="memory"))
    disk = task_for(cfg(root, cache="auto", cache_memory_mb=0, cache_dir=str(tmp_path)))  # auto -> disk
    on_disk = disk.load("test")
    assert on_disk.images is None and "disk cache" in on_disk.origin
    a = np.concatenate([x.numpy() for x, _ in memory.dataset(memory.load("test"), batch_size=5, training=False)])
    b = np.concatenate([x.numpy() for x, _ in disk.dataset(on_disk, batch_size=5, training=False)])
    np.testing.assert_array_equal(a, b)
    train = disk.load("train")
    labels = [np.concatenate([y.numpy() for _, y in disk.dataset(train, batch_size=7, training=True, epoch=e)])
              for e in (0, 1)]
    assert sorted(labels[0]) == sorted(train.labels) and len(labels[0]) == 24
    again = np.concatenate([y.numpy() for _, y in disk.dataset(train, batch_size=7, training=True, epoch=1)])
    np.testing.assert_array_equal(labels[1], again)  # an epoch's order is a function of (seed, epoch)


def test_crop_flip_and_standardisation(tmp_path):
    root = make_folder(tmp_path / "f", n_per_class=4)
    task = task_for(cfg(root, crop=24, flip=True, brightness=0.2, contrast=0.5, standardize=True))
    data = task.load("train")
    first = next(iter(task.dataset(data, batch_size=12, training=True, seed=3)))[0].numpy()
    again = next(iter(task.dataset(data, batch_size=12, training=True, seed=3)))[0].numpy()
    assert first.shape == (12, 24, 24, 3)
    np.testing.assert_array_equal(first, again)
    np.testing.assert_allclose(first.mean(axis=(1, 2, 3)), 0, atol=1e-4)
    test = next(iter(task.dataset(task.load("test"), batch_size=12, training=False)))[0].numpy()
    assert test.shape == (12, 24, 24, 3)


# The tiny model (tests/conftest.py) on a folder's 32x32 RGB images.
FOLDER_TRAIN = ["data=folder", "data.image_size=32", "train.epochs=2", "train.batch_size=32",
                "train.learning_rate=0.01"]


@pytest.mark.slow
def test_a_folder_trains_evaluates_exports_and_predicts_with_its_class_names(tmp_path):
    """data=folder end to end on CPU: 999 generated 64x64 RGB images of 3 classes (798
    train, 201 test; a class is a bright third of the image) train the tiny model for 2
    epochs; evaluate scores the test split per class, keyed by the folder's class names and
    well above chance (1/3); the SavedModel's capsnet_export.json names the classes; predict
    answers with the names, on the run dir and on the export."""
    from conftest import TINY_MODEL, TINY_TRAIN, compose_config

    from capsnet.evaluation import evaluate
    from capsnet.export import METADATA, export
    from capsnet.prediction import predict
    from capsnet.training import train

    root = tmp_path / "shapes"
    make_folder(root, n_per_class=266, size=64, splits=("train",), seed=1)
    make_folder(root, n_per_class=67, size=64, splits=("test",), seed=2)
    run_dir = tmp_path / "run"
    metrics = train(compose_config("train", [*TINY_MODEL, *TINY_TRAIN, *FOLDER_TRAIN, f"data.dir={root}",
                                             f"run_dir={run_dir}"]))
    names = ["bird", "cat", "dog"]  # sorted folder names
    assert metrics["epochs"] == 2 and metrics["global_step"] == 2 * 25  # 798 at 32 a batch

    report = evaluate(str(run_dir))
    assert report["class_names"] == names and report["num_examples"] == 201
    per_class = dict(zip(report["class_names"], report["per_class_accuracy"]))
    assert report["accuracy"] > 0.8, report["accuracy"]
    assert all(accuracy > 0.5 for accuracy in per_class.values()), per_class

    output = tmp_path / "exported"
    export(str(run_dir), output)
    stored = json.loads(next(output.rglob(METADATA)).read_text())
    assert stored["class_names"] == names

    files = [sorted((root / "test" / name).iterdir())[0] for name in names]
    for source in (run_dir, output):
        records = predict(str(source), [str(f) for f in files])
        assert [r["class"] for r in records] == names, (source, records)
        # each record's lengths keyed by the class names, the predicted class's the longest
        assert all(list(r["lengths"]) == names and max(r["lengths"], key=r["lengths"].get) == r["class"]
                   for r in records), records


@pytest.mark.slow
def test_the_paper_cifar10_preset_trains_a_step_on_a_folder(tmp_path):
    """experiment=paper_cifar10 (24x24 crops, flip, brightness, contrast, per-image
    standardisation, leaky routing, no decoder) on a generated 32x32 RGB folder with
    CIFAR-10's ten class names: one step of the tiny model trains and tests finitely."""
    from conftest import TINY_MODEL, TINY_TRAIN, compose_config

    from capsnet.datasets import DATASETS
    from capsnet.training import train

    classes = DATASETS["cifar10"].class_names
    root = tmp_path / "cifar10"
    make_folder(root, n_per_class=2, classes=classes, size=32, splits=("train",), seed=1)
    make_folder(root, n_per_class=1, classes=classes, size=32, splits=("test",), seed=2)
    cfg = compose_config("train", ["experiment=paper_cifar10", *TINY_MODEL, *TINY_TRAIN, f"data.dir={root}",
                                   "train.epochs=1", "train.batch_size=20", f"run_dir={tmp_path / 'run'}"])
    data, model = cfg["data"], cfg["model"]
    assert (data["crop"], data["flip"], data["standardize"]) == (24, True, True)
    assert data["brightness"] > 0 and data["contrast"] > 0 and model["routing"]["leaky"] and not model["decoder"]
    assert model["input_shape"] == [24, 24, 3] and model["num_classes"] == 10
    metrics = train(cfg)
    assert metrics["global_step"] == 1 and np.isfinite(metrics["test_loss"])
    assert metrics["history"][0]["train_loss"] > 0


@pytest.mark.slow
def test_the_paper_cifar10_preset_trains_through_the_fused_op(tmp_path):
    """custom_op=true on experiment=paper_cifar10 routes in the fused op, leaky routing and
    all (capsnet.config.router_spec), and its step and test pass give custom_op=false's
    losses: the same seed, so the same weights and data, through the op's leaky softmax
    instead of TensorFlow's."""
    from conftest import TINY_MODEL, TINY_TRAIN, compose_config

    from capsnet import config
    from capsnet.datasets import DATASETS
    from capsnet.training import train

    classes = DATASETS["cifar10"].class_names
    root = tmp_path / "cifar10"
    make_folder(root, n_per_class=2, classes=classes, size=32, splits=("train",), seed=1)
    make_folder(root, n_per_class=1, classes=classes, size=32, splits=("test",), seed=2)
    metrics = {}
    for custom_op in ("false", "true"):
        cfg = compose_config("train", ["experiment=paper_cifar10", *TINY_MODEL, *TINY_TRAIN, f"data.dir={root}",
                                       "train.epochs=1", "train.batch_size=20", f"custom_op={custom_op}",
                                       f"run_dir={tmp_path / custom_op}"])
        assert cfg["model"]["routing"]["leaky"]
        assert config.router_spec(cfg["custom_op"], cfg["model"])["backend"] == ("fused_op" if custom_op == "true" else "matmul")
        metrics[custom_op] = train(cfg)
    fused, plain = metrics["true"], metrics["false"]
    assert fused["global_step"] == plain["global_step"] == 1
    assert fused["history"][0]["train_loss"] == pytest.approx(plain["history"][0]["train_loss"], rel=1e-4)
    assert fused["test_loss"] == pytest.approx(plain["test_loss"], rel=1e-4)
