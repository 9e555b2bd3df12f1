"""The CapsNet model: conv1 → PrimaryCaps → DigitCaps (+ routing) → lengths, decoder.

Paper configuration (the defaults): conv1 256@9×9 stride 1 ReLU on 28×28×1 →
PrimaryCaps 32 types × 8-D @9×9 stride 2 (6·6·32 = 1152 capsules) → DigitCaps
10 × 16-D, r = 3 → decoder 512-1024-784. 6,804,224 parameters without the decoder,
8,215,568 with it.
"""
import keras
import tensorflow as tf

from capsnet.layers import CONV_FORMS, Conv2D, Decoder, DigitCaps, PrimaryCaps, capsule_lengths
from capsnet.routing import DynamicRouting, Router, router_argument
from capsnet.validation import boolean, finite_float, positive_float, positive_int, positive_int_tuple

__all__ = ["CapsNet", "build_model", "INITIALIZERS"]

# CapsNet's `initializers` choices; capsnet.config's INITIALIZERS (model.initializers) is
# the same tuple (tests/test_model.py checks), kept there for checks without TensorFlow.
INITIALIZERS = ("keras", "authors")


@keras.saving.register_keras_serializable(package="capsnet")
class CapsNet(keras.Model):
    """CapsNet (Sabour, Frosst & Hinton 2017) as a Keras model.

    call(images, labels=None) returns a dict:
        "lengths":         (batch, num_classes) capsule lengths |v_j|, the class scores;
        "v_j":             (batch, num_classes, digit_caps_dim) digit capsules;
        "c_ij":            (batch, in_caps, num_classes) final coupling coefficients;
        "reconstructions": (batch, H, W, C) decoder output, only when decoder=True.
    The decoder sees only the capsule named by `labels` when they are given (training)
    and else the longest capsule, i.e. the prediction (evaluation). Two labels per
    example (batch, 2) (MultiMNIST) give two reconstructions, one from each labelled
    capsule: (batch, 2, H, W, C) (see `reconstruct`).

    images: float in [0, 1], shape (batch, *input_shape). labels: int (batch,) or (batch, 2).
    `router`: how DigitCaps routes, a capsnet.routing.Router (None: dynamic routing as in
    the paper, 3 iterations with stop-gradient, the matmul backend). Its backend only
    picks how u_hat and the routing are computed; the weights are identical, so a model
    built with any backend loads the others' weights. A config's model.routing and
    custom_op become a Router in capsnet.training.model_setup.build_capsnet.
    `w_init_stddev`: DigitCaps' W starts as N(0, w_init_stddev²) per entry (see
    `capsnet.layers.DigitCaps`).
    `initializers` (capsnet.config.INITIALIZERS): how the other weights start. "keras" (the
    default): Keras' defaults, Glorot-uniform kernels and zero biases. "authors": the
    authors' code's (research/capsules in github.com/Sarasra/models, variables.py: truncated
    normals, every bias at 0.1): Conv1 σ 0.05, PrimaryCaps σ 0.1 under their 1/32 (an
    effective σ 0.1/32 at any primary_caps_scale; at 1/32 stored as theirs), the decoder
    σ 0.1, and W a truncated normal of σ w_init_stddev (TF1's truncated_normal and Keras'
    TruncatedNormal both redraw beyond 2σ: the spread is ~0.88σ). PrimaryCaps' and
    DigitCaps' biases keep their own keys.
    `digit_caps_bias`: None (the paper), or the start value of a bias on each digit
    capsule, added to s_j in every routing iteration (the authors' code: 0.1; DigitCaps'
    bias_init); not with routing="fused_op".
    `primary_caps_conv`: how PrimaryCaps computes its strided convolution (auto, strided,
    space_to_depth: PrimaryCaps' conv_form); the same values and weights in each.
    `primary_caps_scale`, `primary_caps_bias`: PrimaryCaps' pre-activation is
    primary_caps_scale · (conv1's maps ∗ kernel) + bias, the bias starting at
    primary_caps_bias (PrimaryCaps' kernel_scale and bias_init): 1 and 0, the paper's
    convolution; the authors' code has 1/32 and 0.1. The layer starts as the unscaled one;
    the scale sets how far Adam moves it a step.
    `dtype`: a Keras dtype policy for every layer: "float32" (the default) or a mixed one,
    "mixed_bfloat16" / "mixed_float16" (train.precision): float32 weights, 16-bit compute,
    float32 where it must be (capsnet.precision); the outputs are float32 in every policy.
    """

    def __init__(self, input_shape=(28, 28, 1), num_classes=10, conv1_filters=256,
                 conv1_kernel_size=9, primary_caps_types=32, primary_caps_dim=8,
                 primary_caps_kernel_size=9, primary_caps_strides=2, digit_caps_dim=16,
                 router=None, decoder=True,
                 decoder_units=(512, 1024), w_init_stddev=0.1, initializers="keras",
                 primary_caps_conv="auto", digit_caps_bias=None, primary_caps_scale=1.0, primary_caps_bias=0.0,
                 padding="valid", **kwargs):
        super().__init__(**kwargs)
        owner = type(self).__name__
        self.image_shape = positive_int_tuple(f"{owner}: input_shape", input_shape, length=3)
        self.num_classes = positive_int(f"{owner}: num_classes", num_classes)
        self.conv1_filters = positive_int(f"{owner}: conv1_filters", conv1_filters)
        self.conv1_kernel_size = positive_int(f"{owner}: conv1_kernel_size", conv1_kernel_size)
        self.primary_caps_types = positive_int(f"{owner}: primary_caps_types", primary_caps_types)
        self.primary_caps_dim = positive_int(f"{owner}: primary_caps_dim", primary_caps_dim)
        self.primary_caps_kernel_size = positive_int(f"{owner}: primary_caps_kernel_size", primary_caps_kernel_size)
        self.primary_caps_strides = positive_int(f"{owner}: primary_caps_strides", primary_caps_strides)
        self.digit_caps_dim = positive_int(f"{owner}: digit_caps_dim", digit_caps_dim)
        self.use_decoder = boolean(f"{owner}: decoder", decoder)
        self.decoder_units = positive_int_tuple(f"{owner}: decoder_units", decoder_units)
        self.digit_caps_bias = None if digit_caps_bias is None else finite_float(f"{owner}: digit_caps_bias",
                                                                                 digit_caps_bias)
        if isinstance(router, dict):
            router = keras.saving.deserialize_keras_object(router)
        self.router = DynamicRouting() if router is None else router
        if not isinstance(self.router, Router):
            raise ValueError(f"{owner}: router must be a capsnet.routing.Router, got {router!r}")
        self.w_init_stddev = positive_float(f"{owner}: w_init_stddev", w_init_stddev)
        if initializers not in INITIALIZERS:
            raise ValueError(f"{owner}: initializers must be one of {', '.join(INITIALIZERS)}, got {initializers!r}")
        self.initializers = initializers
        authors = initializers == "authors"
        truncated, bias = keras.initializers.TruncatedNormal, keras.initializers.Constant
        # Each initializer is made where its layer is made, in the order of old: an unseeded
        # Keras initializer takes its seed from the global generator when it is created, so
        # keras mode starts every seed's weights as before model.initializers existed.
        if primary_caps_conv not in CONV_FORMS:
            raise ValueError(f"{owner}: primary_caps_conv must be one of {', '.join(CONV_FORMS)}, "
                             f"got {primary_caps_conv!r}")

        if padding not in ("valid", "same"):
            raise ValueError(f"{owner}: padding must be 'valid' or 'same', got {padding!r}")
        self.padding = padding
        # 'valid' convolutions: check now that the image survives them, so a bad config
        # fails here with the numbers rather than inside a conv op ('same' keeps any size).
        height, width = self.image_shape[:2]
        conv1_out = min(height, width) - self.conv1_kernel_size + 1
        if padding == "valid" and conv1_out < self.primary_caps_kernel_size:
            raise ValueError(
                f"{owner}: input_shape {self.image_shape} is too small for conv1_kernel_size "
                f"{self.conv1_kernel_size} followed by primary_caps_kernel_size "
                f"{self.primary_caps_kernel_size} (both unpadded): need at least "
                f"{self.conv1_kernel_size + self.primary_caps_kernel_size - 1} pixels per side")

        self.conv1 = Conv2D(
            self.conv1_filters, self.conv1_kernel_size, strides=1, padding=self.padding,
            activation="relu", name="conv1", dtype=self.dtype_policy,
            **({"kernel_initializer": truncated(stddev=0.05), "bias_initializer": bias(0.1)} if authors else {}))
        self.primary_caps = PrimaryCaps(
            num_types=self.primary_caps_types, dim=self.primary_caps_dim,
            kernel_size=self.primary_caps_kernel_size, strides=self.primary_caps_strides,
            padding=self.padding, conv_form=primary_caps_conv, kernel_scale=primary_caps_scale,
            bias_init=primary_caps_bias, name="primary_caps", dtype=self.dtype_policy,
            # The authors' start as a function: their σ 0.1 kernel under their 1/32, an
            # effective σ 0.1/32 whatever primary_caps_scale is (build divides the draw by the
            # scale: at 1/32 the stored kernel is theirs, σ 0.1). Drawn at σ 0.1 under scale 1,
            # every primary capsule would start saturated (|u| ≈ 0.99 on MNIST).
            **({"kernel_initializer": truncated(stddev=0.1 / 32)} if authors else {}))
        self.digit_caps = DigitCaps(
            num_caps=self.num_classes, dim=self.digit_caps_dim, router=self.router,
            kernel_initializer=(truncated if authors else keras.initializers.RandomNormal)(stddev=self.w_init_stddev),
            bias_init=self.digit_caps_bias, name="digit_caps", dtype=self.dtype_policy)
        self.decoder = (
            Decoder(units=self.decoder_units, output_shape=self.image_shape, name="decoder",
                    dtype=self.dtype_policy,
                    # Specifications: each decoder layer makes its own (one object, one draw).
                    **({"kernel_initializer": {"class_name": "TruncatedNormal", "config": {"stddev": 0.1}},
                        "bias_initializer": {"class_name": "Constant", "config": {"value": 0.1}}}
                       if authors else {}))
            if self.use_decoder else None)

    @property
    def in_caps(self):
        """Number of primary capsules i (1152 in the paper config)."""
        conv1_shape = self.conv1.compute_output_shape((None, *self.image_shape))
        return self.primary_caps.compute_output_shape(conv1_shape)[1]

    def build(self, input_shape):
        input_shape = tuple(input_shape)
        if len(input_shape) != 4 or tuple(input_shape[1:]) != self.image_shape:
            raise ValueError(
                f"{self.name}: expected images (batch, {', '.join(map(str, self.image_shape))}), "
                f"got shape {input_shape}")
        # Built from shapes alone (no forward pass), so count_params() is cheap.
        self.conv1.build(input_shape)
        conv1_shape = self.conv1.compute_output_shape(input_shape)
        self.primary_caps.build(conv1_shape)
        u_shape = self.primary_caps.compute_output_shape(conv1_shape)
        self.digit_caps.build(u_shape)
        if self.decoder is not None:
            v_j_shape, _ = self.digit_caps.compute_output_shape(u_shape)
            self.decoder.build(v_j_shape)
        self.input_spec = keras.layers.InputSpec(shape=(None, *self.image_shape))

    def call(self, images, labels=None, training=None):
        if not images.dtype.is_floating:
            raise ValueError(
                f"{self.name}: images must be float in [0, 1], got dtype {images.dtype.name} "
                "(scale integer pixels by 1/255 first)")
        if self.primary_caps.uses_blocks():
            # PrimaryCaps computes on stride×stride blocks of its input: conv1 delivers its
            # maps as those blocks, so no transpose of the (B, H1, W1, conv1_filters) maps
            # runs between the two, nor back in the gradient (1.07-1.11× the bfloat16 and
            # float32 jit steps at batch 512 on an H100, scripts/benchmark_train.py).
            h1, w1 = (d - self.conv1_kernel_size + 1 for d in self.image_shape[:2])
            x = self.conv1(images, output_blocks=self.primary_caps_strides)  # (B, ⌈H1/s⌉, ⌈W1/s⌉, s²·filters)
            u = self.primary_caps(x, map_size=(h1, w1))
        else:
            x = self.conv1(images)                 # (B, H1, W1, conv1_filters)
            u = self.primary_caps(x)               # (B, in_caps, primary_caps_dim)
        v_j, c_ij = self.digit_caps(u)             # (B, classes, dim), (B, in_caps, classes)
        lengths = capsule_lengths(v_j)             # (B, classes)
        outputs = {"lengths": lengths, "v_j": v_j, "c_ij": c_ij}
        if self.decoder is not None:
            if labels is None:
                # Evaluation: reconstruct from the predicted class's capsule.
                mask_labels = tf.argmax(lengths, axis=-1, output_type=tf.int32)
            else:
                labels = tf.convert_to_tensor(labels)
                if labels.shape.rank not in (1, 2) or not labels.dtype.is_integer:
                    raise ValueError(
                        f"{self.name}: labels must be integer class ids of shape (batch,), "
                        f"got {labels.dtype.name} of shape {tuple(labels.shape)} (two-digit images: (batch, 2))")
                mask_labels = labels
            outputs["reconstructions"] = self.reconstruct(v_j, mask_labels)  # (B, H, W, C) or (B, 2, H, W, C)
        return outputs

    def reconstruct(self, v_j, mask_labels):
        """The decoder's image(s) from the capsules named by `mask_labels`: (batch,) ids →
        (batch, H, W, C); (batch, 2) → (batch, 2, H, W, C), each digit from its own capsule
        alone (the other capsules, the other label's included, masked out)."""
        if mask_labels.shape.rank == 2:
            return tf.stack([self.decoder(v_j, mask_labels[:, d]) for d in range(mask_labels.shape[1])],
                            axis=1)                                  # (B, 2, H, W, C)
        return self.decoder(v_j, mask_labels)                        # (B, H, W, C)

    def compute_output_shape(self, input_shape, labels_shape=None):
        return capsule_output_shapes(self, input_shape[0])

    def get_config(self):
        return {
            **super().get_config(),
            "input_shape": list(self.image_shape),
            "num_classes": self.num_classes,
            "conv1_filters": self.conv1_filters,
            "conv1_kernel_size": self.conv1_kernel_size,
            "primary_caps_types": self.primary_caps_types,
            "primary_caps_dim": self.primary_caps_dim,
            "primary_caps_kernel_size": self.primary_caps_kernel_size,
            "primary_caps_strides": self.primary_caps_strides,
            "digit_caps_dim": self.digit_caps_dim,
            "router": keras.saving.serialize_keras_object(self.router),
            "decoder": self.use_decoder,
            "decoder_units": list(self.decoder_units),
            "w_init_stddev": self.w_init_stddev,
            "initializers": self.initializers,
            "primary_caps_conv": self.primary_caps.conv_form,
            "digit_caps_bias": self.digit_caps_bias,
            "primary_caps_scale": self.primary_caps.kernel_scale,
            "primary_caps_bias": self.primary_caps.bias_init,
            "padding": self.padding,
        }

    @classmethod
    def from_config(cls, config):
        # Configs written before routers (routing, routing_iterations, stop_gradient_routing,
        # and the read-only custom_op, jit_routing, fused_routing) load too.
        return cls(**router_argument(config, "digit_caps_bias"))


def capsule_output_shapes(model, batch):
    """The output shapes of a model with a capsule head (CapsNet; capsnet.deep.DeepCapsNet's
    capsules), from its num_classes, digit_caps_dim, in_caps, image_shape and decoder:
    "lengths" (batch, classes), "v_j" (batch, classes, digit_caps_dim), "c_ij" (batch,
    in_caps, classes), and with a decoder "reconstructions" (batch, H, W, C)."""
    shapes = {
        "lengths": (batch, model.num_classes),
        "v_j": (batch, model.num_classes, model.digit_caps_dim),
        "c_ij": (batch, model.in_caps, model.num_classes),
    }
    if model.decoder is not None:
        shapes["reconstructions"] = (batch, *model.image_shape)
    return shapes


def with_weights(model):
    """`model` (any of this package's models: it has an image_shape) with its weights created
    for its images, without a forward pass: ready for count_params(), load_weights() or a
    checkpoint restore."""
    model.build((None, *model.image_shape))
    return model


def build_model(**kwargs):
    """A CapsNet(**kwargs) with its weights created (with_weights). Also takes the dynamic
    routing's arguments of old instead of `router` (routing=<a backend>,
    routing_iterations, stop_gradient_routing: capsnet.routing.router_argument). A config's
    model section with custom_op: capsnet.training.model_setup.build_capsnet."""
    return with_weights(CapsNet(**router_argument(kwargs, "digit_caps_bias")))
