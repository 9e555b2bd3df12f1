"""An image folder's classes and files, from the paths alone (no TensorFlow: the config's
resolvers list the classes before the TensorFlow import).

Layout: DIR/train/<class>/* and DIR/test/<class>/*, or DIR/<class>/* with
data.validation_fraction > 0 (that share of each class's files, drawn with a fixed seed,
is the test split). Classes are the folder names, sorted; images are the files ending in
IMAGE_SUFFIXES (other files are ignored), in sorted order.
"""
import os
from pathlib import Path

import numpy as np

from capsnet.errors import ConfigError, DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
SPLIT_SEED = 20170  # the validation split's draw: the same test files in every run


def root_dir(data_dir):
    """The folder data.dir names, absolute: ConfigError where it is not given, DataError where
    it is not a directory."""
    if data_dir is None or str(data_dir).strip() == "":
        raise ConfigError("data=folder needs data.dir=PATH: a folder of class folders (PATH/train/<class>/*, "
                          "PATH/test/<class>/*, or PATH/<class>/* with data.validation_fraction)")
    root = Path(os.path.expanduser(str(data_dir))).absolute()
    if not root.is_dir():
        raise DataError(f"data dir {root} does not exist or is not a directory (data=folder reads "
                        f"{root}/train/<class>/* and {root}/test/<class>/*)")
    return root


def _class_dirs(folder):
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _images(class_dir):
    return sorted(str(p) for p in class_dir.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def _split_folder(folder, what):
    """{class name: [files]} of `folder` (DataError for an empty folder or a class folder
    without images)."""
    classes = _class_dirs(folder)
    if not classes:
        raise DataError(f"{what} {folder} has no class folders (expected {folder}/<class>/<image files>)")
    files = {}
    for class_dir in classes:
        found = _images(class_dir)
        if not found:
            raise DataError(f"class folder {class_dir} has no images (looked for {', '.join(IMAGE_SUFFIXES)} files)")
        files[class_dir.name] = found
    return files


def layout(data_dir, validation_fraction=0.0):
    """(root, classes, {"train": {class: files}, "test": {class: files}})."""
    root = root_dir(data_dir)
    train, test = root / "train", root / "test"
    if train.is_dir() or test.is_dir():
        if not (train.is_dir() and test.is_dir()):
            missing = test if train.is_dir() else train
            raise DataError(f"data dir {root} has {(train if train.is_dir() else test).name}/ but no {missing.name}/: "
                            f"give both, or put the class folders directly in {root} with data.validation_fraction")
        if validation_fraction:
            raise ConfigError(f"data.validation_fraction={validation_fraction}: {root} has its own test/ folder "
                              "(set it to 0)")
        splits = {"train": _split_folder(train, "the training folder"), "test": _split_folder(test, "the test folder")}
        if list(splits["train"]) != list(splits["test"]):
            only_train = sorted(set(splits["train"]) - set(splits["test"]))
            only_test = sorted(set(splits["test"]) - set(splits["train"]))
            raise DataError(f"{train} and {test} have different classes: "
                            + "; ".join(part for part in (f"only in train/: {', '.join(only_train)}" if only_train else "",
                                                         f"only in test/: {', '.join(only_test)}" if only_test else "")
                                        if part))
        return root, list(splits["train"]), splits
    if not validation_fraction:
        if not _class_dirs(root):
            raise DataError(f"data dir {root} is empty: expected {root}/train/<class>/* and {root}/test/<class>/* "
                            "(or class folders with data.validation_fraction)")
        raise ConfigError(f"data dir {root} has no train/ and test/ folders: split its class folders with "
                          "data.validation_fraction=0.1 (say), or make train/ and test/")
    files = _split_folder(root, "data dir")
    rng = np.random.default_rng(SPLIT_SEED)
    splits = {"train": {}, "test": {}}
    for name, found in files.items():
        order = rng.permutation(len(found))
        n_test = int(round(len(found) * validation_fraction))
        if n_test < 1 or n_test >= len(found):
            raise DataError(f"class folder {root / name} has {len(found)} images: data.validation_fraction="
                            f"{validation_fraction} leaves {'no test' if n_test < 1 else 'no training'} image")
        splits["test"][name] = [found[i] for i in sorted(order[:n_test])]
        splits["train"][name] = [found[i] for i in sorted(order[n_test:])]
    return root, list(files), splits


def class_names(data_dir, validation_fraction=0.0):
    """The folder's classes (sorted folder names)."""
    return layout(data_dir, validation_fraction)[1]


def split_files(data_dir, split, validation_fraction=0.0, classes=None):
    """(paths list, labels int64 array) of `split`; `classes` (the run's stored names):
    DataError if the folder's differ from them."""
    root, found, splits = layout(data_dir, validation_fraction)
    if classes is not None and list(classes) != list(found):
        raise DataError(f"{root} has the classes {', '.join(found)}, but the run was trained on "
                        f"{', '.join(classes)} (data.class_names)")
    paths, labels = [], []
    for k, name in enumerate(found):
        paths += splits[split][name]
        labels += [k] * len(splits[split][name])
    return paths, np.asarray(labels, np.int64)
