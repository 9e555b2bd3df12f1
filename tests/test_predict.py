"""capsnet.prediction / predict.py: image files of the tiny trained run's kind classified
from the run dir and from its export, against the restored model called directly on the
same pixels; other sizes, RGB, JPEG, BMP and GIF files accepted; an unreadable file named
and skipped while the others are predicted; relative paths; reconstructions never
overwrite; path errors reported before TensorFlow is imported."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO, compose_config, repo_env, run_entry_point, synthetic_digits
from capsnet import prediction
from capsnet.errors import CheckpointError, ConfigError, DataError
from test_cli import assert_one_line_error

N = 12


def reference(run_dir, pixels):
    """The run's default checkpoint (predict's) restored into a freshly built model (as evaluate.py's
    model is: its config.yaml, its weights) and called directly on uint8 images (N, H, W, C)
    scaled by 1/255: (lengths, reconstructions)."""
    from capsnet.training.checkpoints import resolve_checkpoint, restore_model
    from capsnet.training.model_setup import build_capsnet

    prefix, _, cfg = resolve_checkpoint(run_dir)
    model = build_capsnet(cfg["model"], False)
    restore_model(model, prefix, "ema" if cfg["train"]["ema_decay"] > 0 else "raw")
    outputs = model(tf.constant(pixels, tf.float32) / 255.0, training=False)
    return outputs["lengths"].numpy(), outputs["reconstructions"].numpy()


def write_png(path, pixels):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(tf.io.encode_png(pixels).numpy())


def write_bmp(path, rgb):
    """A 24-bit uncompressed BMP of uint8 (H, W, 3): rows bottom-up, BGR, padded to 4 bytes."""
    h, w, _ = rgb.shape
    row = w * 3 + (-w * 3) % 4
    data = b"".join(rgb[y, :, ::-1].tobytes().ljust(row, b"\0") for y in range(h - 1, -1, -1))
    header = struct.pack("<2sIHHI", b"BM", 54 + len(data), 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 24, 0, len(data), 2835, 2835, 0, 0)
    path.write_bytes(header + info + data)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """N test-split-like images (uint8 (N, 28, 28, 1)) written as 28x28 grey PNGs in a folder."""
    images, _ = synthetic_digits(N, seed=1)
    pixels = images[..., None]
    folder = tmp_path_factory.mktemp("digits")
    for i in range(N):
        write_png(folder / f"{i:02d}.png", pixels[i])
    return folder, pixels


def by_image(records):
    return {r["image"]: r for r in records}


def assert_consistent(record, num_classes=10, top_k=3):
    """A record's own rules: class = the longest capsule, top_k = the longest ones, longest
    first, every class's length keyed by its name in class order; it survives a JSON round trip."""
    assert list(record["lengths"]) == [str(c) for c in range(num_classes)]  # MNIST's names: the digits
    lengths = np.array(list(record["lengths"].values()))
    assert lengths.shape == (num_classes,)
    assert record["class"] == str(np.argmax(lengths))
    assert [c for c, _ in record["top_k"]] == [str(c) for c in np.argsort(-lengths, kind="stable")[:top_k]]
    assert [v for _, v in record["top_k"]] == sorted(lengths, reverse=True)[:top_k]
    assert json.loads(json.dumps(record)) == record


@pytest.mark.slow
def test_run_dir_predictions_are_the_restored_models(trained_run, digits, tmp_path):
    run_dir, _ = trained_run
    folder, pixels = digits
    records = prediction.predict(run_dir, folder, reconstruct=tmp_path / "recon")
    assert [r["image"] for r in records] == [str(folder / f"{i:02d}.png") for i in range(N)]
    lengths, reconstructions = reference(run_dir, pixels)
    np.testing.assert_allclose([list(r["lengths"].values()) for r in records], lengths, rtol=1e-5, atol=1e-6)
    for i, record in enumerate(records):
        assert_consistent(record)
        assert record["reconstruction"] == str(tmp_path / "recon" / f"{i:02d}.png")
        png = tf.io.decode_png((tmp_path / "recon" / f"{i:02d}.png").read_bytes()).numpy()
        # The decoder's image of the predicted capsule (no label given: the longest).
        np.testing.assert_allclose(png, np.round(reconstructions[i] * 255), atol=1)
    assert sorted(p.name for p in (tmp_path / "recon").iterdir()) == [f"{i:02d}.png" for i in range(N)]

    # Existing reconstructions are never overwritten: refused before anything is read or written.
    before = {p: p.read_bytes() for p in (tmp_path / "recon").iterdir()}
    with pytest.raises(ConfigError, match=r"reconstruct=.*00\.png and 11 more exist\(s\) already"):
        prediction.predict(run_dir, folder, reconstruct=tmp_path / "recon")
    assert {p: p.read_bytes() for p in (tmp_path / "recon").iterdir()} == before
    # top_k and which, through the same call.
    latest = prediction.predict(run_dir, folder / "03.png", top_k=10, which="latest")
    assert len(latest) == 1 and len(latest[0]["top_k"]) == 10
    assert_consistent(latest[0], top_k=10)
    with pytest.raises(ConfigError, match="top_k=11: the model has 10 classes"):
        prediction.predict(run_dir, folder, top_k=11)


@pytest.mark.slow
def test_export_predictions_are_the_restored_models(trained_run, digits, tmp_path):
    from capsnet.export import export

    run_dir, _ = trained_run
    folder, pixels = digits
    export(run_dir, tmp_path / "exported")
    records = prediction.predict(tmp_path / "exported", f"{folder}/*.png", reconstruct=tmp_path / "recon")
    lengths, reconstructions = reference(run_dir, pixels)
    np.testing.assert_allclose([list(r["lengths"].values()) for r in records], lengths, rtol=1e-5, atol=1e-6)
    for i, record in enumerate(records):
        assert_consistent(record)
        png = tf.io.decode_png((tmp_path / "recon" / f"{i:02d}.png").read_bytes()).numpy()
        np.testing.assert_allclose(png, np.round(reconstructions[i] * 255), atol=1)
    # The export's graph and weights are fixed: the run's choices do not apply to it.
    with pytest.raises(ConfigError, match="which=latest: not for an exported SavedModel"):
        prediction.predict(tmp_path / "exported", folder, which="latest")


@pytest.mark.slow
def test_any_size_mode_and_format_is_the_models_input(trained_run, digits, tmp_path):
    run_dir, _ = trained_run
    _, pixels = digits
    x = pixels[5]                                                        # (28, 28, 1)
    rgb = np.repeat(np.repeat(np.repeat(x, 3, axis=-1), 2, axis=0), 2, axis=1)   # 56x56 RGB, 2x2 blocks
    write_png(tmp_path / "in" / "rgb.png", rgb)
    write_png(tmp_path / "in" / "rgba.png", np.concatenate([rgb, np.full((56, 56, 1), 77, np.uint8)], axis=-1))
    write_bmp(tmp_path / "in" / "big.bmp", np.repeat(np.repeat(np.repeat(x, 3, axis=-1), 3, axis=0), 3, axis=1))
    (tmp_path / "in" / "photo.jpg").write_bytes(
        tf.io.encode_jpeg(rgb, quality=100, chroma_downsampling=False).numpy())
    write_png(tmp_path / "in" / "small.png", x[::2, ::2])                   # 14x14: made larger
    (tmp_path / "in" / "notes.txt").write_text("not an image: a directory's listing skips it")
    records = by_image(prediction.predict(run_dir, tmp_path / "in"))
    assert sorted(os.path.basename(p) for p in records) == ["big.bmp", "photo.jpg", "rgb.png", "rgba.png",
                                                            "small.png"]
    expected, _ = reference(run_dir, x[None])
    for name in ("rgb.png", "rgba.png", "big.bmp"):
        # Block-replicated grey: the area resize gives back x; grey from r = g = b is x times
        # the luma weights' sum (0.9999), the alpha channel is dropped.
        np.testing.assert_allclose(list(records[str(tmp_path / "in" / name)]["lengths"].values()), expected[0],
                                   rtol=2e-3, atol=1e-4)
    np.testing.assert_allclose(list(records[str(tmp_path / "in" / "photo.jpg")]["lengths"].values()), expected[0], atol=0.02)
    for record in records.values():
        assert_consistent(record)

    pil = pytest.importorskip("PIL.Image")
    pil.fromarray(rgb).save(tmp_path / "anim.gif")
    (gif,) = prediction.predict(run_dir, tmp_path / "anim.gif")
    assert "error" not in gif
    assert_consistent(gif)


@pytest.mark.slow
def test_an_unreadable_image_is_named_and_the_others_predicted(trained_run, digits, tmp_path):
    run_dir, _ = trained_run
    folder, pixels = digits
    images = tmp_path / "images"
    images.mkdir()
    for i in (0, 1, 2):
        (images / f"{i:02d}.png").write_bytes((folder / f"{i:02d}.png").read_bytes())
    (images / "01.png").write_bytes(b"\x89PNG\r\n\x1a\n but the rest is garbage")
    (images / "empty.jpg").write_bytes(b"")
    records = prediction.predict(run_dir, images)
    assert [os.path.basename(r["image"]) for r in records] == ["00.png", "01.png", "02.png", "empty.jpg"]
    assert records[1]["error"].startswith(f"cannot decode image {images / '01.png'}: ")
    assert records[3]["error"].startswith(f"cannot decode image {images / 'empty.jpg'}: ")
    lengths, _ = reference(run_dir, pixels[[0, 2]])
    np.testing.assert_allclose([list(records[0]["lengths"].values()), list(records[2]["lengths"].values())], lengths,
                               rtol=1e-5, atol=1e-6)  # lengths keyed by class name, in class order


@pytest.mark.slow
def test_predict_py_relative_paths_json_lines_and_a_corrupt_file(trained_run, digits, tmp_path):
    run_dir, _ = trained_run
    folder, pixels = digits
    (tmp_path / "run").symlink_to(run_dir)
    for i in (0, 1):
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / f"{i}.png").write_bytes((folder / f"{i:02d}.png").read_bytes())
    (tmp_path / "in" / "sub").mkdir()
    (tmp_path / "in" / "sub" / "2.png").write_bytes((folder / "02.png").read_bytes())
    (tmp_path / "in" / "bad.png").write_bytes(b"GIF89a? no")
    result = run_entry_point("predict.py", "checkpoint=run", "images=in/**/*.png", "top_k=2",
                             "reconstruct=recon", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: cannot decode image in/bad.png: ") and lines[0].endswith("(skipped)")
    assert "function_node" not in lines[0] and "[Op:" not in lines[0]  # TensorFlow's wrapping taken off
    assert lines[1] == "error: 1 of 4 images could not be predicted (each named above); the other 3 were predicted"
    records = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert [r["image"] for r in records] == ["in/0.png", "in/1.png", "in/sub/2.png"]
    assert [r["reconstruction"] for r in records] == ["recon/0.png", "recon/1.png", "recon/sub/2.png"]
    assert all((tmp_path / r["reconstruction"]).is_file() for r in records)
    lengths, _ = reference(run_dir, pixels[:3])
    np.testing.assert_allclose([list(r["lengths"].values()) for r in records], lengths, rtol=1e-5, atol=1e-6)
    for record in records:
        assert_consistent(record, top_k=2)

    # In process, from another working directory: the same relative names.
    os.chdir(tmp_path)
    try:
        again = prediction.predict("run", ["in/1.png", "in/0.png", "in/1.png"], top_k=2)
    finally:
        os.chdir(REPO)
    assert [r["image"] for r in again] == ["in/1.png", "in/0.png"]  # in the order given, each once
    for mine, theirs in zip(again, records[1::-1]):
        assert mine["class"] == theirs["class"] and "reconstruction" not in mine
        np.testing.assert_allclose(list(mine["lengths"].values()), list(theirs["lengths"].values()), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_path_errors_are_one_line_before_tensorflow(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "0.png").write_bytes(b"")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (tmp_path / "recon").mkdir()
    (tmp_path / "recon" / "0.png").write_bytes(b"mine")
    cases = [
        (dict(checkpoint=tmp_path / "gone", images=tmp_path / "in"), CheckpointError, "checkpoint not found: "),
        (dict(checkpoint=tmp_path / "in", images=tmp_path / "in"), CheckpointError, "no checkpoint in "),
        (dict(checkpoint=run, images=tmp_path / "none.png"), DataError, "image not found: "),
        (dict(checkpoint=run, images=f"{tmp_path}/*.jpg"), DataError, "matches no file"),
        (dict(checkpoint=run, images=tmp_path / "recon" / ".."), None, None),
        (dict(checkpoint=run, images=tmp_path / "in", reconstruct=tmp_path / "recon"), ConfigError,
         "0.png exist(s) already; predict never overwrites"),
        (dict(checkpoint=run, images=tmp_path / "in", reconstruct=tmp_path / "in" / "0.png"), ConfigError,
         "not a directory"),
    ]
    script = ["import sys", "from capsnet import prediction", "from capsnet.errors import CapsnetError",
              "import json", f"cases = json.loads({json.dumps(json.dumps([{k: str(v) for k, v in c.items()} for c, _, _ in cases]))})",
              "for case in cases:",
              "    try:",
              "        prediction.check_inputs(case['checkpoint'], case['images'], case.get('reconstruct'))",
              "        print('ok')",
              "    except CapsnetError as exc:",
              "        print(type(exc).__name__, exc)",
              "assert 'tensorflow' not in sys.modules, 'imported TensorFlow'"]
    result = subprocess.run([sys.executable, "-c", "\n".join(script)], cwd=tmp_path, env=repo_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for line, (_, error, fragment) in zip(result.stdout.splitlines(), cases, strict=True):
        assert line == "ok" if error is None else line.startswith(error.__name__) and fragment in line, line
    assert (tmp_path / "recon" / "0.png").read_bytes() == b"mine"

    result = run_entry_point("predict.py", "checkpoint=gone", "images=in", cwd=tmp_path)
    assert_one_line_error(result, "checkpoint not found: gone")
    result = run_entry_point("predict.py", "checkpoint=run", cwd=tmp_path)
    assert_one_line_error(result, "images=... is required")
    result = run_entry_point("predict.py", "checkpoint=run", "images=in", "top_k=three", cwd=tmp_path)
    assert_one_line_error(result, "top_k must be a positive integer, got 'three'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "recon", "run"]  # nothing written


def test_config_is_composed_and_checked():
    cfg = compose_config("predict", ["checkpoint=a", "images=[x.png,y/*.jpg]"])
    assert cfg == {"checkpoint": "a", "images": ["x.png", "y/*.jpg"], "top_k": 3, "reconstruct": None,
                   "which": None, "weights": None, "custom_op": None, "batch_size": 64, "trust_export": False,
                   "debug": False}
    with pytest.raises(ConfigError, match="predict.py takes no ensemble"):
        compose_config("predict", ["checkpoint=[a,b]", "images=x.png"])
    with pytest.raises(ConfigError, match="custom_op must be true or false"):
        compose_config("predict", ["checkpoint=a", "images=x.png", "custom_op=no"])


@pytest.mark.slow
def test_two_digit_model_names_both_and_reconstructs_them_side_by_side(tiny_idx_dir, tmp_path):
    from capsnet.training import train
    from test_multimnist import multimnist_overrides

    run_dir = tmp_path / "run"
    train(compose_config("train", multimnist_overrides(tiny_idx_dir, run_dir, "train.epochs=1",
                                                       "data.limit_train=32", "data.limit_test=8")))
    images, _ = synthetic_digits(2, seed=3)
    canvas = np.zeros((2, 36, 36, 1), np.uint8)
    canvas[:, 4:32, 4:32, 0] = np.maximum(images, np.roll(images, 3, axis=2))
    for i in range(2):
        write_png(tmp_path / "in" / f"{i}.png", canvas[i])
    records = prediction.predict(run_dir, tmp_path / "in", reconstruct=tmp_path / "recon")
    lengths, reconstructions = reference(run_dir, canvas)
    np.testing.assert_allclose([list(r["lengths"].values()) for r in records], lengths, rtol=1e-5, atol=1e-6)
    for record in records:
        assert_consistent(record)
        order = np.argsort(-np.array(list(record["lengths"].values())), kind="stable")
        assert record["classes"] == [str(c) for c in order[:2]] and record["class"] == record["classes"][0]
        png = tf.io.decode_png((tmp_path / "recon" / os.path.basename(record["image"])).read_bytes()).numpy()
        assert png.shape == (36, 72, 1)  # the two digits' reconstructions side by side


# --------------------------------------------------------------------------- a SavedModel is a program

def crafted_export(directory, target, how):
    """A SavedModel with an export's serving_default (images (N, 28, 28, 1) -> lengths,
    predictions) that also writes `target` when called (`how`: tf.io.write_file, or tf.print
    to a file)."""

    class Crafted(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec((None, 28, 28, 1), tf.float32, name="images")])
        def serve(self, images):
            if how == "write_file":
                tf.io.write_file(str(target), "written by a SavedModel")
            else:
                tf.print("written by a SavedModel", output_stream=f"file://{target}")
            n = tf.shape(images)[0]
            return {"lengths": tf.fill([n, 10], 0.5), "predictions": tf.zeros([n], tf.int32)}

    module = Crafted()
    tf.saved_model.save(module, str(directory), signatures={"serving_default": module.serve})
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("how, op", [("write_file", "WriteFile"), ("print", "PrintV2")])
def test_an_export_without_the_marker_or_with_side_effect_ops_is_refused(digits, tmp_path, how, op):
    folder, _ = digits
    target = tmp_path / "pwned.txt"
    exported = crafted_export(tmp_path / "crafted", target, how)
    with pytest.raises(CheckpointError, match=r"has no assets.extra/capsnet_export.json \(not written by export.py\)"
                                              ".*trust_export=true"):
        prediction.predict(exported, folder / "00.png")
    (exported / "assets.extra").mkdir(exist_ok=True)
    (exported / "assets.extra" / "capsnet_export.json").write_text(json.dumps({"dataset": "mnist"}))
    with pytest.raises(CheckpointError, match=f"holds ops that write files, run Python or print \\({op}\\)"):
        prediction.predict(exported, folder / "00.png")
    assert not target.exists()
    # The explicit override runs it: the graph's side effect happens, as it would in TensorFlow.
    (record,) = prediction.predict(exported, folder / "00.png", trust_export=True)
    assert record["class"] == "0" and target.exists()


@pytest.mark.slow
def test_predict_help_says_a_saved_model_is_a_program():
    result = run_entry_point("predict.py", "--help", cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "A SavedModel is a program" in result.stdout and "trust_export=false" in result.stdout
