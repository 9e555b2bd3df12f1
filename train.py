"""Train CapsNet: `python train.py [key=value ...]` (configs/train.yaml; `--help` lists the groups).

Examples:
    python train.py data.dir=../shared/data/mnist train.epochs=50
    python train.py -m custom_op=true,false          # a sweep: outputs/multirun/...
    python train.py -m seed=0,1,2,3 hydra/launcher=gpus  # its jobs in parallel, one GPU each
    python train.py hydra.run.dir=outputs/my-run     # rerun the same command to resume it
"""
import logging
import os
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from capsnet import cli, config

log = logging.getLogger(__name__)
config.register()  # the schemas configs/ extends (capsnet/config/schemas.py), before Hydra composes


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
@cli.reports_user_errors
def main(cfg: DictConfig):
    # Hydra and OmegaConf have checked the keys and their types; capsnet.config checks the
    # values (and that a switch is written true/false, not no/0). TensorFlow is imported
    # only after that: a config error is reported at once, not after the seconds-long import.
    config.check_overrides(HydraConfig.get().overrides.task, config.TrainAppConfig)
    checked = config.check(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        # The GPU a sweep job was pinned to (hydra/launcher=gpus), in its train.log.
        log.info("CUDA_VISIBLE_DEVICES=%s", os.environ["CUDA_VISIBLE_DEVICES"])
    started = time.perf_counter()
    cli.import_tensorflow_quietly()
    from capsnet.training import train
    log.info("TensorFlow and capsnet.training imported in %.2f s", time.perf_counter() - started)

    metrics = train(checked)
    # Returned so that a Hydra sweeper (e.g. Optuna) can optimise it.
    return metrics["test_accuracy"]


if __name__ == "__main__":
    cli.run(main)
