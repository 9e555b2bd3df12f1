"""Routing: the one place that turns custom_op and a model section's `routing` into the
arguments of a capsnet.routing Router, its backend among them (`router_spec`), and
model.routing of the flags that came before it (`routing_from_flags`: old run configs)."""
from capsnet.config.schemas import _boolean, _routing
from capsnet.errors import ConfigError
from capsnet.validation import boolean


def router_spec(custom_op, model_cfg):
    """The keyword arguments of capsnet.routing.make_router for `custom_op` and a model
    section: model.routing's algorithm and keys, with its backend (capsnet.routing.BACKENDS)
    resolved here, the one place custom_op is read for it: custom_op picks the prediction
    (the compiled op or a TF matmul), model.routing.backend how the routing runs (auto |
    tf | xla). auto is the fused prediction + routing op wherever it applies, the fastest
    setting (docs/benchmarks.md): custom_op=true, dynamic routing with stop-gradient (the
    gradient the op implements) and no capsule bias (the op adds none), leaky or not (the
    op's `leaky` attr); elsewhere the prediction (op or matmul) and TF routing. Dynamic
    routing also takes model.routing_iterations and model.stop_gradient_routing."""
    custom_op = _boolean("custom_op", custom_op)
    routing = _routing("model.routing", model_cfg.get("routing", "auto"))
    prediction = "op" if custom_op else "matmul"
    fused_applies = (routing["algorithm"] == "dynamic"
                     and _boolean("model.stop_gradient_routing", model_cfg.get("stop_gradient_routing", True))
                     and model_cfg.get("digit_caps_bias") is None)
    if routing["backend"] == "xla":
        backend = prediction + "_xla"
    elif routing["backend"] == "auto" and custom_op and fused_applies:
        backend = "fused_op"
    else:
        backend = prediction
    spec = {**routing, "backend": backend}
    if routing["algorithm"] == "dynamic":
        spec.update(iterations=model_cfg.get("routing_iterations", 3),
                    stop_gradient=model_cfg.get("stop_gradient_routing", True))
    return spec


def routing_from_flags(custom_op=False, jit_routing=False, fused_routing=False, stop_gradient_routing=True,
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

