"""A deeper capsule network for natural images (model.kind=deep_capsnet), and the same
network with a plain pooling and dense head (model.kind=deep_cnn) to measure it against.

The stem is the residual network of Page's DAWNBench CIFAR-10 entry ("How to train your
ResNet", Myrtle.ai 2018: 94% in 24 epochs), ResNet-9:

    prep    conv 3x3 w0, BN, ReLU
    layer1  conv 3x3 w1, BN, ReLU, max-pool 2 + residual (2 x conv 3x3 w1, BN, ReLU)
    layer2  conv 3x3 w2, BN, ReLU, max-pool 2
    layer3  conv 3x3 w3, BN, ReLU, max-pool 2 + residual (2 x conv 3x3 w3, BN, ReLU)

(widths w = 64, 128, 256, 512), giving an (H/8, W/8, w3) map: 4x4x512 on CIFAR-10's 32x32.

Head "capsules" (deep_capsnet): PrimaryCaps on that map (a stride-1 'same' convolution to
primary_caps_types capsules of primary_caps_dim at each of its positions, squashed: 4·4·32
= 512 capsules on CIFAR-10) → DigitCaps with the Router of model.routing and custom_op
(dynamic routing; custom_op=true the fused op) → |v_j|, trained with the margin loss;
the reconstruction decoder is optional (model.decoder, off in configs/model/deep_capsnet.yaml:
reconstructing natural images pulls the capsules towards the background's colours).
Head "dense" (deep_cnn): Page's global max-pool and a bias-free dense layer to the
classes, its logits scaled by 1/8, trained with cross-entropy: the same network, its
capsule layers replaced, so the two runs measure what the capsules cost and give.

Outputs as CapsNet's ("lengths", "v_j", "c_ij", "reconstructions" with a decoder) or as
BaselineCNN's ("logits", "lengths" = softmax), so the steps, evaluation, export, predict
and the figures serve both.
"""
import keras
import tensorflow as tf

from capsnet.layers import Decoder, DigitCaps, PrimaryCaps, capsule_lengths
from capsnet.model import capsule_output_shapes, with_weights
from capsnet.routing import DynamicRouting, Router
from capsnet.validation import boolean, positive_float, positive_int, positive_int_tuple

__all__ = ["ConvBlock", "ResidualBlock", "DeepCapsNet", "HEADS", "build_deep"]

# DeepCapsNet's `head` choices: model.kind deep_capsnet → "capsules", deep_cnn → "dense".
HEADS = ("capsules", "dense")
# BatchNormalization's moving averages: 0.9 (PyTorch's 0.1) rather than Keras' 0.99, whose
# averages lag a run of ~20 epochs' changing weights (the test pass would read stale ones).
BN_MOMENTUM = 0.9
# The dense head's logits are scaled down (Page's 0.125): cross-entropy on unscaled logits
# of a max-pooled 512-wide map trains less well in short runs.
DENSE_LOGIT_SCALE = 0.125


@keras.saving.register_keras_serializable(package="capsnet")
class ConvBlock(keras.layers.Layer):
    """conv 3x3 'same' (no bias: the batch norm's beta is its bias) → batch norm → ReLU, then a
    2x2 max-pool when `pool`.

    Input (batch, H, W, C) → (batch, H, W, filters), or (batch, ⌊H/2⌋, ⌊W/2⌋, filters) with pool."""

    def __init__(self, filters, pool=False, **kwargs):
        super().__init__(**kwargs)
        self.filters = positive_int(f"{type(self).__name__}: filters", filters)
        self.pool = boolean(f"{type(self).__name__}: pool", pool)
        policy = self.dtype_policy
        self.conv = keras.layers.Conv2D(self.filters, 3, padding="same", use_bias=False, name="conv", dtype=policy)
        self.norm = keras.layers.BatchNormalization(momentum=BN_MOMENTUM, epsilon=1e-5, name="bn", dtype=policy)

    def build(self, input_shape):
        self.conv.build(input_shape)
        self.norm.build(self.conv.compute_output_shape(input_shape))

    def call(self, x, training=None):
        x = tf.nn.relu(self.norm(self.conv(x), training=training))
        return tf.nn.max_pool2d(x, 2, 2, "VALID") if self.pool else x

    def compute_output_shape(self, input_shape):
        batch, h, w, _ = input_shape
        return (batch, h // 2, w // 2, self.filters) if self.pool else (batch, h, w, self.filters)

    def get_config(self):
        return {**super().get_config(), "filters": self.filters, "pool": self.pool}


@keras.saving.register_keras_serializable(package="capsnet")
class ResidualBlock(keras.layers.Layer):
    """x + ConvBlock(ConvBlock(x)), both of `filters` channels (the input's)."""

    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.filters = positive_int(f"{type(self).__name__}: filters", filters)
        self.first = ConvBlock(self.filters, name="conv_a", dtype=self.dtype_policy)
        self.second = ConvBlock(self.filters, name="conv_b", dtype=self.dtype_policy)

    def build(self, input_shape):
        if input_shape[-1] != self.filters:
            raise ValueError(f"{self.name}: a residual block of {self.filters} channels got an input of shape "
                             f"{tuple(input_shape)}")
        self.first.build(input_shape)
        self.second.build(input_shape)

    def call(self, x, training=None):
        return x + self.second(self.first(x, training=training), training=training)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        return {**super().get_config(), "filters": self.filters}


@keras.saving.register_keras_serializable(package="capsnet")
class DeepCapsNet(keras.Model):
    """The ResNet-9 stem (module docstring) with a capsule head (head="capsules") or Page's
    pooling and dense head (head="dense").

    call(images, labels=None, training=None) returns a dict:
      capsules: "lengths" (batch, classes) |v_j|; "v_j" (batch, classes, digit_caps_dim);
        "c_ij" (batch, in_caps, classes); "reconstructions" (batch, H, W, C) with a decoder,
        from the capsule of `labels` when given (training), else of the longest one;
      dense: "logits" (batch, classes) float32 and "lengths" = softmax(logits); `labels` unread.
    images: float (batch, *input_shape) (in [0, 1], or standardised by the data pipeline).

    widths: the four stages' channels (prep, layer1, layer2, layer3). router: DigitCaps'
    capsnet.routing.Router (None: dynamic routing, 3 iterations, the matmul backend).
    primary_caps_kernel_size: PrimaryCaps' square kernel, stride 1, 'same' padding. The
    input must be at least 8 pixels a side (three 2x2 max-pools).
    """

    def __init__(self, input_shape=(32, 32, 3), num_classes=10, widths=(64, 128, 256, 512), head="capsules",
                 primary_caps_types=32, primary_caps_dim=8, primary_caps_kernel_size=1, digit_caps_dim=16,
                 router=None, decoder=False, decoder_units=(512, 1024), w_init_stddev=0.1, **kwargs):
        super().__init__(**kwargs)
        owner = type(self).__name__
        self.image_shape = positive_int_tuple(f"{owner}: input_shape", input_shape, length=3)
        if min(self.image_shape[:2]) < 8:
            raise ValueError(f"{owner}: input_shape {list(self.image_shape)} is too small for three 2x2 max-pools: "
                             "need at least 8 pixels a side")
        self.num_classes = positive_int(f"{owner}: num_classes", num_classes)
        self.widths = positive_int_tuple(f"{owner}: widths", widths, length=4)
        if head not in HEADS:
            raise ValueError(f"{owner}: head must be one of {', '.join(HEADS)}, got {head!r}")
        self.head = head
        self.primary_caps_types = positive_int(f"{owner}: primary_caps_types", primary_caps_types)
        self.primary_caps_dim = positive_int(f"{owner}: primary_caps_dim", primary_caps_dim)
        self.primary_caps_kernel_size = positive_int(f"{owner}: primary_caps_kernel_size", primary_caps_kernel_size)
        self.digit_caps_dim = positive_int(f"{owner}: digit_caps_dim", digit_caps_dim)
        self.use_decoder = boolean(f"{owner}: decoder", decoder)
        self.decoder_units = positive_int_tuple(f"{owner}: decoder_units", decoder_units)
        self.w_init_stddev = positive_float(f"{owner}: w_init_stddev", w_init_stddev)
        if isinstance(router, dict):
            router = keras.saving.deserialize_keras_object(router)
        self.router = DynamicRouting() if router is None else router
        if not isinstance(self.router, Router):
            raise ValueError(f"{owner}: router must be a capsnet.routing.Router, got {router!r}")
        if head == "dense" and self.use_decoder:
            raise ValueError(f"{owner}: the dense head has no capsules to reconstruct from: decoder must be false")

        policy = self.dtype_policy
        w0, w1, w2, w3 = self.widths
        self.stem = [ConvBlock(w0, name="prep", dtype=policy),
                     ConvBlock(w1, pool=True, name="layer1", dtype=policy),
                     ResidualBlock(w1, name="res1", dtype=policy),
                     ConvBlock(w2, pool=True, name="layer2", dtype=policy),
                     ConvBlock(w3, pool=True, name="layer3", dtype=policy),
                     ResidualBlock(w3, name="res3", dtype=policy)]
        self.decoder = None
        if head == "capsules":
            # conv_form strided: the blocks form is for strided 'valid' convolutions.
            self.primary_caps = PrimaryCaps(
                num_types=self.primary_caps_types, dim=self.primary_caps_dim,
                kernel_size=self.primary_caps_kernel_size, strides=1, padding="same", conv_form="strided",
                name="primary_caps", dtype=policy)
            self.digit_caps = DigitCaps(
                num_caps=self.num_classes, dim=self.digit_caps_dim, router=self.router,
                kernel_initializer=keras.initializers.RandomNormal(stddev=self.w_init_stddev),
                name="digit_caps", dtype=policy)
            if self.use_decoder:
                self.decoder = Decoder(units=self.decoder_units, output_shape=self.image_shape, name="decoder",
                                       dtype=policy)
        else:
            self.classifier = keras.layers.Dense(self.num_classes, use_bias=False, name="logits", dtype=policy)

    def _stem_shape(self, input_shape):
        shape = tuple(input_shape)
        for layer in self.stem:
            shape = layer.compute_output_shape(shape)
        return shape                                                   # (B, H/8, W/8, w3)

    def primary_grid(self):
        """(H', W', types): where each primary capsule sits (PrimaryCaps' order: i = (h·W' + w)·types + t)."""
        _, h, w, _ = self._stem_shape((None, *self.image_shape))
        return h, w, self.primary_caps_types

    @property
    def in_caps(self):
        h, w, types = self.primary_grid()
        return h * w * types

    def build(self, input_shape):
        input_shape = tuple(input_shape)
        if len(input_shape) != 4 or tuple(input_shape[1:]) != self.image_shape:
            raise ValueError(f"{self.name}: expected images (batch, {', '.join(map(str, self.image_shape))}), "
                             f"got shape {input_shape}")
        shape = input_shape
        for layer in self.stem:
            layer.build(shape)
            shape = layer.compute_output_shape(shape)
        if self.head == "capsules":
            self.primary_caps.build(shape)
            u_shape = self.primary_caps.compute_output_shape(shape)
            self.digit_caps.build(u_shape)
            if self.decoder is not None:
                self.decoder.build(self.digit_caps.compute_output_shape(u_shape)[0])
        else:
            self.classifier.build((shape[0], shape[-1]))
        self.input_spec = keras.layers.InputSpec(shape=(None, *self.image_shape))

    def call(self, images, labels=None, training=None):
        if not images.dtype.is_floating:
            raise ValueError(f"{self.name}: images must be float in [0, 1], got dtype {images.dtype.name} "
                             "(scale integer pixels by 1/255 first)")
        x = images
        for layer in self.stem:
            x = layer(x, training=training)                            # ... → (B, H/8, W/8, w3)
        if self.head == "dense":
            pooled = tf.reduce_max(x, axis=[1, 2])                     # (B, w3)
            # float32: the softmax and the cross-entropy need its range under a mixed policy.
            logits = tf.cast(self.classifier(pooled), tf.float32) * DENSE_LOGIT_SCALE  # (B, classes)
            return {"logits": logits, "lengths": tf.nn.softmax(logits, axis=-1)}
        u = self.primary_caps(x)                                       # (B, in_caps, primary_caps_dim)
        v_j, c_ij = self.digit_caps(u)                                 # (B, classes, dim), (B, in_caps, classes)
        lengths = capsule_lengths(v_j)                                 # (B, classes)
        outputs = {"lengths": lengths, "v_j": v_j, "c_ij": c_ij}
        if self.decoder is not None:
            if labels is None:
                mask_labels = tf.argmax(lengths, axis=-1, output_type=tf.int32)  # evaluation: the prediction's
            else:
                mask_labels = tf.convert_to_tensor(labels)
                if mask_labels.shape.rank != 1 or not mask_labels.dtype.is_integer:
                    raise ValueError(f"{self.name}: labels must be integer class ids of shape (batch,), got "
                                     f"{mask_labels.dtype.name} of shape {tuple(mask_labels.shape)}")
            outputs["reconstructions"] = self.reconstruct(v_j, mask_labels)
        return outputs

    def reconstruct(self, v_j, mask_labels):
        """The decoder's image (batch, H, W, C) from the capsules named by `mask_labels` (batch,)."""
        return self.decoder(v_j, mask_labels)

    def compute_output_shape(self, input_shape, labels_shape=None):
        batch = input_shape[0]
        if self.head == "dense":
            return {"logits": (batch, self.num_classes), "lengths": (batch, self.num_classes)}
        return capsule_output_shapes(self, batch)

    def get_config(self):
        return {
            **super().get_config(),
            "input_shape": list(self.image_shape),
            "num_classes": self.num_classes,
            "widths": list(self.widths),
            "head": self.head,
            "primary_caps_types": self.primary_caps_types,
            "primary_caps_dim": self.primary_caps_dim,
            "primary_caps_kernel_size": self.primary_caps_kernel_size,
            "digit_caps_dim": self.digit_caps_dim,
            "router": keras.saving.serialize_keras_object(self.router),
            "decoder": self.use_decoder,
            "decoder_units": list(self.decoder_units),
            "w_init_stddev": self.w_init_stddev,
        }


def build_deep(**kwargs):
    """A DeepCapsNet(**kwargs) with its weights created (with_weights), as build_model."""
    return with_weights(DeepCapsNet(**kwargs))
