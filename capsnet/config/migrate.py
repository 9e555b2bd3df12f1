"""Old run configs: `migrate(saved)`, a run's saved config.yaml in today's shape."""
import dataclasses

from omegaconf import MISSING

from capsnet.config.checks import _default
from capsnet.config.routing import routing_from_flags
from capsnet.config.schemas import TrainAppConfig
from capsnet.errors import ConfigError


# Schema keys added after run dirs began to carry the marker (capsnet.training.run_lock.MARKER_NAME),
# which is what makes a run dir's config.yaml read strictly: a marked run written before them
# lacks them on purpose and ran as their schema defaults (no CNN baseline existed; no
# end-of-training figures were drawn). Any other key missing from a marked run's config.yaml
# means the file was edited, and reading it as today's default could evaluate another model.
ADDED_SINCE_MARKER = ("model.kind", "model.cnn_filters", "model.cnn_kernel_size", "model.cnn_dense_units",
                      "model.cnn_dropout", "model.padding", "train.figures", "model.deep_widths",
                      "data.crop_padding", "data.cutout", "train.lr_decay_floor", "data.max_pixels")


def migrate(saved):
    """A run's saved config (config.yaml, a plain dict) in today's shape, to be `check`ed:
    a key added since the run was saved takes its schema default (what the run was trained
    with: no augmentation beyond shifts, no weight average, W from N(0, 0.1²), one device),
    model.jit_routing / model.fused_routing become model.routing's backend
    (routing_from_flags); model.routing auto | tf | xla (before routers) stays, and `check`
    reads it as the section {algorithm: dynamic, backend: <it>, leaky: false}.
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

