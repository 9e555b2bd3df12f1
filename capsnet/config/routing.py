"""Routing: the one place that decides how DigitCaps routes (`routing_mode`), and the
model.routing of the flags that came before it (`routing_from_flags`: old run configs,
old Keras model configs)."""
from capsnet.config.schemas import ROUTING, _boolean, _one_of
from capsnet.errors import ConfigError
from capsnet.validation import boolean


def routing_mode(custom_op, model_cfg):
    """How DigitCaps runs (one of ROUTING_MODES) for `custom_op` and a model section's
    `routing` (auto | tf | xla), `stop_gradient_routing` and `digit_caps_bias`. The one
    place that decides: auto is the fused prediction + routing op wherever it applies
    (custom_op=true with stop-gradient routing, the gradient the op implements, and no
    capsule bias, which the op does not add), the fastest setting (docs/benchmarks.md),
    and TF routing otherwise."""
    custom_op = _boolean("custom_op", custom_op)
    routing = _one_of(ROUTING)("model.routing", model_cfg.get("routing", "auto"))
    stop_gradient = _boolean("model.stop_gradient_routing", model_cfg.get("stop_gradient_routing", True))
    bias = model_cfg.get("digit_caps_bias")
    prediction = "op" if custom_op else "matmul"
    if routing == "xla":
        return prediction + "_xla"
    if routing == "auto" and custom_op and stop_gradient and bias is None:
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

