"""Evaluate a checkpoint on the test split: `python evaluate.py checkpoint=<run dir or checkpoint path>`.

Prints a table (accuracy, per-class accuracy, confusion matrix) and, as the LAST line
of stdout, one JSON object with accuracy, loss, images_per_sec, per_class_accuracy,
confusion_matrix, ...; the same JSON is written into the run dir's evaluations/ folder
(`evaluations/best-ckpt-7.json` for checkpoints/best/ckpt-7, which no checkpoint rotation of a
training touches; output=PATH writes it elsewhere). A list of checkpoints is an ensemble: its JSON has the
ensemble's scores and each member's own (accuracy, loss, epoch, ...) under `members`
(capsnet.evaluation.evaluate). Keys: configs/eval.yaml.

Examples:
    python evaluate.py checkpoint=outputs/2025-01-01/12-00-00   # best/ if chosen on a validation split, else the last
    python evaluate.py checkpoint=outputs/2025-01-01/12-00-00 which=best custom_op=true
    python evaluate.py checkpoint=outputs/.../checkpoints/latest/ckpt-3 data.dir=/data/mnist
    python evaluate.py 'checkpoint=[outputs/run_a,outputs/run_b,outputs/run_c]' which=latest   # an ensemble
    python evaluate.py checkpoint=outputs/fashion-run tta=flip     # each image also scored mirrored
    python evaluate.py checkpoint=outputs/mnist-run tta=shift      # and moved one pixel each way
    python evaluate.py checkpoint=outputs/expanded-run data.name=affnist   # an expanded_mnist run on the affine set
"""
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from capsnet import cli, config
from capsnet.errors import ConfigError
from capsnet.outputs import check_output

config.register()  # the schemas configs/ extends (capsnet/config/schemas.py), before Hydra composes


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
@cli.reports_user_errors
def main(cfg: DictConfig):
    if OmegaConf.is_missing(cfg, "checkpoint"):
        raise ConfigError("checkpoint=... is required: a run dir (outputs/<date>/<time>) or a checkpoint path "
                          "(or a list of them: an ensemble)")
    config.check_overrides(HydraConfig.get().overrides.task, config.EvalAppConfig)
    cfg = config.check_eval(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))
    cli.check_checkpoints_exist(cfg["checkpoint"], "evaluate.py")  # at once, not after the TensorFlow import
    cli.check_evaluation_data(cfg["checkpoint"], cfg["data"])  # data.dir's IDX files, by their paths
    if cfg["output"] is not None:  # a run's own file, or an existing one without overwrite=true
        check_output(Path(cfg["output"]), cfg["overwrite"])  # as evaluate() checks it
    cli.import_tensorflow_quietly()
    # TensorFlow's modules, imported once the config and the paths are checked.
    from capsnet.evaluation import evaluate, format_report, to_json_line
    from capsnet.training.distribute import set_memory_growth

    set_memory_growth()  # beside a training on the same GPU

    report = evaluate(cfg["checkpoint"], which=cfg["which"], data_name=cfg["data"]["name"],
                      data_dir=cfg["data"]["dir"], limit_test=cfg["data"]["limit_test"],
                      shift_pixels=cfg["data"]["shift_pixels"], pad_pixels=cfg["data"]["pad_pixels"],
                      custom_op=cfg["custom_op"], batch_size=cfg["batch_size"], weights=cfg["weights"],
                      precision=cfg["precision"], tf32=cfg["tf32"], xla=cfg["xla"], output=cfg["output"],
                      overwrite=cfg["overwrite"],
                      tta=cfg["tta"])
    print(format_report(report))
    print(to_json_line(report), flush=True)  # the last line: machine-readable


if __name__ == "__main__":
    cli.run(main)
