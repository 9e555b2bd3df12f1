"""The exported serving signatures against wrong input: each of `serving_default` (float32)
and `serve_uint8` (uint8), called through `model.signatures[...]` as the README shows, in a
fresh process so that an abort shows as its return code. A wrong rank, size or channel count
is an InvalidArgumentError naming the expected and received shapes, so is a wrong dtype; an
empty batch returns empty outputs. The op export (custom_op=true) refuses a 3-D batch the
same way. Also: a killed export's partial folder is removed by the next export of the same
output, and nothing else that looks like one."""
import json
import os
import subprocess
import sys

import pytest

from capsnet import export as capsnet_export
from conftest import repo_env

# Calls one signature with one input and prints what happened as one JSON line.
CALL_SCRIPT = r"""
import json, sys
import numpy as np
import tensorflow as tf

export_dir, signature, shape, dtype = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
if sys.argv[5:] == ["load_op_library"]:  # an export holding the compiled op (custom_op=true)
    import capsnet.ops
    capsnet.ops.load_op_library()
function = tf.saved_model.load(export_dir).signatures[signature]
try:
    out = function(images=tf.zeros(shape, dtype=dtype))
    print(json.dumps({"ok": {k: list(v.shape) for k, v in out.items()}}))
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""

SIGNATURES = {"serving_default": "float32", "serve_uint8": "uint8"}


@pytest.fixture(scope="module")
def portable_export(trained_run, tmp_path_factory):
    run_dir, _ = trained_run
    output = tmp_path_factory.mktemp("serving") / "mnist"
    report = capsnet_export.export(run_dir, output, custom_op=False)
    assert report["input_shape"] == [28, 28, 1] and report["op_library_ops"] == []
    return output


def call(export_dir, signature, shape, dtype, load_op_library=False):
    env = repo_env()
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    extra = ["load_op_library"] if load_op_library else []
    result = subprocess.run([sys.executable, "-c", CALL_SCRIPT, str(export_dir), signature, json.dumps(shape), dtype,
                             *extra], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"rc {result.returncode}: {result.stderr[-2000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("signature", SIGNATURES)
@pytest.mark.parametrize("shape, received", [
    ((4, 28, 28), "(4, 28, 28)"),            # wrong rank: aborted the process
    ((4, 14, 14, 1), "(4, 14, 14, 1)"),      # wrong size: gave 2 predictions for 4 images
    ((2, 28, 28, 3), "(2, 28, 28, 3)"),      # wrong channels
    ((28, 28), "(28, 28)"),                  # one image without its batch dimension
])
def test_a_wrong_shape_is_invalid_argument_naming_both_shapes(portable_export, signature, shape, received):
    seen = call(portable_export, signature, list(shape), SIGNATURES[signature])
    assert seen.get("error") == "InvalidArgumentError", seen
    assert f"images must have the shape (N, 28, 28, 1); received shape: {received}" in seen["message"], seen


@pytest.fixture(scope="module")
def op_export(trained_run, tmp_path_factory):
    output = tmp_path_factory.mktemp("serving_op") / "mnist"
    assert capsnet_export.export(trained_run[0], output, custom_op=True)["op_library_ops"]
    return output


@pytest.mark.slow
@pytest.mark.parametrize("signature", SIGNATURES)
def test_the_op_exports_signatures_refuse_a_3d_batch_too(op_export, signature):
    """The 3-D batch aborted the process for both exports: the op export's signatures (the
    compiled op in the graph) check the shape as the portable export's do, before the op runs."""
    seen = call(op_export, signature, [4, 28, 28], SIGNATURES[signature], load_op_library=True)
    assert seen.get("error") == "InvalidArgumentError", seen
    assert "images must have the shape (N, 28, 28, 1); received shape: (4, 28, 28)" in seen["message"], seen


@pytest.mark.slow
@pytest.mark.parametrize("signature", SIGNATURES)
def test_a_wrong_dtype_is_invalid_argument(portable_export, signature):
    # TensorFlow checks the dtype of a signature's input itself.
    wrong = {"float32": ("float64", "double"), "uint8": ("int32", "int32")}[SIGNATURES[signature]]
    seen = call(portable_export, signature, [2, 28, 28, 1], wrong[0])
    assert seen.get("error") == "InvalidArgumentError", seen
    expected = "float" if SIGNATURES[signature] == "float32" else "uint8"
    assert f"expected to be a {expected} tensor but is a {wrong[1]} tensor" in seen["message"], seen


@pytest.mark.slow
@pytest.mark.parametrize("signature", SIGNATURES)
def test_an_empty_batch_returns_empty_outputs_and_a_good_batch_works(portable_export, signature):
    assert call(portable_export, signature, [0, 28, 28, 1], SIGNATURES[signature]) == {
        "ok": {"lengths": [0, 10], "predictions": [0], "reconstructions": [0, 28, 28, 1]}}
    assert call(portable_export, signature, [3, 28, 28, 1], SIGNATURES[signature]) == {
        "ok": {"lengths": [3, 10], "predictions": [3], "reconstructions": [3, 28, 28, 1]}}


@pytest.mark.slow
def test_a_killed_exports_partial_folder_is_removed_by_the_next_export(trained_run, tmp_path):
    # A SIGKILL mid-write runs no cleanup: its `.name.partial-*` folder stays beside the output.
    run_dir, _ = trained_run
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".model.partial-{dead.pid}-0badc0de"
    running = tmp_path / f".model.partial-{os.getpid()}-00c0ffee"  # an export of this process still writing
    other = tmp_path / f".other.partial-{dead.pid}-deadbeef"          # another output's
    for folder in (stale, running, other):
        folder.mkdir()
        (folder / capsnet_export.PARTIAL_MARKER).write_text("1\n")
        (folder / "saved_model.pb").write_bytes(b"half")
    capsnet_export.export(run_dir, tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([running.name, other.name, "model"])
    assert not (tmp_path / "model" / capsnet_export.PARTIAL_MARKER).exists()  # the marker is the scratch folder's only


@pytest.mark.slow
def test_only_a_folder_export_made_is_removed_as_stale(tmp_path):
    """A folder is removed only with export's exact name pattern, its marker inside and its
    process gone: a user's look-alike folders and their files stay."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    made = tmp_path / f".mymodel.partial-{dead.pid}-0badc0de"
    kept = {tmp_path / ".mymodel.partial-keep": True,                   # the user's, with the marker's name in it
            tmp_path / f".mymodel.partial-{dead.pid}-0badc0de-x": True,  # not the exact pattern
            tmp_path / f".mymodel.partial-{dead.pid}-c0ffee00": False,   # the pattern, no marker
            tmp_path / ".mymodel.partial-deadbeef": False}               # no process named
    for folder, with_marker in [(made, True), *kept.items()]:
        folder.mkdir()
        (folder / "notes.txt").write_text("precious")
        if with_marker:
            (folder / capsnet_export.PARTIAL_MARKER).write_text("1\n")
    capsnet_export.remove_stale_partials(tmp_path / "mymodel")
    assert not made.exists()
    for folder in kept:
        assert (folder / "notes.txt").read_text() == "precious", folder


def test_an_export_holds_no_side_effect_op_but_its_savers(portable_export):
    """side_effect_ops of an export.py export is empty, although its graph holds the saver's
    SaveV2 and MergeV2Checkpoints (every SavedModel's, not run by a load or a signature)."""
    assert {"SaveV2", "MergeV2Checkpoints"} <= capsnet_export.graph_op_types(portable_export)
    assert capsnet_export.side_effect_ops(portable_export) == []
