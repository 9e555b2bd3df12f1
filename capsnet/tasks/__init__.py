"""Tasks: one object per dataset kind that owns what differs between kinds (loading, the
example shape, augmentation, the label format, scoring, what the summaries, evaluation,
export and predict need). Training, evaluation, export and predict ask `task_for(data_cfg)`
instead of branching on the dataset's name.

The kind comes from data.name (capsnet.datasets.DATASETS[name].kind) through the explicit
registry KINDS below, not from a Hydra `_target_`: run dirs saved before tasks existed
have no `_target_` in their config.yaml and must keep loading; evaluate.py's data.name=
override swaps the dataset by its name alone, without a class path that a saved config
would then pin for ever.

What a kind's data keys may be is the config's to check, before the TensorFlow import
(capsnet.config.checks: the data rule, from capsnet.datasets' facts of the kind); the
tasks are above the config and import it.

Adding a dataset kind: a module here with a Task subclass (its `kind` one of
capsnet.datasets.KINDS, added there), a line in KINDS below, the dataset's DatasetSpec in
capsnet/datasets.py, its keys' rule in capsnet/config/checks.py (_data_rule), and its
configs/data/<name>.yaml.
"""
import importlib

from capsnet.datasets import DATASETS
from capsnet.errors import ConfigError
from capsnet.tasks.base import Split, Task

__all__ = ["Task", "Split", "KINDS", "task_class", "task_for"]

# kind -> "module:class" (imported on first use).
KINDS = {
    "single_label": "capsnet.tasks.single_label:SingleLabel",
    "multimnist": "capsnet.tasks.multimnist:MultiMNIST",
    "images": "capsnet.tasks.images:NaturalImages",
    "canvas": "capsnet.tasks.canvas:CanvasDigits",
    "affine": "capsnet.tasks.canvas:AffineDigits",
}


def task_class(name):
    """The Task subclass of dataset `name` (ConfigError naming the known datasets)."""
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r} (known: {', '.join(sorted(DATASETS))})")
    module, _, cls = KINDS[DATASETS[name].kind].partition(":")
    return getattr(importlib.import_module(module), cls)


def task_for(data_cfg):
    """The Task of the `data` section `data_cfg` (a dict: config.check's data section, or a
    run's saved one)."""
    return task_class(data_cfg["name"])(data_cfg)
