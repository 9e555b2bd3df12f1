"""The training config's checks: `check_train_config(cfg)`, the one entry point.

train() calls it first, before TensorFlow touches a device or the data is read, so a bad
value is one ConfigError naming the key. `ema_decay` is also read back from a run's
saved config by evaluate(); `distribute_config` fills in and checks the distribute
section (its choices live in capsnet.training.distribute).
"""
import logging
import os

from capsnet.data import augmentation_options, check_augmentation
from capsnet.errors import ConfigError
from capsnet.losses import loss_params
from capsnet.training.distribute import ALL_REDUCE, DISTRIBUTE_DEFAULTS, SCALE_LR, STRATEGIES, read_tf_config
from capsnet.training.steps import check_xla
from capsnet.validation import boolean, float_in_range, integer, positive_float, positive_int

log = logging.getLogger(__name__)


def check_train_config(cfg):
    """Every value train() reads before the heavy work (data, model): ConfigError naming it.

    Returns the sections train() reads, as plain dicts of their own: (model, data,
    train, distribute), the distribute section checked and with its defaults
    (distribute_config).
    """
    _check_bools(cfg)
    train_cfg = cfg["train"]
    for key in ("epochs", "batch_size", "keep_checkpoints", "log_every_steps", "steps_per_execution", "num_images",
                "histogram_examples"):
        positive_int(f"train.{key}", train_cfg[key], error=ConfigError)
    positive_int("train.lr_decay_steps", train_cfg["lr_decay_steps"], allow_none=True, error=ConfigError)
    for key in ("learning_rate", "lr_decay_rate"):
        positive_float(f"train.{key}", train_cfg[key], error=ConfigError)
    loss_params(cfg["train"])  # m_plus, m_minus, lambda_, reconstruction_weight
    ema_decay(train_cfg)
    check_xla(cfg["train"]["xla"], cfg["custom_op"], cfg["model"].get("jit_routing", False))
    check_augmentation("data.", **augmentation_options(cfg["data"]))
    integer("seed", cfg["seed"], error=ConfigError)
    if not cfg.get("run_dir"):
        raise ConfigError("run_dir is not set (train.py sets it to Hydra's run dir; tests pass one)")
    return dict(cfg["model"]), dict(cfg["data"]), dict(train_cfg), distribute_config(cfg)


# (section, key, default when absent; None = required). Only real booleans pass: Hydra
# passes `custom_op=no` as the string 'no', which bool() would read as True.
BOOL_KEYS = (
    (None, "custom_op", None), (None, "deterministic", False), (None, "debug", False),
    ("train", "lr_staircase", None), ("train", "progress_bar", None),
    ("model", "decoder", True), ("model", "stop_gradient_routing", True), ("model", "jit_routing", False),
)


def _check_bools(cfg):
    for section, key, default in BOOL_KEYS:
        values = cfg[section] if section else cfg
        if not isinstance(values, dict):
            raise ConfigError(f"{section} must be a section of keys, got {values!r}")
        value = values[key] if default is None else values.get(key, default)
        boolean(f"{section}.{key}" if section else key, value, error=ConfigError)


def ema_decay(train_cfg):
    """train.ema_decay checked: a float in [0, 1) (0 = no weight average kept; 1 would
    never move the average from the initial weights)."""
    value = train_cfg.get("ema_decay", 0.0)
    try:
        decay = float_in_range("train.ema_decay", value, 0, 1)
    except ValueError:
        decay = None
    if decay is None or decay == 1:
        raise ConfigError(f"train.ema_decay must be a number in [0, 1) (0: no average; 0.999 averages over "
                          f"~1000 steps), got {value!r}")
    return decay


def distribute_config(cfg):
    """The checked `distribute` section of a config (absent = one device): ConfigError
    naming the key and value. multi_worker also needs a valid TF_CONFIG (read_tf_config)."""
    section = cfg.get("distribute", DISTRIBUTE_DEFAULTS)
    if not isinstance(section, dict):
        raise ConfigError(f"distribute must be a section of keys, got {section!r}")
    unknown = sorted(set(section) - set(DISTRIBUTE_DEFAULTS))
    if unknown:
        raise ConfigError(f"distribute has unknown key(s) {', '.join(unknown)} "
                          f"(known: {', '.join(DISTRIBUTE_DEFAULTS)})")
    dcfg = {**DISTRIBUTE_DEFAULTS, **section}
    strategy = dcfg["strategy"]
    if strategy not in STRATEGIES:
        raise ConfigError(f"distribute.strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if dcfg["all_reduce"] not in ALL_REDUCE[strategy]:
        raise ConfigError(f"distribute.all_reduce must be one of {', '.join(ALL_REDUCE[strategy])} with "
                          f"distribute={strategy}, got {dcfg['all_reduce']!r}")
    devices = dcfg["devices"]
    if devices is not None:
        if strategy != "mirrored":
            raise ConfigError(f"distribute.devices applies to distribute=mirrored only (distribute={strategy} "
                              f"{'uses one device' if strategy == 'none' else 'uses every GPU of each worker'}), "
                              f"got {devices!r}: set it to null")
        if (not isinstance(devices, (list, tuple)) or not devices
                or not all(isinstance(d, str) and d.strip() for d in devices)):
            raise ConfigError(f"distribute.devices must be null or a non-empty list of device names like "
                              f"[/gpu:0, /gpu:1], got {devices!r}")
        if len(set(devices)) != len(devices):
            raise ConfigError(f"distribute.devices lists a device more than once: {list(devices)}")
        dcfg["devices"] = list(devices)
    if dcfg["scale_lr"] not in SCALE_LR:
        raise ConfigError(f"distribute.scale_lr must be one of {', '.join(SCALE_LR)}, got {dcfg['scale_lr']!r}")
    positive_int("distribute.lr_base_batch_size", dcfg["lr_base_batch_size"], error=ConfigError)
    if strategy == "multi_worker":
        read_tf_config()
    elif os.environ.get("TF_CONFIG"):
        log.warning("TF_CONFIG is set but distribute=%s: this process trains alone (distribute=multi_worker "
                    "joins the cluster)", strategy)
    return dcfg
