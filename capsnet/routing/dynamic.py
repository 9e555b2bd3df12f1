"""Dynamic routing by agreement (Sabour et al. 2017, Procedure 1) as a Router.

`DynamicRouting(iterations, stop_gradient, leaky, backend)`: the math is
capsnet.routing.functional.dynamic_routing (its docstring: stop_gradient, the bias, the
leaky "none of the above" softmax); backend fused_op runs prediction and every iteration
in the compiled op capsnet.ops.capsule_routing, leaky or not (stop-gradient routing only
and no bias: the op implements neither of those). Config: configs/model/routing/dynamic.yaml.
"""
from capsnet import ops
from capsnet.precision import float32_math
from capsnet.routing.base import Router, register
from capsnet.routing.functional import dynamic_routing, squash
from capsnet.validation import boolean, positive_int

__all__ = ["DynamicRouting"]


@register("dynamic")
class DynamicRouting(Router):
    """Routing by agreement: `iterations` rounds r ≥ 1 (the paper: 3); `stop_gradient`:
    the inner rounds see stop_gradient(u_hat) (why: dynamic_routing); `leaky`: the
    authors' CIFAR-10 "none of the above" softmax; `backend`: capsnet.routing.BACKENDS."""

    def __init__(self, iterations=3, stop_gradient=True, leaky=False, backend="matmul"):
        owner = type(self).__name__
        self.iterations = positive_int(f"{owner}: iterations", iterations)
        self.stop_gradient = boolean(f"{owner}: stop_gradient", stop_gradient)
        self.leaky = boolean(f"{owner}: leaky", leaky)
        super().__init__(backend)
        if backend == "fused_op" and not self.stop_gradient:
            raise ValueError(f"{owner}: backend fused_op needs stop_gradient=True (the op's gradient is that of "
                             "stop-gradient routing), got stop_gradient=False")

    def route(self, u_hat, bias=None):
        if self.leaky:
            return dynamic_routing(u_hat, self.iterations, self.stop_gradient, bias, leaky=True)
        return dynamic_routing(u_hat, self.iterations, self.stop_gradient, bias)

    def fused(self, u, W, bias=None):
        if bias is not None:
            raise ValueError("DynamicRouting: backend fused_op routes without a capsule bias: use backend op or op_xla")
        # s_j (B, num_caps, dim) before the last squash, c_ij (B, in_caps, num_caps);
        # 16-bit under mixed precision (the op sums in float32), v_j and c_ij float32.
        s_j, c_ij = ops.capsule_routing(u, W, self.iterations, leaky=self.leaky)
        return squash(float32_math(s_j)), float32_math(c_ij)

    def get_config(self):
        return {"iterations": self.iterations, "stop_gradient": self.stop_gradient, "leaky": self.leaky,
                **super().get_config()}
