"""Typed configs: one dataclass schema per config group, and every value check in one place.

The YAML files under configs/ extend these schemas (Hydra structured configs: each group
file's defaults list starts with `- schema`, train.yaml's with `- train_schema`), so
OmegaConf rejects an unknown key or a value of the wrong type while Hydra composes the
config, before any of our code runs. What a type cannot say (a range, a choice, a rule
between keys) is checked beside each schema, by the `check` of its fields
(`field(..., metadata={"check": ...})`) and its section's rule (`_SECTION_RULES`), all
reached through one entry point:

    check(cfg)            a plain dict shaped like configs/train.yaml → the checked dict
                          (ConfigError naming the key: the one line users see)
    check_eval(cfg)       the same for configs/eval.yaml
    migrate(saved)        a run's saved config.yaml → today's shape (keys added since at the
                          schema default it was trained with; model.jit_routing and
                          model.fused_routing → model.routing)
    routing_mode(custom_op, model_cfg)   the one place that decides how DigitCaps routes
    compose(name, overrides)             the real config as a plain dict (tests, scripts)
    explain(exc)          a Hydra/OmegaConf type error → today's one-line wording

Routing. `custom_op` (top level, true | false) stays the user's switch: it picks the capsule
prediction, the compiled op or a TensorFlow matmul. `model.routing` picks how the routing
iterations run: auto | tf | xla. Every one of the 2 × 3 combinations is valid; they give
the five ways DigitCaps can run (ROUTING_MODES, what the layer takes):

    custom_op  model.routing              mode         prediction      routing
    false      auto, tf                   matmul       matmul          TF ops
    false      xla                        matmul_xla   matmul          one XLA computation
    true       tf                         op           compiled op     TF ops
    true       xla                        op_xla       compiled op     one XLA computation
    true       auto (stop_gradient_routing=true)   fused_op   prediction + routing in one op
    true       auto (stop_gradient_routing=false)  op         (the fused op has only the
                                                                stop-gradient gradient)

Only train.xla=jit still rules some out (it cannot compile the op, and compiles the
routing already): checked by the train section's rule.

Schema defaults are also what a run saved before a key existed was trained with (migrate
fills them in): never change one; change the YAML value instead.

No TensorFlow here: config errors are reported before the seconds-long TensorFlow import.
"""
import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigAttributeError, OmegaConfBaseException, ValidationError

from capsnet.datasets import DATASETS, example_shape, is_overlay
from capsnet.errors import ConfigError
from capsnet.validation import (boolean, finite_float, float_in_range, integer, positive_float, positive_int,
                                positive_int_tuple)

__all__ = [
    "ModelConfig", "DataSourceConfig", "AugmentationConfig", "DataConfig", "TrainConfig", "DistributeConfig", "TrainAppConfig",
    "EvalDataConfig", "EvalAppConfig", "register", "check", "check_eval", "check_section", "migrate",
    "routing_mode", "routing_from_flags", "compose", "explain", "check_overrides", "check_augmentation",
    "ROUTING", "ROUTING_MODES", "XLA_MODES", "STRATEGIES", "ALL_REDUCE", "SCALE_LR", "AUGMENTATION_OFF",
    "SHIFT_FILLS", "WHICH", "WEIGHTS",
]

# --------------------------------------------------------------------------- choices

ROUTING = ("auto", "tf", "xla")                                        # model.routing
ROUTING_MODES = ("matmul", "matmul_xla", "op", "op_xla", "fused_op")  # what DigitCaps takes
XLA_MODES = ("none", "autocluster", "jit")                              # train.xla
STRATEGIES = ("none", "mirrored", "multi_worker")                       # distribute.strategy
ALL_REDUCE = {                                                          # distribute.all_reduce, per strategy
    "none": ("auto",),
    "mirrored": ("auto", "nccl", "one_device"),
    "multi_worker": ("auto", "nccl", "ring"),
}
SCALE_LR = ("none", "linear", "sqrt")                                   # distribute.scale_lr
SHIFT_FILLS = ("zero", "edge")                                          # data.shift_fill
WHICH = ("best", "latest")                                              # eval: which
WEIGHTS = ("raw", "ema")                                                # eval: weights


# --------------------------------------------------------------------------- field checks
# Each takes (the key as the user writes it, the value) and returns the value in its plain
# Python type, or raises ConfigError with the wording users have always seen.

def _positive_int(name, value):
    return positive_int(name, value, error=ConfigError)


def _optional_positive_int(name, value):
    return positive_int(name, value, allow_none=True, error=ConfigError)


def _positive_float(name, value):
    return positive_float(name, value, error=ConfigError)


def _finite_float(name, value):
    return finite_float(name, value, error=ConfigError)


def _boolean(name, value):
    return boolean(name, value, error=ConfigError)


def _integer(name, value):
    return integer(name, value, error=ConfigError)


def _string(name, value):
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    return value


def _optional_string(name, value):
    return None if value is None else _string(name, str(value) if hasattr(value, "__fspath__") else value)


def _one_of(choices, *, allow_none=False):
    def check_choice(name, value):
        if value is None and allow_none:
            return None
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)}"
                              f"{' (or null)' if allow_none else ''}, got {value!r}")
        return value
    return check_choice


def _in_range(low, high):
    def check_range(name, value):
        float_in_range(name, value, low, high, error=ConfigError)
        return value  # as written: an int stays an int (see AugmentationConfig)
    return check_range


def _input_shape(name, value):
    # One int is repeated (5 → [5, 5, 5]), as CapsNet reads it.
    return list(positive_int_tuple(name, value, length=3, error=ConfigError))


def _int_list(name, value):
    return list(positive_int_tuple(name, value, error=ConfigError))


def _ema_decay(name, value):
    try:
        decay = float_in_range(name, value, 0, 1)
    except ValueError:
        decay = None
    if decay is None or decay == 1:  # 1 would never move the average from the initial weights
        raise ConfigError(f"{name} must be a number in [0, 1) (0: no average; 0.999 averages over "
                          f"~1000 steps), got {value!r}")
    return decay


def _reconstruction_weight(name, value):
    value = finite_float(name, value, error=ConfigError)
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}")
    return value


def _devices(name, value):
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(d, str) and d.strip() for d in value)):
        raise ConfigError(f"{name} must be null or a non-empty list of device names like [/gpu:0, /gpu:1], "
                          f"got {value!r}")
    if len(set(value)) != len(value):
        raise ConfigError(f"{name} lists a device more than once: {list(value)}")
    return list(value)


def _dataset_name(name, value):
    return _one_of(tuple(sorted(DATASETS)))(name, value)


def _limit(name, value):
    if value is None:
        return None
    return integer(name, value, minimum=1, hint=" (null: all examples)", error=ConfigError)


def _checkpoint(name, value):
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(item, str) or hasattr(item, "__fspath__") for item in items):
        raise ConfigError(f"{name} must be a run dir or checkpoint path, or a list of them, got {value!r}")
    return value


def _eval_batch_size(name, value):
    return positive_int(name, value, allow_none=True,
                        expected="a positive integer (or null: the run's train.batch_size)", error=ConfigError)


def _eval_custom_op(name, value):
    if value is None:
        return None
    return boolean(name, value, expected="true or false (or null: as trained)", error=ConfigError)


def _eval_weights(name, value):
    if value is not None and value not in WEIGHTS:
        raise ConfigError(f"{name} must be one of {', '.join(WEIGHTS)} (or null: the run's average if it kept "
                          f"one), got {value!r}")
    return value


def _checked(default=MISSING, check=None, factory=None):
    """A schema field with its value check beside it."""
    if factory is not None:
        return field(default_factory=factory, metadata={"check": check})
    return field(default=default, metadata={"check": check})


# --------------------------------------------------------------------------- schemas
# configs/<group>/*.yaml extend these (defaults: [schema, _self_]); the comments on each
# key are in the YAML files.

@dataclass
class ModelConfig:
    """configs/model/: the arguments of capsnet.model.CapsNet, and how its routing runs."""
    # Derived from the dataset (see dataset_shape / dataset_classes below); a value given wins.
    input_shape: Any = _checked("${dataset_shape:${data.name},${data.shift_pixels}}", _input_shape)
    num_classes: int = _checked("${dataset_classes:${data.name}}", _positive_int)
    conv1_filters: int = _checked(256, _positive_int)
    conv1_kernel_size: int = _checked(9, _positive_int)
    primary_caps_types: int = _checked(32, _positive_int)
    primary_caps_dim: int = _checked(8, _positive_int)
    primary_caps_kernel_size: int = _checked(9, _positive_int)
    primary_caps_strides: int = _checked(2, _positive_int)
    digit_caps_dim: int = _checked(16, _positive_int)
    routing_iterations: int = _checked(3, _positive_int)
    stop_gradient_routing: bool = _checked(True, _boolean)
    routing: str = _checked("auto", _one_of(ROUTING))
    decoder: bool = _checked(True, _boolean)
    decoder_units: List[int] = _checked(check=_int_list, factory=lambda: [512, 1024])
    w_init_stddev: float = _checked(0.1, _positive_float)


@dataclass
class DataSourceConfig:
    """configs/data/: which dataset, where, how much of it, and its shifts."""
    name: str = _checked("mnist", _dataset_name)
    dir: Optional[str] = _checked(None, _optional_string)
    limit_train: Optional[int] = _checked(None, _limit)
    limit_test: Optional[int] = _checked(None, _limit)
    shift_pixels: int = _checked(2, _integer)  # its range is the image's: checked by the data pipeline


@dataclass
class AugmentationConfig:
    """configs/augmentation/ (mounted in `data`: data.flip, ...): training augmentation
    beyond data.shift_pixels. The defaults are off: the first release's pipeline.

    The four numbers are typed Any, checked by _in_range (a real number in its range, no
    bool): a float field would store `rotate_degrees: 0` as 0.0, and run configs and a
    refused resume's differences ("data.rotate_degrees: 0 -> 5") show them as written."""
    flip: bool = _checked(False, _boolean)
    rotate_degrees: Any = _checked(0.0, _in_range(0, 180))
    zoom: Any = _checked(0.0, _in_range(0, 0.5))
    elastic_alpha: Any = _checked(0.0, _in_range(0, 100))
    elastic_sigma: Any = _checked(4.0, _in_range(0.5, 10))
    shift_fill: str = _checked("zero", _one_of(SHIFT_FILLS))


@dataclass
class DataConfig(AugmentationConfig, DataSourceConfig):
    """The `data` section: configs/data/ (DataSourceConfig's keys) and, merged into it,
    configs/augmentation/ (AugmentationConfig's). The schema of both groups' files: the
    augmentation files name none (a DataConfig of defaults would reset the dataset's keys),
    the section they are merged into is a DataConfig."""


@dataclass
class TrainConfig:
    """configs/train/: optimisation, losses, checkpoints, logging."""
    epochs: int = _checked(50, _positive_int)
    batch_size: int = _checked(100, _positive_int)
    learning_rate: float = _checked(0.001, _positive_float)
    lr_decay_rate: float = _checked(0.9, _positive_float)
    lr_decay_steps: Optional[int] = _checked(None, _optional_positive_int)
    lr_staircase: bool = _checked(False, _boolean)
    xla: str = _checked("none", _one_of(XLA_MODES))
    m_plus: float = _checked(0.9, _finite_float)
    m_minus: float = _checked(0.1, _finite_float)
    lambda_: float = _checked(0.5, _finite_float)
    reconstruction_weight: float = _checked(0.0005, _reconstruction_weight)
    ema_decay: float = _checked(0.0, _ema_decay)
    keep_checkpoints: int = _checked(3, _positive_int)
    log_every_steps: int = _checked(50, _positive_int)
    steps_per_execution: int = _checked(50, _positive_int)
    num_images: int = _checked(8, _positive_int)
    histogram_examples: int = _checked(100, _positive_int)
    progress_bar: bool = _checked(True, _boolean)


@dataclass
class DistributeConfig:
    """configs/distribute/: one device, or the replicas of tf.distribute. The defaults are
    one device (what a run saved before distribute existed trained on)."""
    strategy: str = _checked("none", _one_of(STRATEGIES))
    devices: Optional[List[str]] = _checked(None, _devices)
    all_reduce: str = _checked("auto", _string)  # its choices depend on the strategy: _distribute_rule
    scale_lr: str = _checked("none", _one_of(SCALE_LR))
    lr_base_batch_size: int = _checked(100, _positive_int)


@dataclass
class TrainAppConfig:
    """configs/train.yaml: what train.py composes and capsnet.training.train receives."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distribute: DistributeConfig = field(default_factory=DistributeConfig)
    custom_op: bool = _checked(False, _boolean)
    seed: int = _checked(0, _integer)
    deterministic: bool = _checked(False, _boolean)
    debug: bool = _checked(False, _boolean)
    run_dir: Optional[str] = _checked(None, _optional_string)


@dataclass
class EvalDataConfig:
    """configs/eval.yaml's data: which test split (null = as in the run's config)."""
    name: Optional[str] = _checked(None, lambda n, v: None if v is None else _dataset_name(n, v))
    dir: Optional[str] = _checked(None, _optional_string)
    limit_test: Optional[int] = _checked(None, _limit)


@dataclass
class EvalAppConfig:
    """configs/eval.yaml: what evaluate.py composes."""
    checkpoint: Any = _checked(MISSING, _checkpoint)
    which: str = _checked("best", _one_of(WHICH))
    custom_op: Optional[bool] = _checked(None, _eval_custom_op)
    batch_size: Optional[int] = _checked(None, _eval_batch_size)
    weights: Optional[str] = _checked(None, _eval_weights)
    output: Optional[str] = _checked(None, _optional_string)
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    debug: bool = _checked(False, _boolean)


# Schema of each config group (configs/<group>/*.yaml start with `defaults: [schema, _self_]`).
GROUP_SCHEMAS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "distribute": DistributeConfig}
APP_SCHEMAS = {"train_schema": TrainAppConfig, "eval_schema": EvalAppConfig}
AUGMENTATION_OFF = {f.name: f.default for f in dataclasses.fields(AugmentationConfig)}


# --------------------------------------------------------------------------- derived values

def dataset_shape(name, shift_pixels):
    """model.input_shape of dataset `name`: its images' (H, W, C), or MultiMNIST's canvas
    (28 + 2·shift_pixels). Registered as the `dataset_shape` resolver."""
    spec = DATASETS.get(name)
    if spec is None:
        _dataset_name("data.name", name)  # raises, naming the known ones
    shift = integer("data.shift_pixels", shift_pixels, minimum=0, error=ConfigError)
    return list(example_shape(name, spec.image_shape, shift))


def dataset_classes(name):
    """model.num_classes of dataset `name`. Registered as the `dataset_classes` resolver."""
    if name not in DATASETS:
        _dataset_name("data.name", name)
    return DATASETS[name].num_classes


# --------------------------------------------------------------------------- routing

def routing_mode(custom_op, model_cfg):
    """How DigitCaps runs (one of ROUTING_MODES) for `custom_op` and a model section's
    `routing` (auto | tf | xla) and `stop_gradient_routing`. The one place that decides:
    auto is the fused prediction + routing op wherever it applies (custom_op=true with
    stop-gradient routing, the gradient the op implements), the fastest setting
    (docs/benchmarks.md), and TF routing otherwise."""
    custom_op = _boolean("custom_op", custom_op)
    routing = _one_of(ROUTING)("model.routing", model_cfg.get("routing", "auto"))
    stop_gradient = _boolean("model.stop_gradient_routing", model_cfg.get("stop_gradient_routing", True))
    prediction = "op" if custom_op else "matmul"
    if routing == "xla":
        return prediction + "_xla"
    if routing == "auto" and custom_op and stop_gradient:
        return "fused_op"
    return prediction


def routing_from_flags(custom_op=False, jit_routing=False, fused_routing=False, stop_gradient_routing=True,
                       error=ConfigError):
    """model.routing (auto | tf | xla) of the flags that came before it (a run saved with
    model.jit_routing / model.fused_routing, a CapsNet config written with them). The
    combinations that were never valid raise `error` with the words they always had."""
    for name, value in (("custom_op", custom_op), ("jit_routing", jit_routing),
                        ("stop_gradient_routing", stop_gradient_routing)):
        boolean(name, value, error=error)
    if fused_routing is not None:
        boolean("fused_routing", fused_routing, error=error)
    if fused_routing and not (custom_op and stop_gradient_routing):
        raise error("fused_routing=true needs custom_op=true (it is the compiled op) and "
                    "stop_gradient_routing=true (its gradient is that of stop-gradient routing), got "
                    f"custom_op={str(custom_op).lower()}, stop_gradient_routing={str(stop_gradient_routing).lower()}")
    if fused_routing and jit_routing:
        raise error("jit_routing=true has nothing to compile with fused_routing=true "
                    "(the routing runs inside the fused op): set one of them to false")
    if jit_routing:
        return "xla"
    # fused_routing null was "on wherever it applies" (auto); false (or absent: before it
    # existed) was TF routing.
    return "auto" if fused_routing is None or fused_routing else "tf"


# --------------------------------------------------------------------------- checks

def check_augmentation(prefix="", **options):
    """The augmentation `options` (the keys of AUGMENTATION_OFF, all of them) checked and in
    their plain types, in AUGMENTATION_OFF's order; a bad one → ConfigError naming
    `prefix` + its key. (shift_pixels is checked by make_dataset: its range is the image's.)"""
    if set(options) != set(AUGMENTATION_OFF):
        raise TypeError(f"check_augmentation needs exactly {', '.join(AUGMENTATION_OFF)}, got {', '.join(options)}")
    checks = {f.name: f.metadata["check"] for f in dataclasses.fields(AugmentationConfig)}
    checked = {key: checks[key](prefix + key, options[key]) for key in AUGMENTATION_OFF}
    return {key: float(value) if isinstance(AUGMENTATION_OFF[key], float) else value for key, value in checked.items()}


def _margin_rule(tcfg, prefix):
    """The margin loss's own rule, checked now rather than when the first step is traced."""
    m_plus, m_minus, lambda_ = tcfg["m_plus"], tcfg["m_minus"], tcfg["lambda_"]
    where = f"{prefix}m_plus, {prefix}m_minus, {prefix}lambda_"
    if not 0 <= m_minus < m_plus <= 1:
        raise ConfigError(f"{where}: need 0 <= m_minus < m_plus <= 1 (capsule lengths lie in [0, 1)), "
                          f"got m_plus={m_plus!r}, m_minus={m_minus!r}")
    if lambda_ < 0:
        raise ConfigError(f"{where}: lambda_ must be >= 0, got {lambda_!r}")


def _distribute_rule(dcfg, prefix):
    strategy = dcfg["strategy"]
    if dcfg["all_reduce"] not in ALL_REDUCE[strategy]:
        raise ConfigError(f"{prefix}all_reduce must be one of {', '.join(ALL_REDUCE[strategy])} with "
                          f"distribute={strategy}, got {dcfg['all_reduce']!r}")
    if dcfg["devices"] is not None and strategy != "mirrored":
        raise ConfigError(f"{prefix}devices applies to distribute=mirrored only (distribute={strategy} "
                          f"{'uses one device' if strategy == 'none' else 'uses every GPU of each worker'}), "
                          f"got {dcfg['devices']!r}: set it to null")


def _data_rule(dcfg, prefix):
    """An overlay dataset (MultiMNIST) draws its digits shifted on a zero canvas: no other
    augmentation (the words of capsnet.data.make_split_dataset, which checks it again)."""
    if is_overlay(dcfg["name"]):
        on = [f"{prefix}{k}={v}" for k, v in AUGMENTATION_OFF.items() if dcfg[k] != v]
        if on:
            raise ConfigError(f"{dcfg['name']} takes no flip/rotate/zoom/elastic/shift_fill augmentation (its digits "
                              f"are shifted by data.shift_pixels on a zero canvas): set {', '.join(on)} to the "
                              "default (augmentation=none)")


_SECTION_RULES = {DataConfig: _data_rule, TrainConfig: _margin_rule, DistributeConfig: _distribute_rule}


def check_section(schema, values, prefix=""):
    """`values` (a dict) checked against `schema`: every key known, each value by its
    field's check, then the section's rule. Keys it lacks take the schema default (a
    required one, MISSING, → ConfigError). Returns the checked dict (plain types)."""
    name = prefix.rstrip(".") or "the config"
    if not isinstance(values, dict):
        raise ConfigError(f"{name} must be a section of keys, got {values!r}")
    known = [f.name for f in dataclasses.fields(schema)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        renamed = " (model.jit_routing and model.fused_routing are now model.routing: auto | tf | xla)" \
            if schema is ModelConfig and {"jit_routing", "fused_routing"} & set(unknown) else ""
        raise ConfigError(f"{name} has unknown key(s) {', '.join(unknown)} (known: {', '.join(known)}){renamed}")
    checked = {}
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(f.type):
            checked[f.name] = check_section(f.type, values.get(f.name, {}), f"{prefix}{f.name}.")
            continue
        if f.name in values:
            value = values[f.name]
        else:
            value = _default(f)
            if value is MISSING:
                raise ConfigError(f"{prefix}{f.name} is missing")
        checked[f.name] = f.metadata["check"](prefix + f.name, value)
    rule = _SECTION_RULES.get(schema)
    if rule is not None:
        rule(checked, prefix)
    return checked


def check(cfg):
    """A train config (a plain dict shaped like configs/train.yaml) checked: ConfigError
    naming the first bad key, else the checked dict with plain types (lists for sequences)
    and a section's missing keys at their schema defaults. Rules across sections: train.xla
    against custom_op and model.routing; run_dir set."""
    checked = check_section(TrainAppConfig, cfg)
    xla, routing = checked["train"]["xla"], checked["model"]["routing"]
    if xla == "jit" and checked["custom_op"]:
        # XLA has no kernel for our op: jit_compile would fail on it at the first step.
        raise ConfigError("train.xla=jit cannot compile the custom op (custom_op=true): use train.xla=autocluster, "
                          "which compiles the TensorFlow ops around it")
    if xla == "jit" and routing == "xla":
        # The whole step is one XLA computation already; the nested jit_compile function
        # aborted the process on an H200 (benchmark_train, 2026-11-21).
        raise ConfigError("model.routing=xla is redundant under train.xla=jit (the whole step is compiled, "
                          "the routing with it): set model.routing=auto")
    if not checked["run_dir"]:
        raise ConfigError("run_dir is not set (train.py sets it to Hydra's run dir; tests pass one)")
    return checked


def check_eval(cfg):
    """An eval config (shaped like configs/eval.yaml) checked, as `check` does."""
    if cfg.get("checkpoint", MISSING) in (MISSING, "???"):
        raise ConfigError("checkpoint=... is required: a run dir (outputs/<date>/<time>) or a checkpoint path "
                          "(or a list of them: an ensemble)")
    return check_section(EvalAppConfig, cfg)


def _default(f):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default if f.default is not dataclasses.MISSING else MISSING


# --------------------------------------------------------------------------- old run configs

def migrate(saved):
    """A run's saved config (config.yaml, a plain dict) in today's shape, to be `check`ed:
    a key added since the run was saved takes its schema default (what the run was trained
    with: no augmentation beyond shifts, no weight average, W from N(0, 0.1²), one device),
    and model.jit_routing / model.fused_routing become model.routing (routing_from_flags).
    Values are left as they are (no type conversion): `check` judges them."""
    if not isinstance(saved, dict):
        raise ConfigError(f"a run config must be a section of keys, got {saved!r}")
    cfg = {key: (dict(value) if isinstance(value, dict) else value) for key, value in saved.items()}
    model = cfg.get("model")
    if isinstance(model, dict) and ({"jit_routing", "fused_routing"} & set(model)):
        model["routing"] = routing_from_flags(
            custom_op=cfg.get("custom_op", False), jit_routing=model.pop("jit_routing", False),
            fused_routing=model.pop("fused_routing", False),
            stop_gradient_routing=model.get("stop_gradient_routing", True))
    for f in dataclasses.fields(TrainAppConfig):
        if dataclasses.is_dataclass(f.type):
            section = cfg.get(f.name)
            section = section if isinstance(section, dict) else {}
            cfg[f.name] = {**{g.name: _default(g) for g in dataclasses.fields(f.type)
                              if _default(g) is not MISSING and not _is_interpolation(_default(g))},
                           **section}
        elif f.name not in cfg and _default(f) is not MISSING:
            cfg[f.name] = _default(f)
    return cfg


def _is_interpolation(value):
    return isinstance(value, str) and value.startswith("${")


# --------------------------------------------------------------------------- Hydra

def register():
    """Put the schemas into Hydra's ConfigStore and the resolvers into OmegaConf (idempotent).
    Called on import of this module; train.py, evaluate.py and the tests' compose call it
    before Hydra composes configs/."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for group, schema in GROUP_SCHEMAS.items():
        store.store(group=group, name="schema", node=schema)
    for name, schema in APP_SCHEMAS.items():
        store.store(name=name, node=schema)
    OmegaConf.register_new_resolver("dataset_shape", dataset_shape, replace=True)
    OmegaConf.register_new_resolver("dataset_classes", dataset_classes, replace=True)


def _schema_field(app, dotted):
    """The dataclass field of `dotted` (e.g. "model.decoder_units") under schema `app`, or None."""
    schema, found = app, None
    for part in dotted.split("."):
        if schema is None or not dataclasses.is_dataclass(schema):
            return None
        found = {f.name: f for f in dataclasses.fields(schema)}.get(part)
        if found is None:
            return None
        schema = found.type if dataclasses.is_dataclass(found.type) else None
    return found


def _type_words(tp):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return _type_words(inner[0]) + " or null"
    if origin in (list, List):
        return f"a list of {_type_words(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, "a value")


def _parse_override(text):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides([text])[0]


def explain(exc, app=None):
    """The one-line message of a Hydra/OmegaConf error that is a value of the wrong type
    (OmegaConf's ValidationError, maybe wrapped by Hydra's "Error merging override k=v"),
    in the wording of that key's own check: `train.m_plus must be a finite number, got
    'abc'`. None for anything else. `app`: the schema composed (default: the one whose
    field the error names, train's first)."""
    cause = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__
    if isinstance(cause, ConfigAttributeError) and re.match(r"model\.(jit|fused)_routing$", str(cause.full_key)):
        return (f"{cause.full_key} is gone: model.routing (auto | tf | xla) says how the routing runs, "
                "custom_op=true|false which prediction (capsnet/config.py: routing_mode)")
    if not isinstance(cause, ValidationError):
        return None
    key, value = re.sub(r"(\[\d+\])+$", "", str(cause.full_key or "")), cause.value
    merging = re.match(r"Error merging override (.+)$", str(exc).strip())
    if merging:  # the whole value the user wrote ([32,abc] rather than its bad item)
        try:
            override = _parse_override(merging.group(1))
            if not override.is_sweep_override():
                key, value = override.key_or_group, override.value()
        except Exception:  # noqa: BLE001  (Hydra parsed it once already; keep OmegaConf's words)
            pass
    apps = [app] if app else ([EvalAppConfig] if cause.object_type in (EvalAppConfig, EvalDataConfig)
                              else [TrainAppConfig, EvalAppConfig])
    for schema in apps:
        f = _schema_field(schema, key)
        if f is None or dataclasses.is_dataclass(f.type):
            continue
        try:
            f.metadata["check"](key, value)
        except ConfigError as err:
            return str(err)
        return f"{key} must be {_type_words(f.type)}, got {value!r}"
    return None


def check_overrides(overrides, app=TrainAppConfig):
    """Command-line overrides (`key=value` strings) of schema fields, each checked by its
    field's check: OmegaConf reads `no`, `off`, `yes`, `0` and `1` as booleans, which would
    let `custom_op=no` through as false; a typo is likelier than a meant switch, so a
    switch must be written true or false, as before. Sweeps (`a=1,2`) check each value;
    interpolations and Hydra's own keys pass."""
    from hydra.core.override_parser.types import ChoiceSweep

    for text in overrides:
        override = _parse_override(text)
        if override.is_delete() or override.key_or_group.startswith("hydra"):
            continue
        f = _schema_field(app, override.key_or_group)
        if f is None or dataclasses.is_dataclass(f.type):
            continue  # a group choice (data=mnist) or an unknown key (OmegaConf's to report)
        if override.is_sweep_override():
            sweep = override.value()
            values = list(sweep.list) if isinstance(sweep, ChoiceSweep) else []
        else:
            values = [override.value()]
        for value in values:
            if isinstance(value, str) and "${" in value:
                continue
            f.metadata["check"](override.key_or_group, value)


def compose(config_name="train", overrides=()):
    """The real config (configs/), composed by Hydra with `overrides`, resolved, as a plain
    dict, as train.py/evaluate.py receive it. A value of the wrong type → ConfigError in
    its key's words (explain); an unknown key stays Hydra's ConfigCompositionException."""
    from pathlib import Path

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import ConfigCompositionException

    register()
    app = EvalAppConfig if config_name == "eval" else TrainAppConfig
    check_overrides(overrides, app)
    config_dir = Path(__file__).resolve().parents[1] / "configs"
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except (ConfigCompositionException, ValidationError) as exc:
        message = explain(exc, app)
        if message is None:
            raise
        raise ConfigError(message) from exc


register()
