"""A run dir named relative to the working directory, as the README writes it
(`python evaluate.py checkpoint=outputs/<date>/<time>`): evaluation and export find its
checkpoints and config the same as from an absolute path."""
import os
from pathlib import Path

import pytest


@pytest.fixture
def relative_run(trained_run, monkeypatch):
    """trained_run's dir as `<parent>/run` relative to the working directory (two parts, as
    outputs/<date>/<time> has), the working directory being its parent's parent."""
    run_dir = Path(trained_run[0])
    monkeypatch.chdir(run_dir.parent.parent)
    relative = Path(run_dir.parent.name) / run_dir.name
    assert not relative.is_absolute() and relative.resolve() == run_dir.resolve()
    return relative


@pytest.mark.parametrize("which", ["best", "latest"])
def test_resolve_checkpoint_of_a_relative_run_dir(relative_run, which):
    from capsnet.training.checkpoints import resolve_checkpoint

    prefix, run_dir, cfg = resolve_checkpoint(relative_run, which)
    absolute, absolute_run_dir, _ = resolve_checkpoint(relative_run.resolve(), which)
    assert Path(prefix).resolve() == Path(absolute).resolve()
    assert Path(prefix).parent == relative_run / "checkpoints" / which  # one copy of the directory, not two
    assert Path(run_dir).resolve() == Path(absolute_run_dir).resolve()
    assert cfg["model"]


def test_evaluate_a_relative_run_dir(relative_run, tmp_path):
    from capsnet.evaluation import evaluate

    report = evaluate(str(relative_run), output=tmp_path / "relative.json")
    reference = evaluate(str(relative_run.resolve()), output=tmp_path / "absolute.json")
    assert report["accuracy"] == reference["accuracy"] and report["loss"] == pytest.approx(reference["loss"])
    assert Path(report["checkpoint"]).resolve() == Path(reference["checkpoint"]).resolve()


def test_export_a_relative_run_dir(relative_run, tmp_path):
    from capsnet import export

    report = export.export(str(relative_run), tmp_path / "exported")
    assert (tmp_path / "exported" / "saved_model.pb").is_file()
    assert Path(report["run_dir"]).resolve() == relative_run.resolve()
    assert os.path.samefile(f"{report['checkpoint']}.index",
                            relative_run.resolve() / "checkpoints" / "latest" / f"{Path(report['checkpoint']).name}.index")


def test_a_resume_may_change_the_routing_backend_but_not_its_algorithm():
    # model.routing.backend says how the routing runs (the same math); the algorithm and
    # leaky change what it computes, so a resume with another one is refused.
    from capsnet import config
    from capsnet.training.checkpoints import _config_differences

    saved = config.check(config.compose("train", ["run_dir=/x"]))
    backend = config.check(config.compose("train", ["run_dir=/x", "model.routing.backend=tf"]))
    leaky = config.check(config.compose("train", ["run_dir=/x", "model.routing.leaky=true"]))
    attention = config.check(config.compose("train", ["run_dir=/x", "model/routing=self_attention"]))
    assert _config_differences(saved, backend) == {}
    assert list(_config_differences(saved, leaky)) == ["model.routing.leaky"]
    assert "model.routing.algorithm" in _config_differences(saved, attention)
    # a run saved with the old string form had dynamic routing, not leaky
    old = {**saved, "model": {**saved["model"], "routing": "auto"}}
    assert _config_differences(old, saved) == {}
