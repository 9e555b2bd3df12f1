"""Routing: the one place that turns custom_op and a model section's `routing` into the
arguments of a capsnet.routing Router, its backend among them (`router_spec`). (The flags
that came before model.routing are read by capsnet.config.migrate alone.)"""
from capsnet.config.schemas import _boolean, _routing


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
