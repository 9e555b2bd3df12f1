"""capsnet.export / export.py: a tiny trained run exported both ways and loaded as a user
would (the portable export in a process that cannot import capsnet), its outputs against
evaluation's; the op export's load error; bad input leaves nothing behind."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from conftest import compose_config, repo_env, run_entry_point, write_idx_dataset
from capsnet import export as capsnet_export
from capsnet.errors import CheckpointError, ConfigError
from test_cli import assert_one_line_error

N_TEST = 256

# Loads the portable export and runs both signatures on the images in argv[2] (uint8
# .npy), in a process where importing capsnet fails: nothing in the load may need it.
PORTABLE_SCRIPT = r"""
import importlib.abc, sys
import numpy as np

class NoCapsnet(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "capsnet":
            raise ImportError("this process must not import capsnet")

sys.meta_path.insert(0, NoCapsnet())
import tensorflow as tf

export_dir, images_path, out_path = sys.argv[1:]
images = np.load(images_path)                                            # uint8 (N, H, W, C)
model = tf.saved_model.load(export_dir)
served = model.signatures["serving_default"](images=tf.constant(images.astype(np.float32) / 255))
served_uint8 = model.signatures["serve_uint8"](images=tf.constant(images))
np.savez(out_path, **{k: v.numpy() for k, v in served.items()},
         **{"uint8_" + k: v.numpy() for k, v in served_uint8.items()})
assert not [m for m in sys.modules if m.split(".")[0] == "capsnet"]
"""

# The op export in a fresh process (no op registered yet): what plain tf.saved_model.load
# and capsnet.export.load say, then the load after capsnet.ops.load_op_library().
OP_SCRIPT = r"""
import json, sys
import numpy as np
import tensorflow as tf

export_dir, images_path, out_path = sys.argv[1:]
seen = {}
try:
    tf.saved_model.load(export_dir)
except Exception as exc:
    seen["plain"] = f"{type(exc).__name__}: {exc}"
import capsnet.export, capsnet.ops
try:
    capsnet.export.load(export_dir)
except Exception as exc:
    seen["capsnet"] = f"{type(exc).__name__}: {exc}"
capsnet.ops.load_op_library()
model = capsnet.export.load(export_dir)
images = np.load(images_path)
served = model.signatures["serving_default"](images=tf.constant(images.astype(np.float32) / 255))
np.savez(out_path, **{k: v.numpy() for k, v in served.items()})
print(json.dumps(seen))
"""


def run_script(script, *args, cwd, capsnet_importable):
    """`script` in a fresh Python process (quiet TensorFlow); without capsnet_importable no
    PYTHONPATH entry points at this repository."""
    env = repo_env() if capsnet_importable else {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    result = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def test_split(tmp_path_factory):
    """A 256-image test split (IDX dir; the same generator as the tiny run's) and its uint8 images as .npy."""
    from capsnet.data import load_split

    data_dir = write_idx_dataset(tmp_path_factory.mktemp("test256"), n_train=16, n_test=N_TEST)
    images, labels = load_split("mnist", "test", data_dir=data_dir)
    npy = data_dir / "images.npy"
    np.save(npy, images)
    return data_dir, npy, images, labels


def evaluation_reference(run_dir, data_dir):
    """What evaluate.py computes for the run's default checkpoint on data_dir's test split,
    through its own code path (model rebuilt and restored as evaluate() does, the compiled
    test step, evaluate_model(keep_lengths=True)), plus the model's reconstructions."""
    from capsnet.data import load_split, make_split_dataset
    from capsnet.evaluation import resolve_member
    from capsnet.training.checkpoints import restore_model
    from capsnet.training.model_setup import build_capsnet
    from capsnet.training.steps import evaluate_model, make_eval_step

    member = resolve_member(run_dir, which=None, custom_op=False, weights=None)
    model = build_capsnet(member["cfg"]["model"], False)
    restore_model(model, member["prefix"], member["weights"])
    images, labels = load_split("mnist", "test", data_dir=data_dir)
    dataset = make_split_dataset("mnist", images, labels, batch_size=32, training=False)
    result = evaluate_model(make_eval_step(model, model.image_shape, **member["losses"]), dataset,
                            model.num_classes, keep_lengths=True)
    result["reconstructions"] = model(images.astype(np.float32) / 255, training=False)["reconstructions"].numpy()
    return result


def assert_same_predictions(predictions, lengths):
    """predictions are the longest capsules of `lengths`, except where two lengths tie to
    within float noise (then either is right)."""
    top_two = np.sort(lengths, axis=1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] > 1e-5
    np.testing.assert_array_equal(predictions[clear], np.argmax(lengths, axis=1)[clear])


@pytest.mark.slow
def test_portable_export_loads_without_capsnet_and_matches_evaluate(trained_run, test_split, tmp_path):
    from capsnet.evaluation import evaluate
    from capsnet.scoring import score

    run_dir, _ = trained_run
    data_dir, npy, images, labels = test_split
    output = tmp_path / "exported" / "mnist"
    result = run_entry_point("export.py", f"checkpoint={run_dir}", f"output={output}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["output"] == str(output) and report["custom_op"] is False and report["op_library_ops"] == []
    assert "standard TensorFlow ops only" in result.stdout
    assert f"(epoch {report['epoch']}, trained weights) to {output}" in result.stdout  # evaluate.py's words
    assert not [op for op in capsnet_export.graph_op_types(output) if op.startswith("Capsnet>")]
    metadata = json.loads((output / "assets.extra" / "capsnet_export.json").read_text())
    assert metadata["checkpoint"] == report["checkpoint"] and metadata["epoch"] == report["epoch"]
    assert sorted(p.name for p in output.parent.iterdir()) == ["mnist"]  # no partial directory left

    run_script(PORTABLE_SCRIPT, output, npy, tmp_path / "served.npz", cwd=tmp_path, capsnet_importable=False)
    served = np.load(tmp_path / "served.npz")
    reference = evaluation_reference(run_dir, data_dir)
    np.testing.assert_array_equal(reference["labels"], labels)
    np.testing.assert_allclose(served["lengths"], reference["lengths"], rtol=1e-5, atol=1e-6)
    assert_same_predictions(served["predictions"], reference["lengths"])
    np.testing.assert_allclose(served["reconstructions"], reference["reconstructions"], rtol=1e-5, atol=1e-6)
    # uint8 in: the pipelines' own scaling, so the same numbers.
    for key in ("lengths", "predictions", "reconstructions"):
        np.testing.assert_allclose(served["uint8_" + key], served[key], rtol=1e-6, atol=1e-7)
    # evaluate()'s scores, from the served predictions.
    evaluated = evaluate(run_dir, data_dir=data_dir, output=tmp_path / "eval.json")
    assert evaluated["num_examples"] == N_TEST and evaluated["epoch"] == report["epoch"]
    scores = score(labels, served["predictions"], 10)
    assert scores["accuracy"] == evaluated["accuracy"]
    assert scores["confusion_matrix"] == evaluated["confusion_matrix"]


@pytest.mark.slow
def test_op_export_loads_after_load_op_library_and_agrees(trained_run, test_split, tmp_path):
    run_dir, _ = trained_run
    data_dir, npy, _, _ = test_split
    output = tmp_path / "mnist_op"
    report = capsnet_export.export(run_dir, output, custom_op=True)
    # model.fused_routing=null: the fused prediction + routing op, as custom_op=true trains.
    assert report["custom_op"] is True and report["op_library_ops"] == ["Capsnet>CapsuleRouting"]
    assert "capsnet.ops.load_op_library()" in (output / "assets.extra" / "README.txt").read_text()

    result = run_script(OP_SCRIPT, output, npy, tmp_path / "served.npz", cwd=tmp_path, capsnet_importable=True)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    # Plain TensorFlow names the missing op (the README and assets.extra/README.txt say what to do) ...
    assert seen["plain"].startswith("RuntimeError: Op type not registered 'Capsnet>CapsuleRouting'")
    # ... capsnet.export.load says it in one line.
    assert seen["capsnet"] == (
        f"OpLibraryError: the SavedModel {output} holds the compiled capsnet op Capsnet>CapsuleRouting "
        "(exported with custom_op=true): call capsnet.ops.load_op_library() first "
        "(or export with custom_op=false for a portable graph)")
    served = np.load(tmp_path / "served.npz")
    reference = evaluation_reference(run_dir, data_dir)
    np.testing.assert_allclose(served["lengths"], reference["lengths"], rtol=1e-4, atol=1e-5)
    assert_same_predictions(served["predictions"], reference["lengths"])
    np.testing.assert_allclose(served["reconstructions"], reference["reconstructions"], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_saved_model_cli_runs_the_export(trained_run, test_split, tmp_path):
    # The README's `saved_model_cli run` example; the tool ships with the tensorflow wheel.
    cli = Path(sys.executable).parent / "saved_model_cli"
    if not cli.exists():
        pytest.skip(f"no {cli}")
    run_dir, _ = trained_run
    _, _, images, _ = test_split
    output = tmp_path / "mnist"
    capsnet_export.export(run_dir, output)
    np.save(tmp_path / "digits.npy", images[:8])
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run([str(cli), "run", "--dir", str(output), "--tag_set", "serve", "--signature_def",
                             "serve_uint8", "--inputs", "images=digits.npy", "--outdir", "predictions"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    model = capsnet_export.load(output)
    expected = model.serve_uint8(tf.constant(images[:8]))
    for key in ("lengths", "predictions", "reconstructions"):
        np.testing.assert_allclose(np.load(tmp_path / "predictions" / f"{key}.npy"), expected[key].numpy(),
                                   rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_multimnist_export_predicts_two_digits(tiny_idx_dir, tmp_path):
    from capsnet.data import load_split, make_split_dataset
    from capsnet.evaluation import evaluate
    from capsnet.scoring import pair_report
    from capsnet.training import train
    from test_multimnist import multimnist_overrides

    run_dir = tmp_path / "run"
    train(compose_config("train", multimnist_overrides(tiny_idx_dir, run_dir, "train.epochs=1",
                                                       "data.limit_train=32", "data.limit_test=24")))
    report = capsnet_export.export(run_dir, tmp_path / "multimnist")
    assert report["two_digits"] and report["input_shape"] == [36, 36, 1]
    images, labels = load_split("multimnist", "test", data_dir=tiny_idx_dir, limit=24)
    canvases, pairs = [], []
    for x, y, _ in make_split_dataset("multimnist", images, labels, batch_size=8, training=False, shift_pixels=4):
        canvases.append(x.numpy())
        pairs.append(y.numpy())
    canvases, pairs = np.concatenate(canvases), np.concatenate(pairs)                 # (N, 36, 36, 1), (N, 2)
    served = capsnet_export.load(tmp_path / "multimnist").signatures["serving_default"](images=tf.constant(canvases))
    lengths = served["lengths"].numpy()
    np.testing.assert_array_equal(served["predictions"].numpy(), np.argsort(-lengths, axis=1, kind="stable")[:, :2])
    assert served["reconstructions"].shape == (24, 2, 36, 36, 1)
    evaluated = evaluate(run_dir, output=tmp_path / "eval.json")
    assert pair_report(pairs, served["predictions"].numpy(), 10)["accuracy"] == evaluated["accuracy"]


@pytest.mark.slow
def test_bad_input_is_one_line_and_leaves_nothing(trained_run, tmp_path):
    run_dir, _ = trained_run
    result = run_entry_point("export.py", f"checkpoint={tmp_path / 'gone'}", f"output={tmp_path / 'a'}",
                             cwd=tmp_path)
    assert_one_line_error(result, f"checkpoint not found: {tmp_path / 'gone'}")
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    result = run_entry_point("export.py", f"checkpoint={run_dir}", f"output={existing}", cwd=tmp_path)
    assert_one_line_error(result, f"output {existing} already exists")
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]
    result = run_entry_point("export.py", f"checkpoint={run_dir}", f"output={tmp_path / 'b'}", "wieghts=raw",
                             cwd=tmp_path)
    assert_one_line_error(result, "wieghts")
    result = run_entry_point("export.py", f"checkpoint={run_dir}", cwd=tmp_path)
    assert_one_line_error(result, "output=... is required")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]  # no export, no partial, no Hydra dir


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_leaves_nothing_behind(trained_run, tmp_path, monkeypatch, failure):
    run_dir, _ = trained_run

    class FailingArchive:
        def write_out(self, path, verbose=True):
            (Path(path) / "saved_model.pb").write_bytes(b"half")
            raise failure

    monkeypatch.setattr(capsnet_export, "export_archive", lambda model, two_digits, prepare=None: FailingArchive())
    output = tmp_path / "new" / "parents" / "model"
    expected = (CheckpointError, f"cannot write the export {output}: No space left on device") \
        if isinstance(failure, OSError) else (KeyboardInterrupt, None)
    with pytest.raises(expected[0], match=expected[1]):
        capsnet_export.export(run_dir, output)
    assert list(tmp_path.iterdir()) == []  # the partial export and the parents it made are gone


def test_export_argument_errors(trained_run, tmp_path):
    run_dir, _ = trained_run
    with pytest.raises(ConfigError, match="weights=ema: the run .* kept no average"):
        capsnet_export.export(run_dir, tmp_path / "x", weights="ema")
    with pytest.raises(ConfigError, match="which must be one of best, latest"):
        capsnet_export.export(run_dir, tmp_path / "x", which="newest")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        capsnet_export.export(run_dir, tmp_path / "file" / "x")
    with pytest.raises(CheckpointError, match="cannot load the SavedModel"):
        capsnet_export.load(tmp_path / "nothing")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_an_export_inside_a_runs_checkpoints_is_refused(trained_run, tmp_path):
    """A training deletes and links files under checkpoints/ as best/ and latest/ move on: no
    output goes there, refused before anything is built or written."""
    run_dir, _ = trained_run
    before = sorted(p.relative_to(run_dir) for p in (run_dir / "checkpoints").rglob("*"))
    for output in (run_dir / "checkpoints" / "model", run_dir / "checkpoints" / "best" / "new" / "model"):
        with pytest.raises(ConfigError, match="is inside a run's checkpoints/.*export somewhere else"):
            capsnet_export.export(run_dir, output)
    assert sorted(p.relative_to(run_dir) for p in (run_dir / "checkpoints").rglob("*")) == before
