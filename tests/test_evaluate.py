"""capsnet.evaluation: the report math against NumPy, evaluate() on a tiny trained run, bad input."""
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import checkpoint_lengths, np_margin_loss

from capsnet.errors import CheckpointError, ConfigError, OpLibraryError
from capsnet.evaluation import ensemble_report, evaluate, format_report
from capsnet.idx import read_idx
from capsnet.scoring import confusion_report

REPORT_KEYS = {"accuracy", "loss", "images_per_sec", "per_class_accuracy", "confusion_matrix"}


def test_confusion_report_against_numpy():
    rng = np.random.default_rng(3)
    labels, predictions = rng.integers(0, 4, 200), rng.integers(0, 4, 200)
    labels[labels == 2] = 1  # class 2 has no examples: its accuracy is undefined
    confusion = np.zeros((4, 4), int)
    for t, p in zip(labels, predictions):
        confusion[t, p] += 1
    report = confusion_report(confusion)
    assert report["accuracy"] == pytest.approx(np.mean(labels == predictions))
    for k in (0, 1, 3):
        assert report["per_class_accuracy"][k] == pytest.approx(np.mean(predictions[labels == k] == k))
    assert report["per_class_accuracy"][2] is None
    assert report["confusion_matrix"] == confusion.tolist()


def test_evaluate_run_dir_without_a_validation_split_uses_its_final_checkpoint(trained_run, tiny_idx_dir):
    """The run held no validation split out (its best/ was chosen on the test set): the
    default is the last epoch, which no choice on the test set picked."""
    run_dir, metrics = trained_run
    report = evaluate(run_dir)
    assert REPORT_KEYS <= set(report)
    final = metrics["history"][-1]
    assert report["epoch"] == metrics["epochs"] == 4
    assert report["checkpoint"].endswith("latest/ckpt-4") and "best_chosen_on" not in report
    # The restored weights reproduce what training measured at that epoch.
    assert report["accuracy"] == final["test_accuracy"] == metrics["test_accuracy"]
    assert report["loss"] == pytest.approx(final["test_loss"], rel=1e-5)

    # The confusion matrix counts every test example once, by its true label.
    true_labels = read_idx(tiny_idx_dir / "t10k-labels-idx1-ubyte.gz")
    confusion = np.array(report["confusion_matrix"])
    np.testing.assert_array_equal(confusion.sum(axis=1), np.bincount(true_labels, minlength=10))
    assert report["accuracy"] == pytest.approx(np.trace(confusion) / len(true_labels))
    assert report["num_examples"] == len(true_labels)

    # Written into the run's evaluations/, equal to the returned report.
    written = json.loads(open(report["output"]).read())
    assert report["output"] == str(run_dir.resolve() / "evaluations" / "latest-ckpt-4.json")
    assert written == {k: v for k, v in report.items() if k != "output"}
    table = format_report(report)
    assert "confusion matrix" in table and f"{report['accuracy']:.4%}" in table
    assert "chosen on this test set" not in table
    # MNIST's class names are its indices: each class row names it once (index, examples, accuracy).
    assert report["class_names"] == [str(c) for c in range(10)]
    rows = [line.split() for line in table.splitlines() if re.match(r" {4}\d  ", line)]
    assert [row[0] for row in rows] == [str(c) for c in range(10)] * 2  # the per-class table, the confusion matrix
    assert [len(row) for row in rows] == [3] * 10 + [11] * 10
    # Names that are not the indices (a folder's classes) follow each row.
    named = format_report({**report, "class_names": [f"class_{c}" for c in range(10)]})
    assert [line.split()[-1] for line in named.splitlines() if re.match(r" {4}\d  ", line)] == \
        [f"class_{c}" for c in range(10)] * 2


def test_a_best_checkpoint_chosen_on_the_test_set_says_so(trained_run):
    """which=best of a run without a validation split: the epoch of the highest test
    accuracy, its report and table saying it was chosen on the test set (so its accuracy
    there is optimistic); a path into best/ too."""
    run_dir, metrics = trained_run
    report = evaluate(run_dir, which="best")
    best = metrics["history"][metrics["best_epoch"] - 1]
    assert report["epoch"] == metrics["best_epoch"] and metrics["best_chosen_on"] == "test"
    assert report["checkpoint"].endswith(f"best/ckpt-{metrics['best_epoch']}")
    assert report["accuracy"] == best["test_accuracy"] == max(h["test_accuracy"] for h in metrics["history"])
    assert report["loss"] == pytest.approx(best["test_loss"], rel=1e-5)
    assert report["best_chosen_on"] == "test"
    assert report["output"] == str(run_dir.resolve() / "evaluations" / f"best-ckpt-{metrics['best_epoch']}.json")
    assert "note: checkpoints/best was chosen on this test set" in format_report(report)
    prefix = run_dir / "checkpoints" / "best" / f"ckpt-{metrics['best_epoch']}"
    assert evaluate(prefix, limit_test=20)["best_chosen_on"] == "test"


def test_evaluate_latest_and_a_checkpoint_path(trained_run, tmp_path):
    run_dir, metrics = trained_run
    latest = evaluate(run_dir, which="latest")
    assert latest["epoch"] == 4
    assert latest["accuracy"] == metrics["test_accuracy"]

    prefix = run_dir / "checkpoints" / "latest" / "ckpt-3"
    output = tmp_path / "out" / "ckpt3.json"
    report = evaluate(str(prefix) + ".index", limit_test=40, batch_size=7, output=output)
    assert report["epoch"] == 3 and report["num_examples"] == 40
    assert np.array(report["confusion_matrix"]).sum() == 40
    assert json.loads(output.read_text())["accuracy"] == report["accuracy"]


@pytest.mark.slow
def test_the_default_report_is_outside_checkpoints_and_outlives_their_rotation(trained_run, tiny_config, tmp_path):
    """The default report goes into the run's evaluations/, named after the checkpoint's place
    (best-ckpt-N, latest-ckpt-N; a checkpoint path finds its run dir above it); nothing is
    written under checkpoints/. A training going on in the run dir then moves best/ to
    another epoch and prunes latest/ (train.keep_checkpoints=1), deleting the evaluated
    checkpoints' files: the reports stay, and so does one an older version wrote beside a
    checkpoint (ckpt-N.eval.json: the pruning deletes a checkpoint's own files only)."""
    import tensorflow as tf

    from capsnet.training import train
    from capsnet.training.checkpoints import BestCheckpoint, checkpoint_numbers

    run_dir = shutil.copytree(trained_run[0], tmp_path / "run").resolve()
    shutil.rmtree(run_dir / "evaluations", ignore_errors=True)  # other tests' reports of the shared run
    checkpoints = run_dir / "checkpoints"
    before = sorted(checkpoints.rglob("*"))
    best = evaluate(run_dir, which="best")
    latest = evaluate(checkpoints / "latest" / "ckpt-3")
    assert best["output"] == str(run_dir / "evaluations" / f"best-ckpt-{best['epoch']}.json")
    assert latest["output"] == str(run_dir / "evaluations" / "latest-ckpt-3.json")
    assert sorted(checkpoints.rglob("*")) == before
    old = checkpoints / "best" / f"ckpt-{best['epoch']}.eval.json"
    old.write_text(json.dumps({"accuracy": best["accuracy"]}))

    # best/ moves to another epoch (BestCheckpoint.commit deletes the previous best's files).
    other = max(set(checkpoint_numbers(checkpoints / "latest")) - {best["epoch"]})
    rotated = BestCheckpoint(tf.train.Checkpoint(), checkpoints / "best")
    rotated.adopt(other, checkpoints / "latest" / f"ckpt-{other}")
    rotated.commit(other)
    assert checkpoint_numbers(checkpoints / "best") == [other]
    # latest/ keeps one checkpoint from the next epoch on (CheckpointManager prunes the rest).
    train(tiny_config("train.epochs=5", "train.keep_checkpoints=1", run_dir=run_dir))
    assert checkpoint_numbers(checkpoints / "latest") == [5]
    for report in (best, latest):
        assert not Path(report["checkpoint"] + ".index").exists()
        assert json.loads(Path(report["output"]).read_text()) == {k: v for k, v in report.items() if k != "output"}
    assert json.loads(old.read_text())["accuracy"] == best["accuracy"]


def test_a_pass_with_other_settings_is_reported_beside_the_run_s_own(trained_run, tmp_path):
    """evaluate.py rerun with custom_op switched (or another limit_test) writes its own report,
    named after what differs, and leaves the run's own where compare_runs reads it; a setting
    said as the run had it is the run's own pass."""
    from conftest import load_script

    run_dir = shutil.copytree(trained_run[0], tmp_path / "run").resolve()
    shutil.rmtree(run_dir / "evaluations", ignore_errors=True)  # other tests' reports of the shared run
    reports = run_dir / "evaluations"
    own = evaluate(run_dir, which="latest")
    assert own["custom_op"] is False and own["output"] == str(reports / "latest-ckpt-4.json")
    op = evaluate(run_dir, which="latest", custom_op=True)
    assert op["output"] == str(reports / "latest-ckpt-4.custom_op-true.json")
    few = evaluate(run_dir, which="latest", custom_op=True, limit_test=40)
    assert few["output"] == str(reports / "latest-ckpt-4.custom_op-true+limit_test-40.json")
    assert json.loads((reports / "latest-ckpt-4.json").read_text())["custom_op"] is False
    assert evaluate(run_dir, which="latest", custom_op=False)["output"] == own["output"]
    assert load_script("compare_runs").evaluated_accuracy(run_dir, "latest", 4) == own["accuracy"]


def test_evaluate_batches_as_the_run_tested_unless_told(trained_run, tmp_path):
    """batch_size=None is the run's test pass batch: train.test_batch_size where the run set
    one, else train.batch_size; an explicit batch_size wins. The scores do not depend on it."""
    run_dir, metrics = trained_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    config = yaml.safe_load((copy / "config.yaml").read_text())
    assert evaluate(copy, which="latest", output=tmp_path / "a.json")["batch_size"] == config["train"]["batch_size"]
    config["train"]["test_batch_size"] = 7
    (copy / "config.yaml").write_text(yaml.safe_dump(config))
    report = evaluate(copy, which="latest", output=tmp_path / "b.json")
    assert report["batch_size"] == 7 and report["accuracy"] == metrics["test_accuracy"]
    assert evaluate(copy, which="latest", batch_size=5, output=tmp_path / "c.json")["batch_size"] == 5


def test_missing_checkpoints_name_the_path(trained_run, tmp_path):
    with pytest.raises(CheckpointError, match=f"checkpoint not found: {tmp_path}/nope"):
        evaluate(tmp_path / "nope")

    empty_run = tmp_path / "empty_run"
    (empty_run / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=f"run dir {empty_run} has no latest checkpoint"):
        evaluate(empty_run)
    with pytest.raises(CheckpointError, match=f"run dir {empty_run} has no best checkpoint"):
        evaluate(empty_run, which="best")

    # Checkpoints without their run's config.yaml cannot rebuild the model.
    loose = tmp_path / "loose"
    shutil.copytree(trained_run[0] / "checkpoints" / "latest", loose)
    with pytest.raises(CheckpointError, match="no config.yaml"):
        evaluate(loose)

    with pytest.raises(ConfigError, match=r"which must be one of best, latest \(or null\), got 'worst'"):
        evaluate(trained_run[0], which="worst")


@pytest.mark.slow
def test_a_report_that_cannot_be_written_leaves_no_file_blocking_the_rerun(trained_run, tmp_path):
    """evaluate.py under a file-size limit of 512 bytes (a full disk for the report, larger
    than that): one line, exit 2, no empty or truncated report.json; the same command without
    the limit then writes it (a file left behind would be refused: "exists: overwrite=true")."""
    import resource
    import subprocess
    import sys

    from conftest import REPO, entry_point_env

    output = tmp_path / "report.json"
    command = [sys.executable, str(REPO / "evaluate.py"), f"checkpoint={trained_run[0]}", f"output={output}"]

    def full_disk():  # Python ignores SIGXFSZ: a write past the limit fails with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (512, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    failed = subprocess.run(command, cwd=tmp_path, env=entry_point_env(), capture_output=True, text=True,
                            timeout=300, preexec_fn=full_disk)
    assert failed.returncode == 2, failed.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the report nor its temporary file
    assert f"cannot write the evaluation report {output}: File too large (is the disk full?)" in failed.stderr
    rerun = subprocess.run(command, cwd=tmp_path, env=entry_point_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert json.loads(output.read_text())["accuracy"] == trained_run[1]["test_accuracy"]


def test_a_config_that_does_not_match_the_checkpoint_is_reported(trained_run, tmp_path):
    run_dir = tmp_path / "edited"
    shutil.copytree(trained_run[0], run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["model"]["decoder_units"] = [32, 32]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(CheckpointError, match="cannot load the model from checkpoint .*ckpt-"):
        evaluate(run_dir)


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": "abc"}, "batch_size must be a positive integer .*got 'abc'"),
    ({"batch_size": 0}, "batch_size must be a positive integer .*got 0"),
    ({"batch_size": 2.7}, "batch_size must be a positive integer .*got 2.7"),
    ({"batch_size": True}, "batch_size must be a positive integer .*got True"),
    ({"custom_op": "abc"}, "custom_op must be true or false .*got 'abc'"),
    ({"custom_op": "no"}, "custom_op must be true or false .*got 'no'"),
    ({"xla": "autocluster"}, r"xla must be one of none, jit \(or null: as trained\), got 'autocluster'"),
])
def test_bad_evaluate_arguments_are_one_line_config_errors(trained_run, tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message) as err:
        evaluate(trained_run[0], output=tmp_path / "never.json", **kwargs)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "never.json").exists()


@pytest.mark.slow
def test_xla_jit_for_a_run_routed_by_its_own_xla_computation_is_a_config_error(trained_run, tmp_path):
    # model.routing=xla compiles the routing on its own; nested in a compiled pass it aborted
    # the process on a GPU (check_xla), so evaluate() says so first.
    run_dir = tmp_path / "edited"
    shutil.copytree(trained_run[0], run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["model"]["routing"] = "xla"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"xla=jit: the run .*edited routes with model.routing=xla.*use xla=none"):
        evaluate(run_dir, xla="jit", output=tmp_path / "never.json")
    assert evaluate(run_dir, which="latest", output=tmp_path / "plain.json")["xla"] == "none"


def test_bad_values_in_the_run_config_are_config_errors(trained_run, tmp_path):
    run_dir = tmp_path / "edited"
    shutil.copytree(trained_run[0], run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    for section, key, value, message in (
            (None, "custom_op", "yes", r"custom_op \(.*config.yaml\) must be true or false"),
            ("train", "m_minus", 2.0, "m_minus < m_plus"),
            ("model", "num_classes", "ten", "num_classes must be a positive integer")):
        edited = json.loads(json.dumps(config))
        (edited[section] if section else edited)[key] = value
        (run_dir / "config.yaml").write_text(yaml.safe_dump(edited))
        with pytest.raises(ConfigError, match=message):
            evaluate(run_dir, output=tmp_path / "never.json")


# --------------------------------------------------------------------------- ensembles

def _member_pass(lengths, labels, accuracy=0.5):
    """What evaluate_model(keep_lengths=True) gives ensemble_report, from given lengths."""
    return {"lengths": np.asarray(lengths, np.float32), "labels": np.asarray(labels)}, \
        {"checkpoint": "c", "run_dir": "r", "epoch": 1, "weights": "raw", "custom_op": False, "precision": "float32",
         "accuracy": accuracy,
         "loss": 0.1, "margin_loss": 0.1, "reconstruction_loss": 0.0, "images_per_sec": 100.0,
         "dataset": "mnist", "batch_size": 8}


def test_ensemble_report_scores_the_members_mean_lengths():
    rng = np.random.default_rng(5)
    labels = rng.integers(0, 4, 300)
    lengths = rng.uniform(0, 1, (3, 300, 4))
    # Example 0: two members of three say class 1, but the mean says 0 (0.9+0.4+0.4 > 0+0.5+0.5):
    # lengths are averaged, not votes counted.
    lengths[:, 0] = [[0.9, 0.0, 0, 0], [0.4, 0.5, 0, 0], [0.4, 0.5, 0, 0]]
    passes = [_member_pass(l, labels) for l in lengths]
    report = ensemble_report([r for _, r in passes], [p for p, _ in passes], num_classes=4)
    expected = lengths.mean(axis=0).argmax(axis=1)
    assert expected[0] == 0 and [lengths[m, 0].argmax() for m in range(3)] == [0, 1, 1]
    confusion = np.zeros((4, 4), int)
    np.add.at(confusion, (labels, expected), 1)
    assert report["confusion_matrix"] == confusion.tolist()
    assert report["accuracy"] == pytest.approx(np.mean(expected == labels))
    assert report["num_examples"] == 300 and len(report["members"]) == 3
    # One after another: 3 members at 100 images/s each are an ensemble at 33.3.
    assert report["images_per_sec"] == pytest.approx(100 / 3)
    assert "ensemble accuracy" in format_report(report)

    # Two digits per example: the two longest mean lengths, either order.
    pair_labels = np.array([[0, 1], [2, 3]])
    pair_lengths = [[[0.9, 0.1, 0.8, 0.0], [0.0, 0.9, 0.1, 0.8]],
                    [[0.1, 0.9, 0.0, 0.0], [0.0, 0.0, 0.7, 0.9]]]  # means: [.5 .5 .4 0], [0 .45 .4 .85]
    passes = [_member_pass(l, pair_labels) for l in pair_lengths]
    pairs = ensemble_report([r for _, r in passes], [p for p, _ in passes], num_classes=4)
    assert pairs["accuracy"] == 0.5 and pairs["confusion_matrix"] is None
    assert pairs["per_class_accuracy"] == [1.0, 1.0, 0.0, 1.0]
    assert "both digits right" in format_report(pairs)

    shuffled = [_member_pass(lengths[0], labels), _member_pass(lengths[1], labels[::-1])]
    with pytest.raises(RuntimeError, match="different orders"):
        ensemble_report([r for _, r in shuffled], [p for p, _ in shuffled], num_classes=4)


def test_a_test_split_of_one_batch_is_scored_with_its_rate_unmeasured(trained_run, tmp_path):
    """The clock leaves a test pass's first batch out (its wait includes the compile): with one
    batch nothing is timed. The rate is then None ("not measured"), not 0 images/s, and an
    ensemble of such passes is scored instead of dividing by zero."""
    run_dir, _ = trained_run
    latest = run_dir / "checkpoints" / "latest"
    alone = evaluate(latest / "ckpt-3", limit_test=20, batch_size=50, output=tmp_path / "alone.json")
    assert alone["images_per_sec"] is None and alone["num_examples"] == 20
    assert "images/s not measured (one batch)" in format_report(alone)
    both = evaluate([str(latest / "ckpt-2"), str(latest / "ckpt-3")], limit_test=20, batch_size=50,
                    output=tmp_path / "both.json")
    assert both["images_per_sec"] is None and both["num_examples"] == 20
    assert "images/s not measured" in format_report(both)
    assert json.loads((tmp_path / "both.json").read_text())["images_per_sec"] is None


@pytest.mark.slow
def test_evaluate_a_list_of_checkpoints_as_an_ensemble(trained_run, tiny_idx_dir, tmp_path):
    run_dir, metrics = trained_run
    latest = run_dir / "checkpoints" / "latest"
    prefixes = [latest / "ckpt-2", latest / "ckpt-3", latest / "ckpt-4"]
    report = evaluate([str(p) for p in prefixes], batch_size=7)

    from capsnet.data import load_split, make_split_dataset

    images, labels = load_split("mnist", "test", data_dir=tiny_idx_dir)
    dataset = make_split_dataset("mnist", images, labels, batch_size=50, training=False)
    members = [checkpoint_lengths(p, run_dir, dataset) for p in prefixes]
    expected = np.mean(members, axis=0).argmax(axis=1)
    confusion = np.zeros((10, 10), int)
    np.add.at(confusion, (labels, expected), 1)
    assert report["confusion_matrix"] == confusion.tolist()
    assert report["accuracy"] == pytest.approx(np.mean(expected == labels))
    # Each member's own numbers are those of evaluating it alone (and of training at its epoch).
    for i, (member, prefix, lengths) in enumerate(zip(report["members"], prefixes, members)):
        alone = evaluate(prefix, output=tmp_path / f"alone-{i}.json")
        assert member["checkpoint"] == alone["checkpoint"] == str(prefix)
        assert member["epoch"] == alone["epoch"]
        assert member["accuracy"] == alone["accuracy"] == pytest.approx(np.mean(lengths.argmax(axis=1) == labels))
        assert member["loss"] == pytest.approx(alone["loss"], rel=1e-5)
        assert member["accuracy"] == metrics["history"][member["epoch"] - 1]["test_accuracy"]
    # Written into the first member's run's evaluations/, under a name that says which members.
    assert report["output"].startswith(str(run_dir / "evaluations" / "latest-ckpt-2.ensemble-"))
    written = json.loads(open(report["output"]).read())
    assert written == {k: v for k, v in report.items() if k != "output"}
    table = format_report(report)
    assert table.startswith("ensemble of 3 checkpoints") and str(prefixes[2]) in table
    assert f"ensemble accuracy {report['accuracy']:.4%}" in table

    # An ensemble of one is the checkpoint's plain evaluation.
    one = evaluate([run_dir], output=tmp_path / "one.json")
    assert "members" not in one and one["accuracy"] == evaluate(run_dir)["accuracy"]


@pytest.mark.slow
def test_tta_flip_scores_each_image_by_its_lengths_and_its_mirror_images_averaged(trained_run, tiny_config,
                                                                                   tiny_idx_dir, tmp_path):
    """tta=flip: the plain and the mirrored pass of each checkpoint, and every example scored
    by the capsule lengths of both averaged; the references mirror the images in NumPy and
    run the model directly. Refused for a run that never saw a mirrored image."""
    from capsnet.data import load_split, make_split_dataset
    from capsnet.training import train

    run_dir = tmp_path / "flipped"
    train(tiny_config("data.flip=true", "train.epochs=2", run_dir=run_dir))
    report = evaluate(run_dir, which="latest", tta="flip", batch_size=9)

    images, labels = load_split("mnist", "test", data_dir=tiny_idx_dir)
    prefix = run_dir / "checkpoints" / "latest" / "ckpt-2"
    plain, mirrored = (checkpoint_lengths(prefix, run_dir, make_split_dataset("mnist", x, labels, batch_size=50,
                                                                              training=False))
                       for x in (images, np.flip(images, axis=2)))  # (N, H, W, C): W mirrored
    expected = (plain + mirrored).argmax(axis=1)
    assert report["accuracy"] == pytest.approx(np.mean(expected == labels))
    confusion = np.zeros((10, 10), int)
    np.add.at(confusion, (labels, expected), 1)
    assert report["confusion_matrix"] == confusion.tolist()
    assert [m["view"] for m in report["members"]] == ["plain", "mirrored"]
    for member, lengths in zip(report["members"], (plain, mirrored)):
        assert member["accuracy"] == pytest.approx(np.mean(lengths.argmax(axis=1) == labels))
    assert report["members"][0]["accuracy"] == evaluate(run_dir, which="latest", output=tmp_path / "a.json")["accuracy"]
    assert report["output"].startswith(str(run_dir / "evaluations" / "latest-ckpt-2.ensemble-"))
    assert format_report(report).startswith("ensemble of 2 passes: 1 checkpoint(s) x 2 views, plain and mirrored")

    with pytest.raises(ConfigError, match=r"tta=flip: the run .* was not trained on mirrored images "
                                          r"\(data\.flip=false.*use tta=none") as err:
        evaluate(trained_run[0], tta="flip", output=tmp_path / "never.json")
    assert "\n" not in str(err.value) and not (tmp_path / "never.json").exists()
    with pytest.raises(ConfigError, match="tta must be one of none, flip, shift, got 'rotate'"):
        evaluate(run_dir, tta="rotate", output=tmp_path / "never.json")


def np_shifted(images, dy, dx, fill):
    """(N, H, W, C) images moved dy rows down and dx columns right, one pixel at most; the
    uncovered row or column zero (fill="zero") or a copy of its neighbour (fill="edge")."""
    moved = np.roll(images, (dy, dx), axis=(1, 2))
    if dy:
        moved[:, 0 if dy > 0 else -1] = 0 if fill == "zero" else images[:, 0 if dy > 0 else -1]
    if dx:
        moved[:, :, 0 if dx > 0 else -1] = 0 if fill == "zero" else images[:, :, 0 if dx > 0 else -1]
    return moved


@pytest.mark.slow
@pytest.mark.parametrize("fill", ["zero", "edge"])
def test_tta_shift_scores_each_image_by_its_lengths_and_its_four_one_pixel_shifts_averaged(
        trained_run, tiny_config, tiny_idx_dir, tmp_path, fill):
    """tta=shift: five passes of each checkpoint (the images as they are, moved one pixel
    right, left, down, up, the border filled as the run's training shifts fill it), and every
    example scored by the lengths of the five averaged; the references shift the images in
    NumPy and run the model directly. Refused for a run trained without shifts."""
    from capsnet.data import load_split, make_split_dataset

    if fill == "zero":
        run_dir = trained_run[0]  # data.shift_pixels=2, shift_fill=zero
    else:
        from capsnet.training import train

        run_dir = tmp_path / "edge"
        train(tiny_config("data.shift_fill=edge", "train.epochs=1", run_dir=run_dir))
    report = evaluate(run_dir, which="latest", tta="shift", batch_size=9, output=tmp_path / "tta.json")

    images, labels = load_split("mnist", "test", data_dir=tiny_idx_dir)
    prefix = report["members"][0]["checkpoint"]
    shifts = {"plain": (0, 0), "right": (0, 1), "left": (0, -1), "down": (1, 0), "up": (-1, 0)}
    lengths = [checkpoint_lengths(prefix, run_dir, make_split_dataset(
        "mnist", np_shifted(images, dy, dx, fill), labels, batch_size=50, training=False))
        for dy, dx in shifts.values()]
    assert [m["view"] for m in report["members"]] == list(shifts)
    for member, view_lengths in zip(report["members"], lengths):
        assert member["accuracy"] == pytest.approx(np.mean(view_lengths.argmax(axis=1) == labels))
        # The loss pins the view itself (a shift the other way would score alike on so few images).
        assert member["margin_loss"] == pytest.approx(np_margin_loss(labels, view_lengths).mean(), rel=1e-4)
    expected = np.sum(lengths, axis=0).argmax(axis=1)
    assert report["accuracy"] == pytest.approx(np.mean(expected == labels))
    assert report["tta"] == "shift"
    assert format_report(report).startswith(
        "ensemble of 5 passes: 1 checkpoint(s) x 5 views, plain, right, left, down and up (tta=shift;")

    from capsnet.training import train

    unshifted = tmp_path / "unshifted"
    train(tiny_config("data.shift_pixels=0", "train.epochs=1", run_dir=unshifted))
    with pytest.raises(ConfigError, match=r"tta=shift: the run .* was not trained on shifted images "
                                          r"\(data\.shift_pixels=0\): use tta=none"):
        evaluate(unshifted, tta="shift", output=tmp_path / "never.json")
    assert not (tmp_path / "never.json").exists()


def test_ensembles_of_unlike_runs_are_one_line_config_errors(trained_run, tmp_path):
    run_dir = trained_run[0]
    with pytest.raises(ConfigError, match=r"checkpoint=\[\] names no checkpoint"):
        evaluate([])
    for key, value, message in (
            (("data", "name"), "fashion_mnist", "ensemble members trained on different datasets: mnist .* fashion_mnist"),
            (("model", "num_classes"), 11, r"ensemble members differ in \(image shape, classes\): .*10\).*11\)")):
        other = tmp_path / key[1]
        shutil.copytree(run_dir, other)
        config = yaml.safe_load((other / "config.yaml").read_text())
        config[key[0]][key[1]] = value
        (other / "config.yaml").write_text(yaml.safe_dump(config))
        with pytest.raises(ConfigError, match=message) as err:
            evaluate([run_dir, other], output=tmp_path / "never.json")
        assert "\n" not in str(err.value) and str(other) in str(err.value)
    latest = run_dir / "checkpoints" / "latest"
    with pytest.raises(ConfigError, match=r"names a checkpoint more than once: .*ckpt-4$"):
        evaluate([latest / "ckpt-4", latest / "ckpt-3", latest / "ckpt-4"])
    # The dataset a member was trained on counts even where data.name picks the test split.
    with pytest.raises(ConfigError, match="ensemble members trained on different datasets"):
        evaluate([run_dir, tmp_path / "name"], data_name="mnist")
    with pytest.raises(CheckpointError, match=f"checkpoint not found: {tmp_path}/nope"):
        evaluate([run_dir, tmp_path / "nope"])
    assert not (tmp_path / "never.json").exists()
    assert not list(run_dir.glob("evaluations/best-ckpt-*.ensemble-*"))  # nor where the first member's report would go


# --------------------------------------------------------------------------- the compiled op

def test_evaluate_with_the_custom_op_matches_the_matmul_path(trained_run, tmp_path, spy_on_op):
    """A checkpoint trained on the matmul path, evaluated through the compiled op.

    Needs the op library (capsnet/lib/_capsnet_ops.so): `make test` builds it first.
    """
    calls = spy_on_op()
    run_dir, metrics = trained_run
    report = evaluate(run_dir, which="latest", custom_op=True, output=tmp_path / "op.json")
    assert calls, "evaluate(custom_op=True) did not use the op"
    assert report["custom_op"] is True and report["epoch"] == 4
    assert abs(report["accuracy"] - metrics["test_accuracy"]) <= 1 / report["num_examples"]
    assert report["loss"] == pytest.approx(metrics["test_loss"], rel=1e-4)


def test_a_fused_routing_run_evaluates_on_either_path(trained_run, tmp_path):
    """A run trained with model.fused_routing=true (same W as every path): evaluated as
    trained (the fused op) and with custom_op=false (TF routing), the same accuracy and loss."""
    run_dir = tmp_path / "fused"
    shutil.copytree(trained_run[0], run_dir)
    (run_dir / ".capsnet-run").unlink()  # a run dir of the code that had the flag: no marker, read by migrate
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    saved["custom_op"], saved["model"]["fused_routing"] = True, True
    del saved["model"]["routing"]  # the flag came before model.routing
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    fused = evaluate(run_dir, which="latest", output=tmp_path / "fused.json")
    matmul = evaluate(run_dir, which="latest", custom_op=False, output=tmp_path / "matmul.json")
    assert fused["custom_op"] is True and matmul["custom_op"] is False
    assert abs(fused["accuracy"] - trained_run[1]["test_accuracy"]) <= 1 / fused["num_examples"]
    assert abs(matmul["accuracy"] - fused["accuracy"]) <= 1 / fused["num_examples"]
    assert matmul["loss"] == pytest.approx(fused["loss"], rel=1e-4)


def test_evaluate_without_the_op_library_is_one_line_error(trained_run, tmp_path, fresh_op_loader):
    missing = fresh_op_loader
    with pytest.raises(OpLibraryError) as err:
        evaluate(trained_run[0], custom_op=True, output=tmp_path / "never.json")
    assert "\n" not in str(err.value) and str(missing) in str(err.value) and "make ops" in str(err.value)
    assert not (tmp_path / "never.json").exists()


def test_an_output_never_replaces_a_run_file_nor_an_existing_file_unasked(trained_run, tmp_path):
    # output=RUN/config.yaml would break the run; a checkpoint file is shared by best/ and
    # latest/ through a hard link: both are refused before the pass, and the files kept.
    run_dir = trained_run[0]
    config_file = run_dir / "config.yaml"
    index = next((run_dir / "checkpoints" / "latest").glob("ckpt-*.index"))
    for target in (config_file, index, run_dir / "history.jsonl"):
        before = target.read_bytes()
        with pytest.raises(CheckpointError, match="is a file of a run"):
            evaluate(run_dir, output=target, overwrite=True)
        assert target.read_bytes() == before
    mine = tmp_path / "report.json"
    mine.write_text("my notes\n")
    with pytest.raises(CheckpointError, match="exists: overwrite=true"):
        evaluate(run_dir, output=mine)
    assert mine.read_text() == "my notes\n"
    report = evaluate(run_dir, output=mine, overwrite=True)
    assert json.loads(mine.read_text())["accuracy"] == report["accuracy"]


def test_an_output_under_checkpoints_is_refused_even_as_a_new_file(trained_run):
    """A new file under checkpoints/ would go when the training's best/ or latest/ moves on (a
    folder of them is removed whole): refused before the pass, nothing made."""
    run_dir = trained_run[0]
    for target in (run_dir / "checkpoints" / "report.json", run_dir / "checkpoints" / "best" / "new" / "report.json"):
        with pytest.raises(CheckpointError, match="is a file of a run"):
            evaluate(run_dir, output=target, overwrite=True)
        assert not target.exists()
    assert not (run_dir / "checkpoints" / "best" / "new").exists()
