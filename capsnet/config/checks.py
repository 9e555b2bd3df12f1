"""The checks: `check(cfg)` (a train config), `check_eval(cfg)` (an eval config),
`check_section(schema, values)` (one section by its fields' checks and its rule), and
the rules that span a section's keys (`_SECTION_RULES`) or sections (`check`)."""
import dataclasses
import math
import os
from pathlib import Path

from omegaconf import MISSING

from capsnet import folder
from capsnet.config.schemas import (AUGMENTATION_OFF, ALL_REDUCE, AugmentationConfig, DataConfig, DistributeConfig,
                                    EvalAppConfig, ModelConfig, PredictAppConfig, ROUTED_KINDS, TrainAppConfig,
                                    TrainConfig, augmentation_options, field_default)
from capsnet.datasets import DATASETS, check_canvas_border, is_overlay, source_shape, test_set_refusal
from capsnet.errors import ConfigError, DataError
from capsnet.idx import SPLITS, idx_files


def check_augmentation(prefix="", **options):
    """The augmentation `options` (keys of AUGMENTATION_OFF: make_dataset passes all of them,
    MultiMNIST's pairs OVERLAY_AUGMENTATION's) checked and in their plain types, in
    AUGMENTATION_OFF's order; a bad one → ConfigError naming `prefix` + its key.
    (shift_pixels is checked by make_dataset: its range is the image's.)"""
    unknown = [key for key in options if key not in AUGMENTATION_OFF]
    if unknown:
        raise TypeError(f"check_augmentation takes {', '.join(AUGMENTATION_OFF)}, got {', '.join(unknown)}")
    checks = {f.name: f.metadata["check"] for f in dataclasses.fields(AugmentationConfig)}
    checked = {key: checks[key](prefix + key, options[key]) for key in AUGMENTATION_OFF if key in options}
    return {key: float(value) if isinstance(AUGMENTATION_OFF[key], float) else value for key, value in checked.items()}


def _margin_rule(tcfg, prefix):
    """The margin loss's own rule, checked now rather than when the first step is traced."""
    m_plus, m_minus, lambda_ = tcfg["m_plus"], tcfg["m_minus"], tcfg["lambda_"]
    where = f"{prefix}m_plus, {prefix}m_minus, {prefix}lambda_"
    if not 0 <= m_minus < m_plus <= 1:
        raise ConfigError(f"{where}: need 0 <= m_minus < m_plus <= 1 (capsule lengths lie in [0, 1)), "
                          f"got m_plus={m_plus!r}, m_minus={m_minus!r}")
    if lambda_ < 0:
        raise ConfigError(f"{where}: lambda_ must be >= 0, got {lambda_!r}")


def _distribute_rule(dcfg, prefix):
    strategy = dcfg["strategy"]
    if dcfg["all_reduce"] not in ALL_REDUCE[strategy]:
        raise ConfigError(f"{prefix}all_reduce must be one of {', '.join(ALL_REDUCE[strategy])} with "
                          f"distribute={strategy}, got {dcfg['all_reduce']!r}")
    if dcfg["devices"] is not None and strategy != "mirrored":
        raise ConfigError(f"{prefix}devices applies to distribute=mirrored only (distribute={strategy} "
                          f"{'uses one device' if strategy == 'none' else 'uses every GPU of each worker'}), "
                          f"got {dcfg['devices']!r}: set it to null")


# The data keys of natural images (capsnet.tasks.images) and their off values: the other
# kinds refuse them set, so that a key given to the wrong dataset is not silently ignored.
IMAGE_KEYS_OFF = {"image_size": None, "channels": None, "crop": None, "test_fraction": 0.0,
                  "class_names": None, "standardize": False, "brightness": 0.0, "contrast": 0.0, "crop_padding": 0,
                  "cutout": 0}
# What natural images refuse of the augmentation group (the MNIST family's options).
NATURAL_IMAGES_REFUSE = {"rotate_degrees": 0.0, "zoom": 0.0, "elastic_alpha": 0.0, "erase_probability": 0.0}


def _data_rule(dcfg, prefix):
    """The rules of the dataset's kind (capsnet.datasets.DatasetSpec): natural images'
    (_natural_images_rule); for the others, no natural-image key set (IMAGE_KEYS_OFF), a
    canvas border only where the digits are drawn on one, MultiMNIST's augmentation
    (check_overlay_augmentation), and no training on a test set only (affnist)."""
    name = dcfg["name"]
    if DATASETS[name].kind == "images":
        _natural_images_rule(dcfg, prefix)
        return
    check_canvas_border(name, dcfg.get("pad_pixels"), prefix)
    on = [key for key, off in IMAGE_KEYS_OFF.items() if dcfg.get(key, off) != off]
    if on:
        raise ConfigError(f"{', '.join(prefix + key for key in on)}: only for natural images (data=folder, "
                          f"cifar10, svhn_cropped, smallnorb), not {name}: set "
                          f"{', '.join(f'{prefix}{key}={_yaml(IMAGE_KEYS_OFF[key])}' for key in on)}")
    check_overlay_augmentation(name, augmentation_options(dcfg), prefix)
    if DATASETS[name].test_only:
        raise ConfigError(test_set_refusal(name, prefix))


def _natural_images_rule(dcfg, prefix):
    """Natural images (capsnet.tasks.images): crops, flips, brightness and contrast, not the
    MNIST family's shifts and distortions; data.dir for a folder (which must exist); a
    crop that fits the images; a tensorflow-datasets dataset's own channels."""
    refused = [key for key, off in NATURAL_IMAGES_REFUSE.items() if dcfg.get(key, off) != off]
    if dcfg.get("shift_pixels"):
        refused.insert(0, "shift_pixels")
    if refused:
        raise ConfigError(f"{', '.join(prefix + k for k in refused)}: not for natural images ({dcfg['name']}): "
                          f"use {prefix}crop (random crops), {prefix}flip, {prefix}brightness and "
                          f"{prefix}contrast; set {', '.join(f'{prefix}{k}=0' for k in refused)}")
    check_canvas_border(dcfg["name"], dcfg.get("pad_pixels"), prefix)
    if dcfg["name"] == "folder":
        folder.root_dir(dcfg.get("dir"))  # data.dir is required
    elif dcfg.get("test_fraction") and dcfg.get("dir") is None:
        raise ConfigError(f"{prefix}test_fraction applies to data=folder only ({dcfg['name']} has its "
                          "own test split)")
    if dcfg["name"] == "folder" or dcfg.get("dir") is not None:  # read from files: a disk cache may be made
        _cache_dir_rule(dcfg, prefix)
    h, w, c = source_shape(dcfg)
    crop = dcfg.get("crop")
    if crop and crop > min(h, w):
        raise ConfigError(f"{prefix}crop={crop} is larger than the images ({h}x{w}): at most {min(h, w)}")
    for key in ("crop_padding", "cutout"):  # reflected padding needs fewer pixels than the image has
        value = dcfg.get(key) or 0
        if not 0 <= value < min(h, w):
            raise ConfigError(f"{prefix}{key}={value}: must lie in [0, {min(h, w) - 1}] for images of {h}x{w}")
    if dcfg["name"] != "folder" and dcfg.get("channels") not in (None, c):
        raise ConfigError(f"{prefix}channels={dcfg['channels']}: {dcfg['name']} has {c} (set it to null)")


def _cache_dir_rule(dcfg, prefix):
    """data.cache_dir, where a disk cache may go (data.cache auto or disk): made if missing;
    one line if it cannot be, or is not a writable folder. Here, with the config: not
    minutes into a load, as tempfile's FileNotFoundError."""
    given = dcfg.get("cache_dir")
    if given is None or (dcfg.get("cache") or "auto") not in ("auto", "disk"):
        return
    path = Path(os.path.expanduser(str(given)))
    remedy = f"pick another {prefix}cache_dir (null: the system's temporary folder)"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{prefix}cache_dir {path} is not a directory: {remedy}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        above = next((p for p in path.parents if os.path.lexists(p)), None)
        why = f"{above} is a file" if above is not None and not above.is_dir() else exc.strerror or str(exc)
        raise ConfigError(f"cannot make {prefix}cache_dir {path}: {why}; {remedy}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{prefix}cache_dir {path} is read-only: no disk cache can be written there; {remedy}")


def check_data_files(dcfg, prefix="data.", splits=SPLITS):
    """The files read from data.dir, by their paths alone: an MNIST-family dataset's IDX files
    of `splits` (capsnet.idx.idx_files' DataError, naming the directory), and a folder of class
    folders given to one for training said to be a data=folder's. (A folder's own: the data
    rule.) train.py and evaluate.py call it before the TensorFlow import (train.py also before
    the run dir); not part of `check`, which also checks a run's saved config for evaluate.py
    and predict.py, whose data need not be on this machine."""
    name, data_dir = dcfg["name"], dcfg.get("dir")
    if data_dir is None or DATASETS[name].kind == "images":
        return
    try:
        for split in splits:
            idx_files(data_dir, split)
    except DataError:
        if "train" in splits and folder.looks_like_image_folder(data_dir):
            raise ConfigError(f"{prefix}dir={data_dir} holds no IDX files for data.name={name}: this looks like an "
                              "image folder (class folders of images): add data=folder") from None
        raise


def _yaml(value):
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def check_overlay_augmentation(name, options, prefix="data."):
    """An overlay dataset (MultiMNIST) draws its digits shifted on a zero canvas: of the
    augmentation `options` (any of AUGMENTATION_OFF's keys) it takes only each digit's
    elastic distortion (OVERLAY_AUGMENTATION). ConfigError naming the others that are on;
    the config rule and capsnet.data.make_split_dataset (callers without a config) both
    check through here. Other datasets: nothing to check."""
    if not is_overlay(name):
        return
    on = [key for key, value in options.items() if key not in OVERLAY_AUGMENTATION and value != AUGMENTATION_OFF[key]]
    if on:
        raise ConfigError(f"{name} takes no flip/rotate/zoom/erase/shift_fill augmentation (its digits are shifted by "
                          f"{prefix}shift_pixels on a zero canvas; {prefix}elastic_alpha distorts each): got "
                          f"{', '.join(f'{prefix}{key}={options[key]}' for key in on)}; set "
                          f"{', '.join(f'{prefix}{key}={AUGMENTATION_OFF[key]}' for key in on)} "
                          f"({'the defaults' if len(on) > 1 else 'the default'})")


def _train_rule(tcfg, prefix):
    """The margin loss's rule, a finite learning rate (the field's check passes inf, a
    positive number, which would turn the first step's weights into NaN), and a warm-up
    that the schedule has and that leaves it steps to decay over."""
    _margin_rule(tcfg, prefix)
    if not math.isfinite(tcfg["learning_rate"]):
        raise ConfigError(f"{prefix}learning_rate must be a finite positive number, got {tcfg['learning_rate']!r}")
    warmup = tcfg["warmup_epochs"]
    if warmup and tcfg["lr_schedule"] != "cosine":
        raise ConfigError(f"{prefix}warmup_epochs={warmup:g} needs {prefix}lr_schedule=cosine "
                          f"(the exponential schedule starts at the full rate), got lr_schedule={tcfg['lr_schedule']!r}")
    if warmup and warmup >= tcfg["epochs"]:
        raise ConfigError(f"{prefix}warmup_epochs={warmup:g} must be fewer than {prefix}epochs={tcfg['epochs']} "
                          "(the cosine decay follows the warm-up)")


_SECTION_RULES = {DataConfig: _data_rule, TrainConfig: _train_rule, DistributeConfig: _distribute_rule}


def check_section(schema, values, prefix=""):
    """`values` (a dict) checked against `schema`: every key known, each value by its
    field's check, then the section's rule. Keys it lacks take the schema default (a
    required one, MISSING, → ConfigError). Returns the checked dict (plain types)."""
    name = prefix.rstrip(".") or "the config"
    if not isinstance(values, dict):
        raise ConfigError(f"{name} must be a section of keys, got {values!r}")
    known = [f.name for f in dataclasses.fields(schema)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        renamed = " (model.jit_routing and model.fused_routing are now model.routing.backend: auto | tf | xla)" \
            if schema is ModelConfig and {"jit_routing", "fused_routing"} & set(unknown) else ""
        raise ConfigError(f"{name} has unknown key(s) {', '.join(unknown)} (known: {', '.join(known)}){renamed}")
    checked = {}
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(f.type):
            checked[f.name] = check_section(f.type, values.get(f.name, {}), f"{prefix}{f.name}.")
            continue
        if f.name in values:
            value = values[f.name]
        else:
            value = field_default(f)
            if value is MISSING:
                raise ConfigError(f"{prefix}{f.name} is missing")
        checked[f.name] = f.metadata["check"](prefix + f.name, value)
    rule = _SECTION_RULES.get(schema)
    if rule is not None:
        rule(checked, prefix)
    return checked


def check_xla(xla, backend):
    """train.xla against what it would compile: model.routing.backend=xla (an XLA
    computation of its own; a Router's backend matmul_xla or op_xla) must not be nested
    inside jit. `check`'s rule, and make_train_step's guard (a model built outside a
    config). The compiled ops have XLA kernels (ops/xla_kernels.cc), so jit compiles
    custom_op=true too."""
    if xla == "jit" and (backend == "xla" or backend.endswith("_xla")):
        # The whole step is one XLA computation already; the nested jit_compile function
        # aborted the process on an H200 (benchmark_train, 2026-11-21).
        raise ConfigError("model.routing=xla is redundant under train.xla=jit (the whole step is compiled, "
                          "the routing with it): set model.routing.backend=auto")


def check_all_reduce_in_step(all_reduce, xla, loss_scaling, weight_decay=0.0):
    """distribute.all_reduce=xla puts the all-reduce and the Adam update into each replica's
    compiled step: there must be one (train.xla=jit), and no loss scaling, whose
    skip-or-apply decision (Keras' LossScaleOptimizer) is not in that compiled update, nor
    weight decay (Keras applies it outside update_step).
    `check`'s rule, and make_train_step's guard (a step made outside a config), as check_xla."""
    if all_reduce != "xla":
        return
    if xla != "jit":
        raise ConfigError(f"distribute.all_reduce=xla compiles the all-reduce into each replica's XLA step: "
                          f"it needs train.xla=jit, got train.xla={xla!r}")
    if loss_scaling:
        raise ConfigError("distribute.all_reduce=xla has no loss scaling in its compiled update (mixed_float16's): "
                          "use train.precision=float32 or mixed_bfloat16, or distribute.all_reduce=collective")
    if weight_decay:
        raise ConfigError(f"distribute.all_reduce=xla applies plain Adam updates, without weight decay: set "
                          f"distribute.all_reduce=collective or train.weight_decay=0 (got {weight_decay})")


# custom_op runs capsule routing, which only the ROUTED_KINDS have (also build_capsnet's words).
CUSTOM_OP_CAPSNET_ONLY = ("custom_op=true: model.kind={kind} has no capsule routing for the op to run: "
                          "set custom_op=false")


def check(cfg):
    """A train config (a plain dict shaped like configs/train.yaml) checked: ConfigError
    naming the first bad key, else the checked dict with plain types (lists for sequences)
    and a section's missing keys at their schema defaults. Idempotent: train() checks what
    train.py checked already. Rules across sections: train.xla against custom_op and
    model.routing (check_xla); an overlay dataset on one device; distribute.all_reduce=xla
    against train (check_all_reduce_in_step); train.data_on_device's needs
    (check_data_on_device); run_dir set."""
    checked = check_section(TrainAppConfig, cfg)
    check_xla(checked["train"]["xla"], checked["model"]["routing"]["backend"])
    if checked["custom_op"] and checked["model"]["kind"] not in ROUTED_KINDS:
        raise ConfigError(CUSTOM_OP_CAPSNET_ONLY.format(kind=checked["model"]["kind"]))
    data_name, strategy = checked["data"]["name"], checked["distribute"]["strategy"]
    if is_overlay(data_name) and strategy != "none":
        # Its (B, 2) labels and two reconstructions are not in the distributed step.
        raise ConfigError(f"data.name={data_name} trains on one device only: set distribute=none")
    if is_overlay(data_name) and checked["model"]["kind"] != "capsnet":
        # Its steps take two labels and reconstruct each digit: capsule outputs.
        raise ConfigError(f"data.name={data_name} has two digits an image; model.kind={checked['model']['kind']} "
                          "classifies one: use model=capsnet")
    if DATASETS[data_name].kind == "images" and checked["train"]["data_on_device"]:
        # Its crops and colour changes run per example in tf.data; a folder may stream from a file cache.
        raise ConfigError(f"train.data_on_device=true: not for natural images (data.name={data_name}): set it to false")
    # capsnet.precision.needs_loss_scaling's rule (that module imports TensorFlow).
    check_all_reduce_in_step(checked["distribute"]["all_reduce"], checked["train"]["xla"],
                             checked["train"]["precision"] == "mixed_float16", checked["train"]["weight_decay"])
    if checked["train"]["data_on_device"]:
        check_data_on_device(checked)
    if not checked["run_dir"]:
        raise ConfigError("run_dir is not set (train.py sets it to Hydra's run dir; tests pass one)")
    return checked


# The augmentations that run per example in tf.data (capsnet.data.make_dataset), which
# train.data_on_device's batches do not have.
PER_EXAMPLE_AUGMENTATION = ("rotate_degrees", "zoom")
# What an overlay dataset (MultiMNIST) takes beyond its shifts: each digit distorted on its own
# before the two are overlaid (capsnet.data.pairs_from_draws). The others act on a whole image
# (a flip or an erased box would change both digits together), which the pairs do not have.
OVERLAY_AUGMENTATION = ("elastic_alpha", "elastic_sigma")


def check_data_on_device(cfg):
    """train.data_on_device=true's needs (capsnet.training.device_input): the call's steps
    are one XLA program (train.xla=jit) on one device, or the mirrored step's on the
    devices of one machine (distribute=mirrored), over a dataset augmented a batch at a
    time (flip, shift, elastic, erase; MultiMNIST's pairs)."""
    if cfg["train"]["xla"] != "jit":
        raise ConfigError(f"train.data_on_device=true runs each call's steps as one XLA program: set train.xla=jit "
                          f"(got {cfg['train']['xla']}) or train.data_on_device=false")
    if cfg["distribute"]["strategy"] not in ("none", "mirrored"):
        raise ConfigError(f"train.data_on_device=true trains on the devices of one machine: set distribute=none or "
                          f"distribute=mirrored (got {cfg['distribute']['strategy']}) or train.data_on_device=false")
    on = [f"data.{key}={cfg['data'][key]}" for key in PER_EXAMPLE_AUGMENTATION if cfg["data"][key]]
    if on:
        raise ConfigError(f"train.data_on_device=true augments whole batches on the device (flip, shift, elastic, "
                          f"erase); {', '.join(on)} runs per example in tf.data: set it to 0 or "
                          f"train.data_on_device=false")


def check_eval(cfg):
    """An eval config (shaped like configs/eval.yaml) checked, as `check` does."""
    if cfg.get("checkpoint", MISSING) in (MISSING, "???"):
        raise ConfigError("checkpoint=... is required: a run dir (outputs/<date>/<time>) or a checkpoint path "
                          "(or a list of them: an ensemble)")
    return check_section(EvalAppConfig, cfg)


def check_predict(cfg):
    """A predict config (shaped like configs/predict.yaml) checked, as `check` does."""
    for key, what in (("checkpoint", "a run dir (outputs/<date>/<time>), a checkpoint path or an exported "
                                     "SavedModel directory"),
                      ("images", "an image file, a directory of images or a glob like 'digits/*.png'")):
        if cfg.get(key, MISSING) in (MISSING, "???"):
            raise ConfigError(f"{key}=... is required: {what}")
    return check_section(PredictAppConfig, cfg)
