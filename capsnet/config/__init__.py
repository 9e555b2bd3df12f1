"""Typed configs: one dataclass schema per config group, and every value check in one place.

The YAML files under configs/ extend these schemas (Hydra structured configs: each group
file's defaults list starts with `- schema`, train.yaml's with `- train_schema`), so
OmegaConf rejects an unknown key or a value of the wrong type while Hydra composes the
config, before any of our code runs. What a type cannot say (a range, a choice, a rule
between keys) is checked beside each schema, by the `check` of its fields
(`field(..., metadata={"check": ...})`) and its section's rule (`_SECTION_RULES`), all
reached through one entry point:

    check(cfg)            a plain dict shaped like configs/train.yaml → the checked dict
                          (ConfigError naming the key: the one line users see)
    check_eval(cfg)       the same for configs/eval.yaml
    migrate(saved)        a run's saved config.yaml → today's shape (keys added since at the
                          schema default it was trained with; model.jit_routing and
                          model.fused_routing → model.routing)
    router_spec(custom_op, model_cfg)    the Router's arguments: the one place custom_op
                                         becomes its backend (how DigitCaps routes)
    compose(name, overrides)             the real config as a plain dict (tests, scripts)
    explain(exc)          a Hydra/OmegaConf type error → today's one-line wording

Routing. `custom_op` (top level, true | false) stays the user's switch: it picks the capsule
prediction, the compiled op or a TensorFlow matmul. `model.routing` picks how the routing
iterations run: auto | tf | xla. Every one of the 2 × 3 combinations is valid; they give
the five backends of a Router (capsnet.routing.BACKENDS), router_spec's "backend":

    custom_op  model.routing              backend      prediction      routing
    false      auto, tf                   matmul       matmul          TF ops
    false      xla                        matmul_xla   matmul          one XLA computation
    true       tf                         op           compiled op     TF ops
    true       xla                        op_xla       compiled op     one XLA computation
    true       auto (stop_gradient_routing=true)   fused_op   prediction + routing in one op
    true       auto (stop_gradient_routing=false)  op         (the fused op has only the
                                                                stop-gradient gradient)
    true       auto (model.digit_caps_bias set)    op         (the fused op has no bias)

Only train.xla=jit still rules one out (model.routing=xla: jit compiles the routing
already): checked by the train section's rule. The compiled ops have XLA kernels
(ops/xla_kernels.cc), so jit compiles the op modes too.

Schema defaults are also what a run saved before a key existed was trained with (migrate
fills them in): never change one; change the YAML value instead.

No TensorFlow here: config errors are reported before the seconds-long TensorFlow import.

Modules: schemas (the dataclasses, their field checks, the choices), checks (check,
check_eval, check_section, the rules across keys), routing (router_spec),
migrate (old run configs: the one module that reads what older versions wrote), hydra (register, compose, explain,
check_overrides, the dataset resolvers). Import from here: `from capsnet import config`.
"""
from capsnet.config.checks import (OVERLAY_AUGMENTATION, PER_EXAMPLE_AUGMENTATION, check, check_all_reduce_in_step,
                                   check_augmentation, check_data_files, check_data_on_device, check_eval,
                                   check_overlay_augmentation, check_section, check_xla)
from capsnet.config.hydra import (check_overrides, compose, dataset_classes, dataset_shape, explain, register,
                                  unknown_key)
from capsnet.config.migrate import migrate
from capsnet.config.checks import check_predict
from capsnet.config.schemas import PredictAppConfig
from capsnet.config.routing import router_spec
from capsnet.config.schemas import (ALL_REDUCE, APP_SCHEMAS, AUGMENTATION_OFF, CONV_FORMS, GROUP_SCHEMAS, INITIALIZERS,
                                    PRECISIONS, ROUTING, ROUTING_DEFAULT, SCALE_LR, SHIFT_FILLS, STRATEGIES, WEIGHTS,
                                    WHICH, XLA_MODES, AugmentationConfig, DataConfig, DataSourceConfig,
                                    DistributeConfig, EvalAppConfig, EvalDataConfig, ModelConfig, TrainAppConfig,
                                    TrainConfig, augmentation_on, augmentation_options)

__all__ = [
    "ModelConfig", "DataSourceConfig", "AugmentationConfig", "DataConfig", "TrainConfig", "DistributeConfig", "TrainAppConfig",
    "EvalDataConfig", "EvalAppConfig", "register", "check", "check_eval", "check_section", "migrate",
    "router_spec", "compose", "explain", "unknown_key", "check_overrides", "check_augmentation", "check_xla",
    "check_all_reduce_in_step", "check_data_files", "check_data_on_device", "check_overlay_augmentation",
    "PER_EXAMPLE_AUGMENTATION",
    "OVERLAY_AUGMENTATION",
    "dataset_shape", "dataset_classes", "GROUP_SCHEMAS", "APP_SCHEMAS",
    "ROUTING", "ROUTING_DEFAULT", "CONV_FORMS", "INITIALIZERS", "XLA_MODES", "PRECISIONS", "STRATEGIES", "ALL_REDUCE", "SCALE_LR", "AUGMENTATION_OFF",
    "augmentation_options", "augmentation_on", "SHIFT_FILLS", "WHICH", "WEIGHTS",
]
__all__ += ["PredictAppConfig", "check_predict"]  # predict.py (configs/predict.yaml)

register()
