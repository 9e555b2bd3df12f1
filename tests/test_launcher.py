"""hydra/launcher=gpus (hydra_plugins/capsnet_launcher/gpus.py): a sweep's jobs in parallel
processes, one device slot each; on this CPU machine the devices are only slots."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, TINY_MODEL, TINY_TRAIN, entry_point_env, run_entry_point, sigint_as_in_a_terminal
from hydra_plugins.capsnet_launcher.gpus import check_devices, config_flags, quoted, visible_gpus

from capsnet.errors import ConfigError

# One epoch of the tiny model: each job trains in seconds, after its TensorFlow import.
ONE_EPOCH = [o for o in TINY_TRAIN if not o.startswith("train.epochs=")] + ["train.epochs=1"]
PARALLEL = ["hydra/launcher=gpus", "hydra.launcher.devices=[0,1]"]


def sweep(tmp_path, name, data_dir, swept, *args):
    """`train.py -m <swept> <args>` on the tiny model into tmp_path/name; the CompletedProcess.
    Job dirs are named as by default (<num>_<overrides as key-value>, hydra.sweep.subdir) but by
    the swept key alone, which the test reads more easily than the tiny overrides' long name."""
    swept_key = swept.split("=")[0]
    fixed = [o for o in [*TINY_MODEL, *ONE_EPOCH, f"data.dir={data_dir}"] if o.split("=")[0] != swept_key]
    short_names = f"hydra.job.config.override_dirname.exclude_keys=[{','.join(o.split('=')[0] for o in fixed)}]"
    return run_entry_point("train.py", "-m", swept, *args, *fixed, f"hydra.sweep.dir={tmp_path / name}",
                           short_names, cwd=tmp_path)


def job_span(job_dir):
    """When a job started (Hydra wrote its .hydra/config.yaml) and ended (metrics.json)."""
    return (job_dir / ".hydra" / "config.yaml").stat().st_mtime, (job_dir / "metrics.json").stat().st_mtime


# --------------------------------------------------------------------------- the launcher's pieces

def test_devices_default_to_every_visible_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpus() == ["2", "3"]
    assert check_devices(None, None) == (["2", "3"], 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # GPUs hidden: one slot, not pinned
    assert check_devices(None, None) == ([None], 1)
    assert check_devices([0, 1], 4) == (["0", "1"], 4)


@pytest.mark.parametrize("devices, jobs, words", [
    ([], None, "non-empty list"),
    (0, None, "non-empty list"),
    ([0, 1, 0], None, "device 0 more than once"),
    (["0,1"], None, "one device per entry"),
    ([0, 1], 0, "hydra.launcher.jobs must be a positive integer"),
])
def test_bad_launcher_config_is_a_config_error(devices, jobs, words):
    with pytest.raises(ConfigError, match=words):
        check_devices(devices, jobs)


def test_a_job_keeps_the_sweeps_config_flags():
    argv = ["-m", "-cn", "eval", "seed=0,1", "--config-dir=/x", "hydra/launcher=gpus"]
    assert config_flags(argv) == ["-cn", "eval", "--config-dir=/x"]


def test_a_job_dir_survives_hydras_override_parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    path = "/runs/0_lr=0.1,seed=0/it's [x]"
    parsed = OverridesParser.create().parse_overrides([f"hydra.run.dir={quoted(path)}"])[0]
    assert not parsed.is_sweep_override() and parsed.value() == path


# --------------------------------------------------------------------------- train.py -m ... hydra/launcher=gpus

@pytest.mark.slow
@pytest.mark.parametrize("devices, words", [("[]", "non-empty list"), ("[0,0]", "device 0 more than once")])
def test_bad_devices_are_one_line_before_any_job(tmp_path, devices, words):
    result = run_entry_point("train.py", "-m", "seed=0,1", "hydra/launcher=gpus",
                             f"hydra.launcher.devices={devices}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                             cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: hydra.launcher.devices") and words in lines[0], result.stderr
    assert not list((tmp_path / "sweep").glob("*/"))  # no job started


@pytest.mark.slow
def test_parallel_sweep_matches_the_sequential_one(tiny_idx_dir, tmp_path):
    parallel = sweep(tmp_path, "parallel", tiny_idx_dir, "seed=0,1", *PARALLEL)
    assert parallel.returncode == 0, parallel.stderr
    sequential = sweep(tmp_path, "sequential", tiny_idx_dir, "seed=0,1")
    assert sequential.returncode == 0, sequential.stderr

    names = ["0_seed-0", "1_seed-1"]  # the sequential sweep's layout, hydra.sweep.subdir's default
    assert sorted(p.name for p in (tmp_path / "sequential").iterdir() if p.is_dir()) == names
    spans, pids = [], set()
    for device, name in enumerate(names):
        job, reference = tmp_path / "parallel" / name, tmp_path / "sequential" / name
        log = (job / "train.log").read_text()
        assert f"CUDA_VISIBLE_DEVICES={device}\n" in log  # what the job's own process saw
        assert "CUDA_VISIBLE_DEVICES" not in (reference / "train.log").read_text()
        assert (job / "output.log").is_file()
        # TensorBoard event files: events.out.tfevents.<time>.<host>.<pid>.<n>.v2
        pids |= {p.name.split(".")[-3] for p in job.glob("events.out.tfevents.*")}
        spans.append(job_span(job))
        # The same config as the sequential job's, but for its run dir; the same task overrides.
        assert (job / "config.yaml").read_text().replace(str(job.resolve()), str(reference.resolve())) == \
            (reference / "config.yaml").read_text()
        assert (job / ".hydra" / "overrides.yaml").read_text() == (reference / ".hydra" / "overrides.yaml").read_text()
        got, want = (json.loads((d / "metrics.json").read_text()) for d in (job, reference))
        assert got["run_dir"] == str(job.resolve())
        for key in ("test_loss", "test_accuracy", "train_loss", "global_step"):
            assert got[key] == pytest.approx(want[key], abs=1e-6), key
        for row, ref in zip(*[[json.loads(line) for line in (d / "history.jsonl").read_text().splitlines()]
                              for d in (job, reference)]):
            for key in ("train_loss", "train_margin_loss", "test_loss", "learning_rate"):
                assert row[key] == pytest.approx(ref[key], abs=1e-6), key
    assert len(pids) == 2  # two processes ...
    (start0, end0), (start1, end1) = spans
    assert start0 < end1 and start1 < end0  # ... running at the same time


@pytest.mark.slow
def test_a_failed_job_is_reported_and_the_others_finish(tiny_idx_dir, tmp_path):
    # train.epochs=0 passes the type check of the sweep's config but not the job's value check.
    result = sweep(tmp_path, "sweep", tiny_idx_dir, "train.epochs=1,0", *PARALLEL)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    failed = [line for line in lines if line.startswith("sweep job #1")]
    assert len(failed) == 1, result.stderr
    assert failed[0].startswith("sweep job #1 (train.epochs=0) on device 1 failed with exit status 2: ")
    assert "error: train.epochs" in failed[0]  # the job's own one-line error
    assert lines[-1].startswith("error: 1 of 2 sweep jobs failed: #1 (train.epochs=0) exit status 2"), result.stderr
    assert (tmp_path / "sweep" / "0_train.epochs-1" / "metrics.json").is_file()
    assert (tmp_path / "sweep" / "1_train.epochs-0" / "output.log").is_file()


@pytest.mark.slow
def test_ctrl_c_stops_the_jobs_and_says_so_in_one_line(tiny_idx_dir, tmp_path):
    fixed = [*TINY_MODEL, *ONE_EPOCH, f"data.dir={tiny_idx_dir}"]
    # Its own process group, which the test's Ctrl-C (SIGINT to the group, as a terminal sends it) reaches.
    process = subprocess.Popen([sys.executable, str(REPO / "train.py"), "-m", "seed=0,1,2", *PARALLEL, *fixed,
                                f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.sweep.subdir=${hydra.job.num}"],
                               cwd=tmp_path, env=entry_point_env(), start_new_session=True,
                               preexec_fn=sigint_as_in_a_terminal,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    logs = [tmp_path / "sweep" / str(i) / "train.log" for i in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(log.is_file() and "CUDA_VISIBLE_DEVICES" in log.read_text() for log in logs):
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines() == [
        f"sweep interrupted: jobs #0 (seed=0), #1 (seed=1) stopped, 1 not started (job dirs in {tmp_path / 'sweep'})"]
    assert not (tmp_path / "sweep" / "2").exists()
