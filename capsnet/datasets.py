"""What each dataset name means, without TensorFlow: capsnet.data loads and pipelines the
datasets, capsnet.config derives model.input_shape and model.num_classes from these facts
(before the seconds-long TensorFlow import)."""
import dataclasses

from capsnet.errors import ConfigError

__all__ = ["DatasetSpec", "DATASETS", "is_overlay", "check_canvas_border", "example_shape"]


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What a dataset name means: where tfds has it and what its examples look like."""
    tfds_name: str | None  # None: only readable from IDX files (data.dir)
    image_shape: tuple     # (H, W, C) of the stored (source) images
    num_classes: int
    overlay: bool = False  # True: examples are two overlaid source digits (make_multimnist_dataset)


# Add a dataset here to make it loadable by name.
DATASETS = {
    "mnist": DatasetSpec(tfds_name="mnist", image_shape=(28, 28, 1), num_classes=10),
    "fashion_mnist": DatasetSpec(tfds_name="fashion_mnist", image_shape=(28, 28, 1), num_classes=10),
    # MultiMNIST (paper Sec. 6): generated on the fly from the MNIST files (the same IDX
    # files or tfds dataset as `mnist`) by make_multimnist_dataset.
    "multimnist": DatasetSpec(tfds_name="mnist", image_shape=(28, 28, 1), num_classes=10, overlay=True),
}


def is_overlay(name):
    """Whether dataset `name` yields two-digit examples (labels (B, 2), see make_multimnist_dataset)."""
    return name in DATASETS and DATASETS[name].overlay


def check_canvas_border(name, pad_pixels, prefix="data."):
    """Only an overlay dataset has a canvas border (data.pad_pixels): any other shifts its
    images on their own canvas, so a border set for it is refused (ConfigError, one line)."""
    if pad_pixels is not None and not is_overlay(name):
        raise ConfigError(f"{prefix}pad_pixels applies to multimnist only ({name} images are shifted on their own "
                          f"canvas), got {pad_pixels!r}: set it to null")


def example_shape(name, source_shape, shift_pixels, pad_pixels=None):
    """The (H, W, C) of the images the model sees: the source's, or for an overlay dataset
    the canvas the shifted digits are drawn on, (H + 2·p, W + 2·p, C) with p = pad_pixels,
    or shift_pixels where that is None (MultiMNIST, shift 4: 28 → 36)."""
    h, w, c = source_shape
    if is_overlay(name):
        p = shift_pixels if pad_pixels is None else pad_pixels
        return (h + 2 * p, w + 2 * p, c)
    return (h, w, c)
