"""train.py / evaluate.py as a user runs them: one-line errors, evaluation output, kill and resume.

Each TensorFlow subprocess costs seconds of import, so there are few of them.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tensorflow as tf

from conftest import (
    REPO, TINY_MODEL, TINY_TRAIN, assert_checkpoint_tensors_close, compose_config, entry_point_env, read_events,
    run_entry_point, tfrecords, tiny_overrides, write_idx_dataset,
)


def assert_one_line_error(result, *fragments):
    """Exit status 2 and exactly one stderr line, `error: ...`, naming the problem."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.slow
def test_unknown_config_key(tmp_path):
    result = run_entry_point("train.py", "train.epochz=3", cwd=tmp_path)
    assert_one_line_error(result, "train.epochz")
    assert not (tmp_path / "outputs").exists()  # rejected before any run dir is made


@pytest.mark.slow
def test_missing_data_dir(tmp_path):
    missing = tmp_path / "no_such_dir"
    result = run_entry_point("train.py", f"data.dir={missing}", f"hydra.run.dir={tmp_path / 'run'}",
                             cwd=tmp_path)
    assert_one_line_error(result, str(missing))


@pytest.mark.slow
def test_corrupt_idx_file(tmp_path):
    data = write_idx_dataset(tmp_path / "data", n_train=32, n_test=16)
    images = data / "train-images-idx3-ubyte.gz"
    images.write_bytes(images.read_bytes()[:200])  # cut short, as by an interrupted download
    result = run_entry_point("train.py", f"data.dir={data}", f"hydra.run.dir={tmp_path / 'run'}",
                             cwd=tmp_path)
    assert_one_line_error(result, str(images))


@pytest.mark.slow
def test_a_non_boolean_switch_is_a_one_line_error(tmp_path):
    # Hydra passes `no` as the string 'no'; bool('no') would have turned the op on.
    result = run_entry_point("train.py", "custom_op=no", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_one_line_error(result, "custom_op must be true or false, got 'no'")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_missing_checkpoint(tmp_path):
    result = run_entry_point("evaluate.py", f"checkpoint={tmp_path / 'gone'}", cwd=tmp_path)
    assert_one_line_error(result, str(tmp_path / "gone"))


@pytest.mark.slow
def test_evaluate_prints_a_table_and_ends_with_json(trained_run, tmp_path):
    run_dir, metrics = trained_run
    result = run_entry_point("evaluate.py", f"checkpoint={run_dir}", "which=latest", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stdout.strip().splitlines()
    assert any(line.startswith("confusion matrix") for line in lines)
    report = json.loads(lines[-1])
    assert {"accuracy", "loss", "images_per_sec", "per_class_accuracy", "confusion_matrix"} <= set(report)
    assert report["accuracy"] == metrics["test_accuracy"]
    # weights: null → the trained weights of a run that kept no average.
    assert report["weights"] == "raw" and "trained weights" in lines[0]
    written = json.loads((run_dir / "evaluations" / "latest-ckpt-4.json").read_text())
    assert written["accuracy"] == report["accuracy"]
    assert written["confusion_matrix"] == report["confusion_matrix"]
    assert list(tmp_path.iterdir()) == []  # nothing written in the working directory


@pytest.mark.slow
def test_evaluate_a_list_of_checkpoints_prints_the_ensemble(trained_run, tmp_path):
    run_dir, metrics = trained_run
    latest = run_dir / "checkpoints" / "latest"
    output = tmp_path / "ensemble.json"
    result = run_entry_point("evaluate.py", f"checkpoint=[{latest / 'ckpt-3'},{latest / 'ckpt-4'}]",
                             f"output={output}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "ensemble of 2 checkpoints (class scores: their capsule lengths averaged)"
    report = json.loads(lines[-1])
    assert [m["epoch"] for m in report["members"]] == [3, 4]
    assert report["members"][1]["accuracy"] == metrics["test_accuracy"]
    assert json.loads(output.read_text())["accuracy"] == report["accuracy"]


@pytest.mark.slow
def test_custom_op_true_trains_through_the_cli(tiny_idx_dir, tmp_path):
    # `make test` builds the op library first, so custom_op=true must train here; the
    # missing-library one-liner is tested in test_train.py / test_evaluate.py.
    run_dir = tmp_path / "run"
    args = [*TINY_MODEL, *TINY_TRAIN, "train.epochs=1", "custom_op=true", f"data.dir={tiny_idx_dir}",
            f"hydra.run.dir={run_dir}"]
    result = run_entry_point("train.py", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["epochs"] == 1
    assert yaml_custom_op(run_dir) is True
    # train.log holds what the user saw: the epoch lines, as printed.
    epoch_lines = [line for line in result.stdout.splitlines() if line.startswith("epoch 1")]
    assert len(epoch_lines) == 2
    log = (run_dir / "train.log").read_text()
    for line in epoch_lines:
        assert line in log


def yaml_custom_op(run_dir):
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())["custom_op"]


def train_loss_steps(run_dir):
    """Global steps of the train/loss points on disk so far, read while the run writes them."""
    steps = []
    for path in Path(run_dir).glob("events.out.tfevents.*"):
        for record in tfrecords(path):
            event = tf.compat.v1.Event.FromString(record)
            steps += [event.step for value in event.summary.value if value.tag == "train/loss"]
    return steps


@pytest.mark.slow
def test_killed_run_resumes_at_the_next_epoch_and_matches_an_uninterrupted_one(tmp_path):
    # 2400 examples: 150 steps (a second or more) per epoch, time enough to kill the
    # run inside epoch 2.
    data = write_idx_dataset(tmp_path / "data", n_train=2400, n_test=100)
    steps = 2400 // 16
    run_dir = tmp_path / "run"
    args = [*TINY_MODEL, *TINY_TRAIN, "train.epochs=3", "deterministic=true", f"data.dir={data}",
            f"hydra.run.dir={run_dir}"]

    # Killed MID-epoch 2: once TensorBoard has train/loss past the first checkpoint's step
    # (log_every_steps=4; the writer flushes every 10 summaries, about every 2 log points),
    # i.e. after steps of epoch 2 have changed the weights and Adam's state. Polled from
    # the event file, not timed: epoch 2 then has ~140 steps left (about a second on an idle
    # 2-core machine, longer on a busy one, when the poller is also slower to see the point).
    stdout_path, stderr_path = tmp_path / "first.stdout", tmp_path / "first.stderr"
    with stdout_path.open("w") as stdout, stderr_path.open("w") as stderr:
        first = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path,
                                 env=entry_point_env(), stdout=stdout, stderr=stderr)
    try:
        deadline = time.monotonic() + 240
        while first.poll() is None and time.monotonic() < deadline:
            if max(train_loss_steps(run_dir), default=0) > steps:
                break
            time.sleep(0.05)
        first.kill()
    finally:
        first.kill()
        first.wait(timeout=60)
    reached = max(train_loss_steps(run_dir), default=0)
    log = f"\n--- first run's stdout:\n{stdout_path.read_text()}\n--- stderr:\n{stderr_path.read_text()}"
    assert steps < reached, f"the first run never got into epoch 2 (train/loss up to step {reached}){log}"
    assert (run_dir / "checkpoints" / "latest" / "ckpt-1.index").exists(), log
    assert not (run_dir / "checkpoints" / "latest" / "ckpt-2.index").exists(), f"killed too late{log}"
    assert "epoch 2/3" in stdout_path.read_text() and "epoch 2:" not in stdout_path.read_text(), log
    assert not (run_dir / "metrics.json").exists(), log

    second = run_entry_point("train.py", *args, cwd=tmp_path)
    assert second.returncode == 0, second.stderr + log
    assert "1 of 3 epochs done" in second.stdout
    assert "epoch 1/3" not in second.stdout and "epoch 2/3" in second.stdout
    resumed = json.loads((run_dir / "metrics.json").read_text())
    assert resumed["epochs"] == 3 and resumed["global_step"] == 3 * steps
    assert [h["epoch"] for h in resumed["history"]] == [1, 2, 3]
    # The TensorBoard curves continue: one test point per epoch at the global step.
    assert [step for step, _ in read_events(run_dir)["test/accuracy"]] == [steps, 2 * steps, 3 * steps]

    # An uninterrupted run (in this process) ends with the same weights and metrics.
    from tensorflow.python.framework import config as tf_config

    from capsnet.training import train

    try:
        reference = train(compose_config("train", tiny_overrides(data, tmp_path / "reference",
                                                                 "train.epochs=3", "deterministic=true")))
    finally:
        tf_config.disable_op_determinism()  # a process-wide switch: leave it as other tests expect
    for key in ("test_accuracy", "test_loss", "train_loss"):
        assert resumed[key] == reference[key], key
    assert [h["train_loss"] for h in resumed["history"]] == [h["train_loss"] for h in reference["history"]]
    names = assert_checkpoint_tensors_close(run_dir / "checkpoints" / "latest" / "ckpt-3",
                                            tmp_path / "reference" / "checkpoints" / "latest" / "ckpt-3",
                                            rtol=0, atol=0, prefix=("model/", "optimizer/"))
    assert any(name.startswith("model/decoder") for name in names)


@pytest.mark.slow
def test_offline_train_fails_short_and_leaves_no_run_dir(tmp_path):
    # Data from tensorflow-datasets with every download refused by a proxy on a closed port:
    # one short line, no progress bars, and no empty outputs/<date>/<time>/ left. Fashion-MNIST:
    # MNIST offline trains on the sample in the package (test_first_run.py).
    env = entry_point_env()
    env.pop("NO_PROXY", None)
    env.pop("no_proxy", None)
    env.update({var: "http://127.0.0.1:9" for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")})
    env["TFDS_DATA_DIR"] = str(tmp_path / "tfds")
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "data=fashion_mnist"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert_one_line_error(result, "could not download fashion_mnist", "(no network)", "data.dir=")
    assert len(result.stderr) < 200
    assert not (tmp_path / "outputs").exists()

    # A user error in a run dir that holds more than Hydra's own files (a run to resume) keeps it.
    run_dir = tmp_path / "resumed"
    (run_dir / "checkpoints").mkdir(parents=True)
    result = run_entry_point("train.py", "custom_op=no", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert_one_line_error(result, "custom_op must be true or false")
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "train.log"]  # .hydra/: the lock holder's


@pytest.mark.slow
@pytest.mark.parametrize("on_device", [False, True], ids=["pipeline", "data_on_device"])
def test_xla_cache_dir_is_filled_by_one_run_and_read_by_the_next(tiny_idx_dir, tmp_path, on_device):
    # train.xla_cache_dir: the first run compiles the jit steps (the op's custom call in the
    # train step) and writes them; a second process with the same config loads them: had it
    # compiled again, TensorFlow would have written the files anew. train.data_on_device:
    # its loop program is loaded too; two epochs, so that the next epoch's draws are made
    # in another thread while the first trains (what made its computation differ from run
    # to run until the program was traced ahead: capsnet.training.device_input).
    cache = tmp_path / "cache"
    args = [*TINY_MODEL, *TINY_TRAIN, f"train.epochs={2 if on_device else 1}", "custom_op=true", "train.xla=jit",
            f"train.xla_cache_dir={cache}", f"data.dir={tiny_idx_dir}", f"train.data_on_device={str(on_device).lower()}"]
    first = run_entry_point("train.py", *args, f"hydra.run.dir={tmp_path / 'first'}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    written = {path.name: path.stat().st_mtime_ns for path in cache.iterdir()}
    assert len(written) >= 2, written  # the train loop's and the eval step's computations at least
    second = run_entry_point("train.py", *args, f"hydra.run.dir={tmp_path / 'second'}", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert {path.name: path.stat().st_mtime_ns for path in cache.iterdir()} == written
    # The loaded steps compute what the compiled ones did.
    histories = [json.loads((tmp_path / run / "history.jsonl").read_text().splitlines()[-1])
                 for run in ("first", "second")]
    for key in ("train_loss", "test_loss", "test_accuracy"):
        assert histories[1][key] == pytest.approx(histories[0][key], rel=1e-6), key
    # A resumed run (the first, one epoch more) restores its checkpoint before it traces its steps,
    # which moved TensorFlow's uid counter and so the programs' names: it found nothing in the
    # cache and compiled again until each trace started from an aligned uid (steps.align_trace_names).
    epochs = int(next(a for a in args if a.startswith("train.epochs=")).split("=")[1])
    resumed = run_entry_point("train.py", *args, f"train.epochs={epochs + 1}", f"hydra.run.dir={tmp_path / 'first'}",
                              cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr + resumed.stdout
    assert len((tmp_path / "first" / "history.jsonl").read_text().splitlines()) == epochs + 1
    assert {path.name: path.stat().st_mtime_ns for path in cache.iterdir()} == written
    # The epoch's line says where its time went.
    line = next(line for line in second.stdout.splitlines() if line.startswith("epoch 1:"))
    assert " s: train " in line and ", test " in line and ", save " in line, line


@pytest.mark.slow
def test_an_xla_cache_dir_that_cannot_be_made_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = run_entry_point("train.py", "train.xla=jit", f"train.xla_cache_dir={blocker / 'cache'}",
                             f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_one_line_error(result, "train.xla_cache_dir", str(blocker / "cache"))


def test_every_entry_point_takes_gpu_memory_as_needed():
    """evaluate.py, export.py and predict.py set memory growth right after importing TensorFlow
    (train.py in set_up_devices, after the XLA flags): without it an evaluation beside a running
    training would take the GPU's memory and the training would die in its next allocation. Not
    in the import itself: listing the GPUs there made TensorFlow read TF_XLA_FLAGS before
    train.py set the XLA cache's."""
    root = Path(__file__).parent.parent
    for entry in ("evaluate.py", "export.py", "predict.py"):
        text = (root / entry).read_text()
        assert "cli.import_tensorflow_quietly()\n" in text and "\n    set_memory_growth()" in text, entry
        assert text.index("\n    set_memory_growth()") > text.index("cli.import_tensorflow_quietly()"), entry
    assert "set_memory_growth" not in (root / "capsnet" / "cli.py").read_text().split("def import_tensorflow_quietly")[1] \
        .split("\ndef ")[0]


@pytest.mark.slow
def test_tensorflow_is_imported_without_matplotlib_which_imports_afterwards():
    """Keras imports matplotlib.pyplot with TensorFlow if it can (~0.8 s of a 2-core CPU's start-up);
    cli.import_tensorflow_quietly keeps it out, and matplotlib imports as before once TensorFlow is in
    (the end-of-training figures draw with it)."""
    code = ("import sys\n"
            "from capsnet import cli\n"
            "cli.import_tensorflow_quietly()\n"
            "import keras\n"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'matplotlib'], 'matplotlib imported'\n"
            "import matplotlib.pyplot\n"
            "from capsnet.figures import _render\n"
            "assert _render(lambda figure: figure.add_subplot().plot([0, 1])).shape[-1] == 4\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_our_error_raised_inside_a_resolver_is_said_without_omegaconfs_wrapping():
    """A resolver that reads the data (a folder's classes for model.num_classes) raises a
    ConfigError; OmegaConf wraps it with the key's path and types. The one line is ours."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from capsnet import cli
    from capsnet.errors import ConfigError

    def classes(_):
        raise ConfigError("data dir /x has no train/ and test/ folders")

    OmegaConf.register_new_resolver("_test_classes", classes, replace=True)
    cfg = OmegaConf.create({"model": {"num_classes": "${_test_classes:/x}"}})
    with pytest.raises(OmegaConfBaseException) as caught:
        cfg.model.num_classes
    assert "full_key" in str(caught.value) or "resolving interpolation" in str(caught.value)
    assert cli.one_line(caught.value) == "data dir /x has no train/ and test/ folders"
