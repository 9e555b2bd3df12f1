"""A data=folder run predicts files as its pipeline prepared them: predict.py's lengths of
the test files (from the run dir and from its export) are the model's on the test
pipeline's batches, and its classes score what evaluate.py scores. Images 96x32 (tall):
the pipeline resizes the shorter side and crops the centre, so a squashed image would give
other lengths. Also: an ensemble of runs naming their classes differently is refused, an
image with NaN pixels gets no class, an image over the run's data.max_pixels is reported
per file. One tiny run (1 epoch, 36 images) for the module."""
import json
import shutil

import numpy as np
import pytest
import tensorflow as tf
import yaml
from PIL import Image

from conftest import TINY_MODEL, TINY_TRAIN, compose_config
from capsnet import prediction
from capsnet.errors import ConfigError

pytestmark = pytest.mark.slow

NAMES = ["bird", "cat", "dog"]  # sorted class folder names


def write_tall_images(root, split, n_per_class, seed):
    """96x32 images: class k bright in column band k of the centre 32x32 (what the pipeline
    keeps: the shorter side is already 32, the centre is cropped), and in band k + 1 of the
    top and bottom thirds (what a squash to 32x32 would mix in); some grey, one format each."""
    rng = np.random.default_rng(seed)
    for k, name in enumerate(NAMES):
        directory = root / split / name
        directory.mkdir(parents=True)
        for i in range(n_per_class):
            pixels = rng.integers(0, 60, (96, 32, 3), dtype=np.uint8)
            pixels[32:64, 11 * k:11 * k + 10] = 230
            pixels[:32, 11 * ((k + 1) % 3):11 * ((k + 1) % 3) + 10] = 230
            pixels[64:, 11 * ((k + 1) % 3):11 * ((k + 1) % 3) + 10] = 230
            image = Image.fromarray(pixels)
            (image.convert("L") if i % 3 == 0 else image).save(directory / f"{i}{('.png', '.bmp')[i % 2]}")


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """(run_dir, data root, its export): a data=folder run with a centre crop and per-image
    standardisation, trained 1 epoch on 24 tall images, exported."""
    from capsnet.export import export
    from capsnet.training import train

    base = tmp_path_factory.mktemp("tall")
    root = base / "images"
    write_tall_images(root, "train", 8, seed=1)
    write_tall_images(root, "test", 4, seed=2)
    run_dir = base / "run"
    train(compose_config("train", [*TINY_MODEL, *TINY_TRAIN, "data=folder", "data.image_size=32", "data.crop=28",
                                   "data.standardize=true", "train.epochs=1", "train.batch_size=8",
                                   f"data.dir={root}", f"run_dir={run_dir}"]))
    export(str(run_dir), base / "exported")
    return run_dir, root, base / "exported"


def pipeline_lengths(run_dir):
    """(test file paths, labels, lengths): the run's test pipeline (its task's load and
    dataset) through the restored model, as evaluate.py runs it."""
    from capsnet import folder
    from capsnet.tasks import task_for
    from capsnet.training.checkpoints import resolve_checkpoint, restore_model
    from capsnet.training.model_setup import build_capsnet

    prefix, _, cfg = resolve_checkpoint(run_dir)  # predict's default checkpoint
    model = build_capsnet(cfg["model"], False)
    restore_model(model, prefix, "ema" if cfg["train"]["ema_decay"] > 0 else "raw")
    task = task_for(cfg["data"])
    split = task.load("test")
    paths, labels = folder.split_files(cfg["data"]["dir"], "test", classes=cfg["data"]["class_names"])
    assert len(split) == len(paths)  # every file decoded: the order is the files'
    lengths = np.concatenate([model(images, training=False)["lengths"].numpy()
                              for images, _ in task.dataset(split, batch_size=5, training=False)])
    return paths, labels, lengths


def test_predict_prepares_files_as_the_pipeline_and_scores_as_evaluate(folder_run):
    from capsnet.evaluation import evaluate

    run_dir, _, exported = folder_run
    paths, labels, lengths = pipeline_lengths(run_dir)
    report = evaluate(str(run_dir))
    assert report["num_examples"] == len(paths) == 12
    for source in (run_dir, exported):
        records = prediction.predict(str(source), paths)
        assert all("error" not in r for r in records), records
        np.testing.assert_allclose([list(r["lengths"].values()) for r in records], lengths, rtol=1e-4, atol=1e-5,
                                   err_msg=str(source))
        classes = [NAMES.index(r["class"]) for r in records]
        assert classes == list(np.argmax(lengths, axis=1)), source
        assert np.mean(np.array(classes) == labels) == pytest.approx(report["accuracy"]), source


def test_an_ensemble_of_runs_naming_their_classes_differently_is_refused(folder_run, tmp_path):
    from capsnet.evaluation import evaluate

    run_dir, _, _ = folder_run
    for names, difference in ((["bird", "dog", "cat"], "class 1 is 'cat' in .* but 'dog' in"),
                              (["bird", "cat", "fish"], "class 2 is 'dog' in .* but 'fish' in")):
        other = tmp_path / "-".join(names)
        shutil.copytree(run_dir, other)
        config = yaml.safe_load((other / "config.yaml").read_text())
        config["data"]["class_names"] = names
        (other / "config.yaml").write_text(yaml.safe_dump(config))
        with pytest.raises(ConfigError, match=f"ensemble members name their classes differently: {difference}") as err:
            evaluate([str(run_dir), str(other)], output=tmp_path / "never.json")
        assert "\n" not in str(err.value) and str(other) in str(err.value)
    assert not (tmp_path / "never.json").exists()


def test_nan_pixels_get_no_class_from_the_signature_nor_from_predict(folder_run, monkeypatch):
    from capsnet.export import NO_CLASS, load

    run_dir, root, exported = folder_run
    signature = load(exported).signatures["serving_default"]
    images = np.full((3, 28, 28, 3), 0.5, np.float32)
    images[0, 3, 4, 1] = np.nan
    images[1, 0, 0, 0] = np.inf
    out = signature(images=tf.constant(images))
    assert list(out["predictions"].numpy()[:2]) == [NO_CLASS, NO_CLASS]
    assert not np.isfinite(out["lengths"].numpy()[:2]).any()
    assert out["predictions"].numpy()[2] in range(3) and np.isfinite(out["lengths"].numpy()[2]).all()

    # predict: the file whose pixels reach the model as NaN is named, the others predicted.
    files = [str(p) for p in sorted((root / "test" / "cat").iterdir())[:2]]
    real = prediction.load_image
    monkeypatch.setattr(prediction, "load_image", lambda path, classifier: (
        real(path, classifier) * np.float32(np.nan) if path == files[0] else real(path, classifier)))
    for source in (run_dir, exported):
        records = prediction.predict(str(source), files)
        assert records[0] == {"image": files[0], "error": f"the model's capsule lengths for image {files[0]} are "
                                                         "not finite (NaN or inf): no class predicted"}
        assert records[1]["class"] in NAMES


def test_an_image_over_the_runs_max_pixels_is_reported_per_file_and_not_decoded(folder_run, tmp_path, monkeypatch):
    from capsnet.export import export

    run_dir, root, _ = folder_run
    small = tmp_path / "run"
    shutil.copytree(run_dir, small)
    config = yaml.safe_load((small / "config.yaml").read_text())
    config["data"]["max_pixels"] = 96 * 32 - 1  # the tall test images are one pixel over
    (small / "config.yaml").write_text(yaml.safe_dump(config))
    export(str(small), tmp_path / "exported")
    tall = str(sorted((root / "test" / "dog").iterdir())[0])
    square = tmp_path / "square.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(square)
    decoded = []
    real = tf.io.decode_image
    monkeypatch.setattr(tf.io, "decode_image", lambda data, *a, **k: decoded.append(1) or real(data, *a, **k))
    for source in (small, tmp_path / "exported"):
        decoded.clear()
        records = prediction.predict(str(source), [tall, str(square)])
        assert records[0] == {"image": tall, "error": f"image {tall} is 32x96 pixels, more than the run's "
                                                      f"data.max_pixels={96 * 32 - 1}: not decoded"}
        assert records[1]["class"] in NAMES and len(decoded) == 1
    stored = json.loads((tmp_path / "exported" / "assets.extra" / "capsnet_export.json").read_text())
    assert stored["data"]["max_pixels"] == 96 * 32 - 1
