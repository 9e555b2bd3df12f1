"""A model at initialisation, on one batch: how active Conv1's ReLUs are, how long the
primary capsules u and the digit capsules v_j are, how far routing moves c_ij from uniform,
the loss, and each variable's gradient against Adam's epsilon (1e-7). Run on the CPU:

    # the paper model on uniform noise with random labels, batch 512 and 2048 (a minute)
    .venv/bin/python scripts/probe_init_gradients.py
    # a config's model on its first training batch (data.dir set), e.g. both starts of the MultiMNIST preset
    .venv/bin/python scripts/probe_init_gradients.py --batch 100 experiment=paper_multimnist \
        data.dir=../shared/data/mnist model.initializers=<keras | authors>

Trailing arguments are train.py's config overrides (float32, the matmul path: custom_op=false);
without data.dir the batch is uniform noise with random labels (single-label datasets only).
A bad override, value, batch size or data dir: one line, `error: ...`, exit 2.
Why it exists: [reliability] item 3 (docs/verification.md): the paper model at batch 2048 on
a repeated noise batch sat at loss 0.8426 on an H100; this shows what that loss is. Later,
why the authors' initializers fit MultiMNIST faster (docs/results.md, thirty-ninth session).
"""
import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from capsnet import cli, config  # noqa: E402  (no TensorFlow: config errors come before its import)
from capsnet.datasets import is_overlay  # noqa: E402
from capsnet.errors import CapsnetError, ConfigError  # noqa: E402

ADAM_EPSILON = 1e-7


def probe(model, images, labels, losses, targets=None):
    """The statistics of `model` on one batch (float32 images, labels (B,) or (B, 2), and for
    two-digit labels the targets (B, 2, H, W, C)): a dict of scalars, and per trainable
    variable (path, weight rms, gradient rms, median |gradient|, fraction of gradient
    entries below Adam's epsilon)."""
    import tensorflow as tf

    from capsnet.losses import capsnet_losses

    with tf.GradientTape() as tape:
        conv1 = model.conv1(images)
        u = model.primary_caps(conv1)
        outputs = model(images, labels=labels, training=True)
        total, margin, reconstruction = capsnet_losses(images, labels, outputs, **losses, targets=targets)
        loss = tf.reduce_mean(total)
    grads = tape.gradient(loss, model.trainable_variables)
    lengths = outputs["lengths"].numpy()                                   # (B, classes)
    present = np.zeros(lengths.shape, bool)                                # the labelled classes
    for column in labels.numpy().reshape(len(lengths), -1).T:
        present[np.arange(len(lengths)), column] = True
    u_lengths = np.linalg.norm(u.numpy(), axis=-1)
    stats = {
        "loss": float(loss), "margin": float(tf.reduce_mean(margin)),
        "reconstruction": float(tf.reduce_mean(reconstruction)),
        "conv1_active": float(np.mean(conv1.numpy() > 0)),
        "u_length_mean": float(u_lengths.mean()), "u_length_p10": float(np.percentile(u_lengths, 10)),
        "u_length_p90": float(np.percentile(u_lengths, 90)),
        "v_length_mean": float(lengths.mean()), "v_length_max": float(lengths.max()),
        "v_length_present": float(lengths[present].mean()), "v_length_absent": float(lengths[~present].mean()),
        # Each primary capsule's largest coupling over the classes: 1 / classes where routing
        # has not moved the couplings from uniform.
        "c_ij_max_mean": float(outputs["c_ij"].numpy().max(axis=-1).mean()),
    }
    variables = []
    for variable, grad in zip(model.trainable_variables, grads):
        w, g = variable.numpy(), grad.numpy()
        variables.append((variable.path, float(np.sqrt(np.mean(w ** 2))), float(np.sqrt(np.mean(g ** 2))),
                          float(np.median(np.abs(g))), float(np.mean(np.abs(g) < ADAM_EPSILON))))
    return stats, variables


def batches(cfg, batch_sizes, rng):
    """(batch size, images, labels, targets) for each size: the config's first training batch
    (epoch 0, as the run draws it) where data.dir is set, else uniform noise with random labels."""
    import tensorflow as tf

    from capsnet.data import augmentation_options, load_split, make_split_dataset

    data_cfg = cfg["data"]
    if data_cfg.get("dir"):
        train_images, train_labels = load_split(data_cfg["name"], "train", data_dir=data_cfg["dir"],
                                                limit=data_cfg.get("limit_train"))
    for batch in batch_sizes:
        if not data_cfg.get("dir"):
            images = tf.constant(rng.uniform(0, 1, (batch, *cfg["model"]["input_shape"])).astype(np.float32))
            labels = tf.constant(rng.integers(0, cfg["model"]["num_classes"], batch).astype(np.int32))
            yield batch, images, labels, None
            continue
        dataset = make_split_dataset(data_cfg["name"], train_images, train_labels, batch_size=batch, training=True,
                                     seed=cfg["seed"], shift_pixels=data_cfg["shift_pixels"],
                                     pad_pixels=data_cfg["pad_pixels"], **augmentation_options(data_cfg))
        first = next(iter(dataset))
        yield batch, first[0], first[1], (first[2] if len(first) > 2 else None)


def batch_sizes(text):
    """--batch: comma-separated positive integers."""
    try:
        sizes = [int(size) for size in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, comma-separated, got {text!r}")
    return sizes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=batch_sizes, default=[512, 2048], help="batch sizes (default 512,2048)")
    parser.add_argument("overrides", nargs="*", help="train.py config overrides, e.g. experiment=paper_multimnist")
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory() as run_dir:  # the checks need a run_dir; nothing is written
            cfg = config.check(config.compose("train", ["custom_op=false", *args.overrides, f"run_dir={run_dir}"]))
        if not cfg["data"].get("dir") and is_overlay(cfg["data"]["name"]):
            raise ConfigError(f"{cfg['data']['name']} has two labels an image, not a noise batch: set data.dir")
        if cfg["data"].get("dir") and not Path(cfg["data"]["dir"]).is_dir():
            raise ConfigError(f"data.dir={cfg['data']['dir']} is not a directory")
        cli.import_tensorflow_quietly()
        import keras

        from capsnet.losses import loss_params
        from capsnet.training.model_setup import build_capsnet

        keras.utils.set_random_seed(cfg["seed"])
        rng = np.random.default_rng(cfg["seed"])
        data = list(batches(cfg, args.batch, rng))  # the data's errors before the model is built
        model = build_capsnet(cfg["model"], custom_op=False)
        losses = loss_params(cfg["train"])
    except CapsnetError as exc:
        cli.fail(exc)
    except (HydraException, OmegaConfBaseException) as exc:  # e.g. an unknown key
        cli.fail(cli.one_line(exc))
    for batch, images, labels, targets in data:
        stats, variables = probe(model, images, labels, losses, targets)
        s = stats  # short, for the report line below
        print(" | ".join([
            f"batch {batch}: loss {s['loss']:.4f} margin {s['margin']:.4f} lengths mean {s['v_length_mean']:.2e} "
            f"max {s['v_length_max']:.2e} (labelled {s['v_length_present']:.2e}, others {s['v_length_absent']:.2e})",
            f"reconstruction {s['reconstruction']:.1f}",
            f"conv1 ReLUs active {s['conv1_active']:.3f}",
            f"|u| mean {s['u_length_mean']:.3f} (p10 {s['u_length_p10']:.3f}, p90 {s['u_length_p90']:.3f})",
            f"max_j c_ij mean {s['c_ij_max_mean']:.3f}"]), flush=True)
        for path, w_rms, g_rms, g_median, small in variables:
            print(f"  {path:45s} |w| rms {w_rms:.2e}  grad rms {g_rms:.2e}  median|g| {g_median:.2e}  "
                  f"frac|g|<1e-7 {small:.2f}", flush=True)


if __name__ == "__main__":
    main()
