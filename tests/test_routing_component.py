"""Routing as a component (capsnet.routing): the numbers of the code before routers, the
Router's Keras serialisation, the one place custom_op becomes a backend, old configs."""
import json
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
import yaml

from capsnet import config, routing
from capsnet.errors import ConfigError
from capsnet.losses import capsnet_losses
from capsnet.model import CapsNet, build_model
from capsnet.routing import DynamicRouting, SelfAttentionRouting, make_router
from capsnet.training.model_setup import build_capsnet

DATA = Path(__file__).parent / "data"

TINY = dict(input_shape=[28, 28, 1], num_classes=10, conv1_filters=16, conv1_kernel_size=9, primary_caps_types=4,
            primary_caps_dim=8, primary_caps_kernel_size=9, primary_caps_strides=2, digit_caps_dim=8,
            routing_iterations=3, stop_gradient_routing=True, routing={"algorithm": "dynamic", "backend": "auto",
                                                                       "leaky": False},
            decoder=True, decoder_units=[32, 64], w_init_stddev=0.1, initializers="keras", primary_caps_conv="auto",
            digit_caps_bias=None, primary_caps_scale=1.0, primary_caps_bias=0.0)

# The losses of 3 Adam steps (lr 0.01, seed 0, op determinism, 8 random images) recorded
# from the code before routers (main c6f5a42: DigitCaps(routing=<mode>), model.routing
# auto | tf | xla), as float hex: the same seeds must give bitwise the same losses.
RECORDED = {
    "custom_op=false": (False, {}, ["0x1.af3b1e0000000p-1", "0x1.1c34d40000000p-1", "0x1.7121c00000000p-1"]),
    "custom_op=true": (True, {}, ["0x1.af3b1e0000000p-1", "0x1.1c34d40000000p-1", "0x1.7121bc0000000p-1"]),
    "custom_op=true,routing=tf": (True, {"backend": "tf"},
                                  ["0x1.af3b1e0000000p-1", "0x1.1c34d40000000p-1", "0x1.7121be0000000p-1"]),
    "custom_op=false,routing=xla": (False, {"backend": "xla"},
                                    ["0x1.af3b1e0000000p-1", "0x1.1c34d40000000p-1", "0x1.7121bc0000000p-1"]),
    "custom_op=true,routing=xla": (True, {"backend": "xla"},
                                   ["0x1.af3b1e0000000p-1", "0x1.1c34d40000000p-1", "0x1.7121be0000000p-1"]),
    "custom_op=false,stop_gradient_routing=false": (False, {"stop_gradient_routing": False},
                                                    ["0x1.af3b1e0000000p-1", "0x1.1c34ec0000000p-1",
                                                     "0x1.6d46b60000000p-1"]),
    "custom_op=true,digit_caps_bias=0.1": (True, {"digit_caps_bias": 0.1},
                                           ["0x1.6dbbce0000000p-1", "0x1.1a45980000000p-1", "0x1.3e1dbc0000000p-1"]),
}


def three_step_losses(custom_op, model_cfg):
    tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(0)
    model = build_capsnet(model_cfg, custom_op)
    optimizer = keras.optimizers.Adam(0.01)
    rng = np.random.default_rng(0)
    images = tf.constant(rng.uniform(size=(8, 28, 28, 1)).astype(np.float32))
    labels = tf.constant(rng.integers(0, 10, size=8).astype(np.int32))
    losses = []
    for _ in range(3):
        with tf.GradientTape() as tape:
            outputs = model(images, labels=labels, training=True)
            total, _, _ = capsnet_losses(images, labels, outputs, m_plus=0.9, m_minus=0.1, lambda_=0.5,
                                         reconstruction_weight=0.0005)
            loss = tf.reduce_mean(total)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss.numpy()).hex())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RECORDED))
def test_losses_are_bitwise_those_of_the_code_before_routers(case):
    custom_op, changes, expected = RECORDED[case]
    model_cfg = {**TINY, "routing": {**TINY["routing"]}}
    if "backend" in changes:
        model_cfg["routing"]["backend"] = changes["backend"]
    model_cfg.update({k: v for k, v in changes.items() if k != "backend"})
    assert three_step_losses(custom_op, model_cfg) == expected


def test_layers_and_model_import_nothing_from_the_config_package():
    for path in ("capsnet/layers.py", "capsnet/model.py", "capsnet/routing/base.py", "capsnet/routing/dynamic.py",
                 "capsnet/routing/self_attention.py", "capsnet/routing/functional.py"):
        text = (Path(__file__).parents[1] / path).read_text()
        assert "capsnet.config" not in text.replace("capsnet.config.", "").split('"""', 2)[-1] or \
            "from capsnet.config" not in text and "import capsnet.config" not in text, path


def test_the_layers_choices_are_the_configs():
    from capsnet.layers import CONV_FORMS
    from capsnet.model import INITIALIZERS
    assert CONV_FORMS == config.CONV_FORMS and INITIALIZERS == config.INITIALIZERS
    # Every backend a Router takes is one the config can ask for, and no other.
    asked = {config.router_spec(op, {"routing": r, "stop_gradient_routing": sg})["backend"]
             for op in (False, True) for r in config.ROUTING for sg in (False, True)}
    assert asked == set(routing.BACKENDS)


@pytest.mark.parametrize("custom_op, routing_cfg, model_keys, backend", [
    (False, {"backend": "auto"}, {}, "matmul"),
    (True, {"backend": "auto"}, {}, "fused_op"),
    (True, {"backend": "tf"}, {}, "op"),
    (True, {"backend": "xla"}, {}, "op_xla"),
    (False, {"backend": "xla"}, {}, "matmul_xla"),
    (True, {"backend": "auto", "leaky": True}, {}, "fused_op"),     # the fused op routes leaky too
    (True, {"backend": "auto"}, {"stop_gradient_routing": False}, "op"),
    (True, {"backend": "auto"}, {"digit_caps_bias": 0.1}, "op"),
    (True, {"algorithm": "self_attention", "backend": "auto"}, {}, "op"),
    (False, "tf", {}, "matmul"),                                   # model.routing=tf, as before routers
])
def test_custom_op_maps_to_the_backend_in_one_place(custom_op, routing_cfg, model_keys, backend):
    model_cfg = {"routing": routing_cfg if isinstance(routing_cfg, str) else {"algorithm": "dynamic", **routing_cfg},
                 **model_keys}
    assert config.router_spec(custom_op, model_cfg)["backend"] == backend
    router = make_router(**config.router_spec(custom_op, model_cfg))
    assert router.backend == backend


def test_router_serialises_with_keras_and_round_trips_in_the_model():
    for router in (DynamicRouting(iterations=2, stop_gradient=False, leaky=True, backend="op"),
                   SelfAttentionRouting(epsilon=1e-6, backend="matmul_xla")):
        spec = keras.saving.serialize_keras_object(router)
        assert spec["config"] == router.get_config()
        assert type(router)(**router.get_config()) == router  # get_config is the constructor's arguments
        assert keras.saving.deserialize_keras_object(spec) == router
        model = build_model(router=router, conv1_filters=8, primary_caps_types=2, digit_caps_dim=4,
                            decoder_units=(8, 16))
        cfg = model.get_config()
        assert CapsNet.from_config(json.loads(json.dumps(cfg))).get_config() == cfg


def test_a_keras_config_written_before_routers_loads():
    """capsnet_get_config_v1.json: CapsNet.get_config() of main c6f5a42 (routing=fused_op,
    with the read-only custom_op/jit_routing/fused_routing flags)."""
    old = json.loads((DATA / "capsnet_get_config_v1.json").read_text())
    model = CapsNet.from_config(old)
    assert model.router == DynamicRouting(iterations=3, stop_gradient=True, leaky=False, backend="fused_op")
    older = {k: v for k, v in old.items() if k != "routing"}  # the flags alone, before `routing`
    assert CapsNet.from_config({**older, "fused_routing": None}).router.backend == "fused_op"
    assert CapsNet.from_config({**older, "fused_routing": False, "jit_routing": True}).router.backend == "op_xla"


def test_a_run_config_written_before_routers_migrates_and_builds():
    """run_config_v1.yaml: the config.yaml a tiny custom_op=true run of main c6f5a42 wrote
    (model.routing: auto, model.routing_iterations, model.stop_gradient_routing)."""
    saved = yaml.safe_load((DATA / "run_config_v1.yaml").read_text())
    assert saved["model"]["routing"] == "auto"
    checked = config.check(config.migrate(saved))
    assert checked["model"]["routing"] == {"algorithm": "dynamic", "backend": "auto", "leaky": False}
    model = build_capsnet(checked["model"], checked["custom_op"])
    assert model.router == DynamicRouting(iterations=3, stop_gradient=True, backend="fused_op")
    for old, backend in (("tf", "op"), ("xla", "op_xla")):
        again = config.check(config.migrate({**saved, "model": {**saved["model"], "routing": old}}))
        assert config.router_spec(True, again["model"])["backend"] == backend


def test_bad_routing_configs_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"^model\.routing\.backend must be one of auto, tf, xla, got 'fast'$"):
        config.router_spec(False, {"routing": {"algorithm": "dynamic", "backend": "fast"}})
    model_cfg = {**TINY, "routing": {"algorithm": "em", "backend": "auto"}}
    with pytest.raises(ConfigError, match=r"^model: routing algorithm must be one of dynamic, self_attention, got 'em'$"):
        build_capsnet(model_cfg, False)
