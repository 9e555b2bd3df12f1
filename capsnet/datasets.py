"""What each dataset name means, without TensorFlow: capsnet.tasks loads and pipelines the
datasets (one Task class per `kind`), capsnet.config derives model.input_shape and
model.num_classes from these facts (before the seconds-long TensorFlow import)."""
import dataclasses

from capsnet.errors import ConfigError

__all__ = ["DatasetSpec", "DATASETS", "KINDS", "is_overlay", "has_canvas", "check_canvas_border", "example_shape",
           "source_shape", "spec_class_names", "test_set_refusal", "DEFAULT_MAX_PIXELS"]

DIGITS = tuple(str(d) for d in range(10))
# data.max_pixels' default: the most pixels an image file may declare to be decoded (8192 x 8192,
# a 48-megapixel photo's and more; a 20000 x 20000 PNG of 388 KB took 8.5 GB to train on).
DEFAULT_MAX_PIXELS = 8192 * 8192


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What a dataset name means: where tfds has it, what its examples look like, and which
    Task kind (capsnet.tasks.KINDS) loads, pipelines and scores it."""
    tfds_name: str | None  # None: only readable from files (data.dir)
    image_shape: tuple     # (H, W, C) of the stored (source) images; None: the folder's (data.image_size, data.channels)
    num_classes: int | None  # None: the folder's class folders
    overlay: bool = False  # True: examples are two overlaid source digits (make_multimnist_dataset)
    # capsnet.tasks.KINDS: single_label | multimnist | images (natural images) | canvas | affine (capsnet.tasks.canvas)
    kind: str = "single_label"
    class_names: tuple | None = None  # None: each class named by its index (a folder: its folder names)
    dark_background: bool = False  # light shapes on black: a mostly light image given to predict gets a notice
    # True: each digit drawn on a zero canvas data.pad_pixels wider on every side (null:
    # data.shift_pixels), as an overlay dataset's are (capsnet.tasks.canvas)
    canvas: bool = False
    test_only: bool = False  # True: a test set only (affnist): training on it is refused


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
    # Expanded MNIST (paper Sec. 5.2): each MNIST digit on a 40x40 canvas (data.pad_pixels 6),
    # shifted by up to data.shift_pixels (6) in training; the test digits at one fixed shift
    # each (capsnet.tasks.canvas). Read from the MNIST files (tfds mnist or data.dir).
    "expanded_mnist": DatasetSpec(tfds_name="mnist", image_shape=(28, 28, 1), num_classes=10, kind="canvas",
                                  class_names=DIGITS, dark_background=True, canvas=True),
    # The 10,000 MNIST test digits on that canvas, each under one random affine map in
    # affNIST's ranges (capsnet.affine): a test set for expanded_mnist runs, generated here
    # in affNIST's ranges, not affNIST's own files.
    "affnist": DatasetSpec(tfds_name="mnist", image_shape=(28, 28, 1), num_classes=10, kind="affine",
                           class_names=DIGITS, dark_background=True, canvas=True, test_only=True),
}
KINDS = ("single_label", "multimnist", "images", "canvas", "affine")
# A folder's images (data.image_size, data.channels null): decoded to 32x32 RGB.
DEFAULT_IMAGE_SIZE = 32
DEFAULT_CHANNELS = 3


def is_overlay(name):
    """Whether dataset `name` yields two-digit examples (labels (B, 2), see make_multimnist_dataset)."""
    return name in DATASETS and DATASETS[name].overlay


def has_canvas(name):
    """Whether dataset `name` draws its digits on a canvas data.pad_pixels wider on every side
    (MultiMNIST, expanded_mnist, affnist)."""
    return name in DATASETS and (DATASETS[name].overlay or DATASETS[name].canvas)


def spec_class_names(name, num_classes):
    """Dataset `name`'s class names (DatasetSpec.class_names) if it has num_classes of
    them, else None."""
    names = DATASETS[name].class_names if name in DATASETS else None
    return tuple(names) if names is not None and len(names) == num_classes else None


def test_set_refusal(name, prefix="data."):
    """The one line refusing to train on a test-only dataset `name` (DatasetSpec.test_only)."""
    return (f"{prefix}name={name} is a test set only (no training split): train with data=expanded_mnist and "
            f"score the run with evaluate.py checkpoint=<run dir> data.name={name}")


def check_canvas_border(name, pad_pixels, prefix="data."):
    """Only a dataset drawn on a canvas (has_canvas) has a canvas border (data.pad_pixels): any
    other shifts its images on their own canvas, so a border set for it is refused
    (ConfigError, one line)."""
    if pad_pixels is not None and not has_canvas(name):
        raise ConfigError(f"{prefix}pad_pixels applies to multimnist, expanded_mnist and affnist only ({name} images "
                          f"are shifted on their own canvas), got {pad_pixels!r}: set it to null")


def example_shape(name, source_shape, shift_pixels, pad_pixels=None, *, crop=None):
    """The (H, W, C) of the images the model sees: the source's, for a dataset drawn on a
    canvas (has_canvas) the canvas, (H + 2·p, W + 2·p, C) with p = pad_pixels, or
    shift_pixels where that is None (MultiMNIST, shift 4: 28 → 36; expanded_mnist and
    affnist, pad 6: 28 → 40), and for natural images with data.crop the crop's (crop, crop, C)."""
    h, w, c = source_shape
    if has_canvas(name):
        p = shift_pixels if pad_pixels is None else pad_pixels
        return (h + 2 * p, w + 2 * p, c)
    if crop:
        return (crop, crop, c)
    return (h, w, c)


def source_shape(dcfg):
    """The stored (decoded) images' (H, W, C) of a natural-image data section (a dict with
    name, and image_size and channels where set): a folder's at data.image_size and
    data.channels (DEFAULT_IMAGE_SIZE, DEFAULT_CHANNELS where null), a tensorflow-datasets
    dataset's own, resized to data.image_size where set."""
    spec = DATASETS[dcfg["name"]]
    size = dcfg.get("image_size")
    if spec.image_shape is None:  # a folder
        size = size or DEFAULT_IMAGE_SIZE
        return (size, size, dcfg.get("channels") or DEFAULT_CHANNELS)
    h, w, c = spec.image_shape
    return (size, size, c) if size else (h, w, c)
