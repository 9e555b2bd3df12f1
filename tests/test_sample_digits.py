"""scripts/sample_digits.py: the README's digits to predict on are the bundled sample's test
images, named by their labels, and predict.py reads them."""
import sys

import numpy as np
import pytest
import tensorflow as tf

import capsnet.data

from conftest import load_script

sample_digits = load_script("sample_digits")


def test_the_digits_are_the_samples_test_images_named_by_label(tmp_path, capsys):
    from capsnet.data.sources import load_sample

    images, labels, _ = load_sample("mnist", "test")
    written = sample_digits.main([str(tmp_path / "d"), "--per-digit", "2"])
    assert len(written) == 20 and sorted(p.name for p in (tmp_path / "d").iterdir()) == sorted(p.name for p in written)
    for path in written:
        digit, index = map(int, path.stem.split("_"))
        assert labels[index] == digit
        assert np.flatnonzero(labels == digit)[:2].tolist().count(index) == 1  # the digit's first two
        decoded = tf.io.decode_png(path.read_bytes()).numpy()  # (28, 28, 1) uint8
        np.testing.assert_array_equal(decoded[..., 0], images[index])
    assert "20 digits in" in capsys.readouterr().out
    assert sample_digits.main([str(tmp_path / "d"), "--per-digit", "2"]) == []  # a rerun: nothing new
    assert "(0 written, 20 already there" in capsys.readouterr().out


def test_a_bad_count_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        sample_digits.main([str(tmp_path / "d"), "--per-digit", "0"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --per-digit 0: at least 1"


def test_predict_reads_them(trained_run, tmp_path):
    from capsnet.prediction import predict

    run_dir, _ = trained_run
    written = sample_digits.main([str(tmp_path / "d")])
    records = predict(str(run_dir), str(tmp_path / "d" / "*.png"))
    assert [r["image"] for r in records] == sorted(str(p) for p in written)
    assert all(r["class"] in r["lengths"] and "error" not in r for r in records)


def test_its_import_leaves_tensorflow_to_import_tensorflow_quietly(monkeypatch):
    """TensorFlow imported before main()'s import_tensorflow_quietly prints its native start-up
    lines (cudart, cpu_feature_guard, a cuInit error) on the user's terminal: loading the script
    must not import it (capsnet.data does)."""
    for name in [n for n in sys.modules if n == "capsnet.data" or n.startswith("capsnet.data.")]:
        monkeypatch.delitem(sys.modules, name)  # restored afterwards, as is capsnet.data itself
    monkeypatch.setattr(capsnet, "data", capsnet.data)
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # `import tensorflow` raises ImportError meanwhile
    load_script("sample_digits")
