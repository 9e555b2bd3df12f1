"""Tasks (capsnet.tasks): the same batches as the pipelines before tasks existed, the kind
each dataset name gets, and the rules a kind owns.

The checksums were recorded from capsnet.data.make_split_dataset before training,
evaluation and export asked a Task (three batches of 64 of the first 300 examples,
seed 7, epoch 2): a Task that changed the order, the augmentation or the values of a batch
fails them."""
import hashlib
from pathlib import Path

import numpy as np
import pytest

from capsnet.errors import ConfigError
from capsnet.tasks import task_class, task_for

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
CASES = {
    "mnist": ({"name": "mnist", "dir": str(SHARED / "mnist"), "shift_pixels": 2}, {}),
    "fashion_mnist": ({"name": "fashion_mnist", "dir": str(SHARED / "fashion-mnist"), "shift_pixels": 2},
                      {"flip": True, "rotate_degrees": 5.0, "erase_probability": 0.5}),
    "multimnist": ({"name": "multimnist", "dir": str(SHARED / "mnist"), "shift_pixels": 4, "pad_pixels": None},
                   {"elastic_alpha": 16.0}),
}
RECORDED = {
    ("mnist", "train"): "59902a8eec8092e63215bd4186bf951445162d729f2abf50243ae94199b3470c",
    ("mnist", "test"): "0c2f384afc279ca496f9a4b351f303db1fcae9cdc9dddb051411492db187637d",
    ("fashion_mnist", "train"): "dc2c9092fab9501a5eb260db10e8e76ba038fe92f79d155a9ecc89bd4f96820a",
    ("fashion_mnist", "test"): "da393770c9c2e44f8151c6cb7683da066b64a0fecf77832625cdd4f9bdf7ebc2",
    ("multimnist", "train"): "8bd3a22ce7ac5ed009282e0369b14adde77e0f513b57968322d0368476784112",
    ("multimnist", "test"): "e94fb357e896cc3736bbd96524aa8b2ba1564c347211a199f70d25aa2674611a",
}


@pytest.mark.skipif(not (SHARED / "fashion-mnist").is_dir(), reason="needs the real MNIST/Fashion-MNIST files")
@pytest.mark.parametrize("name", sorted(CASES))
def test_task_batches_equal_the_pipelines_before_tasks(name):
    from capsnet.config import AUGMENTATION_OFF

    data_cfg, augmentation = CASES[name]
    task = task_for({**AUGMENTATION_OFF, **data_cfg, **augmentation})
    for split, training in (("train", True), ("test", False)):
        data = task.load(split, limit=300)
        digest = hashlib.sha256()
        for batch in task.dataset(data, batch_size=64, training=training, seed=7, epoch=2).take(3):
            for tensor in batch:
                digest.update(np.ascontiguousarray(tensor.numpy()).tobytes())
        assert digest.hexdigest() == RECORDED[name, split], (name, split)


def test_kinds_by_name():
    assert task_class("mnist").kind == "single_label"
    assert task_class("multimnist").label_format.per_example == 2
    assert task_class("folder").kind == task_class("cifar10").kind == "images"
    with pytest.raises(ConfigError, match="unknown dataset 'nope'"):
        task_class("nope")


def test_class_names_from_the_dataset_spec():
    assert task_for({"name": "fashion_mnist"}).class_names()[9] == "Ankle boot"
    assert task_for({"name": "cifar10"}).class_names()[0] == "airplane"
    assert task_for({"name": "smallnorb"}).num_classes == 5


def test_image_keys_refused_for_the_mnist_family(tiny_config):
    from capsnet import config

    with pytest.raises(ConfigError, match="data.crop: only for natural images"):
        config.check(tiny_config("data.crop=20"))


def test_mnist_shifts_refused_for_natural_images(tmp_path):
    from capsnet.config.checks import _data_rule

    with pytest.raises(ConfigError, match="data.shift_pixels: not for natural images"):
        _data_rule({"name": "cifar10", "shift_pixels": 2, "pad_pixels": None}, "data.")
    with pytest.raises(ConfigError, match="data=folder needs data.dir"):
        _data_rule({"name": "folder", "shift_pixels": 0, "pad_pixels": None, "dir": None}, "data.")
    with pytest.raises(ConfigError, match="data.crop=40 is larger than the images"):
        _data_rule({"name": "cifar10", "shift_pixels": 0, "pad_pixels": None, "crop": 40}, "data.")


@pytest.mark.slow
def test_tfds_names_load_through_tensorflow_datasets_offline():
    """The real tfds loading code on tfds' mock data: cifar10 RGB, smallnorb's stereo pair
    as 2 channels at 48x48 with its 5 categories."""
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=6):
        cifar = task_for({"name": "cifar10"}).load("train")
        norb = task_for({"name": "smallnorb"}).load("test")
    assert cifar.images.shape == (6, 32, 32, 3) and cifar.images.dtype == np.uint8
    assert norb.images.shape == (6, 48, 48, 2) and set(norb.labels) <= set(range(5))
    task = task_for({"name": "smallnorb", "crop": 32, "brightness": 0.25, "contrast": 0.5, "standardize": True})
    images, labels = next(iter(task.dataset(norb, batch_size=6, training=True, seed=1)))
    assert images.shape == (6, 32, 32, 2)
    np.testing.assert_allclose(images.numpy().mean(axis=(1, 2, 3)), 0, atol=1e-4)  # per-image standardised
