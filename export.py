"""Export a checkpoint as a TensorFlow SavedModel: `python export.py checkpoint=<run dir or checkpoint path> output=<dir>`.

Prints what was exported and its signatures and, as the LAST line of stdout, one JSON
object (output, checkpoint, epoch, weights, custom_op, signatures, op_library_ops, ...).
The SavedModel's `serving_default` signature takes float32 images (N, H, W, C) in
[0, 1], `serve_uint8` uint8 images in [0, 255]; both return the capsule lengths, the
predicted class (MultiMNIST runs: the two predicted digits) and the reconstruction of
the predicted capsule (capsnet.export). Keys: configs/export.yaml.

Examples:
    python export.py checkpoint=outputs/2025-01-01/12-00-00 output=exported/mnist        # portable: standard TF ops
    python export.py checkpoint=outputs/2025-01-01/12-00-00 which=latest weights=raw output=exported/mnist_raw
    python export.py checkpoint=outputs/2025-01-01/12-00-00 custom_op=true output=exported/mnist_op   # the compiled op
"""
import hydra
from omegaconf import DictConfig, OmegaConf

from capsnet import cli
from capsnet.errors import ConfigError
from capsnet.outputs import check_export_output


@hydra.main(version_base="1.3", config_path="configs", config_name="export")
@cli.reports_user_errors
def main(cfg: DictConfig):
    for key, what in (("checkpoint", "a run dir (outputs/<date>/<time>) or a checkpoint path"),
                      ("output", "the SavedModel directory to create (it must not exist)")):
        if OmegaConf.is_missing(cfg, key):
            raise ConfigError(f"{key}=... is required: {what}")
    cfg = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    cli.check_checkpoints_exist(cfg["checkpoint"], "export.py")  # at once, not after the TensorFlow import
    check_export_output(cfg["output"])  # an existing or unwritable output, too
    cli.import_tensorflow_quietly()
    # TensorFlow's modules, imported once the checkpoint and output paths are checked.
    from capsnet.export import export, format_summary
    from capsnet.evaluation import to_json_line
    from capsnet.training.distribute import set_memory_growth

    set_memory_growth()  # beside a training on the same GPU

    report = export(cfg["checkpoint"], cfg["output"], which=cfg["which"], weights=cfg["weights"],
                    custom_op=cfg["custom_op"])
    print(format_summary(report))
    print(to_json_line(report), flush=True)  # the last line: machine-readable


if __name__ == "__main__":
    cli.run(main)
