"""The schemas: one dataclass per config group, each field with its value check beside it
(`field(..., metadata={"check": ...})`), and the choices they allow.

A field check takes (the key as the user writes it, the value) and returns the value in
its plain Python type, or raises ConfigError with the wording users have always seen.
The checks that span a section's keys, or sections, are in capsnet.config.checks.
Schema defaults are what a run saved before a key existed was trained with
(capsnet.config.migrate fills them in): never change one; change the YAML value instead.
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING

from capsnet.datasets import DATASETS, DEFAULT_MAX_PIXELS
from capsnet.errors import ConfigError
from capsnet.validation import (boolean, finite_float, float_in_range, integer, positive_float, positive_int,
                                positive_int_tuple)

# --------------------------------------------------------------------------- choices

ROUTING = ("auto", "tf", "xla")                                        # model.routing.backend
ROUTING_DEFAULT = {"algorithm": "dynamic", "backend": "auto", "leaky": False}  # configs/model/routing/dynamic.yaml
XLA_MODES = ("none", "autocluster", "jit")                              # train.xla
EVAL_XLA = ("none", "jit")                                              # evaluate.py xla (autocluster is process-wide)
CONV_FORMS = ("auto", "strided", "space_to_depth")                      # model.primary_caps_conv
PADDINGS = ("valid", "same")                                            # model.padding
INITIALIZERS = ("keras", "authors")                                     # model.initializers
MODEL_KINDS = ("capsnet", "baseline_cnn", "deep_capsnet", "deep_cnn")  # model.kind
ROUTED_KINDS = ("capsnet", "deep_capsnet")                             # the model kinds with capsule routing
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")            # train.precision (Keras policy names)
STRATEGIES = ("none", "mirrored", "multi_worker")                       # distribute.strategy
ALL_REDUCE = {                                                          # distribute.all_reduce, per strategy
    "none": ("auto",),
    "mirrored": ("auto", "collective", "xla", "nccl", "one_device"),
    "multi_worker": ("auto", "nccl", "ring"),
}
SCALE_LR = ("none", "linear", "sqrt")                                   # distribute.scale_lr
LR_SCHEDULES = ("exponential", "cosine")                                # train.lr_schedule
OPTIMIZERS = ("adam", "sgd")                                            # train.optimizer
SHIFT_FILLS = ("zero", "edge")                                          # data.shift_fill
WHICH = ("best", "latest")                                              # eval: which
WEIGHTS = ("raw", "ema")                                                # eval: weights
TTA = ("none", "flip", "shift")                                         # eval: tta
DATA_CACHES = ("auto", "memory", "disk", "none")                        # data.cache


# --------------------------------------------------------------------------- field checks
# Each takes (the key as the user writes it, the value) and returns the value in its plain
# Python type, or raises ConfigError with the wording users have always seen.

def _positive_int(name, value):
    return positive_int(name, value, error=ConfigError)


def _optional_positive_int(name, value):
    return positive_int(name, value, allow_none=True, error=ConfigError)


def _positive_float(name, value):
    return positive_float(name, value, error=ConfigError)


def _finite_float(name, value):
    return finite_float(name, value, error=ConfigError)


def _optional_finite_float(name, value):
    return None if value is None else _finite_float(name, value)


def _boolean(name, value):
    return boolean(name, value, error=ConfigError)


def _integer(name, value):
    return integer(name, value, error=ConfigError)


def _seed(name, value):
    # keras.utils.set_random_seed seeds NumPy too, whose np.random.seed takes [0, 2**32 - 1] only.
    return integer(name, value, minimum=0, maximum=2**32 - 1, error=ConfigError)


def _string(name, value):
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    return value


def _optional_string(name, value):
    return None if value is None else _string(name, str(value) if hasattr(value, "__fspath__") else value)


def _one_of(choices, *, allow_none=False):
    def check_choice(name, value):
        if value is None and allow_none:
            return None
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)}"
                              f"{' (or null)' if allow_none else ''}, got {value!r}")
        return value
    return check_choice


def _in_range(low, high):
    def check_range(name, value):
        float_in_range(name, value, low, high, error=ConfigError)
        return value  # as written: an int stays an int (see AugmentationConfig)
    return check_range


def _input_shape(name, value):
    # One int is repeated (5 → [5, 5, 5]), as CapsNet reads it.
    return list(positive_int_tuple(name, value, length=3, error=ConfigError))


def _int_list(name, value):
    return list(positive_int_tuple(name, value, error=ConfigError))


def _ema_decay(name, value):
    try:
        decay = float_in_range(name, value, 0, 1)
    except ValueError:
        decay = None
    if decay is None or decay == 1:  # 1 would never move the average from the initial weights
        raise ConfigError(f"{name} must be a number in [0, 1) (0: no average; 0.999 averages over "
                          f"~1000 steps), got {value!r}")
    return decay


def _warmup_epochs(name, value):
    return float_in_range(name, value, 0, 1000, error=ConfigError)


def _non_negative_float(name, value):
    value = finite_float(name, value, error=ConfigError)
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}")
    return value


def _devices(name, value):
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(d, str) and d.strip() for d in value)):
        raise ConfigError(f"{name} must be null or a non-empty list of device names like [/gpu:0, /gpu:1], "
                          f"got {value!r}")
    if len(set(value)) != len(value):
        raise ConfigError(f"{name} lists a device more than once: {list(value)}")
    return list(value)


def _dataset_name(name, value):
    return _one_of(tuple(sorted(DATASETS)))(name, value)


def _optional_channels(name, value):
    if value is None:
        return None
    return integer(name, value, minimum=1, maximum=3, hint=" (1 grey, 3 RGB; null: the dataset's)", error=ConfigError)


def _optional_names(name, value):
    if value is None:
        return None
    if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{name} must be a list of class names (non-empty strings) or null, got {value!r}")
    return [str(v) for v in value]


def _limit(name, value):
    if value is None:
        return None
    return integer(name, value, minimum=1, hint=" (null: all examples)", error=ConfigError)


def _optional_pixels(null_means):
    """A check for a pixel count >= 0 or null, whose error says what null means."""
    def check(name, value):
        if value is None:
            return None
        return integer(name, value, minimum=0, hint=f" (null: {null_means})", error=ConfigError)
    return check


def _checkpoint(name, value):
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(item, str) or hasattr(item, "__fspath__") for item in items):
        raise ConfigError(f"{name} must be a run dir or checkpoint path, or a list of them, got {value!r}")
    return value


def _eval_batch_size(name, value):
    return positive_int(name, value, allow_none=True,
                        expected="a positive integer (or null: the run's train.batch_size)", error=ConfigError)


def _eval_boolean(name, value):
    if value is None:
        return None
    return boolean(name, value, expected="true or false (or null: as trained)", error=ConfigError)


def _eval_precision(name, value):
    if value is not None and value not in PRECISIONS:
        raise ConfigError(f"{name} must be one of {', '.join(PRECISIONS)} (or null: as trained), got {value!r}")
    return value


def _eval_xla(name, value):
    if value is not None and value not in EVAL_XLA:
        raise ConfigError(f"{name} must be one of {', '.join(EVAL_XLA)} (or null: as trained), got {value!r}")
    return value


def _eval_weights(name, value):
    if value is not None and value not in WEIGHTS:
        raise ConfigError(f"{name} must be one of {', '.join(WEIGHTS)} (or null: the run's average if it kept "
                          f"one), got {value!r}")
    return value


def field_default(f):
    """The default of the schema field `f` (its factory's value where it has one), or MISSING."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default if f.default is not dataclasses.MISSING else MISSING


def _checked(default=MISSING, check=None, factory=None):
    """A schema field with its value check beside it."""
    if factory is not None:
        return field(default_factory=factory, metadata={"check": check})
    return field(default=default, metadata={"check": check})


def _routing(name, value):
    """model.routing: a section {algorithm, backend, the algorithm's keys}; a string
    auto | tf | xla (what model.routing was before routers) is dynamic routing's backend."""
    if isinstance(value, str) and value in ROUTING:
        return {**ROUTING_DEFAULT, "backend": value}
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be one of {', '.join(ROUTING)}, got {value!r} (or a section: "
                          f"{name}.algorithm, {name}.backend, ...; configs/model/routing/)")
    algorithm = value.get("algorithm", "dynamic")
    if not isinstance(algorithm, str):
        raise ConfigError(f"{name}.algorithm must be a name (configs/model/routing/), got {algorithm!r}")
    checked = {**value, "algorithm": algorithm, "backend": _one_of(ROUTING)(f"{name}.backend", value.get("backend", "auto"))}
    if "leaky" in value:
        checked["leaky"] = _boolean(f"{name}.leaky", value["leaky"])
    return checked


# --------------------------------------------------------------------------- schemas
# configs/<group>/*.yaml extend these (defaults: [schema, _self_]); the comments on each
# key are in the YAML files.

@dataclass
class ModelConfig:
    """configs/model/: the arguments of capsnet.model.CapsNet, and how its routing runs."""
    # Derived from the dataset (see dataset_shape / dataset_classes below); a value given wins.
    input_shape: Any = _checked("${dataset_shape:${data.name},${data.shift_pixels},${data.pad_pixels}}",
                                _input_shape)
    num_classes: int = _checked("${dataset_classes:${data.name}}", _positive_int)
    conv1_filters: int = _checked(256, _positive_int)
    conv1_kernel_size: int = _checked(9, _positive_int)
    primary_caps_types: int = _checked(32, _positive_int)
    primary_caps_dim: int = _checked(8, _positive_int)
    primary_caps_kernel_size: int = _checked(9, _positive_int)
    primary_caps_strides: int = _checked(2, _positive_int)
    digit_caps_dim: int = _checked(16, _positive_int)
    routing_iterations: int = _checked(3, _positive_int)
    stop_gradient_routing: bool = _checked(True, _boolean)
    # configs/model/routing/<algorithm>.yaml; its keys past algorithm and backend are the
    # router's arguments (checked when it is built). Any: an old `model.routing=tf` string
    # override still works (_routing).
    routing: Any = _checked(check=_routing, factory=lambda: dict(ROUTING_DEFAULT))
    decoder: bool = _checked(True, _boolean)
    decoder_units: List[int] = _checked(check=_int_list, factory=lambda: [512, 1024])
    w_init_stddev: float = _checked(0.1, _positive_float)
    initializers: str = _checked("keras", _one_of(INITIALIZERS))
    primary_caps_conv: str = _checked("auto", _one_of(CONV_FORMS))
    padding: str = _checked("valid", _one_of(PADDINGS))
    digit_caps_bias: Optional[float] = _checked(None, _optional_finite_float)
    primary_caps_scale: float = _checked(1.0, _positive_float)
    primary_caps_bias: float = _checked(0.0, _finite_float)
    # Which network (capsnet.training.model_setup.build_capsnet): capsnet, the paper's CNN
    # baseline (capsnet.baseline.BaselineCNN), which reads only input_shape, num_classes and cnn_*,
    # or the ResNet-9 stem with capsules or a dense head (capsnet.deep.DeepCapsNet: deep_capsnet, deep_cnn).
    kind: str = _checked("capsnet", _one_of(MODEL_KINDS))
    cnn_filters: List[int] = _checked(check=_int_list, factory=lambda: [256, 256, 128])
    cnn_kernel_size: int = _checked(5, _positive_int)
    cnn_dense_units: List[int] = _checked(check=_int_list, factory=lambda: [328, 192])
    cnn_dropout: float = _checked(0.5, _in_range(0, 0.99))
    # deep_capsnet / deep_cnn (capsnet.deep.DeepCapsNet): the ResNet-9 stem's four widths.
    deep_widths: List[int] = _checked(check=_int_list, factory=lambda: [64, 128, 256, 512])


@dataclass
class DataSourceConfig:
    """configs/data/: which dataset, where, how much of it, and its shifts."""
    name: str = _checked("mnist", _dataset_name)
    dir: Optional[str] = _checked(None, _optional_string)
    limit_train: Optional[int] = _checked(None, _limit)
    limit_test: Optional[int] = _checked(None, _limit)
    # Every kind: this share of each class of the training examples (after limit_train) held
    # out as the validation split, which chooses checkpoints/best (capsnet/tasks/holdout.py)
    validation_fraction: Any = _checked(0.0, _in_range(0, 0.9))
    shift_pixels: int = _checked(2, _integer)  # its range is the image's: checked by the data pipeline
    # MultiMNIST's canvas border (null: shift_pixels)
    pad_pixels: Optional[int] = _checked(None, _optional_pixels("data.shift_pixels"))
    # Natural images (data=folder, cifar10, svhn_cropped, smallnorb: capsnet/tasks/images.py);
    # the MNIST family refuses them set (_data_rule).
    image_size: Optional[int] = _checked(None, _optional_positive_int)  # a folder's images resized/cropped to it
    channels: Optional[int] = _checked(None, _optional_channels)  # a folder's: 1 grey | 3 RGB
    crop: Optional[int] = _checked(None, _optional_positive_int)  # random crop x crop in training, the centre at test
    test_fraction: Any = _checked(0.0, _in_range(0, 0.9))  # a folder without train/ and test/: the test share
    cache: str = _checked("auto", _one_of(DATA_CACHES))
    cache_memory_mb: int = _checked(2048, _positive_int)  # cache=auto: decoded images above it go to a file cache
    cache_dir: Optional[str] = _checked(None, _optional_string)  # the file cache's folder (null: the system's temp)
    class_names: Optional[List[str]] = _checked(None, _optional_names)  # a folder's classes (its folder names)
    # An image file whose header declares more pixels is skipped unread (a folder; predict)
    max_pixels: int = _checked(DEFAULT_MAX_PIXELS, _positive_int)
    standardize: bool = _checked(False, _boolean)  # per-image standardisation (tf.image.per_image_standardization)
    brightness: Any = _checked(0.0, _in_range(0, 1))  # training: random brightness delta in +-brightness
    contrast: Any = _checked(0.0, _in_range(0, 0.9))  # training: random contrast factor in [1 - c, 1 + c]
    crop_padding: int = _checked(0, _integer)  # training: the image's border reflected by this many pixels before the random crop
    cutout: int = _checked(0, _integer)  # training: a cutout x cutout square (clipped at the edges) zeroed at a random centre


@dataclass
class AugmentationConfig:
    """configs/augmentation/ (mounted in `data`: data.flip, ...): training augmentation
    beyond data.shift_pixels. The defaults are off: the first release's pipeline.

    The numbers are typed Any, checked by _in_range (a real number in its range, no
    bool): a float field would store `rotate_degrees: 0` as 0.0, and run configs and a
    refused resume's differences ("data.rotate_degrees: 0 -> 5") show them as written."""
    flip: bool = _checked(False, _boolean)
    rotate_degrees: Any = _checked(0.0, _in_range(0, 180))
    zoom: Any = _checked(0.0, _in_range(0, 0.5))
    elastic_alpha: Any = _checked(0.0, _in_range(0, 100))
    elastic_sigma: Any = _checked(4.0, _in_range(0.5, 10))
    shift_fill: str = _checked("zero", _one_of(SHIFT_FILLS))
    erase_probability: Any = _checked(0.0, _in_range(0, 1))
    erase_max_area: Any = _checked(0.4, _in_range(0.02, 1))


@dataclass
class DataConfig(AugmentationConfig, DataSourceConfig):
    """The `data` section: configs/data/ (DataSourceConfig's keys) and, merged into it,
    configs/augmentation/ (AugmentationConfig's). The schema of both groups' files: the
    augmentation files name none (a DataConfig of defaults would reset the dataset's keys),
    the section they are merged into is a DataConfig."""


@dataclass
class TrainConfig:
    """configs/train/: optimisation, losses, checkpoints, logging."""
    epochs: int = _checked(50, _positive_int)
    batch_size: int = _checked(100, _positive_int)
    test_batch_size: Optional[int] = _checked(None, _optional_positive_int)
    drop_remainder: bool = _checked(False, _boolean)
    learning_rate: float = _checked(0.001, _positive_float)
    optimizer: str = _checked("adam", _one_of(OPTIMIZERS))
    momentum: float = _checked(0.9, _in_range(0, 1))  # optimizer=sgd: Nesterov momentum
    lr_schedule: str = _checked("exponential", _one_of(LR_SCHEDULES))
    lr_decay_rate: float = _checked(0.9, _positive_float)
    lr_decay_steps: Optional[int] = _checked(None, _optional_positive_int)
    lr_staircase: bool = _checked(False, _boolean)
    lr_decay_floor: float = _checked(0.0, _in_range(0, 1))  # exponential: the rate stops falling at it
    warmup_epochs: float = _checked(0.0, _warmup_epochs)
    xla: str = _checked("none", _one_of(XLA_MODES))
    precision: str = _checked("float32", _one_of(PRECISIONS))
    tf32: bool = _checked(True, _boolean)
    xla_cache_dir: Optional[str] = _checked(None, _optional_string)
    m_plus: float = _checked(0.9, _finite_float)
    m_minus: float = _checked(0.1, _finite_float)
    lambda_: float = _checked(0.5, _finite_float)
    reconstruction_weight: float = _checked(0.0005, _non_negative_float)
    weight_decay: float = _checked(0.0, _non_negative_float)
    ema_decay: float = _checked(0.0, _ema_decay)
    test_every_epochs: int = _checked(1, _positive_int)
    save_every_epochs: int = _checked(1, _positive_int)
    collapse_patience: Optional[int] = _checked(10, _optional_positive_int)
    keep_checkpoints: int = _checked(3, _positive_int)
    log_every_steps: int = _checked(50, _positive_int)
    steps_per_execution: int = _checked(50, _positive_int)
    data_on_device: bool = _checked(False, _boolean)
    num_images: int = _checked(8, _positive_int)
    histogram_examples: int = _checked(100, _positive_int)
    # TensorBoard's figures at the end of training (capsnet.figures); runs saved before it had none.
    figures: bool = _checked(False, _boolean)
    progress_bar: bool = _checked(True, _boolean)
    progress_every_seconds: float = _checked(30.0, _non_negative_float)
    long_run_notice_minutes: float = _checked(60.0, _non_negative_float)
    restart: bool = _checked(False, _boolean)


@dataclass
class DistributeConfig:
    """configs/distribute/: one device, or the replicas of tf.distribute. The defaults are
    one device (what a run saved before distribute existed trained on)."""
    strategy: str = _checked("none", _one_of(STRATEGIES))
    devices: Optional[List[str]] = _checked(None, _devices)
    all_reduce: str = _checked("auto", _string)  # its choices depend on the strategy: _distribute_rule
    scale_lr: str = _checked("none", _one_of(SCALE_LR))
    lr_base_batch_size: int = _checked(100, _positive_int)


@dataclass
class TrainAppConfig:
    """configs/train.yaml: what train.py composes and capsnet.training.train receives."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distribute: DistributeConfig = field(default_factory=DistributeConfig)
    custom_op: bool = _checked(False, _boolean)
    seed: int = _checked(0, _seed)
    deterministic: bool = _checked(False, _boolean)
    debug: bool = _checked(False, _boolean)
    run_dir: Optional[str] = _checked(None, _optional_string)
    name: Optional[str] = _checked(None, _optional_string)  # the run dir's suffix (hydra_plugins/capsnet_run_name)


@dataclass
class EvalDataConfig:
    """configs/eval.yaml's data: which test split (null = as in the run's config)."""
    name: Optional[str] = _checked(None, lambda n, v: None if v is None else _dataset_name(n, v))
    dir: Optional[str] = _checked(None, _optional_string)
    limit_test: Optional[int] = _checked(None, _limit)
    shift_pixels: Optional[int] = _checked(None, _optional_pixels("the run's"))  # MultiMNIST's test pairs: their shifts
    pad_pixels: Optional[int] = _checked(None, _optional_pixels("the run's"))    # and canvas border


@dataclass
class EvalAppConfig:
    """configs/eval.yaml: what evaluate.py composes."""
    checkpoint: Any = _checked(MISSING, _checkpoint)
    # null: best where the run chose it on a validation split, else latest (checkpoints.default_which)
    which: Optional[str] = _checked(None, _one_of(WHICH, allow_none=True))
    custom_op: Optional[bool] = _checked(None, _eval_boolean)
    batch_size: Optional[int] = _checked(None, _eval_batch_size)
    weights: Optional[str] = _checked(None, _eval_weights)
    precision: Optional[str] = _checked(None, _eval_precision)
    tf32: Optional[bool] = _checked(None, _eval_boolean)
    xla: Optional[str] = _checked(None, _eval_xla)
    output: Optional[str] = _checked(None, _optional_string)
    overwrite: bool = _checked(False, _boolean)  # an existing output= file may be replaced
    tta: str = _checked("none", _one_of(TTA))
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    debug: bool = _checked(False, _boolean)


# Schema of each config group (configs/<group>/*.yaml start with `defaults: [schema, _self_]`).
GROUP_SCHEMAS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "distribute": DistributeConfig}
APP_SCHEMAS = {"train_schema": TrainAppConfig, "eval_schema": EvalAppConfig}
AUGMENTATION_OFF = {f.name: f.default for f in dataclasses.fields(AugmentationConfig)}


def augmentation_options(data_cfg):
    """The AUGMENTATION_OFF keys of a `data` config section, each at its default where the
    section lacks it (a run saved before the key existed trained without it)."""
    return {key: data_cfg.get(key, off) for key, off in AUGMENTATION_OFF.items()}


def augmentation_on(data_cfg):
    """The options of augmentation_options(data_cfg) that are not off, as the overrides that
    set them (["data.elastic_alpha=16", ...]; [] when all are off), for one-line errors."""
    return [f"data.{key}={value}" for key, value in augmentation_options(data_cfg).items()
            if value != AUGMENTATION_OFF[key]]


# --------------------------------------------------------------------------- predict.py

def _predict_checkpoint(name, value):
    if isinstance(value, (list, tuple)):
        raise ConfigError(f"{name} must be one run dir, checkpoint path or exported SavedModel directory "
                          f"(predict.py takes no ensemble), got {list(value)!r}")
    if not (isinstance(value, str) or hasattr(value, "__fspath__")) or str(value).strip() == "":
        raise ConfigError(f"{name} must be a run dir, checkpoint path or exported SavedModel directory, got {value!r}")
    return str(value)


def _image_paths(name, value):
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items or not all((isinstance(item, str) or hasattr(item, "__fspath__")) and str(item).strip()
                            for item in items):
        raise ConfigError(f"{name} must be an image file, a directory of images or a glob (or a list of them), "
                          f"got {value!r}")
    return [str(item) for item in items] if isinstance(value, (list, tuple)) else str(value)


@dataclass
class PredictAppConfig:
    """configs/predict.yaml: what predict.py composes (capsnet.prediction.predict's arguments)."""
    checkpoint: Any = _checked(MISSING, _predict_checkpoint)
    images: Any = _checked(MISSING, _image_paths)
    top_k: int = _checked(3, _positive_int)
    reconstruct: Optional[str] = _checked(None, _optional_string)
    which: Optional[str] = _checked(None, _one_of(WHICH, allow_none=True))
    weights: Optional[str] = _checked(None, _eval_weights)
    custom_op: Optional[bool] = _checked(None, _eval_boolean)
    batch_size: int = _checked(64, _positive_int)
    trust_export: bool = _checked(False, _boolean)  # run any SavedModel (a program), not only this project's exports
    debug: bool = _checked(False, _boolean)


APP_SCHEMAS["predict_schema"] = PredictAppConfig
