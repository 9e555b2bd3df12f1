"""capsnet.config: the typed schemas, their checks, routing, derived values, old run configs.

No TensorFlow: config errors come before the seconds-long import.
"""
import re
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from capsnet import config
from capsnet.errors import ConfigError
from conftest import REPO, compose_config


def train_cfg(*overrides):
    return compose_config("train", ["run_dir=/unused", *overrides])


def one_line_error(overrides, config_name="train"):
    with pytest.raises(ConfigError) as err:
        cfg = compose_config(config_name, overrides)
        (config.check_eval if config_name == "eval" else config.check)(cfg)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.slow
def test_importing_config_does_not_import_tensorflow():
    code = "import capsnet.config, capsnet.cli, sys; print('tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# --------------------------------------------------------------------------- every group composes

@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    [], ["data=fashion_mnist"], ["data=multimnist"], ["augmentation=fashion"], ["augmentation=none"],
    ["distribute=none"], ["distribute=mirrored"], ["distribute=multi_worker"],
    ["experiment=paper_mnist"], ["experiment=paper_fashion_mnist"], ["experiment=paper_multimnist"],
    ["experiment=fast_mnist"], ["experiment=tuned_mnist"], ["model=capsnet", "train=default"], ["custom_op=true"],
    ["model=deep_capsnet"], ["model=deep_cnn"], ["model=deep_capsnet", "custom_op=true"],
    ["speed=none"], ["speed=gpu"], ["experiment=paper_multimnist", "speed=none"],
    ["model.routing.backend=xla"], ["model.routing.backend=tf"], ["model/routing=self_attention"],
])
def test_every_config_group_composes_and_checks(overrides):
    cfg = train_cfg(*overrides)
    checked = config.check(cfg)
    assert checked == cfg  # the composed config is already in its checked form
    assert set(checked) == {"model", "data", "train", "distribute", "custom_op", "seed", "deterministic", "debug", "name",
                            "run_dir"}
    assert set(checked["data"]) == {"name", "dir", "limit_train", "limit_test", "shift_pixels", "pad_pixels",
                                   "image_size", "channels", "crop", "validation_fraction", "test_fraction", "cache", "cache_memory_mb",
                                   "cache_dir", "class_names", "max_pixels", "standardize", "brightness", "contrast",
                                   "crop_padding", "cutout", *config.AUGMENTATION_OFF}
    assert set(checked["distribute"]) == {"strategy", "devices", "all_reduce", "scale_lr", "lr_base_batch_size"}


def test_eval_config_composes_and_checks():
    cfg = compose_config("eval", ["checkpoint=/some/run"])
    assert config.check_eval(cfg) == cfg
    assert cfg["data"] == {"name": None, "dir": None, "limit_test": None, "shift_pixels": None, "pad_pixels": None}
    assert cfg["custom_op"] is None and cfg["tf32"] is None
    with pytest.raises(ConfigError, match=r"checkpoint=\.\.\. is required"):
        config.check_eval({"which": "best"})


@pytest.mark.slow
def test_group_choices_set_what_they_say():
    assert train_cfg("augmentation=fashion")["data"]["flip"] is True
    assert train_cfg("experiment=paper_fashion_mnist")["data"]["flip"] is True
    assert train_cfg("experiment=paper_mnist")["data"]["flip"] is False
    # fast_mnist: paper_mnist's model and data with the fastest switches and
    # a short cosine schedule over full batches of 512.
    fast, paper = train_cfg("experiment=fast_mnist"), train_cfg("experiment=paper_mnist")
    assert fast["custom_op"] is True and fast["model"] == paper["model"] and fast["data"] == paper["data"]
    changed = {"epochs": 18, "batch_size": 512, "drop_remainder": True, "test_batch_size": 1000, "learning_rate": 0.005,
               "lr_schedule": "cosine", "warmup_epochs": 2, "xla": "jit", "precision": "mixed_bfloat16",
               "data_on_device": True}
    assert {k: fast["train"][k] for k in changed} == changed
    assert {k: v for k, v in fast["train"].items() if k not in changed} == {
        k: v for k, v in paper["train"].items() if k not in changed}
    # tuned_mnist: paper_mnist with exactly the overrides its results were measured with
    # (docs/results.md, MNIST), nothing else.
    measured = ["model.conv1_filters=512", "model.primary_caps_types=16", "data.elastic_alpha=16",
                "train.ema_decay=0.999", "train.weight_decay=0.15", "train.xla=jit", "train.precision=mixed_bfloat16",
                "train.data_on_device=true", "train.test_batch_size=1000", "train.save_every_epochs=5"]
    tuned = train_cfg("experiment=tuned_mnist")
    assert tuned == train_cfg("experiment=paper_mnist", *measured)
    assert tuned != paper
    # speed=gpu: exactly the four speed switches, on any dataset; speed=none undoes them in a preset.
    switches = {"xla": "jit", "precision": "mixed_bfloat16", "data_on_device": True, "test_batch_size": 1000}
    default = train_cfg()
    for base in ([], ["data=multimnist"]):
        fast_cfg, plain = train_cfg(*base, "speed=gpu"), train_cfg(*base)
        assert {k: v for k, v in fast_cfg["train"].items() if plain["train"][k] != v} == switches
        assert {k: v for k, v in fast_cfg.items() if k != "train"} == {k: v for k, v in plain.items() if k != "train"}
    for preset in ("tuned_mnist", "fast_mnist", "paper_multimnist"):
        assert {k: train_cfg(f"experiment={preset}")["train"][k] for k in switches} == switches
        assert {k: train_cfg(f"experiment={preset}", "speed=none")["train"][k] for k in switches} == {
            k: default["train"][k] for k in switches}
    assert train_cfg("speed=gpu", "train.precision=float32")["train"]["precision"] == "float32"  # a key still wins
    assert train_cfg("distribute=mirrored")["distribute"]["strategy"] == "mirrored"
    assert train_cfg("distribute=multi_worker")["distribute"]["devices"] is None


# --------------------------------------------------------------------------- derived values

@pytest.mark.parametrize("overrides, shape", [
    (["data=mnist"], [28, 28, 1]),
    (["data=fashion_mnist"], [28, 28, 1]),
    (["data=multimnist"], [36, 36, 1]),                        # 28 + 2 * 4
    (["data=multimnist", "data.shift_pixels=2"], [32, 32, 1]),  # the canvas follows the shift
    (["experiment=paper_multimnist"], [36, 36, 1]),
    (["data=mnist", "data.shift_pixels=0"], [28, 28, 1]),      # a training shift does not change the images
    (["model.input_shape=[32,32,1]"], [32, 32, 1]),            # a value given wins
])
def test_input_shape_and_num_classes_come_from_the_dataset(overrides, shape):
    cfg = train_cfg(*overrides)
    assert cfg["model"]["input_shape"] == shape and cfg["model"]["num_classes"] == 10


def test_the_old_routing_string_checks_to_the_section():
    # model.routing=auto|tf|xla (before routing became a section) still works on the command line
    for backend in ("auto", "tf", "xla"):
        checked = config.check(train_cfg(f"model.routing={backend}"))
        assert checked["model"]["routing"] == {"algorithm": "dynamic", "backend": backend, "leaky": False}


def test_an_unknown_dataset_is_one_line():
    assert one_line_error(["data.name=cifar", "run_dir=/x"]) == \
        ("data.name must be one of affnist, cifar10, expanded_mnist, fashion_mnist, folder, mnist, multimnist, "
         "smallnorb, svhn_cropped, got 'cifar'")


# --------------------------------------------------------------------------- unknown keys, wrong types

@pytest.mark.parametrize("override", ["train.epochz=3", "model.no_such_key=1", "data.flipp=true", "seedd=1",
                                      "distribute.device=[/gpu:0]"])
def test_unknown_keys_are_rejected_naming_the_key(override):
    with pytest.raises(ConfigCompositionException, match=override.split("=")[0].replace(".", r"\.")):
        train_cfg(override)


@pytest.mark.parametrize("override, message", [
    ("seed=abc", "seed must be an integer, got 'abc'"),
    ("train.epochs=1.5", "train.epochs must be a positive integer, got 1.5"),
    ("train.m_plus=abc", "train.m_plus must be a finite number, got 'abc'"),
    ("train.lr_decay_steps=abc", "train.lr_decay_steps must be a positive integer or null, got 'abc'"),
    ("model.decoder_units=[32,abc]", "model.decoder_units must be a non-empty sequence of positive integers, "
                                     "got [32, 'abc']"),
    ("custom_op=no", "custom_op must be true or false, got 'no'"),
    ("custom_op=1", "custom_op must be true or false, got 1"),
    ("data.flip=yes", "data.flip must be true or false, got 'yes'"),
    ("distribute.devices=/gpu:0", "distribute.devices must be null or a non-empty list"),
    ("model.routing=fused", "model.routing must be one of auto, tf, xla, got 'fused'"),
])
def test_wrong_types_are_one_line_naming_the_key(override, message):
    assert message in one_line_error([override, "run_dir=/x"])


def test_a_sweep_checks_each_value():
    with pytest.raises(ConfigError, match="custom_op must be true or false, got 'no'"):
        config.check_overrides(["custom_op=true,no"])
    config.check_overrides(["custom_op=true,false", "train.epochs=1,2", "data=mnist", "hydra.run.dir=x"])


@pytest.mark.parametrize("override, message", [
    ("seed=abc", "seed must be an integer, got 'abc'"),
    ("model.decoder_units=[32,abc]", "model.decoder_units must be a non-empty sequence of positive integers"),
    ("train.epochs=1.5", "train.epochs must be a positive integer, got 1.5"),
])
def test_omegaconf_type_errors_are_explained_in_the_keys_words(override, message):
    """What train.py's Hydra reports (its composition runs before our checks): explain()."""
    from hydra import compose, initialize_config_dir

    config.register()
    with pytest.raises(ConfigCompositionException) as err:
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            compose(config_name="train", overrides=[override])
    assert message in config.explain(err.value)


def test_a_type_error_in_a_yaml_file_is_explained():
    """Not an override: OmegaConf's own ValidationError, the schema's type in words."""
    node = OmegaConf.structured(config.TrainAppConfig)
    with pytest.raises(Exception) as err:
        node.train.batch_size = "many"
    assert config.explain(err.value) == "train.batch_size must be a positive integer, got 'many'"


@pytest.mark.slow
def test_the_cli_prints_a_type_error_as_one_line(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "train.m_plus=abc",
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: train.m_plus must be a finite number, got 'abc'"


# --------------------------------------------------------------------------- value checks (one place)

@pytest.mark.parametrize("overrides, message", [
    (["train.epochs=0"], "train.epochs must be a positive integer, got 0"),
    (["train.m_minus=0.95"], "need 0 <= m_minus < m_plus <= 1"),
    (["train.lambda_=-1"], "lambda_ must be >= 0"),
    (["train.ema_decay=1.0"], "train.ema_decay must be a number in [0, 1)"),
    (["train.collapse_patience=0"], "train.collapse_patience must be a positive integer"),
    (["train.test_every_epochs=0"], "train.test_every_epochs must be a positive integer"),
    (["data.rotate_degrees=200"], "data.rotate_degrees must be a number in [0, 180], got 200"),
    (["data.shift_fill=reflect"], "data.shift_fill must be one of zero, edge, got 'reflect'"),
    (["data.erase_probability=1.5"], "data.erase_probability must be a number in [0, 1], got 1.5"),
    (["data.erase_probability=-0.1"], "data.erase_probability must be a number in [0, 1], got -0.1"),
    (["data.erase_max_area=0.01"], "data.erase_max_area must be a number in [0.02, 1], got 0.01"),
    (["data.erase_max_area=2"], "data.erase_max_area must be a number in [0.02, 1], got 2"),
    (["data=multimnist", "data.erase_probability=0.5", "data.elastic_alpha=16"],
     "multimnist takes no flip/rotate/zoom/erase/shift_fill augmentation (its digits are shifted by "
     "data.shift_pixels on a zero canvas; data.elastic_alpha distorts each): got data.erase_probability=0.5; set "
     "data.erase_probability=0.0 (the default)"),
    (["data=multimnist", "augmentation=fashion"], "multimnist takes no flip/rotate/zoom/erase/shift_fill"),
    (["data=multimnist", "data.erase_probability=0.5", "data.zoom=0.1"],
     "got data.zoom=0.1, data.erase_probability=0.5; set data.zoom=0.0, data.erase_probability=0.0 (the defaults)"),
    (["distribute.strategy=horovod"], "distribute.strategy must be one of none, mirrored, multi_worker"),
    (["distribute=mirrored", "distribute.all_reduce=ring"],
     "distribute.all_reduce must be one of auto, collective, xla, nccl, one_device with distribute=mirrored, got 'ring'"),
    (["distribute.devices=[/cpu:0]"], "distribute.devices applies to distribute=mirrored only"),
    (["distribute=mirrored", "distribute.devices=[/cpu:0,/cpu:0]"], "distribute.devices lists a device more than once"),
    (["train.xla=jit", "model.routing=xla"], "model.routing=xla is redundant under train.xla=jit"),
    (["train.xla=fast"], "train.xla must be one of none, autocluster, jit, got 'fast'"),
])
def test_bad_values_are_one_line_config_errors(overrides, message):
    assert message in one_line_error([*overrides, "run_dir=/x"])


def test_check_takes_plain_dicts_too():
    cfg = train_cfg()
    with pytest.raises(ConfigError, match=r"^model has unknown key\(s\) jit_routing .*now model\.routing"):
        config.check({**cfg, "model": {**cfg["model"], "jit_routing": False}})
    with pytest.raises(ConfigError, match="^custom_op must be true or false, got 'no'$"):
        config.check({**cfg, "custom_op": "no"})
    with pytest.raises(ConfigError, match="^run_dir is not set"):
        config.check({**cfg, "run_dir": None})
    partial = {k: v for k, v in cfg.items() if k != "distribute"}
    assert config.check(partial)["distribute"]["strategy"] == "none"  # a missing section: the schema's defaults


# --------------------------------------------------------------------------- routing: one place

@pytest.mark.parametrize("custom_op, routing, stop_gradient, mode", [
    (False, "auto", True, "matmul"),
    (False, "tf", True, "matmul"),
    (False, "xla", True, "matmul_xla"),
    (True, "auto", True, "fused_op"),   # the fastest, by default
    (True, "auto", False, "op"),        # the fused op has only the stop-gradient gradient
    (True, "tf", True, "op"),
    (True, "xla", True, "op_xla"),
    (True, "xla", False, "op_xla"),
    (False, "auto", False, "matmul"),
])
def test_routing_resolves_in_one_place(custom_op, routing, stop_gradient, mode):
    cfg = train_cfg(f"custom_op={str(custom_op).lower()}", f"model.routing={routing}",
                    f"model.stop_gradient_routing={str(stop_gradient).lower()}")
    assert config.router_spec(cfg["custom_op"], cfg["model"])["backend"] == mode
    # A capsule bias (the authors' code) keeps auto off the fused op, which routes without one.
    biased = train_cfg(f"custom_op={str(custom_op).lower()}", f"model.routing={routing}",
                       f"model.stop_gradient_routing={str(stop_gradient).lower()}", "model.digit_caps_bias=0.1")
    assert config.router_spec(biased["custom_op"], biased["model"])["backend"] == ("op" if mode == "fused_op" else mode)


def test_every_routing_mode_is_reachable_and_every_written_combination_valid():
    modes = {config.router_spec(op, {"routing": r, "stop_gradient_routing": sg})["backend"]
             for op in (False, True) for r in config.ROUTING for sg in (False, True)}
    assert modes == {"matmul", "matmul_xla", "op", "op_xla", "fused_op"}  # the table in capsnet/config/__init__.py


@pytest.mark.parametrize("override, message", [
    ("model.fused_routing=true", "model.fused_routing is gone: model.routing"),
    ("model.jit_routing=true", "model.jit_routing is gone: model.routing"),
])
def test_the_old_routing_flags_cannot_be_written(override, message):
    with pytest.raises(ConfigError) as err:
        train_cfg(override)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


# --------------------------------------------------------------------------- old run configs

def old_run_config(**model_flags):
    """A config.yaml as the first releases saved it: no routing, no augmentation beyond
    shifts, no canvas border (pad_pixels), no weight average, no w_init_stddev, no
    distribute section."""
    cfg = train_cfg()
    model = {k: v for k, v in cfg["model"].items() if k not in ("routing", "w_init_stddev")}
    data = {k: v for k, v in cfg["data"].items() if k not in (*config.AUGMENTATION_OFF, "pad_pixels")}
    train = {k: v for k, v in cfg["train"].items() if k != "ema_decay"}
    return {"model": {**model, **model_flags}, "data": data, "train": train, "custom_op": False, "seed": 3,
            "deterministic": False, "debug": False, "run_dir": "/old/run"}


def test_an_old_run_config_migrates_to_the_schema_defaults():
    migrated = config.check(config.migrate(old_run_config(jit_routing=False)))
    assert migrated["model"]["w_init_stddev"] == 0.1 and migrated["train"]["ema_decay"] == 0.0
    assert {k: migrated["data"][k] for k in config.AUGMENTATION_OFF} == config.AUGMENTATION_OFF
    assert migrated["data"]["pad_pixels"] is None  # the canvas border was the shift
    assert migrated["distribute"] == {"strategy": "none", "devices": None, "all_reduce": "auto", "scale_lr": "none",
                                      "lr_base_batch_size": 100}
    assert migrated["seed"] == 3 and migrated["model"]["routing"] == {"algorithm": "dynamic", "backend": "tf",
                                                                      "leaky": False}


@pytest.mark.parametrize("custom_op, flags, routing, mode", [
    (False, dict(jit_routing=False), "tf", "matmul"),                      # before fused_routing existed
    (True, dict(jit_routing=False), "tf", "op"),
    (False, dict(jit_routing=True), "xla", "matmul_xla"),
    (True, dict(jit_routing=True, fused_routing=False), "xla", "op_xla"),
    (True, dict(jit_routing=False, fused_routing=None), "auto", "fused_op"),  # null: wherever it applies
    (True, dict(jit_routing=False, fused_routing=True), "auto", "fused_op"),
    (True, dict(jit_routing=False, fused_routing=False), "tf", "op"),
    (False, dict(jit_routing=False, fused_routing=None), "auto", "matmul"),
])
def test_old_routing_flags_migrate(custom_op, flags, routing, mode):
    migrated = config.migrate({**old_run_config(**flags), "custom_op": custom_op})
    assert "jit_routing" not in migrated["model"] and "fused_routing" not in migrated["model"]
    assert migrated["model"]["routing"] == routing
    assert config.router_spec(custom_op, config.check(migrated)["model"])["backend"] == mode


@pytest.mark.parametrize("custom_op, flags, routing, mode", [
    (False, dict(jit_routing=False), "tf", "matmul"),
    (True, dict(jit_routing=False), "tf", "op"),
    (False, dict(jit_routing=True), "xla", "matmul_xla"),
    (True, dict(jit_routing=True, fused_routing=False), "xla", "op_xla"),
    (True, dict(jit_routing=False, fused_routing=None), "auto", "fused_op"),
    (True, dict(jit_routing=False, fused_routing=True), "auto", "fused_op"),
    (True, dict(jit_routing=False, fused_routing=None, stop_gradient_routing=False), "auto", "op"),
    (False, dict(jit_routing=False, fused_routing=None), "auto", "matmul"),
])
def test_layer_arguments_from_before_routers_migrate_as_run_configs_do(custom_op, flags, routing, mode):
    """DigitCaps' and CapsNet's arguments of old (capsnet.routing.router_argument) are read by
    the run config's rule: the same backend for the same flags, the rounds and stop-gradient kept;
    a backend named outright (routing=<backend>) is taken as it is."""
    from capsnet.config.migrate import legacy_router_spec

    spec = legacy_router_spec(custom_op=custom_op, routing_iterations=2, **flags)
    assert spec["algorithm"] == "dynamic" and spec["backend"] == mode and spec["iterations"] == 2
    assert spec["stop_gradient"] is flags.get("stop_gradient_routing", True)
    old = {**old_run_config(**{k: v for k, v in flags.items() if k != "stop_gradient_routing"}), "custom_op": custom_op}
    old["model"]["stop_gradient_routing"] = flags.get("stop_gradient_routing", True)
    assert config.router_spec(custom_op, config.check(config.migrate(old))["model"])["backend"] == mode
    assert legacy_router_spec(routing="op_xla", routing_iterations=2)["backend"] == "op_xla"
    with pytest.raises(ValueError, match="fused_routing=true needs custom_op=true"):
        legacy_router_spec(custom_op=False, fused_routing=True)
    with pytest.raises(ValueError, match="jit_routing=true has nothing to compile"):
        legacy_router_spec(custom_op=True, fused_routing=True, jit_routing=True)


@pytest.mark.parametrize("custom_op, flags, message", [
    (False, dict(fused_routing=True), "fused_routing=true needs custom_op=true"),
    (True, dict(fused_routing=True, jit_routing=True), "jit_routing=true has nothing to compile"),
])
def test_old_invalid_routing_flags_are_refused_in_their_old_words(custom_op, flags, message):
    with pytest.raises(ConfigError, match=message):
        config.migrate({**old_run_config(**flags), "custom_op": custom_op})


def test_migrate_leaves_values_for_check_to_judge():
    old = old_run_config()
    old["custom_op"] = "yes"  # OmegaConf would read it as true; check refuses it
    migrated = config.migrate(old)
    assert migrated["custom_op"] == "yes"
    with pytest.raises(ConfigError, match="custom_op must be true or false, got 'yes'"):
        config.check(migrated)


@pytest.mark.parametrize("seed, message", [
    ("-1", "seed must be in [0, 4294967295], got -1"),
    (str(2**40), f"seed must be in [0, 4294967295], got {2**40}"),
    (str(2**32), "seed must be in [0, 4294967295], got 4294967296"),
    ("abc", "seed must be an integer, got 'abc'"),
])
def test_a_seed_that_seeding_would_refuse_is_a_config_error(seed, message):
    # The valid range is what keras.utils.set_random_seed takes: NumPy's seeding is its narrowest.
    import numpy as np
    if seed.lstrip("-").isdigit():
        with pytest.raises(ValueError):
            np.random.seed(int(seed))
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose_config("train", [f"seed={seed}"])


def test_the_seed_range_ends_are_accepted_by_seeding(tmp_path):
    import numpy as np
    for seed in (0, 2**32 - 1):
        assert compose_config("train", [f"seed={seed}", f"run_dir={tmp_path}"])["seed"] == seed
        np.random.seed(seed)  # keras.utils.set_random_seed's narrowest seeding (TensorFlow's takes any int64)
