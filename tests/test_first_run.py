"""A first run as a new user makes it: `make train` offline on the MNIST sample in the package,
data dirs that moved or hold another dataset, and the one-line answers to the first
mistakes (a mistyped key, a checkpoint path that does not exist, a shadowing `capsnet`
folder). No test touches the network: tensorflow-datasets' load is replaced by one that
fails as it does offline."""
import hashlib
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import REPO, TINY_MODEL, compose_config, entry_point_env, run_entry_point

MNIST_DIR = REPO.parent / "shared" / "data" / "mnist"
FASHION_DIRS = [REPO.parent / "shared" / "data" / "fashion-mnist", Path("/usr/share/datasets/fashion-mnist")]
FASHION_DIR = next((d for d in FASHION_DIRS if (d / "t10k-images-idx3-ubyte.gz").is_file()), None)

# What tensorflow-datasets' load does offline (a requests ConnectionError), for a subprocess:
# train.py then runs as `python train.py ...` would.
OFFLINE_TRAIN = textwrap.dedent("""
    import runpy, sys
    import tensorflow_datasets as tfds

    def offline(*args, **kwargs):
        raise ConnectionError("no network (test)")

    tfds.load = offline
    sys.argv = ["train.py", *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


@pytest.fixture
def offline_tfds(monkeypatch):
    """tensorflow-datasets' load failing as offline; returns the list of its calls. The
    process' record of what tfds could not provide is emptied before and after."""
    tfds = pytest.importorskip("tensorflow_datasets")
    from capsnet.data import sources

    calls = []

    def offline(name, **kwargs):
        calls.append(name)
        raise ConnectionError("no network (test)")

    monkeypatch.setattr(tfds, "load", offline)
    monkeypatch.setattr(sources, "_TFDS_UNAVAILABLE", {})
    return calls


# --------------------------------------------------------------------------- the sample

def test_the_sample_is_the_first_images_of_mnist():
    from capsnet.data import load_sample

    train_images, train_labels, _ = load_sample("mnist", "train")
    test_images, test_labels, _ = load_sample("mnist", "test")
    assert train_images.shape == (6000, 28, 28) and test_images.shape == (1000, 28, 28)
    assert train_images.dtype == np.uint8
    counts = np.bincount(train_labels, minlength=10)
    assert counts.min() >= 500 and counts.max() <= 700  # every class, roughly balanced
    assert np.bincount(test_labels, minlength=10).min() >= 80
    if not MNIST_DIR.is_dir():
        pytest.skip(f"{MNIST_DIR} (the official files) is not here")
    from capsnet.idx import read_idx

    np.testing.assert_array_equal(train_images, read_idx(MNIST_DIR / "train-images-idx3-ubyte.gz")[:6000])
    np.testing.assert_array_equal(train_labels, read_idx(MNIST_DIR / "train-labels-idx1-ubyte.gz")[:6000])
    np.testing.assert_array_equal(test_images, read_idx(MNIST_DIR / "t10k-images-idx3-ubyte.gz")[:1000])
    np.testing.assert_array_equal(test_labels, read_idx(MNIST_DIR / "t10k-labels-idx1-ubyte.gz")[:1000])


def test_the_sample_is_package_data():
    """pyproject ships it, and it is small enough for the repository."""
    text = (REPO / "pyproject.toml").read_text()
    assert '"sample_data/*.npz"' in text
    assert (REPO / "capsnet" / "sample_data" / "mnist_sample.npz").stat().st_size <= 1.5e6


def test_offline_mnist_is_the_sample_with_one_notice(offline_tfds, capsys):
    from capsnet.data import load_sample, load_split

    train_images, train_labels = load_split("mnist", "train")
    test_images, _ = load_split("mnist", "test", limit=300)
    np.testing.assert_array_equal(train_images[..., 0], load_sample("mnist", "train")[0])
    assert len(train_labels) == 6000 and len(test_images) == 300
    assert offline_tfds == ["mnist"]  # asked once: offline each attempt costs seconds
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("notice:")]
    assert len(lines) == 1
    assert "6,000 of the 60,000 training images" in lines[0] and "1,000 of the 10,000 test images" in lines[0]
    assert "data.dir=" in lines[0] and "online" in lines[0] and "no network" in lines[0]


@pytest.mark.timeout(120)
def test_offline_mnist_prints_the_notice_alone(tmp_path, monkeypatch, capsys, caplog):
    """tensorflow-datasets' own attempt, failing as offline (a proxy on a closed local port, as in
    test_data.py), prints its "Downloading and preparing dataset ..." line and logs absl warnings
    ("Variant folder ... has no dataset_info.json"): nothing of it comes before the notice."""
    pytest.importorskip("tensorflow_datasets")
    import logging

    from capsnet import data
    from capsnet.data import sources

    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.setattr(sources, "_TFDS_UNAVAILABLE", {})
    monkeypatch.setattr(logging.getLogger("urllib3"), "level", logging.getLogger("urllib3").level)
    caplog.set_level(logging.DEBUG)
    absl_level = logging.getLogger("absl").level
    images, _ = data.load_split("mnist", "test", tfds_data_dir=str(tmp_path))
    assert len(images) == 1000  # the sample
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.strip()] == [line for line in out.splitlines()
                                                                    if line.startswith("notice:")], out
    assert "Downloading" not in out
    assert [r.getMessage() for r in caplog.records if r.name.startswith("absl")] == []
    assert logging.getLogger("absl").level == absl_level  # restored: only tfds' attempt is quiet


def test_online_mnist_keeps_what_tfds_printed(monkeypatch, capsys):
    """Quiet only while it may fail: a download made says so, after it."""
    tfds = pytest.importorskip("tensorflow_datasets")
    from capsnet import data
    from capsnet.data import sources

    def downloaded(name, **kwargs):
        print(f"Dataset {name} downloaded and prepared to /somewhere.")
        images, labels = data.load_sample("mnist", kwargs["split"])[:2]
        return images[..., None], labels

    monkeypatch.setattr(tfds, "load", downloaded)
    monkeypatch.setattr(sources, "_TFDS_UNAVAILABLE", {})
    assert len(data.load_split("mnist", "test")[1]) == 1000
    assert capsys.readouterr().out == "Dataset mnist downloaded and prepared to /somewhere.\n"


def test_offline_fashion_mnist_still_fails_in_one_line(offline_tfds):
    from capsnet.data import load_split
    from capsnet.errors import DataError

    with pytest.raises(DataError, match="could not download fashion_mnist.*data.dir="):
        load_split("fashion_mnist", "test")


def test_make_train_runs_the_quickstart_preset():
    text = (REPO / "Makefile").read_text()
    assert "$(if $(strip $(ARGS)),$(ARGS),experiment=quickstart)" in text
    cfg = compose_config("train", ["experiment=quickstart", "run_dir=unused"])
    assert cfg["data"]["name"] == "mnist" and cfg["data"]["dir"] is None
    assert cfg["train"]["epochs"] < 10 and cfg["model"]["conv1_filters"] < 256


@pytest.mark.slow
def test_quickstart_trains_offline_on_the_sample(tmp_path):
    """`python train.py experiment=quickstart` offline, shortened: it trains on the sample and says so once."""
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-c", OFFLINE_TRAIN, "experiment=quickstart", *TINY_MODEL, "train.epochs=1",
         "data.limit_train=200", "data.limit_test=100", "train.batch_size=50", "train.progress_bar=false",
         f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=entry_point_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    notices = [line for line in result.stdout.splitlines() if "sample" in line and line.startswith("notice:")]
    assert len(notices) == 1, result.stdout
    assert "6,000 of the 60,000 training images" in notices[0]
    assert "epoch 1/1" in result.stdout
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["data"]["dir"] is None and saved["data"]["limit_train"] == 200


# --------------------------------------------------------------------------- another dataset's files

def _write_split(directory, prefix, images, labels):
    from capsnet.idx import write_idx

    directory.mkdir(parents=True, exist_ok=True)
    write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", images)
    write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", labels)


@pytest.fixture
def mnist_prefix_dir(tmp_path):
    """An IDX dir of the sample's first MNIST images (a copy of the first N, as a user may keep)."""
    from capsnet.data import load_sample

    directory = tmp_path / "mnist_first"
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images, labels, _ = load_sample("mnist", split)
        _write_split(directory, prefix, images[:500], labels[:500])
    return directory


def test_mnist_files_are_refused_as_fashion_mnist(mnist_prefix_dir):
    from capsnet.data import load_split
    from capsnet.errors import DataError

    assert len(load_split("mnist", "train", data_dir=mnist_prefix_dir)[1]) == 500
    assert len(load_split("multimnist", "test", data_dir=mnist_prefix_dir)[1]) == 500
    with pytest.raises(DataError, match=r"holds MNIST's files, not Fashion-MNIST's.*data\.name=mnist") as err:
        load_split("fashion_mnist", "train", data_dir=mnist_prefix_dir, limit=10)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(FASHION_DIR is None, reason="no Fashion-MNIST files here (apt-get install dataset-fashion-mnist)")
def test_fashion_mnist_files_are_refused_as_mnist():
    from capsnet.data import load_split
    from capsnet.errors import DataError

    assert len(load_split("fashion_mnist", "test", data_dir=FASHION_DIR, limit=5)[1]) == 5
    for name in ("mnist", "multimnist"):
        with pytest.raises(DataError, match="holds Fashion-MNIST's files, not MNIST's"):
            load_split(name, "test", data_dir=FASHION_DIR)


@pytest.mark.skipif(not MNIST_DIR.is_dir() or FASHION_DIR is None, reason="the official files are not here")
def test_fingerprints_are_the_official_files():
    """The fingerprints name the real files' first images (independent of the sample)."""
    from capsnet.data import known_dataset
    from capsnet.idx import read_idx

    # The official archives, by the SHA-256 tensorflow-datasets records for MNIST.
    assert hashlib.sha256((MNIST_DIR / "t10k-images-idx3-ubyte.gz").read_bytes()).hexdigest().startswith("8d422c7b")
    for directory, name in ((MNIST_DIR, "mnist"), (FASHION_DIR, "fashion_mnist")):
        for prefix, split in (("train", "train"), ("t10k", "test")):
            assert known_dataset(read_idx(directory / f"{prefix}-images-idx3-ubyte.gz")) == (name, split)


def test_a_users_own_data_is_neither(tiny_idx_dir):
    from capsnet.data import known_dataset, load_split

    images, _ = load_split("fashion_mnist", "train", data_dir=tiny_idx_dir)
    assert known_dataset(images) is None


# --------------------------------------------------------------------------- a run whose data moved

@pytest.fixture
def moved_data_run(trained_run, tmp_path):
    """A copy of trained_run whose config.yaml names a data dir that is no longer there."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run[0], run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg["data"]["dir"] = str(tmp_path / "moved_away")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return run_dir


def test_evaluate_says_the_moved_data_dir_came_from_the_run(moved_data_run, tiny_idx_dir):
    from capsnet.errors import DataError
    from capsnet.evaluation import evaluate

    with pytest.raises(DataError) as err:
        evaluate(moved_data_run, which="latest")
    message = str(err.value)
    assert "moved_away does not exist" in message and str(moved_data_run / "config.yaml") in message
    assert "data.dir=" in message and "\n" not in message
    report = evaluate(moved_data_run, which="latest", data_dir=str(tiny_idx_dir), output=str(moved_data_run / "e.json"))
    assert report["num_examples"] == 100


@pytest.mark.slow
def test_export_needs_no_data_dir(moved_data_run, tmp_path):
    from capsnet.export import export

    report = export(moved_data_run, tmp_path / "exported", which="latest")
    assert Path(report["output"]).is_dir()


# --------------------------------------------------------------------------- first mistakes

def test_a_mistyped_key_gets_the_close_key_not_hydras_plus_hint():
    from hydra.errors import ConfigCompositionException

    from capsnet import cli

    for override, expected in (("train.epoch=1", "did you mean train.epochs?"),
                               ("trian.epochs=1", "did you mean train.epochs?"),
                               ("custom_ops=true", "did you mean custom_op?")):
        with pytest.raises(ConfigCompositionException) as err:
            compose_config("train", [override])
        line = cli.one_line(err.value)
        assert expected in line and "+" not in line, line


@pytest.mark.slow
def test_a_mistyped_key_on_the_command_line():
    result = run_entry_point("train.py", "train.epoch=1", cwd=REPO, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: unknown key train.epoch: did you mean train.epochs?"


@pytest.mark.slow
@pytest.mark.parametrize("path", ["exported/mnist/saved_model.pb", "plots/accuracy.png", "figs/perturbation_2.png"])
def test_the_readmes_output_folders_are_git_ignored(path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
    assert result.returncode == 0


def test_a_complete_run_says_how_to_extend_it():
    from capsnet.training.run_lock import complete_run_notice

    line = complete_run_notice("outputs/x", 3)
    assert "complete (3 of 3 epochs done)" in line and "train.epochs=" in line and "hydra.run.dir=outputs/x" in line
    assert "complete (1 of 1 epoch done)" in complete_run_notice("outputs/x", 1)


@pytest.mark.slow
@pytest.mark.parametrize("script, config_file", [("evaluate.py", "eval.yaml"), ("export.py", "export.yaml"),
                                                 ("predict.py", "predict.yaml")])
def test_help_of_a_checkpoint_command_lists_its_own_keys_only(script, config_file):
    """train.py's config groups (data=, model=, experiment=, ...) are refused by these commands
    (no match in their defaults list): their --help shows their own keys instead."""
    result = run_entry_point(script, "--help", cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"== Keys (configs/{config_file}) ==" in result.stdout
    assert "\n  checkpoint=???  " in result.stdout  # each key with its default and comment
    assert "Configuration groups" not in result.stdout
    assert "experiment:" not in result.stdout and "paper_mnist" not in result.stdout


@pytest.mark.slow
def test_a_shadowing_capsnet_folder_is_named_in_one_line(tmp_path):
    """A folder `capsnet` without __init__.py in the current directory imported as `capsnet`, a
    namespace package, while its modules come from the package (as with an editable install,
    whose finder comes after the current directory on the import path)."""
    (tmp_path / "capsnet").mkdir()
    probe = textwrap.dedent(f"""
        import sys, types
        shadow = types.ModuleType("capsnet")  # what the import system makes of the folder: no __file__
        shadow.__path__ = [{str(tmp_path / "capsnet")!r}, {str(REPO / "capsnet")!r}]
        sys.modules["capsnet"] = shadow
        import capsnet.cli
    """)
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=entry_point_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and str(tmp_path / "capsnet") in line and "shadows" in line
