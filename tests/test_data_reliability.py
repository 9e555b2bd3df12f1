"""An image folder's disk cache and a data.cache=none run when the disk or the folder lets
them down: one line naming the key and the remedy, nothing of the run lost, and no cache
folder left behind by a process that died (capsnet.tasks.images)."""
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from capsnet import config
from capsnet.errors import ConfigError, DataError
from capsnet.tasks import images, task_for
from conftest import REPO, TINY_MODEL, TINY_TRAIN, compose_config, entry_point_env, repo_env
from test_folder_data import cfg, make_folder
from test_reliability import tree_bytes

FOLDER = ["data=folder", "data.image_size=32", "train.batch_size=8", "train.learning_rate=0.01"]


def folder_overrides(root, run_dir, *extra):
    return [*TINY_MODEL, *TINY_TRAIN, *FOLDER, f"data.dir={root}", f"run_dir={run_dir}", *extra]


def caches(directory):
    return sorted(p.name for p in Path(directory).glob(images.CACHE_PREFIX + "*"))


# --------------------------------------------------------------------------- a cache that cannot be written

def test_a_cache_disk_with_less_room_than_the_split_is_refused_before_decoding(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "f", n_per_class=4)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    monkeypatch.setattr(images.shutil, "disk_usage", lambda path: SimpleNamespace(total=10 ** 9, used=0, free=1000))
    with pytest.raises(DataError) as err:
        task_for(cfg(root, cache="disk", cache_dir=str(cache_dir))).load("train")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"cannot write the disk cache of {root} (train, 0.0 MB decoded) in "
                              f"data.cache_dir={cache_dir}: 0.0 MB free there; free space there, set data.cache_dir")
    assert caches(cache_dir) == []


def _file_size_limit(limit):
    """Popen preexec_fn: files of at most `limit` bytes (RLIMIT_FSIZE), a longer write failing
    with EFBIG (SIGXFSZ ignored, as a full disk's ENOSPC fails a write, not the process)."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_a_cache_that_cannot_be_written_is_one_line_and_the_run_resumes(tmp_path):
    """train.py resuming a folder run with data.cache=disk where files may not exceed 32 KB
    (the decoded split is 72 KB): exit 2, one line naming data.cache_dir, the OS's reason and
    the remedies; no cache folder left; the run's checkpoints untouched, and the same run
    resumes with a cache that fits."""
    from capsnet.training import train

    root = make_folder(tmp_path / "f", n_per_class=8)
    run_dir, cache_dir = tmp_path / "run", tmp_path / "cache"
    cache_dir.mkdir()
    train(compose_config("train", folder_overrides(root, run_dir, "train.epochs=1")))
    before = tree_bytes(run_dir / "checkpoints")
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *folder_overrides(root, run_dir, "train.epochs=2"),
         "data.cache=disk", f"data.cache_dir={cache_dir}", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=entry_point_env(), capture_output=True, text=True, timeout=300,
        preexec_fn=_file_size_limit(32 * 1024))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"error: cannot write the disk cache of {root} (train, 0.1 MB decoded) in "
                                    f"data.cache_dir={cache_dir}: File too large; free space there")
    assert "data.cache=none" in result.stderr
    assert caches(cache_dir) == [] and not list(cache_dir.iterdir())
    assert tree_bytes(run_dir / "checkpoints") == before
    metrics = train(compose_config("train", folder_overrides(root, run_dir, "train.epochs=2", "data.cache=disk",
                                                             f"data.cache_dir={cache_dir}")))
    assert metrics["resumed_from"] == str(run_dir / "checkpoints" / "latest" / "ckpt-1") and metrics["epochs"] == 2


# --------------------------------------------------------------------------- data.cache_dir checked with the config

def test_a_cache_dir_that_cannot_be_made_is_one_line_from_the_config_check(tmp_path):
    root = make_folder(tmp_path / "f", n_per_class=2)
    (tmp_path / "a-file").write_text("not a folder")
    remedy = "pick another data.cache_dir (null: the system's temporary folder)"
    for given, message in ((tmp_path / "a-file" / "cache", f"cannot make data.cache_dir {tmp_path / 'a-file' / 'cache'}: "
                            f"{tmp_path / 'a-file'} is a file; {remedy}"),
                           (tmp_path / "a-file", f"data.cache_dir {tmp_path / 'a-file'} is not a directory: {remedy}")):
        with pytest.raises(ConfigError) as err:
            config.check(compose_config("train", folder_overrides(root, tmp_path / "run", f"data.cache_dir={given}")))
        assert str(err.value) == message
    # One that does not exist yet is made; with data.cache=memory the key is not read.
    config.check(compose_config("train", folder_overrides(root, tmp_path / "run", f"data.cache_dir={tmp_path}/new/c")))
    assert (tmp_path / "new" / "c").is_dir()
    config.check(compose_config("train", folder_overrides(root, tmp_path / "run", "data.cache=memory",
                                                          f"data.cache_dir={tmp_path / 'a-file' / 'cache'}")))


@pytest.mark.slow
def test_the_cache_dir_check_needs_no_tensorflow(tmp_path):
    """The check runs with the config, before train.py imports TensorFlow (seconds)."""
    root = make_folder(tmp_path / "f", n_per_class=2)
    (tmp_path / "a-file").write_text("")
    code = ("import sys\nfrom capsnet import config\nfrom capsnet.errors import ConfigError\n"
            "from conftest import compose_config\n"
            f"overrides = {folder_overrides(root, tmp_path / 'run', f'data.cache_dir={tmp_path}/a-file/c')!r}\n"
            "try:\n    config.check(compose_config('train', overrides))\n"
            "except ConfigError as err:\n    print(err)\n"
            "print('tensorflow' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], env=repo_env(REPO / "tests"), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-2].startswith(f"cannot make data.cache_dir {tmp_path}/a-file/c: "), result
    assert result.stdout.splitlines()[-1] == "False"


# --------------------------------------------------------------------------- files gone with data.cache=none

@pytest.mark.slow
def test_files_gone_before_a_cache_none_epoch_are_named(tmp_path):
    """data.cache=none decodes the files every epoch: one deleted since the load is a
    DataError naming it when the next epoch's batches are made, not an epoch cut short."""
    root = make_folder(tmp_path / "f", n_per_class=4)
    task = task_for(cfg(root, cache="none"))
    data = task.load("train")
    full = sum(len(y) for _, y in task.dataset(data, batch_size=5, training=True, epoch=0))
    assert full == 12
    gone = sorted((root / "train" / "cat").iterdir())[:2]
    for path in gone:
        path.unlink()
    with pytest.raises(DataError) as err:
        task.dataset(data, batch_size=5, training=True, epoch=1)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"2 image file(s) of {root} (train, none cache) are gone since the run started "
                              f"(data.cache=none reads them every epoch): {gone[0]}, {gone[1]}; the epoch is not "
                              "saved; put the file(s) back")


@pytest.mark.slow
def test_a_test_image_deleted_during_a_cache_none_run_is_one_line_and_the_run_resumes(tmp_path, monkeypatch):
    """A test image deleted while epoch 2 trains: its test pass stops the run with one line
    naming the file (not tf.data's 'End of sequence' or NotFoundError); epoch 1's checkpoint
    is as it was, and once the file is back the same run resumes from it."""
    from capsnet.training import train
    from test_reliability import before_epoch

    root = make_folder(tmp_path / "f", n_per_class=8)
    run_dir = tmp_path / "run"
    gone = sorted((root / "test" / "dog").iterdir())[3]
    kept = gone.read_bytes()
    before_epoch(monkeypatch, 2, gone.unlink)
    overrides = folder_overrides(root, run_dir, "train.epochs=2", "data.cache=none")
    with pytest.raises(DataError) as err:
        train(compose_config("train", overrides))
    assert str(err.value) == (f"image file {gone} is gone (deleted or moved while the run read it: data.cache=none "
                              f"reads the files every epoch); {images._GONE_REMEDY}")
    assert [p.name for p in sorted((run_dir / "checkpoints" / "latest").glob("*.index"))] == ["ckpt-1.index"]
    monkeypatch.undo()
    gone.write_bytes(kept)
    metrics = train(compose_config("train", overrides))
    assert metrics["resumed_from"] == str(run_dir / "checkpoints" / "latest" / "ckpt-1") and metrics["epochs"] == 2


# --------------------------------------------------------------------------- caches of dead processes

_MAKE_CACHE = """
import sys, time
from capsnet.tasks import images
directory = images._cache_dir({{"cache_dir": {parent!r}}}, 10, "root", "train")
(directory / "train.data").write_bytes(bytes(4096))
print(directory, flush=True)
time.sleep(120)
"""


def _cache_holder(parent):
    """A process that made a cache folder in `parent` and sleeps: (Popen, its folder)."""
    process = subprocess.Popen([sys.executable, "-c", _MAKE_CACHE.format(parent=str(parent))], env=repo_env(),
                               stdout=subprocess.PIPE, text=True)
    return process, Path(process.stdout.readline().strip())


@pytest.mark.slow
def test_the_cache_of_a_killed_process_is_removed_by_the_next_one(tmp_path, capsys):
    """kill -9 leaves a cache folder (no atexit runs): the next process making a cache in the
    same folder removes it, with a notice; a living process's cache, another host's, and a
    fresh folder without an owner file stay; one without an owner file untouched for a day goes."""
    killed, killed_dir = _cache_holder(tmp_path)
    living, living_dir = _cache_holder(tmp_path)
    try:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        assert (killed_dir / "train.data").is_file()  # what kill -9 leaves
        other_host = tmp_path / f"{images.CACHE_PREFIX}otherhost"
        other_host.mkdir()
        (other_host / "owner").write_text("pid 1\nhost some-other-machine\nsince 2026-01-01T00:00:00\n")
        old, fresh = tmp_path / f"{images.CACHE_PREFIX}old", tmp_path / f"{images.CACHE_PREFIX}fresh"
        for unmarked in (old, fresh):
            unmarked.mkdir()
            (unmarked / "train.data").write_bytes(b"x")
        two_days_ago = time.time() - 2 * 86400
        for path in (old / "train.data", old):
            os.utime(path, (two_days_ago, two_days_ago))
        mine = images._cache_dir({"cache_dir": str(tmp_path)}, 10, "root", "train")
        try:
            assert set(caches(tmp_path)) == {p.name for p in (living_dir, other_host, fresh, mine)}
            out = capsys.readouterr().out
            assert f"notice: removed 2 disk cache folder(s) in {tmp_path} left by runs that ended" in out
            assert killed_dir.name in out and old.name in out
            assert "pid" in (mine / "owner").read_text()
        finally:
            images._remove_cache(mine)
        assert not mine.exists()
    finally:
        living.kill()
        living.wait(timeout=30)
