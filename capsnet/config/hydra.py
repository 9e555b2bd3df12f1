"""Hydra: the schemas in its ConfigStore and the dataset resolvers (`register`), the real
config composed (`compose`), a type error in its key's words (`explain`), and the
command line's values checked by their fields' checks (`check_overrides`)."""
import dataclasses
import re
import typing
from typing import List

from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from capsnet.config.schemas import (APP_SCHEMAS, GROUP_SCHEMAS, EvalAppConfig, EvalDataConfig, TrainAppConfig,
                                    _dataset_name)
from capsnet.config.schemas import PredictAppConfig
from capsnet import folder
from capsnet.datasets import DATASETS, example_shape, source_shape
from capsnet.errors import ConfigError
from capsnet.validation import integer

# --------------------------------------------------------------------------- derived values

def dataset_shape(name, shift_pixels, pad_pixels=None, *, _root_=None):
    """model.input_shape of dataset `name`: its images' (H, W, C), MultiMNIST's canvas
    (28 + 2·pad_pixels, pad_pixels null: shift_pixels), or for natural images (a folder,
    cifar10, ...) data.image_size and data.channels, data.crop where set. Registered as
    the `dataset_shape` resolver (OmegaConf passes the config's root as _root_)."""
    spec = DATASETS.get(name)
    if spec is None:
        _dataset_name("data.name", name)  # raises, naming the known ones
    shift = integer("data.shift_pixels", shift_pixels, minimum=0, error=ConfigError)
    if pad_pixels is not None:
        pad_pixels = integer("data.pad_pixels", pad_pixels, minimum=0, error=ConfigError)
    if spec.kind == "images":
        data = _data_section(_root_)
        return list(example_shape(name, source_shape(data), 0, crop=data.get("crop")))
    return list(example_shape(name, spec.image_shape, shift, pad_pixels))


def dataset_classes(name, *, _root_=None):
    """model.num_classes of dataset `name` (a folder: its class folders). Registered as the
    `dataset_classes` resolver."""
    if name not in DATASETS:
        _dataset_name("data.name", name)
    if DATASETS[name].num_classes is None:
        names = dataset_class_names(name, _root_=_root_)
        if names is None:
            folder.root_dir(None)  # ConfigError: data=folder needs data.dir
        return len(names)
    return DATASETS[name].num_classes


def dataset_class_names(name, *, _root_=None):
    """data.class_names of dataset `name`: a folder's class folder names (sorted), else the
    dataset's names (capsnet.datasets), or null. Registered as the `dataset_class_names`
    resolver: the run's config.yaml keeps them."""
    if name not in DATASETS:
        _dataset_name("data.name", name)
    if DATASETS[name].num_classes is None:
        data = _data_section(_root_)
        if data.get("dir") is None:
            # Hydra resolves it while merging configs/data/folder.yaml, before data.dir= is applied;
            # a run without data.dir is refused by the data rule (capsnet.tasks.images).
            return None
        return folder.class_names(data.get("dir"), data.get("test_fraction") or 0.0)
    names = DATASETS[name].class_names
    return None if names is None else list(names)


def _data_section(root):
    """The `data` section of the config root a resolver was given, as a plain dict."""
    if root is None or "data" not in root:
        return {}
    data = root["data"]
    keys = ("dir", "image_size", "channels", "crop", "test_fraction", "name")
    return {key: data.get(key) for key in keys}


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
    OmegaConf.register_new_resolver("dataset_class_names", dataset_class_names, replace=True)


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
                "custom_op=true|false which prediction (capsnet/config/routing.py: router_spec)")
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
    if app is None and cause.object_type is PredictAppConfig:
        apps = [PredictAppConfig]
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


def unknown_key(exc):
    """The one line for an override of a key the config does not have (Hydra's "Could not
    override 'train.epoch'. To append to your config use +train.epoch=1", whose `+` form
    fails in turn: the schemas are closed): the known keys closest to it
    (difflib.get_close_matches), or where to see them. None for any other error."""
    import difflib

    from omegaconf import DictConfig

    match = re.match(r"Could not override '([^']+)'", str(exc).strip())
    cause = exc.__cause__
    if not match or not isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        return None
    wanted = match.group(1)
    missing = str(getattr(cause, "full_key", "") or wanted)   # the first part of it that is not there
    parent = getattr(cause, "parent_node", None)
    known = [str(k) for k in parent.keys()] if isinstance(parent, DictConfig) else []
    prefix, _, last = missing.rpartition(".")
    rest = wanted[len(missing):] if wanted.startswith(missing) else ""
    close = [f"{prefix + '.' if prefix else ''}{k}{rest}" for k in difflib.get_close_matches(last, known, n=3)]
    if close:
        return f"unknown key {wanted}: did you mean {' or '.join(close)}?"
    return f"unknown key {wanted} (--cfg job prints the config with every key)"


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
    if config_name == "predict":
        app = PredictAppConfig
    check_overrides(overrides, app)
    config_dir = Path(__file__).resolve().parents[2] / "configs"
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except (ConfigCompositionException, ValidationError) as exc:
        message = explain(exc, app)
        if message is None:
            raise
        raise ConfigError(message) from exc

