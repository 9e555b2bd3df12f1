"""Train CapsNet: `python train.py [key=value ...]` (configs/train.yaml; `--help` lists the groups).

Examples:
    python train.py data.dir=/data/mnist train.epochs=50
    python train.py -m custom_op=true,false          # a sweep: outputs/multirun/...
    python train.py -m seed=0,1,2,3 hydra/launcher=gpus  # its jobs in parallel, one GPU each
    python train.py hydra.run.dir=outputs/my-run     # rerun the same command to resume it
"""
import logging
import os
import shlex
import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from capsnet import cli, config
from capsnet.training.run_lock import finished_run

log = logging.getLogger(__name__)
# The schemas configs/ extends (capsnet/config/schemas.py) are registered with Hydra by the import of
# capsnet.config above (config.register: ~0.07 s a call on a 2-core CPU, once is enough), before it composes.


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
@cli.reports_user_errors
def main(cfg: DictConfig):
    # Hydra and OmegaConf have checked the keys and their types; capsnet.config checks the
    # values (and that a switch is written true/false, not no/0), once: train() is handed the
    # checked config. TensorFlow is imported only after that: a config error is reported at
    # once, not after the seconds-long import.
    hydra_cfg = HydraConfig.get()
    config.check_overrides(hydra_cfg.overrides.task, config.TrainAppConfig)
    checked = config.check(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))
    config.check_data_files(checked["data"])  # the IDX files data.dir should hold, by their paths
    # Before anything is written into the run dir, and before this job's first log line
    # (which would create train.log there): a directory that is not ours is left untouched.
    cli.check_run_dir(checked["run_dir"], given=hydra_cfg.run.dir if hydra_cfg.mode.name == "RUN" else None)
    # Locked before this job's first log line: its train.log is the run dir's, and a second
    # training refused there writes nothing into it. (Under multi_worker train() locks it, in
    # the chief alone.)
    lock = None if checked["distribute"]["strategy"] == "multi_worker" else cli.lock_run_dir(checked["run_dir"])
    if lock is not None and (finished := finished_run(checked)) is not None:
        lock.release()  # a finished run rerun: answered from its files, TensorFlow not imported
        return finished["test_accuracy"]
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        # The GPU a sweep job was pinned to (hydra/launcher=gpus), in its train.log.
        log.info("CUDA_VISIBLE_DEVICES=%s", os.environ["CUDA_VISIBLE_DEVICES"])
    started = time.perf_counter()
    cli.import_tensorflow_quietly()
    # TensorFlow's modules, imported once the config and the run dir are checked.
    from capsnet.training.loop import train
    from capsnet.training.run_dir import hydra_snapshot
    log.info("TensorFlow and capsnet.training imported in %.2f s", time.perf_counter() - started)

    # The command that resumes this run: its overrides, with the run dir named (a plain run's
    # dir is named by its start time: the same command would start a new run).
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith(("hydra.run.dir=", "run_dir="))]
    resume = " ".join(["python", os.path.basename(sys.argv[0]), *map(shlex.quote, overrides),
                       shlex.quote(f"hydra.run.dir={checked['run_dir']}")])
    metrics = train(checked, checked=True, resume_command=resume, lock=lock,
                    hydra_files=hydra_snapshot(cfg, hydra_cfg, hydra_cfg.overrides.task))
    # Returned so that a Hydra sweeper (e.g. Optuna) can optimise it.
    return metrics["test_accuracy"]


if __name__ == "__main__":
    cli.run(main)
