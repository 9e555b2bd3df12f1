"""Routing: how a capsule layer turns its input capsules into output capsules.

- `functional`: the pure math (squash, routing_softmax, dynamic_routing), no layers, no
  config; re-exported here.
- `base`: the `Router` interface, the backends (BACKENDS) and the registry
  (`register`, `make_router`, `algorithms`).
- `dynamic`: DynamicRouting, routing by agreement (Sabour et al. 2017), with the fused
  compiled op as a backend and the authors' leaky routing as an option.
- `self_attention`: SelfAttentionRouting (Efficient-CapsNet, Mazzia et al. 2021).

A config's model.routing becomes a Router in one place, capsnet.config.routing.router_spec
(custom_op → backend) and capsnet.training.model_setup.build_capsnet; capsnet.layers and
capsnet.model receive the Router and import nothing from capsnet.config. A Keras config or
keyword arguments from before routers are read by `router_argument`, through
capsnet.config.migrate (the one module that reads what older versions wrote).
"""
from capsnet.config.migrate import LEGACY_ROUTER_KEYS, legacy_router_spec
from capsnet.routing.base import BACKENDS, Router, algorithms, make_router, register
from capsnet.routing.dynamic import DynamicRouting
from capsnet.routing.functional import dynamic_routing, routing_softmax, squash
from capsnet.routing.self_attention import SelfAttentionRouting

__all__ = ["squash", "routing_softmax", "dynamic_routing", "Router", "BACKENDS", "register", "make_router",
           "algorithms", "DynamicRouting", "SelfAttentionRouting", "router_argument"]


def router_argument(config, bias_key):
    """A DigitCaps or CapsNet config with `router` (a Router): a serialised router
    deserialised; a config written before routers (capsnet.config.migrate's
    LEGACY_ROUTER_KEYS) gets the Router of migrate.legacy_router_spec, its read-only flags
    dropped. `bias_key`: the config's capsule bias start (bias_init, digit_caps_bias)."""
    import keras

    config = dict(config)
    legacy = {key: config.pop(key) for key in LEGACY_ROUTER_KEYS if key in config}
    if isinstance(config.get("router"), dict):
        config["router"] = keras.saving.deserialize_keras_object(config["router"])
    elif "router" not in config and legacy:
        config["router"] = make_router(**legacy_router_spec(**legacy, bias_init=config.get(bias_key)))
    return config
