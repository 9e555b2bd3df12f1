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
capsnet.model receive the Router and import nothing from capsnet.config.
"""
from capsnet.routing.base import BACKENDS, Router, algorithms, make_router, register
from capsnet.routing.dynamic import DynamicRouting
from capsnet.routing.functional import dynamic_routing, routing_softmax, squash
from capsnet.routing.self_attention import SelfAttentionRouting

__all__ = ["squash", "routing_softmax", "dynamic_routing", "Router", "BACKENDS", "register", "make_router",
           "algorithms", "DynamicRouting", "SelfAttentionRouting", "legacy_router", "router_argument"]


def legacy_router(routing=None, routing_iterations=3, stop_gradient_routing=True, custom_op=False,
                  jit_routing=False, fused_routing=False, bias_init=None):
    """The DynamicRouting of the arguments DigitCaps and CapsNet took before routers (Keras
    configs written by them, in exports and SavedModels): a routing mode (a BACKENDS name),
    routing_iterations, stop_gradient_routing; or, older still, the flags custom_op,
    jit_routing and fused_routing (null: the fused op wherever it applies). ValueError for
    the combinations that were never valid."""
    if routing is None:
        if fused_routing and not (custom_op and stop_gradient_routing):
            raise ValueError("fused_routing=true needs custom_op=true and stop_gradient_routing=true")
        if fused_routing and jit_routing:
            raise ValueError("jit_routing=true has nothing to compile with fused_routing=true")
        prediction = "op" if custom_op else "matmul"
        fused_applies = custom_op and stop_gradient_routing and bias_init is None
        routing = (prediction + "_xla" if jit_routing
                   else "fused_op" if (fused_routing or fused_routing is None) and fused_applies else prediction)
    return DynamicRouting(iterations=routing_iterations, stop_gradient=stop_gradient_routing, backend=routing)


LEGACY_KEYS = ("routing", "routing_iterations", "stop_gradient_routing", "custom_op", "jit_routing", "fused_routing")


def router_argument(config, bias_key):
    """A DigitCaps or CapsNet config with `router` (a Router): a serialised router
    deserialised; a config written before routers (LEGACY_KEYS) gets legacy_router's, its
    read-only flags dropped. `bias_key`: the config's capsule bias start (bias_init,
    digit_caps_bias)."""
    import keras

    config = dict(config)
    legacy = {key: config.pop(key) for key in LEGACY_KEYS if key in config}
    if isinstance(config.get("router"), dict):
        config["router"] = keras.saving.deserialize_keras_object(config["router"])
    elif "router" not in config and legacy:
        config["router"] = legacy_router(**legacy, bias_init=config.get(bias_key))
    return config
