"""CapsNet's capsule math and Keras layers (Sabour, Frosst & Hinton 2017).

- `squash(s)`: Eq. 1, the capsule non-linearity.
- `capsule_lengths(v)`: |v_j|, the class scores, with a gradient that stays finite at 0.
- `Conv2D`, `Dense`: Keras' layers with the bias added by capsnet.precision.bias_add
  (fast bias gradients under mixed precision).
- `PrimaryCaps`: a convolution whose channels are grouped into 8-D capsules u_i.
- `DigitCaps`: u_hat_j|i = W_ij u_i for every (primary i, digit j) pair, routed to the
  outputs v_j by the Router it is given (capsnet.routing: dynamic routing, with the
  fused compiled op as one backend; self-attention routing).
- `Decoder`: the reconstruction network on the masked v_j.

Names follow the paper: u (input capsules), u_hat (predictions), b_ij (routing logits),
c_ij (coupling coefficients), s_j (weighted sum), v_j (squashed output capsules).
"""
import math

import keras
import tensorflow as tf
from tensorflow.compiler.tf2xla.ops import gen_xla_ops

from capsnet.conv import conv2d_to_blocks, space_to_depth_conv2d
from capsnet.precision import bias_add, float32_math
from capsnet.routing import DynamicRouting, Router, router_argument, squash
from capsnet.validation import finite_float, positive_float, positive_int, positive_int_tuple
from capsnet.xla_context import in_xla_computation

__all__ = ["squash", "capsule_lengths", "Conv2D", "Dense", "PrimaryCaps", "DigitCaps", "Decoder", "CONV_FORMS"]

# PrimaryCaps' conv_form choices; capsnet.config's CONV_FORMS (model.primary_caps_conv) is
# the same tuple (tests/test_layers.py checks), kept there for checks without TensorFlow.
CONV_FORMS = ("auto", "strided", "space_to_depth")


def capsule_lengths(v, axis=-1, epsilon=1e-12):
    """Capsule lengths sqrt(|v|² + epsilon) along `axis`.

    tf.norm's gradient v/|v| is 0/0 at v = 0 (an all-blank image with zero biases
    gives exactly that, and one NaN poisons every weight); with epsilon the gradient
    v/sqrt(|v|² + epsilon) has norm < 1 everywhere. Epsilon stays tiny because a
    fresh paper-config model has lengths of 1e-5 to 4e-4 on MNIST (squash is
    quadratic for short vectors): squash's 1e-7 here would put a 3e-4 floor under
    them and shrink their gradients by up to 30×.
    """
    positive_float("epsilon", epsilon)
    v = float32_math(v)  # the class scores stay float32 under mixed precision
    return tf.sqrt(tf.reduce_sum(tf.square(v), axis=axis) + epsilon)


def _known_shape(shape):
    return tuple(None if d is None else int(d) for d in shape)


# --------------------------------------------------------------------------- layers

@keras.saving.register_keras_serializable(package="capsnet")
class Conv2D(keras.layers.Conv2D):
    """keras.layers.Conv2D with its bias added by capsnet.precision.bias_add: the same
    values, weights and checkpoint names; under a mixed policy its bias gradient is a
    matmul, not TensorFlow's slow 16-bit BiasAddGrad (see bias_add).

    Space-to-depth blocks (capsnet.conv; the same values and kernel variable, other
    kernels; PrimaryCaps' `conv_form` says when):
    - `call(inputs, space_to_depth=True)`: a strided "valid" convolution (equal strides)
      as a stride-1 one on the input's blocks; with `map_size=(H, W)` the inputs are
      those blocks already (an (H, W) map's, as `output_blocks` gives them).
    - `call(inputs, output_blocks=b)`: a stride-1 "valid" convolution whose output comes
      as its b×b blocks, (B, ⌈H'/b⌉, ⌈W'/b⌉, b·b·filters).

    `kernel_scale` (attribute, default 1): the output is kernel_scale · (inputs ∗ kernel)
    + bias, the kernel variable unscaled (PrimaryCaps' `kernel_scale` says why).
    """

    kernel_scale = 1.0

    def build(self, input_shape):
        super().build(input_shape)
        if self.data_format == "channels_last":
            # call() checks the channels: blocks (map_size) have b·b times a map's.
            self.input_spec = keras.layers.InputSpec(min_ndim=4)

    def call(self, inputs, space_to_depth=False, map_size=None, output_blocks=None):
        if self.data_format != "channels_last":
            return super().call(inputs)
        channels = int(self.kernel.shape[2]) * (1 if map_size is None else self.strides[0] * self.strides[1])
        if inputs.shape[-1] != channels:
            form = "" if map_size is None else f" ({self.strides[0]}x{self.strides[1]} blocks of a {tuple(map_size)} map)"
            raise ValueError(f"{self.name}: expected axis -1 of the input to have {channels} channels{form}, "
                             f"got shape {tuple(inputs.shape)}")
        repeats = 1
        # Scaling the kernel (k·k·C·filters values) costs less than scaling the output, and
        # gives the same output and the same gradient (kernel_scale times the unscaled one).
        kernel = self.kernel if self.kernel_scale == 1.0 else self.kernel * self.kernel_scale
        if output_blocks is not None:
            if self.strides != (1, 1) or self.padding != "valid":
                raise ValueError(f"{self.name}: output_blocks needs strides 1 and padding 'valid', "
                                 f"got strides {self.strides}, padding {self.padding!r}")
            outputs = conv2d_to_blocks(inputs, kernel, output_blocks)
            repeats = output_blocks * output_blocks  # channel groups of the blocks: one bias each
        elif space_to_depth:
            outputs = space_to_depth_conv2d(inputs, kernel, self.strides, map_size=map_size)
        else:
            outputs = self.convolution_op(inputs, kernel)
        if self.use_bias:
            outputs = bias_add(outputs, self.bias if repeats == 1 else tf.tile(self.bias, [repeats]))
        if self.activation is keras.activations.relu and in_xla_computation():
            return relu_one_buffer(outputs)
        return outputs if self.activation is None else self.activation(outputs)


@keras.saving.register_keras_serializable(package="capsnet")
class Dense(keras.layers.Dense):
    """keras.layers.Dense with its bias added by capsnet.precision.bias_add (see Conv2D)."""

    def call(self, inputs, training=None):
        if self.lora_enabled or self.quantization_mode is not None:
            return super().call(inputs, training=training)
        x = tf.matmul(inputs, self.kernel)
        if self.bias is not None:
            x = bias_add(x, self.bias)
        return x if self.activation is None else self.activation(x)


@keras.saving.register_keras_serializable(package="capsnet")
class PrimaryCaps(keras.layers.Layer):
    """Primary capsules: one Conv2D with num_types·dim filters, regrouped into capsules, squashed.

    The convolution has no ReLU: like the authors' reference, the pre-activation goes
    straight into squash, which already bounds the length to [0, 1).

    Capsule ordering: the conv output (batch, H', W', num_types·dim) is reshaped
    row-major, so capsule i = (h·W' + w)·num_types + t holds channels
    [t·dim, (t+1)·dim) at output position (h, w). DigitCaps' W[i] follows this order.

    `conv_form` (model.primary_caps_conv; capsnet.config.CONV_FORMS): how the strided
    convolution is computed, the same outputs and weights in each: "strided", TensorFlow's
    strided convolution; "space_to_depth", a stride-1 one on 2×2 blocks (capsnet.conv;
    padding "valid" and equal strides only); "auto", the blocks where the layer's ops go
    into an XLA computation (train.xla=jit) and the strided one elsewhere, the faster of
    the two in each place (capsnet/conv.py says why; scripts/benchmark_conv.py `--form`).

    `kernel_scale` and `bias_init` (model.primary_caps_scale, primary_caps_bias): the
    capsules' pre-activation is kernel_scale · (inputs ∗ kernel) + bias, the bias starting
    at bias_init. 1 and 0 (the defaults): the paper's convolution. The authors' code
    (conv_slim_capsule: PrimaryCaps as a capsule layer with one routing iteration, whose
    coupling coefficients are 1/num_types) has 1/32 and 0.1. The kernel starts at its
    initializer's draw divided by kernel_scale, so the layer starts as the unscaled one
    (the authors' kernel starts from a truncated N(0, 0.1²), ~0.003 after the 1/32,
    against Glorot's ~0.007 here); what the scale changes is the learning: under Adam a
    step moves the kernel by about the learning rate whatever its gradient's scale, so the
    pre-activation moves kernel_scale times as far.

    Input shape: `(batch, H, W, C)` feature maps.
    Output shape: `(batch, H'·W'·num_types, dim)` capsules u, |u_i| < 1, with
    H' = (H − kernel_size) // strides + 1 for "valid" padding (ceil(H / strides) for "same").
    """

    def __init__(self, num_types=32, dim=8, kernel_size=9, strides=2, padding="valid",
                 kernel_initializer="glorot_uniform", conv_form="auto", kernel_scale=1.0, bias_init=0.0, **kwargs):
        super().__init__(**kwargs)
        owner = type(self).__name__
        self.kernel_scale = positive_float(f"{owner}: kernel_scale", kernel_scale)
        self.bias_init = finite_float(f"{owner}: bias_init", bias_init)
        self.num_types = positive_int(f"{owner}: num_types", num_types)
        self.dim = positive_int(f"{owner}: dim", dim)
        self.kernel_size = positive_int_tuple(f"{owner}: kernel_size", kernel_size, length=2)
        self.strides = positive_int_tuple(f"{owner}: strides", strides, length=2)
        if padding not in ("valid", "same"):
            raise ValueError(f"{owner}: padding must be 'valid' or 'same', got {padding!r}")
        self.padding = padding
        if conv_form not in CONV_FORMS:
            raise ValueError(f"{owner}: conv_form must be one of {', '.join(CONV_FORMS)}, got {conv_form!r}")
        blocks_apply = padding == "valid" and self.strides[0] == self.strides[1]
        if conv_form == "space_to_depth" and not blocks_apply:
            raise ValueError(f"{owner}: conv_form 'space_to_depth' needs padding 'valid' and equal strides, "
                             f"got padding {padding!r}, strides {self.strides}")
        self.conv_form = conv_form
        # Whether call() runs the blocks: None = decided per trace (inside XLA or not).
        self._blocks = {"strided": False, "space_to_depth": True, "auto": None if blocks_apply else False}[conv_form]
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.conv = Conv2D(
            self.num_types * self.dim, self.kernel_size, strides=self.strides,
            padding=self.padding, activation=None,
            kernel_initializer=self.kernel_initializer, bias_initializer=keras.initializers.Constant(self.bias_init),
            name="conv", dtype=self.dtype_policy,
        )
        self.conv.kernel_scale = self.kernel_scale

    def _grid(self, input_shape):
        """(H', W') of the capsule grid for an input of `input_shape`, validating it."""
        shape = _known_shape(input_shape)
        if len(shape) != 4:
            raise ValueError(
                f"{self.name}: expected feature maps (batch, H, W, C), got shape {shape}")
        if any(d is None for d in shape[1:]):
            raise ValueError(
                f"{self.name}: H, W and C must be known to size the capsule grid, got shape {shape}")
        grid = []
        for size, k, s in zip(shape[1:3], self.kernel_size, self.strides):
            if self.padding == "valid":
                if size < k:
                    raise ValueError(
                        f"{self.name}: input {shape} is smaller than kernel_size "
                        f"{self.kernel_size} (padding 'valid')")
                grid.append((size - k) // s + 1)
            else:
                grid.append(-(-size // s))
        return tuple(grid)

    def build(self, input_shape):
        self._grid(input_shape)
        self.conv.build(input_shape)
        if self.kernel_scale != 1.0:
            self.conv.kernel.assign(self.conv.kernel / self.kernel_scale)  # the unscaled layer's start
        # The channels are checked by self.conv: map_size inputs have b·b times as many.
        self.input_spec = keras.layers.InputSpec(ndim=4)

    def uses_blocks(self):
        """Whether call() computes on space-to-depth blocks in the computation being built
        (conv_form, and for "auto" whether it goes into XLA): then it also takes its input
        as blocks (map_size)."""
        return in_xla_computation() if self._blocks is None else self._blocks

    def call(self, inputs, map_size=None):
        """inputs: (B, H, W, C) feature maps, or with map_size=(H, W) (only when
        uses_blocks()) their b×b space-to-depth blocks (B, ⌈H/b⌉, ⌈W/b⌉, b·b·C), b = the
        stride, as conv1 delivers them (Conv2D's output_blocks)."""
        h, w = self._grid(inputs.shape if map_size is None else (inputs.shape[0], *map_size, inputs.shape[-1]))
        in_xla = in_xla_computation()
        blocks = self.uses_blocks()
        if map_size is not None and not blocks:
            raise ValueError(f"{self.name}: map_size (blocks as input) needs the blocks form "
                             f"(conv_form {self.conv_form!r} here computes the strided convolution)")
        if blocks:
            # Under XLA on an H100 the three parts of this convolution on blocks took
            # 2.0 of the strided one's 3.1 ms (bfloat16, batch 512) and the whole step
            # 1.3-1.7× less time; on a CPU XLA's strided input gradient is 86× TensorFlow's
            # kernel and the blocks' is not. Outside XLA TensorFlow's strided kernels are
            # the faster ones (scripts/benchmark_conv.py `--form`).
            x = self.conv(inputs, space_to_depth=True, map_size=map_size)
        else:
            if self.padding == "valid" and in_xla:
                # conv_form="strided" under XLA: the rows and columns no window reaches
                # (the paper's 20×20 maps, 9×9 kernel, stride 2: the 20th) are cropped: the
                # same outputs and gradients, but then XLA hands the input gradient to
                # cuDNN's backward-data kernel; with the unused row it lowers it to a
                # forward convolution over a dilated input (6.0 of a 12.8 ms bfloat16 step
                # at batch 512 on an H100; with the crop the step took 6.2 ms). Not outside
                # XLA: the crop's slice cost 8-20% of the step there (the crop A/B).
                used_h = (h - 1) * self.strides[0] + self.kernel_size[0]
                used_w = (w - 1) * self.strides[1] + self.kernel_size[1]
                if (used_h, used_w) != tuple(inputs.shape[1:3]):
                    inputs = inputs[:, :used_h, :used_w, :]
            x = self.conv(inputs)
        u = tf.reshape(x, (-1, h * w * self.num_types, self.dim))  # x (B, H', W', types·dim) → (B, in_caps, dim)
        return squash(u)

    def compute_output_shape(self, input_shape):
        h, w = self._grid(input_shape)
        return (input_shape[0], h * w * self.num_types, self.dim)

    def get_config(self):
        return {
            **super().get_config(),
            "num_types": self.num_types,
            "dim": self.dim,
            "kernel_size": list(self.kernel_size),
            "strides": list(self.strides),
            "padding": self.padding,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "conv_form": self.conv_form,
            "kernel_scale": self.kernel_scale,
            "bias_init": self.bias_init,
        }


@tf.custom_gradient
def relu_one_buffer(x):
    """max(x, 0) inside an XLA computation, with the gradient TensorFlow's Relu has
    (dy where the output is > 0), keeping one map-sized buffer of x and relu(x), not two,
    and giving the backward pass a one-byte mask (y > 0) instead of the map itself.

    Why: with tf.nn.relu, XLA fuses a copy of the cheap max(x, 0) into the gradient's
    mask (x > 0 read from x) and so keeps both x and relu(x) alive from the forward pass
    to the backward one: for conv1 at batch 512 in float32 two 200 MiB buffers, the
    largest values at the step's memory peak (XLA's buffer assignment on an H100).
    Behind XLA's optimization barrier the mask can only read what the barrier returns, x
    dies at the max (which cuDNN then fuses into the convolution), and the values are the
    same. Measured on an H100 (XLA's buffer assignment and peak memory): float32 batch 512,
    the plan 790 -> 748 MiB and the step's peak 1,093 -> 1,054 MiB (the matmul path 1,289
    -> 1,127), in one instance.
    The mask: when the gradient read y > 0 from y, y stayed alive until the gradient's
    mask ran, next to PrimaryCaps' input gradient dy and the masked gradient (three
    map-sized buffers side by side in XLA's plan; XLA does not write the masked
    gradient over dy). With the mask computed in the forward pass (1 byte an element,
    a quarter of float32's map) y dies once PrimaryCaps' weight gradient has read it,
    so at most two maps and the mask are live at once (read from XLA's buffer
    assignment). (The barrier works on GPUs only: XLA's CPU compiler drops
    barriers before it fuses, and there it recomputes the mask from y.)
    """
    y = tf.nn.relu(x)
    y, positive = gen_xla_ops.xla_optimization_barrier([y, y > 0])

    def grad(dy):
        return tf.where(positive, dy, tf.zeros_like(dy))

    return y, grad


@keras.saving.register_keras_serializable(package="capsnet")
class DigitCaps(keras.layers.Layer):
    """Fully connected capsules, routed by a Router (capsnet.routing).

    u_hat[b, i, j] = W[i, j] · u[b, i] for every input capsule i and output capsule j,
    then the router (dynamic routing by default: b_ij zero per sample, a few rounds of
    agreement) gives v_j. The only weight is W, shape (in_caps, num_caps, dim, in_dim): no
    bias and no trainable b_ij, as in the paper (1152·10·16·8 = 1,474,560 weights). That
    layout is shared by every router backend, so weights and checkpoints work with any of
    them. With `bias_init` set, a second weight b_j (num_caps, dim), as in the authors'
    code (added to s_j by the router); a router may ask for weights of its own
    (Router.weights: self-attention's log priors), made here under their names.

    Args:
        num_caps: output capsules j (classes).
        dim: output capsule dimension.
        router: a capsnet.routing.Router (or its Keras serialisation); None: dynamic
            routing as in the paper (3 iterations, stop-gradient, matmul backend). The
            router says how u_hat and the routing are computed (its `backend`).
        kernel_initializer: initializer for W. Default N(0, 0.1²) per entry (the
            official code's; CapsNet's `w_init_stddev` sets the spread). Keras'
            fan-based initializers would read the 4-D W as a conv kernel with fans of
            ~10⁴ (W_ij's own are in_dim and dim) and make it tiny. The spread matters
            (likely because Adam moves each entry by ~lr a step whatever its size, so a
            large draw stays nearer its random start). Measured: early in training a
            larger W learns faster (small model, 150
            steps: test accuracy 0.945 with 0.1, 0.915 with 0.01), at the end of the
            paper recipe a smaller one generalises better (paper model, H200,
            docs/results.md: Fashion-MNIST 93.48% with 0.01, 93.31% with 0.03, 92.96%
            with 0.1; MNIST 99.50% with 0.03, 99.45% with 0.1).
        bias_init: None (the paper: no bias), or the value every entry of a bias b_j
            starts at, added to s_j before the squash in each routing iteration (the
            authors' code: 0.1).

    Input shape: `(batch, in_caps, in_dim)` capsules u.
    Output shape: a tuple `(v_j, c_ij)`: v_j `(batch, num_caps, dim)` and the final
    coupling coefficients c_ij `(batch, in_caps, num_caps)`.
    Under a mixed-precision policy u_hat is computed in 16 bits and the routing in
    float32; v_j and c_ij are float32 (capsnet.precision).
    """

    def __init__(self, num_caps=10, dim=16, router=None, kernel_initializer=None, bias_init=None, **kwargs):
        super().__init__(**kwargs)
        owner = type(self).__name__
        self.num_caps = positive_int(f"{owner}: num_caps", num_caps)
        self.dim = positive_int(f"{owner}: dim", dim)
        self.bias_init = None if bias_init is None else finite_float(f"{owner}: bias_init", bias_init)
        if isinstance(router, dict):
            router = keras.saving.deserialize_keras_object(router)
        self.router = DynamicRouting() if router is None else router
        if not isinstance(self.router, Router):
            raise ValueError(f"{owner}: router must be a capsnet.routing.Router, got {router!r}")
        if self.router.backend == "fused_op" and self.bias_init is not None:
            raise ValueError(f"{owner}: the fused_op backend routes without a capsule bias, got "
                             f"bias_init={bias_init!r}: use backend op or op_xla, or no bias")
        if kernel_initializer is None:
            kernel_initializer = keras.initializers.RandomNormal(stddev=0.1)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    def _in_shape(self, input_shape):
        shape = _known_shape(input_shape)
        if len(shape) != 3 or shape[1] is None or shape[2] is None:
            raise ValueError(
                f"{self.name}: expected capsules (batch, in_caps, in_dim) with known "
                f"in_caps and in_dim, got shape {shape}")
        return shape[1], shape[2]

    def build(self, input_shape):
        in_caps, in_dim = self._in_shape(input_shape)
        self.W = self.add_weight(
            name="W", shape=(in_caps, self.num_caps, self.dim, in_dim),
            initializer=self.kernel_initializer, trainable=True,
        )
        # autocast=False: under a mixed policy the bias reaches the float32 routing sums as
        # float32 (autocast would round it to 16 bits first, unlike evaluation in float32).
        self.b_j = None if self.bias_init is None else self.add_weight(
            name="b_j", shape=(self.num_caps, self.dim), initializer=keras.initializers.Constant(self.bias_init),
            trainable=True, autocast=False)
        # The router's own weights, as attributes: checkpoints name them digit_caps/<name>.
        router_weights = self.router.weights(in_caps, self.num_caps, self.dim)
        self.router_weights = tuple(router_weights)
        for name, (shape, initializer) in router_weights.items():
            setattr(self, name, self.add_weight(name=name, shape=shape, initializer=initializer, trainable=True,
                                                autocast=False))
        self.input_spec = keras.layers.InputSpec(ndim=3, axes={1: in_caps, 2: in_dim})
        self.router.prepare()

    def call(self, u):
        W = tf.cast(self.W, u.dtype)
        return self.router(u, W, self.b_j, {name: getattr(self, name) for name in self.router_weights})

    def compute_output_shape(self, input_shape):
        in_caps, _ = self._in_shape(input_shape)
        batch = input_shape[0]
        return (batch, self.num_caps, self.dim), (batch, in_caps, self.num_caps)

    def get_config(self):
        return {
            **super().get_config(),
            "num_caps": self.num_caps,
            "dim": self.dim,
            "router": keras.saving.serialize_keras_object(self.router),
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_init": self.bias_init,
        }

    @classmethod
    def from_config(cls, config):
        # Configs written before routers (routing, routing_iterations, ... keys) load too.
        return cls(**router_argument(config, "bias_init"))


@keras.saving.register_keras_serializable(package="capsnet")
class Decoder(keras.layers.Layer):
    """Reconstruction network: masked v_j → FC ReLU → … → FC sigmoid → image.

    All capsules but the one named by `mask_labels` are zeroed (the label in training,
    the prediction in evaluation), so the image must be rebuilt from one capsule's
    pose: the regulariser of the paper's Sec. 4.1.

    Args:
        units: hidden FC sizes, ReLU (paper: 512, 1024).
        output_shape: reconstructed image shape (H, W, C); the last FC has H·W·C
            sigmoid units (pixels in [0, 1]).
        kernel_initializer, bias_initializer: what every FC layer starts from, as a Keras
            identifier or serialized initializer (None: Dense's own defaults, Glorot uniform
            and zeros); each layer makes its own instance from it, since one unseeded
            instance shared by all would draw the same values in each.

    Input shape: `v_j (batch, num_caps, dim)` and `mask_labels (batch,)` int class ids
    in [0, num_caps) (an id outside that range masks every capsule out).
    Output shape: `(batch, H, W, C)`, float32 under a mixed-precision policy too.
    """

    def __init__(self, units=(512, 1024), output_shape=(28, 28, 1), kernel_initializer=None,
                 bias_initializer=None, **kwargs):
        super().__init__(**kwargs)
        owner = type(self).__name__
        self.units = positive_int_tuple(f"{owner}: units", units)
        self.image_shape = positive_int_tuple(f"{owner}: output_shape", output_shape)
        # Serialized once (an instance given is copied by its config), made anew per layer.
        self.kernel_initializer, self.bias_initializer = (
            None if i is None else keras.initializers.serialize(keras.initializers.get(i))
            for i in (kernel_initializer, bias_initializer))

        def init():
            return {name: keras.initializers.get(spec) for name, spec in
                    (("kernel_initializer", self.kernel_initializer), ("bias_initializer", self.bias_initializer))
                    if spec is not None}
        # One attribute per Dense layer (fc1, fc2, …), never a Python list: Keras 3 wraps
        # lists in its own container, which tf.train.Checkpoint's object graph cannot see,
        # so `tf.train.Checkpoint(model=...)` would silently skip every layer in it.
        for k, n in enumerate(self.units):
            setattr(self, f"fc{k + 1}", Dense(n, activation="relu", name=f"fc{k + 1}",
                                                           dtype=self.dtype_policy, **init()))
        # The output layer's sigmoid is applied in call(), in float32: under mixed precision a
        # 16-bit sigmoid would round pixels near 0 and 1 (bfloat16: steps of 1/256 below 1).
        last = f"fc{len(self.units) + 1}"
        setattr(self, last, Dense(math.prod(self.image_shape), activation=None, name=last,
                                               dtype=self.dtype_policy, **init()))

    @property
    def dense_layers(self):
        """The FC layers in order: the ReLU hidden layers, then the sigmoid output layer."""
        return [getattr(self, f"fc{k + 1}") for k in range(len(self.units) + 1)]

    def _caps_shape(self, v_j_shape):
        shape = _known_shape(v_j_shape)
        if len(shape) != 3 or shape[1] is None or shape[2] is None:
            raise ValueError(
                f"{self.name}: expected v_j (batch, num_caps, dim) with known num_caps "
                f"and dim, got shape {shape}")
        return shape[1], shape[2]

    def build(self, v_j_shape, mask_labels_shape=None):
        num_caps, dim = self._caps_shape(v_j_shape)
        width = num_caps * dim
        for layer in self.dense_layers:
            layer.build((None, width))
            width = layer.units
        self.input_spec = keras.layers.InputSpec(ndim=3, axes={1: num_caps, 2: dim})

    def call(self, v_j, mask_labels):
        num_caps, dim = self._caps_shape(v_j.shape)
        if mask_labels.shape.rank != 1 or not mask_labels.dtype.is_integer:
            raise ValueError(
                f"{self.name}: mask_labels must be integer class ids of shape (batch,), "
                f"got {mask_labels.dtype.name} of shape {tuple(mask_labels.shape)}")
        mask = tf.one_hot(mask_labels, num_caps, dtype=v_j.dtype)  # (B, num_caps)
        x = tf.reshape(v_j * mask[:, :, None], (-1, num_caps * dim))  # (B, num_caps*dim)
        for layer in self.dense_layers:
            x = layer(x)                                             # last: (B, H*W*C), logits
        x = tf.sigmoid(float32_math(x))                              # pixels in [0, 1], float32
        return tf.reshape(x, (-1, *self.image_shape))                # (B, H, W, C)

    def compute_output_shape(self, v_j_shape, mask_labels_shape=None):
        self._caps_shape(v_j_shape)
        return (v_j_shape[0], *self.image_shape)

    def get_config(self):
        return {
            **super().get_config(),
            "units": list(self.units),
            "output_shape": list(self.image_shape),
            "kernel_initializer": self.kernel_initializer,
            "bias_initializer": self.bias_initializer,
        }
