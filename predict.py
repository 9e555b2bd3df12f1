"""Classify image files: `python predict.py checkpoint=<run dir or export> images=<file, dir or glob>`.

Prints one JSON line per image on stdout, in input order: {"image", "class" (its name:
digits for MNIST, Fashion-MNIST's ten names, else the index), "top_k": [[class, capsule
length], ...], "lengths": {class: capsule length, ...} for every class} (two-digit models also "classes",
the two predicted digits; with reconstruct=DIR also "reconstruction", the PNG written).
Any PNG, JPEG, BMP or GIF, grey or RGB, of any size, is made the model's input as the run's
pipeline makes its images (grey or RGB, the shorter side resized and the centre cropped, the
run's crop and standardisation); colours are not inverted (MNIST-family models expect light
digits on a dark background). An image that cannot be read or decoded, is over the run's
data.max_pixels, or gives non-finite capsule lengths is named in one line on stderr and
skipped; the others are predicted and the exit status is then 2 (capsnet.prediction).
A SavedModel is a program: only this project's exports are run unless trust_export=true.
Keys: configs/predict.yaml.

Examples:
    python predict.py checkpoint=outputs/2025-01-01/12-00-00 images=my_digit.png        # the run's default checkpoint
    python predict.py checkpoint=outputs/2025-01-01/12-00-00 'images=digits/*.png' top_k=5 which=latest
    python predict.py checkpoint=exported/mnist images=digits/ reconstruct=reconstructions   # a SavedModel, a folder
"""
import json
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from capsnet import cli, config
from capsnet.console import say
from capsnet.errors import DataError
from capsnet.prediction import check_inputs, iter_predictions  # no TensorFlow: it loads the model's modules itself

# The schemas configs/ extends (capsnet/config/schemas.py) are registered with Hydra by the import of
# capsnet.config above (config.register: ~0.07 s a call on a 2-core CPU, once is enough), before it composes.


@hydra.main(version_base="1.3", config_path="configs", config_name="predict")
@cli.reports_user_errors
def main(cfg: DictConfig):
    config.check_overrides(HydraConfig.get().overrides.task, config.PredictAppConfig)
    cfg = config.check_predict(OmegaConf.to_container(cfg, resolve=True))
    check_inputs(cfg["checkpoint"], cfg["images"], cfg["reconstruct"])  # the paths, before TensorFlow
    cli.import_tensorflow_quietly()
    # TensorFlow's module, imported once the paths are checked (predict's own import it as they need).
    from capsnet.training.distribute import set_memory_growth

    set_memory_growth()  # beside a training on the same GPU
    total = failed = 0
    for record in iter_predictions(cfg["checkpoint"], cfg["images"], top_k=cfg["top_k"],
                                   reconstruct=cfg["reconstruct"], which=cfg["which"], weights=cfg["weights"],
                                   custom_op=cfg["custom_op"], batch_size=cfg["batch_size"],
                                   notice=lambda line: say(line, stream=sys.stderr),
                                   trust_export=cfg["trust_export"]):
        total += 1
        if "error" in record:
            failed += 1
            say(f"error: {record['error']} (skipped)", stream=sys.stderr)
        else:
            print(json.dumps(record), flush=True)
    if failed == total:
        raise DataError(f"no image could be predicted ({total}, each named above)")
    if failed:
        raise DataError(f"{failed} of {total} images could not be predicted (each named above); "
                        f"the other {total - failed} were predicted")


if __name__ == "__main__":
    cli.run(main)
