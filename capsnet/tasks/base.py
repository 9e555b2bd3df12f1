"""The Task interface (capsnet.tasks) and the Split it loads."""
import dataclasses

from capsnet.datasets import DATASETS, check_canvas_border, spec_class_names
from capsnet.errors import ConfigError

# The data keys of natural images (capsnet.tasks.images) and their off values: the other
# kinds refuse them set, so that a key given to the wrong dataset is not silently ignored.
IMAGE_KEYS_OFF = {"image_size": None, "channels": None, "crop": None, "validation_fraction": 0.0,
                  "class_names": None, "standardize": False, "brightness": 0.0, "contrast": 0.0, "crop_padding": 0,
                  "cutout": 0}


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


class Task:
    """What one dataset kind means to the trainer. A subclass per kind (KINDS); an instance
    per data section (`data_cfg`, the checked `data` dict)."""
    kind = None
    labels_per_example = 1  # 2: MultiMNIST's (B, 2) labels and (B, 2, H, W, C) reconstruction targets

    def __init__(self, data_cfg):
        self.cfg = dict(data_cfg)
        self.name = self.cfg["name"]
        self.spec = DATASETS[self.name]

    # ----------------------------------------------------------------- config (no TensorFlow)
    @classmethod
    def check_config(cls, dcfg, prefix="data."):
        """The section rule of this kind's data keys (ConfigError, one line). Default: the
        natural-image keys must be off, and no canvas border (data.pad_pixels)."""
        check_canvas_border(dcfg["name"], dcfg.get("pad_pixels"), prefix)
        on = [key for key, off in IMAGE_KEYS_OFF.items() if dcfg.get(key, off) != off]
        if on:
            raise ConfigError(f"{', '.join(prefix + key for key in on)}: only for natural images (data=folder, "
                              f"cifar10, svhn_cropped, smallnorb), not {dcfg['name']}: set "
                              f"{', '.join(f'{prefix}{key}={_yaml(IMAGE_KEYS_OFF[key])}' for key in on)}")

    @property
    def two_digits(self):
        """Whether examples carry two labels (the steps' and the export's two_digits)."""
        return self.labels_per_example == 2

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

    def dataset(self, data, *, batch_size, training, seed=0, epoch=0, drop_remainder=False):
        """One epoch of batches of the Split `data`: (images float32 (B, H, W, C), labels
        int32 (B,) or (B, 2)[, digits]); training shuffles and augments, keyed by (seed, epoch)."""
        raise NotImplementedError

    def check(self, data, model, split):
        """The Split fits the built `model` (ConfigError, one line): its examples' shape is
        model.input_shape and its labels lie in [0, num_classes)."""
        from capsnet.training.model_setup import check_labels

        check_labels(data.labels, data.images, model=model, split=f"{self.name} {split}",
                     image_shape=self.example_shape(data.shape))

    def serving_images(self, images):
        """What the model sees of float32 images in [0, 1] given to the export or predict
        (the pipeline's deterministic test-time steps): as they are by default."""
        return images

    def score(self, labels, predictions, num_classes):
        """The report's scores (capsnet.scoring.score) with the class names where known."""
        from capsnet.scoring import score

        report = score(labels, predictions, num_classes)
        names = self.class_names(num_classes)
        if names is not None:
            report["class_names"] = list(names)
        return report


def _yaml(value):
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
