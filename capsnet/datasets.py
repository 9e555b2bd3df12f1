"""What each dataset name means, without TensorFlow: capsnet.tasks loads and pipelines the
datasets (one Task class per `kind`), capsnet.config derives model.input_shape and
model.num_classes from these facts (before the seconds-long TensorFlow import)."""
import dataclasses

from capsnet.errors import ConfigError

__all__ = ["DatasetSpec", "DATASETS", "KINDS", "is_overlay", "check_canvas_border", "example_shape", "spec_class_names"]

DIGITS = tuple(str(d) for d in range(10))


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What a dataset name means: where tfds has it, what its examples look like, and which
    Task kind (capsnet.tasks.KINDS) loads, pipelines and scores it."""
    tfds_name: str | None  # None: only readable from files (data.dir)
    image_shape: tuple     # (H, W, C) of the stored (source) images; None: the folder's (data.image_size, data.channels)
    num_classes: int | None  # None: the folder's class folders
    overlay: bool = False  # True: examples are two overlaid source digits (make_multimnist_dataset)
    kind: str = "single_label"  # capsnet.tasks.KINDS: single_label | multimnist | images (natural images)
    class_names: tuple | None = None  # None: each class named by its index (a folder: its folder names)
    dark_background: bool = False  # light shapes on black: a mostly light image given to predict gets a notice


# Add a dataset here to make it loadable by name (a new kind: a module in capsnet/tasks/ too).
DATASETS = {
    "mnist": DatasetSpec(tfds_name="mnist", image_shape=(28, 28, 1), num_classes=10, class_names=DIGITS,
                         dark_background=True),
    # Fashion-MNIST's labels 0-9 (Xiao, Rasul & Vollgraf 2017, the dataset's README).
    "fashion_mnist": DatasetSpec(tfds_name="fashion_mnist", image_shape=(28, 28, 1), num_classes=10,
                                 class_names=("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                                              "Sneaker", "Bag", "Ankle boot"), dark_background=True),
    # MultiMNIST (paper Sec. 6): generated on the fly from the MNIST files (the same IDX
    # files or tfds dataset as `mnist`) by make_multimnist_dataset.
    "multimnist": DatasetSpec(tfds_name="mnist", image_shape=(28, 28, 1), num_classes=10, overlay=True,
                              kind="multimnist", class_names=DIGITS, dark_background=True),
    # Natural images (capsnet.tasks.images): tensorflow-datasets' names, or data.dir a folder
    # of class folders (data=folder); data.crop: random crops in training, the centre at test.
    "cifar10": DatasetSpec(tfds_name="cifar10", image_shape=(32, 32, 3), num_classes=10, kind="images",
                           class_names=("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                                        "ship", "truck")),
    "svhn_cropped": DatasetSpec(tfds_name="svhn_cropped", image_shape=(32, 32, 3), num_classes=10, kind="images",
                                class_names=DIGITS),
    # smallNORB: the stereo pair as 2 channels, downsampled 96 -> 48 (the paper, Sec. 7).
    "smallnorb": DatasetSpec(tfds_name="smallnorb", image_shape=(48, 48, 2), num_classes=5, kind="images",
                             class_names=("animal", "human", "airplane", "truck", "car")),
    "folder": DatasetSpec(tfds_name=None, image_shape=None, num_classes=None, kind="images"),
}
KINDS = ("single_label", "multimnist", "images")


def is_overlay(name):
    """Whether dataset `name` yields two-digit examples (labels (B, 2), see make_multimnist_dataset)."""
    return name in DATASETS and DATASETS[name].overlay


def spec_class_names(name, num_classes):
    """Dataset `name`'s class names (DatasetSpec.class_names) if it has num_classes of
    them, else None."""
    names = DATASETS[name].class_names if name in DATASETS else None
    return tuple(names) if names is not None and len(names) == num_classes else None


def check_canvas_border(name, pad_pixels, prefix="data."):
    """Only an overlay dataset has a canvas border (data.pad_pixels): any other shifts its
    images on their own canvas, so a border set for it is refused (ConfigError, one line)."""
    if pad_pixels is not None and not is_overlay(name):
        raise ConfigError(f"{prefix}pad_pixels applies to multimnist only ({name} images are shifted on their own "
                          f"canvas), got {pad_pixels!r}: set it to null")


def example_shape(name, source_shape, shift_pixels, pad_pixels=None, *, crop=None):
    """The (H, W, C) of the images the model sees: the source's, for an overlay dataset
    the canvas the shifted digits are drawn on, (H + 2·p, W + 2·p, C) with p = pad_pixels,
    or shift_pixels where that is None (MultiMNIST, shift 4: 28 → 36), and for natural
    images with data.crop the crop's (crop, crop, C)."""
    h, w, c = source_shape
    if is_overlay(name):
        p = shift_pixels if pad_pixels is None else pad_pixels
        return (h + 2 * p, w + 2 * p, c)
    if crop:
        return (crop, crop, c)
    return (h, w, c)
