"""Train CapsNet: `python train.py [key=value ...]` (configs/train.yaml; `--help` lists the groups).

Examples:
    python train.py data.dir=../shared/data/mnist train.epochs=50
    python train.py -m custom_op=true,false          # a sweep: outputs/multirun/...
    python train.py hydra.run.dir=outputs/my-run     # rerun the same command to resume it
"""
import hydra
from omegaconf import DictConfig, OmegaConf

from capsnet import cli


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
@cli.reports_user_errors
def main(cfg: DictConfig):
    # TensorFlow is imported only now, after Hydra has checked the config: a typo in a
    # key is reported at once instead of after the seconds-long import.
    cli.import_tensorflow_quietly()
    from capsnet.training import train

    metrics = train(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))
    # Returned so that a Hydra sweeper (e.g. Optuna) can optimise it.
    return metrics["test_accuracy"]


if __name__ == "__main__":
    cli.run(main)
