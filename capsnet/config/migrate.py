"""Old run configs: `migrate(saved)`, a run's saved config.yaml in today's shape, the one step
every saved config is read through (capsnet.training.checkpoints reads a run dir's with it) and
the one module that knows what older versions wrote: keys added since (their schema defaults,
ADDED_SINCE_MARKER), data.validation_fraction's old meaning, model.jit_routing /
model.fused_routing (model.routing's backend); and,
for the Keras configs and keyword arguments of DigitCaps and CapsNet from before routers,
`legacy_router_spec` (capsnet.routing.router_argument builds the Router of it)."""
import dataclasses

from omegaconf import MISSING

from capsnet.config.routing import router_spec
from capsnet.config.schemas import TrainAppConfig, field_default
from capsnet.errors import ConfigError
from capsnet.validation import boolean


# Schema keys added after run dirs began to carry the marker (capsnet.training.run_lock.MARKER_NAME),
# which is what makes a run dir's config.yaml read strictly: a marked run written before them
# lacks them on purpose and ran as their schema defaults (no CNN baseline existed; no
# end-of-training figures were drawn). Any other key missing from a marked run's config.yaml
# means the file was edited, and reading it as today's default could evaluate another model.
ADDED_SINCE_MARKER = ("model.kind", "model.cnn_filters", "model.cnn_kernel_size", "model.cnn_dense_units",
                      "model.cnn_dropout", "model.padding", "train.figures", "model.deep_widths",
                      "data.crop_padding", "data.cutout", "train.lr_decay_floor", "data.max_pixels",
                      "train.optimizer", "train.momentum", "data.test_fraction", "train.long_run_notice_minutes")


def migrate(saved):
    """A run's saved config (config.yaml, a plain dict) in today's shape, to be `check`ed:
    a key added since the run was saved takes its schema default (what the run was trained
    with: no augmentation beyond shifts, no weight average, W from N(0, 0.1²), one device),
    model.jit_routing / model.fused_routing become model.routing's backend
    (_routing_from_flags); data.validation_fraction of a run saved before data.test_fraction
    becomes data.test_fraction (the folder's test share it meant then); model.routing auto |
    tf | xla (before routers) stays, and `check` reads it as the section {algorithm:
    dynamic, backend: <it>, leaky: false}.
    Values are left as they are (no type conversion): `check` judges them."""
    if not isinstance(saved, dict):
        raise ConfigError(f"a run config must be a section of keys, got {saved!r}")
    cfg = {key: (dict(value) if isinstance(value, dict) else value) for key, value in saved.items()}
    data = cfg.get("data")
    if isinstance(data, dict) and "test_fraction" not in data and "validation_fraction" in data:
        # Before data.test_fraction, data.validation_fraction was a folder's test share (a run
        # then had no validation split).
        data["test_fraction"] = data.pop("validation_fraction")
    model = cfg.get("model")
    if isinstance(model, dict) and ({"jit_routing", "fused_routing"} & set(model)):
        model["routing"] = _routing_from_flags(
            custom_op=cfg.get("custom_op", False), jit_routing=model.pop("jit_routing", False),
            fused_routing=model.pop("fused_routing", False),
            stop_gradient_routing=model.get("stop_gradient_routing", True))
    for f in dataclasses.fields(TrainAppConfig):
        if dataclasses.is_dataclass(f.type):
            section = cfg.get(f.name)
            section = section if isinstance(section, dict) else {}
            cfg[f.name] = {**{g.name: field_default(g) for g in dataclasses.fields(f.type)
                              if field_default(g) is not MISSING and not _is_interpolation(field_default(g))},
                           **section}
        elif f.name not in cfg and field_default(f) is not MISSING:
            cfg[f.name] = field_default(f)
    return cfg


def _is_interpolation(value):
    return isinstance(value, str) and value.startswith("${")


def _routing_from_flags(custom_op=False, jit_routing=False, fused_routing=False, stop_gradient_routing=True,
                       error=ConfigError):
    """model.routing.backend (auto | tf | xla) of the flags that came before it (a run saved with
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


# DigitCaps' and CapsNet's routing arguments before routers (their Keras configs, and keyword
# arguments written for them): a backend name, the rounds and the stop-gradient; or, older
# still, the flags custom_op, jit_routing and fused_routing.
LEGACY_ROUTER_KEYS = ("routing", "routing_iterations", "stop_gradient_routing", "custom_op", "jit_routing",
                      "fused_routing")


def legacy_router_spec(routing=None, routing_iterations=3, stop_gradient_routing=True, custom_op=False,
                       jit_routing=False, fused_routing=False, bias_init=None):
    """capsnet.routing.make_router's arguments for LEGACY_ROUTER_KEYS (`bias_init`: the layer's
    capsule bias start): dynamic routing with `routing` as its backend; or, for the flags,
    the backend a run config of them migrates to (_routing_from_flags, then router_spec: the
    fused op wherever it applies, null fused_routing meaning auto). ValueError for the
    combinations that were never valid."""
    if routing is None:
        backend = _routing_from_flags(custom_op, jit_routing, fused_routing, stop_gradient_routing, error=ValueError)
        return router_spec(custom_op, {"routing": backend, "routing_iterations": routing_iterations,
                                       "stop_gradient_routing": stop_gradient_routing, "digit_caps_bias": bias_init})
    return {"algorithm": "dynamic", "iterations": routing_iterations, "stop_gradient": stop_gradient_routing,
            "backend": routing}
