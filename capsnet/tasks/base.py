"""The Task interface (capsnet.tasks) and the Split it loads."""
import dataclasses

import tensorflow as tf

from capsnet import folder
from capsnet.datasets import DATASETS, spec_class_names
from capsnet.errors import ConfigError
from capsnet.scoring import score
from capsnet.tasks.labels import ONE_LABEL
from capsnet.tasks.holdout import validation_indices


@dataclasses.dataclass
class Split:
    """One loaded split: `labels` int64 (N,) in NumPy always; `images` uint8 (N, H, W, C)
    in NumPy where the split is held in memory, else None (a streamed folder: `source`
    is then what the task streams from); `shape` the stored images' (H, W, C); `origin`
    where it came from, in words."""
    labels: object
    images: object = None
    shape: tuple = None
    origin: str = ""
    source: object = None

    def __len__(self):
        return len(self.labels)

    def subset(self, indices, origin):
        """The examples at `indices` of an in-memory split, as a Split of their own."""
        return dataclasses.replace(self, labels=self.labels[indices], images=self.images[indices], origin=origin)


class Task:
    """What one dataset kind means to the trainer. A subclass per kind (KINDS); an instance
    per data section (`data_cfg`, the checked `data` dict)."""
    kind = None
    # How its examples are labelled (capsnet.tasks.labels): the compiled steps, the evaluation,
    # the export and predict ask it.
    label_format = ONE_LABEL

    def __init__(self, data_cfg):
        self.cfg = dict(data_cfg)
        self.name = self.cfg["name"]
        self.spec = DATASETS[self.name]

    @property
    def num_classes(self):
        return self.spec.num_classes

    def class_names(self, num_classes=None):
        """The class names (a tuple) or None (classes are named by their index)."""
        return spec_class_names(self.name, num_classes or self.num_classes)

    @property
    def dark_background(self):
        return self.spec.dark_background

    def example_shape(self, source_shape):
        """The (H, W, C) the model sees for stored images of `source_shape`."""
        return tuple(source_shape)

    # ----------------------------------------------------------------- data (TensorFlow)
    def load(self, split, *, limit=None):
        """One split as a Split (limit: its first N examples)."""
        raise NotImplementedError

    def load_train_validation(self, *, limit=None, fraction=0.0):
        """(train Split, validation Split or None): the training split (limit: its first N
        examples), `fraction` of it held out as the validation split where fraction > 0
        (capsnet.tasks.holdout: per class, a fixed seed; the two disjoint)."""
        train = self.load("train", limit=limit)
        if not fraction:
            return train, None
        kept, held = validation_indices(train.labels, fraction, where=f"{self.name}'s training split")
        origin = train.origin or f"{self.name} train"
        return (train.subset(kept, f"{origin}, less the validation split"),
                train.subset(held, f"{origin}, validation_fraction={fraction}"))

    def dataset(self, data, *, batch_size, training, seed=0, epoch=0, drop_remainder=False):
        """One epoch of batches of the Split `data`: (images float32 (B, H, W, C), labels
        int32 (B,) or (B, 2)[, digits]); training shuffles and augments, keyed by (seed, epoch)."""
        raise NotImplementedError

    def check(self, data, model, split):
        """The Split fits the built `model` (ConfigError, one line): its examples' shape is
        model.input_shape and its labels lie in [0, num_classes)."""
        check_labels(data.labels, data.images, model=model, split=f"{self.name} {split}",
                     image_shape=self.example_shape(data.shape))

    def file_image(self, data, image_shape):
        """float32 (H, W, C) in [0, 1]: the model's input (`image_shape`) of an image file's
        bytes `data`, for predict. Default (the MNIST family, read from arrays, not files):
        the image-file decoding of the folder pipeline (capsnet.folder.decode_image_bytes:
        grey or RGB, the shorter side resized, the centre cropped square) at the model's size,
        scaled by 1/255 as every pipeline scales."""
        return default_file_image(data, image_shape)

    def for_test_pairs(self, given, run_border):
        """(task, test_pairs): the task that evaluate scores with, given its data.shift_pixels /
        data.pad_pixels (`given`, those set) over a run whose canvas border was `run_border`,
        and the test pairs its report names (None: the test images are scored as they are).
        Only MultiMNIST makes pairs: the others refuse them (ConfigError, one line)."""
        if given:
            raise ConfigError(f"data.shift_pixels / data.pad_pixels make MultiMNIST's test pairs: the {self.name} "
                              "test images are scored as they are (set them to null)")
        return self, None

    def serving_images(self, images):
        """What the model sees of float32 images in [0, 1] given to the export or predict
        (the pipeline's deterministic test-time steps): as they are by default."""
        return images

    def score(self, labels, predictions, num_classes):
        """The report's scores (capsnet.scoring.score) with the class names where known."""
        report = score(labels, predictions, num_classes)
        names = self.class_names(num_classes)
        if names is not None:
            report["class_names"] = list(names)
        return report


def check_labels(labels, images, *, model, split, image_shape=None):
    """The data must fit the model: image shape = input_shape, labels in [0, num_classes).

    `model` is a built CapsNet: its input_shape and num_classes have been checked
    (build_capsnet), unlike the raw config values. image_shape: the shape of the
    examples the model will see, when the pipeline makes them from `images`
    (MultiMNIST: capsnet.data.example_shape); None = the images' own.
    """
    input_shape = tuple(model.image_shape)
    image_shape = tuple(images.shape[1:]) if image_shape is None else tuple(image_shape)
    if image_shape != input_shape:
        raise ConfigError(f"{split} images have shape {image_shape} but model.input_shape is "
                          f"{list(input_shape)}")
    num_classes = int(model.num_classes)
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise ConfigError(f"{split} labels lie in [{labels.min()}, {labels.max()}] but model.num_classes is "
                          f"{num_classes}")


def default_file_image(data, image_shape):
    """Task.file_image's default, also for an export that does not record its data section:
    folder.decode_image_bytes at the model's (square) size, scaled by 1/255."""
    height, width, channels = image_shape
    if height != width:
        raise ConfigError(f"the model takes {height}x{width} images: predict makes square ones (the folder "
                          "pipeline's decoding)")
    return tf.cast(folder.decode_image_bytes(data, height, channels), tf.float32) / 255.0
