"""data.validation_fraction: a validation split held out of the training examples for every
data kind (capsnet.tasks.holdout, Task.load_train_validation), disjoint from what is
trained on and the same in every run; best/ chosen on it; a folder's old test share
(data.validation_fraction before data.test_fraction) read from old run configs."""
import json
import math

import numpy as np
import pytest
import tensorflow as tf
from test_folder_data import make_folder

from capsnet import config
from capsnet.errors import ConfigError
from capsnet.tasks import task_for
from capsnet.tasks.holdout import validation_indices


def rows(images):
    """{image bytes: count} of a uint8 (N, ...) array: the examples as values, whatever their order."""
    found = {}
    for image in images:
        found[image.tobytes()] = found.get(image.tobytes(), 0) + 1
    return found


def test_validation_indices_are_disjoint_per_class_and_fixed():
    labels = np.random.default_rng(5).integers(0, 7, 1000)
    train, held = validation_indices(labels, 0.2)
    assert not set(train) & set(held) and sorted([*train, *held]) == list(range(1000))
    counts = np.bincount(labels, minlength=7)
    np.testing.assert_array_equal(np.bincount(labels[held], minlength=7), np.round(counts * 0.2).astype(int))
    again = validation_indices(labels.copy(), 0.2)
    np.testing.assert_array_equal(again[1], held)
    # A class's draw does not depend on the other classes: dropping class 3 keeps the others' split.
    kept = np.flatnonzero(labels != 3)
    _, held_without = validation_indices(labels[kept], 0.2)
    np.testing.assert_array_equal(kept[held_without], held[labels[held] != 3])


def test_validation_indices_keep_a_training_example_of_each_class_and_refuse_an_empty_split():
    train, held = validation_indices(np.array([0, 1, 1, 2, 2, 2]), 0.9)
    assert set(np.array([0, 1, 1, 2, 2, 2])[train]) == {0, 1, 2} and len(held) == 3
    with pytest.raises(ConfigError, match=r"data.validation_fraction=0.1 of the training split \(4 examples\) "
                                          "holds out no example"):
        validation_indices(np.array([0, 1, 2, 3]), 0.1)
    # Labels of more than one class an example: one draw over all of them.
    pairs = np.arange(40).reshape(20, 2)
    train, held = validation_indices(pairs, 0.25)
    assert len(held) == 5 and not set(train) & set(held)


def assert_held_out(full, train, validation, fraction):
    """train and validation are the in-memory `full` split's examples, each once, disjoint;
    each class's validation share is round(n * fraction)."""
    everything = rows(full.images)
    assert len(everything) == len(full)  # (no duplicate image: a value identifies an example)
    ours, held = rows(train.images), rows(validation.images)
    assert not set(ours) & set(held)
    assert {**ours, **held} == everything
    labels = dict(zip((image.tobytes() for image in full.images), full.labels))
    assert [labels[image.tobytes()] for image in validation.images] == list(validation.labels)
    counts = np.bincount(full.labels)
    np.testing.assert_array_equal(np.bincount(validation.labels, minlength=len(counts)),
                                  np.round(counts * fraction).astype(int))


@pytest.mark.parametrize("name", ["mnist", "multimnist"])
def test_the_mnist_family_and_multimnist_hold_out_validation_digits(tiny_idx_dir, name):
    """MultiMNIST holds out digits before they are paired: no digit of a validation pair is trained on."""
    task = task_for({"name": name, "dir": str(tiny_idx_dir), "shift_pixels": 2 if name == "mnist" else 4})
    full = task.load("train", limit=200)
    train, validation = task.load_train_validation(limit=200, fraction=0.25)
    assert_held_out(full, train, validation, 0.25)
    again = task.load_train_validation(limit=200, fraction=0.25)[1]
    np.testing.assert_array_equal(again.images, validation.images)
    assert task.load_train_validation(limit=200)[1] is None


@pytest.mark.parametrize("cache", ["memory", "none"])
def test_a_folder_holds_out_validation_files_apart_from_its_test_share(tmp_path, cache):
    """A folder of class folders: data.test_fraction's test files, data.validation_fraction's
    validation files and the training files are three disjoint sets, the same in every load
    (in memory, and streamed: cache=none)."""
    root = make_folder(tmp_path / "f", n_per_class=12, size=16, splits=(None,))
    data = {"name": "folder", "dir": str(root), "image_size": 16, "channels": 3, "shift_pixels": 0,
            "test_fraction": 0.25, "cache": cache}
    task = task_for(data)
    train, validation = task.load_train_validation(fraction=0.34)
    test = task.load("test")
    assert (len(train), len(validation), len(test)) == (18, 9, 9)
    np.testing.assert_array_equal(np.bincount(validation.labels), [3, 3, 3])
    if cache == "none":
        files = [set(split.source["paths"]) for split in (train, validation)]
        assert not files[0] & files[1]
        assert len(files[0] | files[1]) == 27 and not (files[0] | files[1]) & set(test.source["paths"])
        assert task.load_train_validation(fraction=0.34)[1].source["paths"] == validation.source["paths"]
    else:
        seen = [rows(split.images) for split in (train, validation, test)]
        assert not seen[0].keys() & seen[1].keys() and not (seen[0].keys() | seen[1].keys()) & seen[2].keys()
        again = task.load_train_validation(fraction=0.34)[1]
        np.testing.assert_array_equal(again.images, validation.images)


def test_cifar10_class_folders_hold_out_a_validation_split(tmp_path):
    names = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
    root = make_folder(tmp_path / "cifar", n_per_class=5, classes=names, size=32)
    task = task_for({"name": "cifar10", "dir": str(root), "image_size": 32, "channels": 3, "shift_pixels": 0,
                     "cache": "memory"})
    full = task.load("train")
    train, validation = task.load_train_validation(fraction=0.2)
    assert_held_out(full, train, validation, 0.2)


def test_validation_fraction_is_every_kind_s_and_test_fraction_the_folder_s(tiny_config):
    assert config.check(tiny_config("data.validation_fraction=0.1"))["data"]["validation_fraction"] == 0.1
    assert config.check(tiny_config("data=multimnist", "data.validation_fraction=0.1"))["data"][
        "validation_fraction"] == 0.1
    with pytest.raises(ConfigError, match="data.test_fraction: only for natural images"):
        config.check(tiny_config("data.test_fraction=0.1"))


def test_an_old_run_config_s_validation_fraction_was_the_folder_s_test_share():
    """A run saved before data.test_fraction: its data.validation_fraction was the test share
    of a folder without train/ and test/, and the run had no validation split."""
    migrated = config.migrate({"data": {"name": "folder", "dir": "/x", "validation_fraction": 0.2}})
    assert migrated["data"]["test_fraction"] == 0.2 and migrated["data"]["validation_fraction"] == 0.0
    today = config.migrate({"data": {"name": "folder", "dir": "/x", "validation_fraction": 0.1,
                                     "test_fraction": 0.2}})
    assert today["data"]["test_fraction"] == 0.2 and today["data"]["validation_fraction"] == 0.1


def test_a_folder_without_train_and_test_names_test_fraction(tmp_path, tiny_config):
    root = make_folder(tmp_path / "f", n_per_class=4, splits=(None,))
    with pytest.raises(ConfigError, match="split its class folders with data.test_fraction=0.1 .*"
                                          "data.validation_fraction holds out validation images of the training split"):
        task_for({"name": "folder", "dir": str(root), "image_size": 16, "channels": 3,
                  "validation_fraction": 0.1}).load_train_validation(fraction=0.1)


def test_best_is_the_highest_validation_accuracy_where_the_run_has_one():
    """The rule of best/ over a history whose test accuracy keeps rising while the
    validation accuracy peaks at epoch 2: best is epoch 2, its test accuracy reported as
    best_test_accuracy; without validation, the test accuracy's peak."""
    from capsnet.training.loop import best_metrics
    from capsnet.training.run_dir import last_epoch_was_best

    history = [{"epoch": e, "test_accuracy": t, "validation_accuracy": v}
               for e, t, v in ((1, 0.5, 0.6), (2, 0.6, 0.8), (3, 0.7, 0.7), (4, 0.8, 0.8))]
    assert [last_epoch_was_best(history[:e], e) for e in (1, 2, 3, 4)] == [True, True, False, False]
    assert best_metrics(history, 0.8) == {"best_epoch": 2, "best_chosen_on": "validation", "best_test_accuracy": 0.6,
                                         "best_validation_accuracy": 0.8}
    tested_only = [{k: v for k, v in h.items() if k != "validation_accuracy"} for h in history]
    assert [last_epoch_was_best(tested_only[:e], e) for e in (1, 2, 3, 4)] == [True, True, True, True]
    assert best_metrics(tested_only, 0.8) == {"best_epoch": 4, "best_chosen_on": "test", "best_test_accuracy": 0.8}


@pytest.mark.slow
def test_a_run_with_a_validation_split_chooses_best_on_it_and_evaluate_defaults_to_it(tiny_config, tiny_idx_dir,
                                                                                      tmp_path, capsys):
    from capsnet.evaluation import evaluate, format_report
    from capsnet.idx import read_idx
    from capsnet.training import train

    run_dir = tmp_path / "run"
    metrics = train(tiny_config("data.validation_fraction=0.25", "train.epochs=3", run_dir=run_dir))
    out = capsys.readouterr().out
    history = metrics["history"]
    assert all({"validation_accuracy", "validation_loss", "test_accuracy"} <= set(h) for h in history)
    accuracies = [h["validation_accuracy"] for h in history]
    best_epoch = accuracies.index(max(accuracies)) + 1  # the first of equal bests
    assert metrics["best_epoch"] == best_epoch and metrics["best_chosen_on"] == "validation"
    assert metrics["best_test_accuracy"] == history[best_epoch - 1]["test_accuracy"]
    assert [p.name for p in (run_dir / "checkpoints" / "best").glob("*.index")] == [f"ckpt-{best_epoch}.index"]
    # The steps cover the training digits less a quarter of each class.
    counts = np.bincount(read_idx(tiny_idx_dir / "train-labels-idx1-ubyte.gz"))
    trained_on = int(counts.sum() - np.round(counts * 0.25).sum())
    assert metrics["global_step"] == 3 * math.ceil(trained_on / 16)
    line = next(line for line in out.splitlines() if line.startswith(f"epoch {best_epoch}: "))
    assert " | val loss " in line and "(best) | test loss " in line
    # TensorBoard: validation/ and test/ curves apart, one point each an epoch.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir)).Reload()
    tags = events.Tags()["tensors"]
    assert {"validation/accuracy", "test/accuracy"} <= set(tags)
    shown = [float(tf.make_ndarray(e.tensor_proto)) for e in events.Tensors("validation/accuracy")]
    assert shown == pytest.approx(accuracies)

    report = evaluate(run_dir)
    assert report["checkpoint"].endswith(f"best/ckpt-{best_epoch}") and report["best_chosen_on"] == "validation"
    assert report["accuracy"] == history[best_epoch - 1]["test_accuracy"]
    assert "chosen on this test set" not in format_report(report)
    assert json.loads((run_dir / "metrics.json").read_text())["best_chosen_on"] == "validation"
