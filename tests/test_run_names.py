"""Run dir names (configs/hydra/default.yaml, hydra_plugins/capsnet_run_name): the overrides
that differ from the defaults, paths left out, or the name given; names that `evaluate.py
checkpoint=<run dir>` accepts; and a run rerun with its hydra.run.dir resumes."""
import json
import re

import pytest

from conftest import CONFIG_DIR, TINY_MODEL, TINY_TRAIN, run_entry_point
from hydra_plugins.capsnet_run_name import MAX_LENGTH, run_name


TIME = r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d"
NAME = "name"


def hydra_config(*overrides):
    """The `hydra` node of train.py's config composed with `overrides`, resolved as for a run."""
    from hydra import compose, initialize_config_dir

    from capsnet import config

    config.register()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=True).hydra


@pytest.mark.parametrize("overrides, name, expected", [
    ("", None, ""),                                               # a plain run: outputs/<date>/<time>
    ("custom_op-true+seed-1", None, "_custom_op-true+seed-1"),
    ("custom_op-true+seed-1", "op-vs-matmul", "_op-vs-matmul"),   # a name replaces the overrides
    ("custom_op-true", "", "_custom_op-true"),                    # name= (empty): as if not given
    ("model.decoder_units-[32,64]", None, "_model.decoder_units-_32_64"),
    ("distribute.devices-[/gpu:0,/gpu:1]", None, "_distribute.devices-_gpu_0_gpu_1"),
    ("", "my run/v2 'final'", "_my_run_v2_final"),
    ("custom_op-False+seed-0", None, "_custom_op-false+seed-0"),  # a sweep job's Python booleans
    ("name_True-True", None, "_name_True-true"),                  # only the value
])
def test_run_name(overrides, name, expected):
    assert run_name(overrides, name) == expected


def test_a_long_run_name_keeps_what_fits_and_counts_the_rest():
    items = [f"model.key_number_{k}-{k}" for k in range(12)]
    name = run_name("+".join(items))
    assert len(name) <= 1 + MAX_LENGTH
    kept = name[1:].split("+")
    left = int(re.fullmatch(r"(\d+)-more", kept.pop()).group(1))
    assert kept == items[:len(kept)] and len(kept) + left == len(items) and left > 0
    with_seed = run_name("+".join(items + ["seed-7"]))  # the seed is kept, the others cut
    assert len(with_seed) <= 1 + MAX_LENGTH and re.search(r"\+seed-7\+\d+-more$", with_seed), with_seed
    one = run_name("x-" + "y" * 300)  # one override longer than a name: its start
    assert len(one) == 1 + MAX_LENGTH - len("+1-more") and one.startswith("_x-yyy")
    assert run_name("", "n" * 300) == "_" + "n" * MAX_LENGTH


def test_run_dirs_are_named_after_the_overrides_that_differ():
    assert re.fullmatch(TIME, hydra_config().run.dir)
    named = hydra_config("seed=1", "custom_op=true", "data.dir=/data/mnist", "train.xla_cache_dir=/tmp/xla",
                         "debug=true").run.dir
    assert re.fullmatch(TIME + r"_custom_op-true\+seed-1", named), named  # sorted; paths and debug left out
    assert re.fullmatch(TIME + "_op", hydra_config("custom_op=true", f"{NAME}=op").run.dir)
    assert re.fullmatch(TIME + r"_experiment-paper_mnist", hydra_config("experiment=paper_mnist").run.dir)


@pytest.mark.parametrize("overrides", [
    ("custom_op=true", "seed=1"),
    ("model.decoder_units=[32,64]", "train.learning_rate=1e-3", "train.lr_schedule=cosine"),
    ("distribute.devices=[/gpu:0,/gpu:1]", "seed=-1"),
])
def test_a_run_dir_is_a_checkpoint_value_hydra_parses_as_written(overrides):
    """`python evaluate.py checkpoint=<run dir>`, unquoted, as the README writes it: Hydra's parser
    rejects a value with `=` and reads one with `,` as a sweep (the names of key=value,key=value)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    run_dir = hydra_config(*overrides).run.dir
    parsed = OverridesParser.create().parse_override(f"checkpoint={run_dir}")
    assert not parsed.is_sweep_override() and parsed.value() == run_dir


@pytest.mark.slow
def test_train_py_names_its_run_dir_and_resumes_it(tiny_idx_dir, tmp_path):
    # The tiny settings left out of the name, as paths are, so that it is the one override left.
    tiny = [*TINY_MODEL, *(o for o in TINY_TRAIN if not o.startswith("train.epochs=")), f"data.dir={tiny_idx_dir}"]
    short = f"hydra.job.config.override_dirname.exclude_keys=[{','.join(o.split('=')[0] for o in tiny)},train.epochs]"
    first = run_entry_point("train.py", *tiny, short, "seed=1", "train.epochs=1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    assert re.fullmatch(TIME + "_seed-1", str(run_dir.relative_to(tmp_path))), run_dir

    again = run_entry_point("train.py", *tiny, short, "seed=1", "train.epochs=2", f"hydra.run.dir={run_dir}",
                            cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert list((tmp_path / "outputs").glob("*/*")) == [run_dir]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["resumed_from"] and metrics["epochs"] == 2
    assert [h["epoch"] for h in metrics["history"]] == [1, 2]


def test_a_300_character_override_list_gives_a_valid_run_dir(tmp_path):
    # A sweep's long override list: each run dir's name is shortened to fit a file name (255
    # bytes), stays a value evaluate.py's checkpoint= parses, and can be created.
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from conftest import compose_config

    overrides = ["seed=123456789", "custom_op=true", "train.learning_rate=0.000123456789", "train.batch_size=64",
                 "train.epochs=30", "model.routing_iterations=3", "model.decoder_units=[512,1024]",
                 "train.lr_schedule=cosine", "data.limit_train=100000", "data.limit_test=50000",
                 "train.ema_decay=0.999", "deterministic=true", "model.input_shape=[28,28,1]",
                 "train.weight_decay=0.0001", "model.num_classes=10", "train.warmup_epochs=2"]
    assert len(" ".join(overrides)) >= 300
    hydra = hydra_config(*overrides, "hydra.job.num=7")
    for run_dir in (hydra.run.dir, f"{hydra.sweep.dir}/{hydra.sweep.subdir}"):
        assert max(len(part.encode()) for part in run_dir.split("/")) <= 255, run_dir
        assert len(run_dir.rsplit("/", 1)[-1]) <= len("21-53-33") + 1 + MAX_LENGTH, run_dir
        assert re.search(r"\+\d+-more$", run_dir), run_dir
        parsed = OverridesParser.create().parse_override(f"checkpoint={run_dir}")
        assert not parsed.is_sweep_override() and parsed.value() == run_dir
        (tmp_path / run_dir).mkdir(parents=True)
    assert re.fullmatch(r"7_custom_op-true\+.*", hydra.sweep.subdir)
    # The same overrides compose into a config that passes every check (no training here).
    cfg = compose_config("train", [*overrides, f"run_dir={tmp_path / 'run'}"])
    assert cfg["seed"] == 123456789 and cfg["train"]["epochs"] == 30
