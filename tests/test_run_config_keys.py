"""A marked run dir written before a config key existed stays readable (the key at its
schema default, the behaviour the run had), while an edited config.yaml (a key deleted that
every marked run has, or one the schema does not know) is refused in one line."""
import shutil

import pytest
import yaml

from capsnet.errors import CheckpointError
from capsnet.training.checkpoints import read_run_config


def copy_with_config(trained_run, tmp_path, edit):
    run_dir, _ = trained_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    saved = yaml.safe_load((copy / "config.yaml").read_text())
    edit(saved)
    (copy / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    return copy


def test_keys_added_since_take_their_schema_defaults(trained_run, tmp_path):
    def drop(saved):
        del saved["model"]["kind"], saved["train"]["figures"], saved["data"]["max_pixels"]

    read = read_run_config(copy_with_config(trained_run, tmp_path, drop))
    assert read["model"]["kind"] == "capsnet" and read["train"]["figures"] is False
    assert read["data"]["max_pixels"] == 8192 * 8192


def test_an_unknown_key_is_refused_naming_it(trained_run, tmp_path):
    def add(saved):
        saved["train"]["epoch_count"] = 3

    with pytest.raises(CheckpointError, match=r"unknown key train\.epoch_count"):
        read_run_config(copy_with_config(trained_run, tmp_path, add))


def test_a_deleted_key_of_every_marked_run_is_refused_naming_it(trained_run, tmp_path):
    def drop(saved):
        del saved["model"]["routing_iterations"]

    with pytest.raises(CheckpointError, match=r"no key model\.routing_iterations"):
        read_run_config(copy_with_config(trained_run, tmp_path, drop))


def test_a_run_of_the_config_before_the_validation_split_and_sgd_reads_as_it_ran(trained_run, tmp_path):
    """The config.yaml shape every marked run had before data.test_fraction, train.optimizer,
    train.momentum and train.long_run_notice_minutes: read with Adam, no validation split, its
    data.validation_fraction (then a folder's test share) as data.test_fraction."""
    def as_before(saved):
        saved["data"]["validation_fraction"] = saved["data"].pop("test_fraction")
        for key in ("optimizer", "momentum", "long_run_notice_minutes"):
            del saved["train"][key]

    read = read_run_config(copy_with_config(trained_run, tmp_path, as_before))
    assert read["train"]["optimizer"] == "adam" and read["train"]["long_run_notice_minutes"] == 60
    assert read["data"]["validation_fraction"] == 0 and read["data"]["test_fraction"] == 0
