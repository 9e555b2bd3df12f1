"""The model of a config, and the check that its op can run: shared by train() and evaluate().

- `build_capsnet(model_cfg, custom_op, precision)`: the model of a config's `model`
  section, model.kind's class (CapsNet: model.routing and custom_op made a Router,
  capsnet.config.router_spec; or the CNN baseline) in a train.precision, config errors as ConfigError.
- `check_op_library(devices)`: custom_op=true fails at once if the compiled op cannot run.
"""
import tensorflow as tf

from capsnet import ops
from capsnet.baseline import build_baseline
from capsnet.deep import build_deep
from capsnet.config.routing import router_spec
from capsnet.config.checks import CUSTOM_OP_CAPSNET_ONLY
from capsnet.config.schemas import MODEL_KINDS
from capsnet.errors import ConfigError, OpLibraryError
from capsnet.model import build_model
from capsnet.routing import make_router


# model.kind=baseline_cnn: the BaselineCNN argument each of its config keys is.
BASELINE_KEYS = {"input_shape": "input_shape", "num_classes": "num_classes", "cnn_filters": "filters",
                 "cnn_kernel_size": "kernel_size", "cnn_dense_units": "dense_units", "cnn_dropout": "dropout"}
# model.kind=deep_capsnet / deep_cnn: the DeepCapsNet argument each of its config keys is (deep_cnn reads
# the first three: its head has no capsules), and the head each kind is.
DEEP_KEYS = {"input_shape": "input_shape", "num_classes": "num_classes", "deep_widths": "widths",
             "primary_caps_types": "primary_caps_types", "primary_caps_dim": "primary_caps_dim",
             "primary_caps_kernel_size": "primary_caps_kernel_size", "digit_caps_dim": "digit_caps_dim",
             "decoder": "decoder", "decoder_units": "decoder_units", "w_init_stddev": "w_init_stddev"}
DEEP_HEADS = {"deep_capsnet": "capsules", "deep_cnn": "dense"}


def build_capsnet(model_cfg, custom_op, precision="float32"):
    """The model of a config's `model` section and `custom_op`: model.kind picks the class
    (capsnet: CapsNet; baseline_cnn: capsnet.baseline.BaselineCNN from input_shape,
    num_classes and the cnn_* keys, the others unread; deep_capsnet / deep_cnn:
    capsnet.deep.DeepCapsNet from DEEP_KEYS, its capsule or dense head). CapsNet's DigitCaps routes with the
    Router of capsnet.config.router_spec (custom_op → its backend: the one place); bad values (a non-integer
    num_classes, input_shape=5, an unknown key, ...) → ConfigError naming them.
    `precision` (train.precision, checked): the model's Keras dtype policy (capsnet.precision).

    The values go to the model as they are: it checks them (and turns lists into
    tuples), so a bool(...) or tuple(...) here cannot misread or crash on them first.
    """
    kind = model_cfg.get("kind", "capsnet")  # (a config saved before model.kind: a CapsNet)
    if kind == "baseline_cnn":
        if custom_op:  # evaluate.py / export.py custom_op=true on a CNN run (train: config.check)
            raise ConfigError(CUSTOM_OP_CAPSNET_ONLY.format(kind=kind))
        try:
            return build_baseline(**{arg: model_cfg[key] for key, arg in BASELINE_KEYS.items() if key in model_cfg},
                                  dtype=precision)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"model: {' '.join(str(exc).split())}") from exc
    if kind in DEEP_HEADS:
        return _build_deep(model_cfg, custom_op, precision, DEEP_HEADS[kind])
    if kind != "capsnet":
        raise ConfigError(f"model.kind must be one of {', '.join(MODEL_KINDS)}, got {kind!r}")
    router_keys = ("routing", "routing_iterations", "stop_gradient_routing")  # the router's (router_spec)
    cnn_keys = ("kind", "deep_widths", *(key for key in BASELINE_KEYS if key.startswith("cnn_")))  # the others'
    model_cfg = {k: v for k, v in model_cfg.items() if k not in cnn_keys}
    try:
        router = make_router(**router_spec(custom_op, model_cfg))
        return build_model(**{k: v for k, v in model_cfg.items() if k not in router_keys}, router=router,
                           dtype=precision)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"model: {' '.join(str(exc).split())}") from exc


def _build_deep(model_cfg, custom_op, precision, head):
    """build_capsnet's DeepCapsNet: the capsule head routes with router_spec's Router (as CapsNet's
    DigitCaps); the dense head has none, and custom_op=true is refused for it."""
    if head == "dense" and custom_op:
        raise ConfigError(CUSTOM_OP_CAPSNET_ONLY.format(kind=model_cfg.get("kind")))
    keys = DEEP_KEYS if head == "capsules" else ("input_shape", "num_classes", "deep_widths")
    try:
        router = make_router(**router_spec(custom_op, model_cfg)) if head == "capsules" else None
        return build_deep(**{DEEP_KEYS[key]: model_cfg[key] for key in keys if key in model_cfg}, head=head,
                          router=router, dtype=precision)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"model: {' '.join(str(exc).split())}") from exc


def check_op_library(devices=None):
    """custom_op=true must use the compiled op: fail now, with the op's one-line error, if
    it cannot run (not built, stale, or built without CUDA while TensorFlow sees a GPU)
    rather than deep inside the first compiled step.

    devices: where the op will run (a strategy's replica devices, each of which runs it
    on its own slice of the batch); None = the default device.
    """
    if tf.config.list_physical_devices("GPU") and ops.build_stamp(ops.library_path()).get("cuda") is False:
        # The op has only a CPU kernel: TensorFlow would place it on the CPU and copy u and
        # u_hat across every step, silently, while the rest of the model runs on the GPU.
        raise OpLibraryError(f"the capsnet op library {ops.library_path()} was built without CUDA, but TensorFlow "
                             "sees a GPU (the op would run on the CPU): run `make ops-cuda` (needs nvcc), "
                             "or set custom_op=false")
    for device in devices or [None]:
        with tf.device(device):
            u = tf.zeros((1, 1, 1))        # (batch, in_caps, in_dim)
            W = tf.zeros((1, 1, 1, 1))     # (in_caps, out_caps, out_dim, in_dim)
            try:
                ops.capsule_prediction(u, W)
            except OpLibraryError:
                raise
            except tf.errors.OpError as exc:
                where = f" on {device}" if device else ""
                raise OpLibraryError(f"the capsule-prediction op library does not run{where}: {exc.message}; "
                                     "rebuild it with `make ops`") from exc
