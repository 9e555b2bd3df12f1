"""MultiMNIST (Sabour et al. 2017, Sec. 6): two MNIST digits of different classes,
shifted and overlaid (capsnet.data.make_multimnist_dataset); labels (B, 2), each digit
alone as the reconstruction target, scored by the two longest capsules."""
from capsnet.data import make_split_dataset
from capsnet.datasets import example_shape
from capsnet.tasks.labels import TWO_DIGITS
from capsnet.tasks.single_label import SingleLabel


class MultiMNIST(SingleLabel):
    kind = "multimnist"
    label_format = TWO_DIGITS

    def example_shape(self, source_shape):
        return example_shape(self.name, source_shape, self.cfg.get("shift_pixels", 4), self.cfg.get("pad_pixels"))

    def test_pairs(self):
        """The test pairs' shifts and canvas border (evaluate's report names them)."""
        shift = self.cfg.get("shift_pixels", 4)
        pad = self.cfg.get("pad_pixels")
        return {"shift_pixels": shift, "pad_pixels": shift if pad is None else pad}

    def for_test_pairs(self, given, run_border):
        # A shift given alone keeps the run's canvas (a border of null was the run's shift).
        task = type(self)({**self.cfg, "pad_pixels": given.get("pad_pixels", run_border)})
        return task, task.test_pairs()

    def dataset(self, data, *, batch_size, training, seed=0, epoch=0, drop_remainder=False):
        # The test split: its fixed pairs of the run's shift and canvas; training: each
        # digit's elastic distortion too (the only augmentation MultiMNIST takes).
        augmentation = {k: v for k, v in self.augmentation().items() if k != "shift_pixels"} if training else {}
        return make_split_dataset(self.name, data.images, data.labels, batch_size=batch_size, training=training,
                                  seed=seed, epoch=epoch, shift_pixels=self.cfg.get("shift_pixels", 4),
                                  pad_pixels=self.cfg.get("pad_pixels"), drop_remainder=drop_remainder,
                                  **augmentation)
