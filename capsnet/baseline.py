"""The CNN baseline of Sabour et al. 2017, sec. 5: what CapsNet is compared against.

conv 256 → conv 256 → conv 128, each 5×5, stride 1, ReLU → FC 328 → FC 192 → dropout →
a num_classes softmax, trained with cross-entropy (capsnet.training.steps.model_losses).
The paper gives no padding or pooling, only "~35.4M parameters": 'same' padding and no
pooling give 35,445,522 on 28×28×1 (the flattened 28·28·128 maps feed FC 328: 32.9M of
them); 'valid' padding would give 13.3M and a 2×2 pooling after the last conv 10.8M.
On 40×40×1 (affNIST-size) inputs: 69,704,466. The authors' code
(Sarasra/models research/capsules) has no baseline to copy.

The model returns the dict the trainer's steps read, under CapsNet's names where the
meaning carries over: "lengths" are the class probabilities (the scores argmax predicts
from, that an ensemble averages and an export serves), "logits" what the loss takes.
No capsules, routing or decoder: no "v_j", "c_ij" or "reconstructions".
"""
import keras
import tensorflow as tf

from capsnet.model import with_weights
from capsnet.validation import float_in_range, positive_int, positive_int_tuple

__all__ = ["BaselineCNN"]


@keras.saving.register_keras_serializable(package="capsnet")
class BaselineCNN(keras.Model):
    """The paper's CNN baseline as a Keras model.

    call(images, labels=None, training=None) returns a dict:
        "logits":  (batch, num_classes) the pre-softmax scores (float32);
        "lengths": (batch, num_classes) softmax(logits), the class probabilities.
    `labels` is accepted and ignored (the trainer passes them to every model: CapsNet's
    decoder uses them). Dropout (rate `dropout`) sits between the last hidden layer and
    the softmax layer, as in the paper, and is active only with training=True.

    images: float in [0, 1], shape (batch, *input_shape).
    """

    def __init__(self, input_shape=(28, 28, 1), num_classes=10, filters=(256, 256, 128), kernel_size=5,
                 dense_units=(328, 192), dropout=0.5, **kwargs):
        super().__init__(**kwargs)
        owner = type(self).__name__
        self.image_shape = positive_int_tuple(f"{owner}: input_shape", input_shape, length=3)
        self.num_classes = positive_int(f"{owner}: num_classes", num_classes)
        self.filters = positive_int_tuple(f"{owner}: filters", filters)
        self.kernel_size = positive_int(f"{owner}: kernel_size", kernel_size)
        self.dense_units = positive_int_tuple(f"{owner}: dense_units", dense_units)
        self.dropout_rate = float_in_range(f"{owner}: dropout", dropout, 0.0, 0.99)
        # What the steps and exports ask every model (CapsNet's attributes of the same name).
        self.use_decoder = False
        policy = self.dtype_policy
        self.convs = [keras.layers.Conv2D(f, self.kernel_size, strides=1, padding="same", activation="relu",
                                          name=f"conv{i + 1}", dtype=policy) for i, f in enumerate(self.filters)]
        self.flatten = keras.layers.Flatten(name="flatten", dtype=policy)
        self.hidden = [keras.layers.Dense(u, activation="relu", name=f"fc{i + 1}", dtype=policy)
                       for i, u in enumerate(self.dense_units)]
        self.dropout = keras.layers.Dropout(self.dropout_rate, name="dropout", dtype=policy)
        self.classifier = keras.layers.Dense(self.num_classes, name="logits", dtype=policy)

    def build(self, input_shape):
        input_shape = tuple(input_shape)
        if len(input_shape) != 4 or tuple(input_shape[1:]) != self.image_shape:
            raise ValueError(f"{self.name}: expected images (batch, {', '.join(map(str, self.image_shape))}), "
                             f"got shape {input_shape}")
        # From shapes alone (no forward pass), as CapsNet.build: count_params() is cheap.
        shape = input_shape
        for conv in self.convs:
            conv.build(shape)
            shape = conv.compute_output_shape(shape)                  # (B, H, W, filters): 'same' keeps H, W
        shape = self.flatten.compute_output_shape(shape)               # (B, H·W·filters[-1])
        for dense in self.hidden:
            dense.build(shape)
            shape = dense.compute_output_shape(shape)                  # (B, units)
        self.classifier.build(shape)
        self.input_spec = keras.layers.InputSpec(shape=(None, *self.image_shape))

    def call(self, images, labels=None, training=None):
        if not images.dtype.is_floating:
            raise ValueError(f"{self.name}: images must be float in [0, 1], got dtype {images.dtype.name} "
                             "(scale integer pixels by 1/255 first)")
        x = images
        for conv in self.convs:
            x = conv(x)                                                # (B, H, W, filters)
        x = self.flatten(x)                                            # (B, H·W·filters[-1])
        for dense in self.hidden:
            x = dense(x)                                               # (B, units)
        x = self.dropout(x, training=training)
        # float32 under a mixed policy: the softmax and the cross-entropy need its range.
        logits = tf.cast(self.classifier(x), tf.float32)              # (B, classes)
        return {"logits": logits, "lengths": tf.nn.softmax(logits, axis=-1)}

    def compute_output_shape(self, input_shape, labels_shape=None):
        return {"logits": (input_shape[0], self.num_classes), "lengths": (input_shape[0], self.num_classes)}

    def get_config(self):
        return {
            **super().get_config(),
            "input_shape": list(self.image_shape),
            "num_classes": self.num_classes,
            "filters": list(self.filters),
            "kernel_size": self.kernel_size,
            "dense_units": list(self.dense_units),
            "dropout": self.dropout_rate,
        }


def build_baseline(**kwargs):
    """A BaselineCNN(**kwargs) with its weights created (with_weights), as build_model."""
    return with_weights(BaselineCNN(**kwargs))
