"""The Router interface and the registry of routing algorithms.

A Router turns input capsules u (batch, in_caps, in_dim) and the capsule layer's W
(in_caps, out_caps, out_dim, in_dim) into output capsules v_j and coupling coefficients
c_ij. capsnet.layers.DigitCaps owns W (and the weights a router asks for, `weights`) and
calls the router; the router owns the math and how it runs (`backend`).

Backends (BACKENDS, name → (prediction, routing)): how u_hat = W u is computed and how
the routing runs, the same values in each (rounding aside). A Router's backend is chosen
from the user's custom_op and model.routing.backend in one place,
capsnet.config.router_spec; here it is only read:

    matmul        u_hat by a TensorFlow matmul, routing as TF ops
    matmul_xla    u_hat by matmul, the routing compiled by XLA on its own (jit_compile)
    op            u_hat by the compiled op (capsnet.ops.capsule_prediction), TF routing
    op_xla        the compiled op, then the routing compiled by XLA on its own
    fused_op      prediction and routing in one compiled op (only routers that have one:
                  `fused`; dynamic routing, capsnet.ops.capsule_routing)

Why an explicit registry and not Hydra's `_target_`/`instantiate`: a run's saved config
names its routing by a short stable word (`algorithm: dynamic`), not a Python path that
a module move would break in every old run dir; Keras serialises the built router by
its registered name (package "capsnet") in the same way; and the error for an unknown
name lists the registered ones in one line.

Adding an algorithm: a module in capsnet/routing/ with a Router subclass decorated
`@register("name")` (its constructor arguments are its config keys; `route` its math;
`weights` any weights it needs), imported in capsnet/routing/__init__.py, a config file
configs/model/routing/<name>.yaml, and tests. capsnet/routing/self_attention.py is the
example.
"""
import inspect

import keras
import tensorflow as tf

from capsnet import ops

__all__ = ["Router", "BACKENDS", "register", "make_router", "algorithms"]

BACKENDS = {
    "matmul": ("matmul", "tf"),
    "matmul_xla": ("matmul", "xla"),
    "op": ("op", "tf"),
    "op_xla": ("op", "xla"),
    "fused_op": ("op", "fused"),
}

_REGISTRY = {}


def register(name):
    """Class decorator: the Router subclass of algorithm `name`, Keras-serialisable."""

    def decorate(cls):
        cls.algorithm = name
        _REGISTRY[name] = cls
        return keras.saving.register_keras_serializable(package="capsnet")(cls)

    return decorate


def algorithms():
    """The registered algorithm names, sorted."""
    return tuple(sorted(_REGISTRY))


def make_router(algorithm="dynamic", **params):
    """The Router of `algorithm` built with `params` (its constructor arguments);
    ValueError for an unknown name or argument. An argument the algorithm does not take
    but that is off (false or null: `leaky: false` left from dynamic routing's config
    after `model.routing.algorithm=self_attention`) is dropped."""
    if algorithm not in _REGISTRY:
        raise ValueError(f"routing algorithm must be one of {', '.join(algorithms())}, got {algorithm!r}")
    cls = _REGISTRY[algorithm]
    takes = inspect.signature(cls.__init__).parameters
    foreign = sorted(key for key, value in params.items() if key not in takes and value not in (False, None))
    if foreign:
        raise ValueError(f"routing algorithm {algorithm} takes {', '.join(k for k in takes if k != 'self')}, "
                         f"not {', '.join(foreign)}")
    return cls(**{key: value for key, value in params.items() if key in takes})


class Router:
    """How a capsule layer routes: `router(u, W, bias, weights)` → (v_j, c_ij).

    Subclasses implement `route(u_hat, bias, **weights)` (the routing math on the
    predictions u_hat (batch, in_caps, out_caps, out_dim)), and may implement
    `fused(u, W)` (backend fused_op) and `weights(in_caps, out_caps, out_dim)` (extra
    weights the layer creates and passes back). get_config() is exactly the constructor
    arguments; from_config(config) is cls(**config).
    """

    algorithm = None
    fused = None  # (u, W, bias, **weights) → (v_j, c_ij) in one compiled op, for routers that have one

    def __init__(self, backend="matmul"):
        if backend not in BACKENDS:
            raise ValueError(f"{type(self).__name__}: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if backend == "fused_op" and self.fused is None:
            raise ValueError(f"{type(self).__name__}: backend fused_op is dynamic routing's compiled op; "
                             f"{self.algorithm} routing runs on matmul, matmul_xla, op or op_xla")
        self.backend = backend
        self._route_xla = None

    def weights(self, in_caps, out_caps, out_dim):
        """{name: (shape, initializer)} of the weights the layer makes for this router."""
        return {}

    def route(self, u_hat, bias=None, **weights):
        raise NotImplementedError

    def prepare(self):
        """Load what the backend needs before the first call: the compiled op library
        (OpLibraryError, one line, if it cannot load). DigitCaps.build calls it, so the
        error comes from building the model, not from inside a Keras call(), whose
        wrapper would rewrite it into a multi-line report of the call's arguments."""
        prediction, _ = BACKENDS[self.backend]
        if prediction == "op":
            ops.load_op_library()

    def __call__(self, u, W, bias=None, weights=None):
        weights = weights or {}
        prediction, routing = BACKENDS[self.backend]
        if routing == "fused":
            return self.fused(u, W, bias, **weights)
        # The prediction is looked up per call (not once in __init__) so a test or a rebuilt
        # op library is picked up; the lookup only happens at trace time under tf.function.
        predict = ops.capsule_prediction if prediction == "op" else ops.capsule_prediction_matmul
        u_hat = predict(u, W)  # (B, in_caps, out_caps, out_dim)
        if routing == "xla":
            return self._xla_route()(u_hat, bias, **weights)
        return self.route(u_hat, bias, **weights)

    def _xla_route(self):
        # The routing as one XLA computation of its own; Python arguments are constants
        # of the trace, so each setting traces once.
        if self._route_xla is None:
            self._route_xla = tf.function(self.route, jit_compile=True)
        return self._route_xla

    def get_config(self):
        return {"backend": self.backend}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other):
        return type(self) is type(other) and self.get_config() == other.get_config()

    __hash__ = object.__hash__  # routers are compared by config, hashed by identity (tf.function caches)
