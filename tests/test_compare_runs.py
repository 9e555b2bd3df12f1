"""scripts/compare_runs.py: a real tiny run and evaluate.py's report of it, the group numbers
against NumPy on made-up histories, the seed pairing, images/s (each run's mean, each group's,
the ratio to the reference), and one-line errors."""
import json
import shutil

import numpy as np
import pytest
import yaml

from conftest import load_script

compare_runs = load_script("compare_runs")


def fake_run(root, name, seed, test_accs, *, epochs=None, train_acc=0.99, untested=(), config=None, speeds=None,
             validation_accs=None):
    """A run dir as train.py leaves one: config.yaml (`config`'s sections besides train.epochs
    and the seed) and history.jsonl, one line an epoch (epochs in `untested` without a test
    pass, as train.test_every_epochs > 1 leaves them; `speeds`: the epochs' train images/s;
    `validation_accs`: the epochs' validation accuracy, as a run with data.validation_fraction has it)."""
    run = root / name
    run.mkdir(parents=True)
    config = {**(config or {}), "seed": seed}
    config["train"] = {**config.get("train", {}), "epochs": epochs or len(test_accs)}
    run.joinpath("config.yaml").write_text(yaml.safe_dump(config))
    lines = []
    for epoch, acc in enumerate(test_accs, start=1):
        record = {"epoch": epoch, "train_accuracy": train_acc, "train_loss": 0.1}
        if speeds is not None:
            record["train_images_per_sec"] = speeds[epoch - 1]
        if validation_accs is not None:
            record["validation_accuracy"] = validation_accs[epoch - 1]
        if epoch not in untested:
            record["test_accuracy"] = acc
        lines.append(json.dumps(record))
    run.joinpath("history.jsonl").write_text("\n".join(lines) + "\n")
    return run


@pytest.mark.slow
def test_a_real_run_and_evaluate_py_report_of_its_final_checkpoint(trained_run, tmp_path, capsys):
    from capsnet.evaluation import evaluate

    run_dir = shutil.copytree(trained_run[0], tmp_path / "real")
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    # Without a report there is none to show (other tests evaluate the shared run: drop theirs).
    shutil.rmtree(run_dir / "evaluations", ignore_errors=True)
    assert compare_runs.read_run(run_dir, 0.5).evaluated is None

    report = evaluate(run_dir, which="latest")  # written at its default place
    assert report["output"] == str(run_dir.resolve() / "evaluations" / f"latest-ckpt-{len(history)}.json")
    run = compare_runs.read_run(run_dir, 0.5)
    assert run.evaluated == report["accuracy"]
    assert run.final == history[-1]["test_accuracy"] == metrics["test_accuracy"]
    assert run.seed == 0 and run.epochs == run.last_epoch == len(history) and run.finished
    assert run.train_accuracy == history[-1]["train_accuracy"]
    assert run.images_per_sec == pytest.approx(metrics["images_per_sec"], rel=1e-9)  # the run's mean

    summary = compare_runs.main([f"tiny={run_dir}", "--threshold", "0.5"])
    printed = capsys.readouterr().out
    assert summary["groups"]["tiny"]["mean"] == run.final
    assert f"| 0 | {100 * run.final:.2f}% | {100 * report['accuracy']:.2f}% |" in printed
    assert f"| {compare_runs.speed(run.images_per_sec)} | {run_dir} |" in printed


def test_the_evaluated_report_is_read_from_evaluations_then_from_beside_the_checkpoint(tmp_path):
    """evaluate.py's default report of the last epoch: evaluations/latest-ckpt-N.json, else
    (a run dir evaluated before reports moved out of checkpoints/) checkpoints/latest/ckpt-N.eval.json;
    a report of another epoch, or of best/, is not the run's final."""
    run = fake_run(tmp_path, "run", 0, [0.97, 0.98, 0.99])
    (run / "checkpoints" / "latest").mkdir(parents=True)
    (run / "evaluations").mkdir()
    (run / "evaluations" / "latest-ckpt-2.json").write_text(json.dumps({"accuracy": 0.5}))
    (run / "evaluations" / "best-ckpt-3.json").write_text(json.dumps({"accuracy": 0.6}))
    assert compare_runs.read_run(run, 0.5).evaluated is None

    old = run / "checkpoints" / "latest" / "ckpt-3.eval.json"
    old.write_text(json.dumps({"accuracy": 0.981}))
    assert compare_runs.read_run(run, 0.5).evaluated == 0.981

    (run / "evaluations" / "latest-ckpt-3.json").write_text(json.dumps({"accuracy": 0.982}))
    assert compare_runs.read_run(run, 0.5).evaluated == 0.982  # the new place first
    old.unlink()
    assert compare_runs.read_run(run, 0.5).evaluated == 0.982


def test_group_numbers_against_numpy(tmp_path):
    rng = np.random.default_rng(0)
    finals = {}
    for seed in range(6):
        accs = list(0.99 + 0.009 * rng.random(8))
        finals[seed] = accs
        fake_run(tmp_path, f"a_{seed}", seed, accs)
    name, paths = compare_runs.parse_group(f"A={tmp_path}/a_*")
    runs = [compare_runs.read_run(p, 0.995) for p in paths]
    summary = compare_runs.summarize({name: runs}, "A", [2, 8, 9], 0.995)["groups"]["A"]

    last = np.array([finals[s][-1] for s in range(6)])
    assert summary["mean"] == pytest.approx(last.mean())
    assert summary["sd"] == pytest.approx(last.std(ddof=1))
    assert summary["se"] == pytest.approx(last.std(ddof=1) / np.sqrt(6))
    assert (summary["min"], summary["max"]) == (pytest.approx(last.min()), pytest.approx(last.max()))
    at = np.array([finals[s] for s in range(6)])
    assert summary["in_run_mean"][2] == pytest.approx(at[:, 1].mean())
    assert summary["in_run_mean"][8] == pytest.approx(at[:, 7].mean())
    assert summary["in_run_mean"][9] is None  # no run has an epoch 9
    for row in summary["runs"]:
        accs = np.array(finals[row["seed"]])
        assert row["best"] == pytest.approx(accs.max()) and row["best_epoch"] == accs.argmax() + 1
        above = np.flatnonzero(accs >= 0.995)
        assert row["first_at_threshold"] == (above[0] + 1 if above.size else None)


def test_paired_difference_uses_common_seeds_only(tmp_path):
    ref = {0: 0.9960, 1: 0.9970, 2: 0.9950, 3: 0.9965}
    new = {1: 0.9975, 2: 0.9958, 3: 0.9962, 7: 0.9990}  # seed 0 missing, seed 7 extra
    for seed, acc in ref.items():
        fake_run(tmp_path, f"ref_{seed}", seed, [0.98, acc])
    for seed, acc in new.items():
        fake_run(tmp_path, f"new_{seed}", seed, [0.98, acc])
    groups = {name: [compare_runs.read_run(p, 0.99) for p in paths]
              for name, paths in map(compare_runs.parse_group, [f"ref={tmp_path}/ref_*", f"new={tmp_path}/new_*"])}
    vs = compare_runs.summarize(groups, "ref", [2], 0.99)["groups"]["new"]["vs_reference"]

    diffs = np.array([new[s] - ref[s] for s in (1, 2, 3)])
    assert vs["seeds"] == [1, 2, 3]
    assert vs["mean_difference"] == pytest.approx(diffs.mean())
    assert vs["se"] == pytest.approx(diffs.std(ddof=1) / np.sqrt(3))


def test_images_per_sec_of_runs_groups_and_against_the_reference(tmp_path, capsys):
    """A run's speed is the mean of its epochs' (metrics.json's images_per_sec, not its last
    epoch's); a group's the mean of its runs'; the others' against the reference's a ratio."""
    fake_run(tmp_path, "matmul_0", 0, [0.98, 0.99], speeds=[55.0, 47.0])
    fake_run(tmp_path, "matmul_1", 1, [0.98, 0.99], speeds=[50.0, 52.0])
    fake_run(tmp_path, "op_0", 0, [0.98, 0.99], speeds=[20000.0, 24000.0], config={"custom_op": True})
    # A redone epoch (a resumed run): its later line counts, not both.
    fake_run(tmp_path, "op_1", 1, [0.98, 0.99], speeds=[26000.0, 24000.0], config={"custom_op": True})
    history = tmp_path / "op_1" / "history.jsonl"
    lines = history.read_text().splitlines()
    redone = json.loads(lines[1]) | {"train_images_per_sec": 22000.0}
    history.write_text("\n".join([lines[0], lines[1], json.dumps(redone)]) + "\n")
    # A run from before the speed was recorded: no number, and no part of its group's.
    fake_run(tmp_path, "op_old", 2, [0.98, 0.99], config={"custom_op": True})

    summary = compare_runs.main([f"matmul={tmp_path}/matmul_*", f"op={tmp_path}/op_*"])
    out = capsys.readouterr().out
    matmul, op = summary["groups"]["matmul"], summary["groups"]["op"]
    assert [r["images_per_sec"] for r in matmul["runs"]] == [51.0, 51.0]
    assert [r["images_per_sec"] for r in op["runs"]] == [22000.0, 24000.0, None]
    assert matmul["images_per_sec"] == 51.0 and op["images_per_sec"] == 23000.0
    assert op["vs_reference"]["speed_ratio"] == pytest.approx(23000.0 / 51.0)
    assert op["vs_reference"]["recipe"] == {"custom_op": [False, True]}
    assert f"| 51.0 | {tmp_path}/matmul_0 |" in out and f"| 22,000 | {tmp_path}/op_0 |" in out
    assert f"| – | {tmp_path}/op_old |" in out
    assert "; 23,000 images/s." in out
    assert "| 51.0 | reference |" in out and f"| 23,000 | ×{23000 / 51:.2f} |" in out


def test_untested_epochs_and_unfinished_runs(tmp_path, capsys):
    # Tested every 2nd epoch: the last epoch (5) untested, so the final is epoch 4's test.
    fake_run(tmp_path, "sparse", 0, [0.90, 0.91, 0.92, 0.93, 0.99], untested=(1, 3, 5))
    run = compare_runs.read_run(tmp_path / "sparse", 0.5)
    assert run.final == 0.93 and run.last_epoch == 5 and sorted(run.tested) == [2, 4]
    # Stopped at epoch 3 of 10: counted, and marked.
    fake_run(tmp_path, "cut", 1, [0.90, 0.95, 0.96], epochs=10)
    summary = compare_runs.main([f"g={tmp_path}/*"])
    out = capsys.readouterr().out
    assert summary["groups"]["g"]["mean"] == pytest.approx((0.93 + 0.96) / 2)
    assert "96.00% * (epoch 3 of 10)" in out and "* 1 run stopped before train.epochs" in out
    assert "### g (2 runs)" in out


def test_json_output(tmp_path):
    fake_run(tmp_path, "r0", 0, [0.99, 0.995])
    fake_run(tmp_path, "r1", 1, [0.99, 0.997])
    out = tmp_path / "summary.json"
    summary = compare_runs.main([f"{tmp_path}/r*", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(summary))
    assert json.loads(out.read_text())["groups"][f"{tmp_path}/r*"]["mean"] == pytest.approx(0.996)


def test_each_group_shows_what_its_recipe_changes_and_what_its_runs_disagree_on(tmp_path, capsys):
    # A's runs: written before train.tf32 existed (no key: the default, TF32 on, as migrate says).
    for seed in (0, 1):
        fake_run(tmp_path, f"a_{seed}", seed, [0.99], config={"model": {"primary_caps_types": 32}})
        fake_run(tmp_path, f"t_{seed}", seed, [0.99],
                 config={"model": {"primary_caps_types": 16}, "train": {"tf32": True},
                         "data": {"dir": f"/somewhere/{seed}"}})  # where the data was: not the recipe
    # A glob that caught two recipes: the group says so.
    fake_run(tmp_path, "m_0", 0, [0.99], config={"train": {"weight_decay": 0.05, "input": [1, 2]}})
    fake_run(tmp_path, "m_1", 1, [0.99], config={"train": {"weight_decay": 0.2}})
    summary = compare_runs.main([f"A={tmp_path}/a_*", f"T16={tmp_path}/t_*", f"M={tmp_path}/m_*", "--at", "1"])
    out = capsys.readouterr().out
    assert summary["groups"]["T16"]["vs_reference"]["recipe"] == {"model.primary_caps_types": [32, 16]}
    assert "Recipe against A: model.primary_caps_types 32 → 16." in out
    assert summary["groups"]["A"]["varies"] == summary["groups"]["T16"]["varies"] == {}
    assert summary["groups"]["M"]["varies"] == {"train.input": ["'(absent)'", "(1, 2)"],
                                                "train.weight_decay": ["0.05", "0.2"]}
    assert "Its runs differ in: train.input ('(absent)', (1, 2)); train.weight_decay (0.05, 0.2)." in out
    # Only what all of M's runs share is compared with A: the defaults, so nothing.
    assert "Recipe against A: the same." in out.split("### M")[1]


@pytest.mark.parametrize("setup, args, message", [
    (lambda d: None, ["A={d}/none_*"], "matches no directory"),
    (lambda d: (d / "empty").mkdir(), ["A={d}/empty"], "has no history.jsonl"),
    (lambda d: (d / "h").mkdir() or (d / "h" / "history.jsonl").write_text("{}\n"), ["A={d}/h"], "has no config.yaml"),
    (lambda d: fake_run(d, "u", 0, [0.9, 0.9], untested=(1, 2)), ["A={d}/u"], "no epoch of history.jsonl has a test"),
    (lambda d: (fake_run(d, "x1", 3, [0.9]), fake_run(d, "x2", 3, [0.9])), ["A={d}/x*"], "both ran seed 3"),
    (lambda d: (fake_run(d, "a", 0, [0.9]), fake_run(d, "x1", 3, [0.9]), fake_run(d, "x2", 3, [0.9])),
     ["A={d}/a", "B={d}/x*", "--reference", "B"], "group B: "),
    (lambda d: fake_run(d, "r", 0, [0.9]), ["A={d}/r", "--reference", "B"], "--reference B: not a group"),
    (lambda d: fake_run(d, "r", 0, [0.9]), ["A={d}/r", "A={d}/r"], "group A given twice"),
])
def test_bad_input_is_one_line(tmp_path, capsys, setup, args, message):
    setup(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        compare_runs.main([a.format(d=tmp_path) for a in args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_the_first_epoch_at_a_threshold_is_a_column_only_when_asked_for(tmp_path, capsys):
    """No target accuracy fits every dataset: without --threshold no "first ≥" column; with
    it, each run's first epoch at or above it (– where none), and every row as wide as the header."""
    fake_run(tmp_path, "r0", 0, [0.90, 0.95, 0.97])
    fake_run(tmp_path, "r1", 1, [0.90, 0.93, 0.94])

    def table_rows(out):  # the group's table of runs: from its header to the first line outside it
        lines = out.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("| seed |"))
        end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
        return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[start:end]]

    summary = compare_runs.main([f"g={tmp_path}/r*"])
    rows = table_rows(capsys.readouterr().out)
    assert summary["threshold"] is None and not any("first" in cell for cell in rows[0])
    assert {len(row) for row in rows} == {len(rows[0])}
    assert all(r["first_at_threshold"] is None for r in summary["groups"]["g"]["runs"])

    compare_runs.main([f"g={tmp_path}/r*", "--threshold", "0.95"])
    rows = table_rows(capsys.readouterr().out)
    column = rows[0].index("first ≥ 95.00%")
    assert {len(row) for row in rows} == {len(rows[0])}
    assert [row[column] for row in rows[2:]] == ["2", "–"]  # r0 reaches 0.95 at epoch 2, r1 never


def test_a_group_of_one_run_is_one_run(tmp_path, capsys):
    fake_run(tmp_path, "only", 0, [0.90, 0.95], epochs=3)
    compare_runs.main([f"A={tmp_path}/only"])
    out = capsys.readouterr().out
    assert "### A (1 run)" in out and "* 1 run stopped before train.epochs" in out


def test_best_epoch_is_chosen_as_best_was_and_says_on_what(tmp_path, capsys):
    """best/ of a run with a validation split holds the epoch of the highest validation accuracy
    (TrainingState.new_best), not of the highest test accuracy; the column shows that epoch's test
    accuracy and what it was chosen on. Without one, the test-chosen epoch, named so."""
    fake_run(tmp_path, "val", 0, [0.97, 0.99, 0.98], validation_accs=[0.96, 0.97, 0.975],
             config={"data": {"validation_fraction": 0.1}})
    fake_run(tmp_path, "test", 1, [0.97, 0.99, 0.98])
    val, test = compare_runs.read_run(tmp_path / "val"), compare_runs.read_run(tmp_path / "test")
    assert (val.best, val.best_on) == ((0.98, 3), "validation")
    assert (test.best, test.best_on) == ((0.99, 2), "test")
    summary = compare_runs.main([f"g={tmp_path}/*"])
    out = capsys.readouterr().out
    assert [(r["best"], r["best_epoch"], r["best_chosen_on"]) for r in summary["groups"]["g"]["runs"]] == [
        (0.98, 3, "validation"), (0.99, 2, "test")]
    assert "| best epoch: test acc (epoch, chosen on) |" in out
    assert "| 98.00% (3, validation) |" in out and "| 99.00% (2, test) |" in out


def test_the_evaluated_report_of_a_run_with_a_validation_split_is_of_best(tmp_path):
    """evaluate.py's default for a run with a validation split is best/ (checkpoints.default_which):
    its report, evaluations/best-ckpt-<best epoch>.json (or beside the checkpoint, older), is the
    one read; latest's report of the last epoch is not what that default scores."""
    run = fake_run(tmp_path, "run", 0, [0.97, 0.99, 0.98], validation_accs=[0.96, 0.98, 0.97],
                   config={"data": {"validation_fraction": 0.1}})
    (run / "checkpoints" / "best").mkdir(parents=True)
    (run / "evaluations").mkdir()
    (run / "evaluations" / "latest-ckpt-3.json").write_text(json.dumps({"accuracy": 0.5}))
    (run / "evaluations" / "best-ckpt-3.json").write_text(json.dumps({"accuracy": 0.6}))
    assert compare_runs.read_run(run).evaluated is None
    old = run / "checkpoints" / "best" / "ckpt-2.eval.json"
    old.write_text(json.dumps({"accuracy": 0.991}))
    assert compare_runs.read_run(run).evaluated == 0.991
    (run / "evaluations" / "best-ckpt-2.json").write_text(json.dumps({"accuracy": 0.992}))
    assert compare_runs.read_run(run).evaluated == 0.992
