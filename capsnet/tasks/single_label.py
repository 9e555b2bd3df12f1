"""One label per image from uint8 arrays in memory: MNIST and Fashion-MNIST (IDX files or
tensorflow-datasets), pipelined by capsnet.data.make_dataset (shifts and the
augmentation group's options, keyed by (seed, epoch))."""
from capsnet.config import augmentation_options
from capsnet.data.pipeline import make_dataset
from capsnet.data.sources import load_split
from capsnet.tasks.base import Split, Task


class SingleLabel(Task):
    kind = "single_label"

    def load(self, split, *, limit=None):
        images, labels = load_split(self.name, split, data_dir=self.cfg.get("dir"), limit=limit)
        return Split(labels=labels, images=images, shape=tuple(images.shape[1:]))

    def augmentation(self):
        """make_dataset's augmentation keywords of this data section."""
        return {"shift_pixels": self.cfg.get("shift_pixels", 2), **augmentation_options(self.cfg)}

    def dataset(self, data, *, batch_size, training, seed=0, epoch=0, drop_remainder=False):
        # The test split: no augmentation.
        augmentation = self.augmentation() if training else {}
        return make_dataset(data.images, data.labels, batch_size=batch_size, training=training, seed=seed,
                            epoch=epoch, drop_remainder=drop_remainder, **augmentation)
