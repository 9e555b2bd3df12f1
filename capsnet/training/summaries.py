"""TensorBoard: one writer per run dir, so `tensorboard --logdir outputs` lists runs side by side.

- `write_train_scalars`: train/ loss, accuracy, images/s, step time, gradient norm and the LR, the
  means of a `MetricWindow` of steps (every train.log_every_steps steps).
- `write_epoch_summaries`: test/ scalars, the routing and capsule-length histograms and
  the inputs over their reconstructions (capsnet.figures.image_grid), once an epoch.
- `RunSummaries.validation`: validation/ scalars (data.validation_fraction's split, which
  chooses checkpoints/best), apart from test/'s.
- `write_hparams`: the run's values in the HParams dashboard, once a run.
- `write_run_scalars`: after every epoch, the run's mean images/s so far
  (`train/mean_images_per_sec`, metrics.json's images_per_sec), the HParams dashboard's
  images/s column: it shows a metric's last value, and the last train/images_per_sec window
  is one window's speed, not the run's.
- `RunSummaries`: a run's writer and all of the above that train() writes, one object; at the
  end of training (train.figures) also capsnet.figures' pictures (`RunSummaries.figures`).
TensorBoard's step is the global step (optimizer.iterations).
"""
import contextlib
import json

import numpy as np
import tensorflow as tf

from capsnet import config
from capsnet.config.schemas import ROUTED_KINDS
from capsnet.figures import image_grid, model_figures
from capsnet.training.run_dir import write_error

# Values shown side by side in TensorBoard's HParams dashboard, and the metrics they explain.
HPARAMS = ("model", "custom_op", "routing", "backend", "xla", "precision", "tf32", "dataset", "limit_train", "limit_test",
           "epochs", "batch_size", "routing_iterations", "seed", "learning_rate", "lr_schedule", "weight_decay", "decoder")
HPARAM_DESCRIPTIONS = {"model": "model.kind: capsnet, the paper's CNN baseline (baseline_cnn), deep_capsnet or "
                                "deep_cnn",
                       "routing": "model.routing.algorithm: dynamic, self_attention (none: a model without capsules)",
                       "backend": "how the routing runs (custom_op with model.routing.backend): matmul, matmul_xla, op, "
                                  "op_xla, fused_op (none: a model without capsules)",
                       "limit_train": "data.limit_train: training examples used (0: all)",
                       "limit_test": "data.limit_test: test examples used (0: all)",
                       "epochs": "train.epochs: the epochs the run was started for"}
RUN_SPEED_TAG = "train/mean_images_per_sec"
HPARAM_METRICS = {"test/accuracy": "test accuracy (last tested epoch)",
                  "validation/accuracy": "validation accuracy (last tested epoch; data.validation_fraction)",
                  RUN_SPEED_TAG: "images/s (the run's mean)"}


class MetricWindow:
    """Example-weighted sums of step values over a window of steps, and the clock of its timed
    steps. `to_json` / `from_json`: the window as text, which a Ctrl-C's checkpoint keeps so
    that the resumed epoch's means cover its steps before the interruption too."""

    def __init__(self):
        self.sums, self.examples = {}, 0
        self.timed_steps, self.timed_images, self.timed_seconds = 0, 0, 0.0

    def to_json(self):
        return json.dumps(vars(self))  # floats written exactly (repr): the sums go on as they were

    @classmethod
    def from_json(cls, text):
        """The window of `to_json`'s text; an empty one for "" (a checkpoint without it)."""
        window = cls()
        if text:
            vars(window).update(json.loads(text))
        return window

    def add(self, values, batch):
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + value * batch
        self.examples += batch

    def add_time(self, steps, images, seconds):
        self.timed_steps += steps
        self.timed_images += images
        self.timed_seconds += seconds

    def means(self):
        means = {key: total / max(self.examples, 1) for key, total in self.sums.items()}
        if self.timed_steps and self.timed_seconds > 0:
            means["images_per_sec"] = self.timed_images / self.timed_seconds
            means["step_time_ms"] = 1000.0 * self.timed_seconds / self.timed_steps
        return means


def write_hparams(writer, run_dir, cfg, data_cfg):
    from tensorboard.plugins.hparams import api as hp  # noqa: PLC0415  (only needed once)

    capsnet = cfg["model"].get("kind", "capsnet") in ROUTED_KINDS
    # The routing DigitCaps runs, as the model was built with it; the CNNs route nothing.
    router = config.router_spec(cfg["custom_op"], cfg["model"]) if capsnet else {"algorithm": "none", "backend": "none"}
    values = {
        "model": str(cfg["model"].get("kind", "capsnet")),
        "custom_op": bool(cfg["custom_op"]),
        "routing": str(router["algorithm"]),
        "backend": str(router["backend"]),
        "xla": str(cfg["train"]["xla"]),
        "precision": str(cfg["train"]["precision"]),
        "tf32": bool(cfg["train"]["tf32"]),
        "dataset": str(data_cfg["name"]),
        # HParams values cannot be null: 0 stands for "no limit" (see HPARAM_DESCRIPTIONS).
        "limit_train": int(data_cfg.get("limit_train") or 0),
        "limit_test": int(data_cfg.get("limit_test") or 0),
        "epochs": int(cfg["train"]["epochs"]),
        "batch_size": int(cfg["train"]["batch_size"]),
        "routing_iterations": int(cfg["model"]["routing_iterations"]) if capsnet else 0,
        "seed": int(cfg["seed"]),
        "learning_rate": float(cfg["train"]["learning_rate"]),
        "lr_schedule": str(cfg["train"]["lr_schedule"]),
        "weight_decay": float(cfg["train"]["weight_decay"]),
        "decoder": bool(cfg["model"]["decoder"]),
    }
    with writer.as_default():
        # Every run writes the same experiment config (no per-run domains), so a sweep's
        # runs merge into one HParams table.
        hp.hparams_config(hparams=[hp.HParam(name, description=HPARAM_DESCRIPTIONS.get(name)) for name in HPARAMS],
                          metrics=[hp.Metric(tag, display_name=shown) for tag, shown in HPARAM_METRICS.items()])
        hp.hparams(values, trial_id=str(run_dir))


def mean_images_per_sec(history):
    """The run's training speed: the mean of its epochs' images/s (history.jsonl's
    train_images_per_sec, the epochs before a resume included); None before any."""
    speeds = [h["train_images_per_sec"] for h in history if h.get("train_images_per_sec") is not None]
    return float(np.mean(speeds)) if speeds else None


def write_run_scalars(writer, history, step):
    """After an epoch: the run's mean images/s so far under RUN_SPEED_TAG (HParams' images/s)."""
    speed = mean_images_per_sec(history)
    if speed is not None:
        with writer.as_default(step=step):
            tf.summary.scalar(RUN_SPEED_TAG, speed)


def write_train_scalars(writer, window, learning_rate, step, loss_scale=None):
    """The train/ scalars of a log window; `loss_scale`: mixed_float16's dynamic loss scale
    variable (read after the window's steps were fetched, so it waits for nothing)."""
    means = window.means()
    with writer.as_default(step=step):
        # grad_norm: the global gradient norm the non-finite guard checks (0 where the guard is off).
        for key in ("loss", "margin_loss", "reconstruction_loss", "accuracy", "images_per_sec", "step_time_ms",
                    "grad_norm"):
            if key in means:
                tf.summary.scalar(f"train/{key}", means[key])
        tf.summary.scalar("train/learning_rate", learning_rate)
        if loss_scale is not None:
            tf.summary.scalar("train/loss_scale", loss_scale)


def write_epoch_summaries(writer, model, test, show_images, tcfg, step, raw_test=None, class_names=None):
    """The test pass's scalars (test/per_class/<class>: each class's accuracy, named by
    `class_names` where the task has them, else by index), the test/per_class_accuracy
    table, histograms and reconstructions."""
    outputs = model(show_images, training=False)  # no labels: masked by the prediction, as at test time
    with writer.as_default(step=step):
        for key in ("loss", "margin_loss", "reconstruction_loss", "accuracy", "images_per_sec"):
            tf.summary.scalar(f"test/{key}", test[key])
        if raw_test is not None:  # train.ema_decay: `test` is the average's, these the trained weights'
            for key in ("loss", "accuracy"):
                tf.summary.scalar(f"test/raw_{key}", raw_test[key])
        per_class = test.get("per_class_accuracy")
        if per_class is not None:
            names = [str(k) for k in range(len(per_class))] if class_names is None else [str(n) for n in class_names]
            rows = []
            for name, accuracy in zip(names, per_class):
                if accuracy is not None:  # None: no test example of the class
                    tf.summary.scalar(f"test/per_class/{name}", accuracy)
                rows.append(f"| {name} | {'-' if accuracy is None else f'{accuracy:.4f}'} |")
            tf.summary.text("test/per_class_accuracy", "\n".join(["| class | accuracy |", "|---|---|", *rows]))
        n = tcfg["histogram_examples"]
        # The coupling coefficients after the last routing iteration and the class scores.
        if "c_ij" in outputs:  # (a CNN baseline routes nothing; its "lengths" are class probabilities)
            tf.summary.histogram("routing/c_ij", outputs["c_ij"][:n])
        tf.summary.histogram("capsules/lengths", outputs["lengths"][:n])
        if "reconstructions" in outputs:
            n = tcfg["num_images"]
            tf.summary.image("reconstructions/inputs_over_reconstructions",
                             image_grid(show_images[:n], outputs["reconstructions"][:n]), max_outputs=1)
    writer.flush()


class RunSummaries:
    """A run's TensorBoard: one writer into the run dir (the chief's; a no-op writer on the
    other workers of a multi-worker run), and what train() writes through it. A write that
    fails (a full disk, a read-only run dir) is one CheckpointError naming the event file."""

    def __init__(self, run_dir, chief=True):
        self.run_dir, self.chief = run_dir, chief
        with self._writing():
            self.writer = tf.summary.create_file_writer(str(run_dir)) if chief else tf.summary.create_noop_writer()

    @contextlib.contextmanager
    def _writing(self):
        try:
            yield
        except (tf.errors.OpError, OSError) as exc:
            raise self.write_failed(exc) from None

    def write_failed(self, exc):
        """The one-line CheckpointError naming the event file, for `exc` from a write of this
        writer (train_epoch's train/ scalars included); None for another error."""
        if isinstance(exc, tf.errors.OpError) and "tfevents" not in str(exc) and "summary" not in str(exc).lower():
            return None
        path = next(iter(sorted(self.run_dir.glob("events.out.tfevents.*"))[-1:]), self.run_dir)
        return write_error(path, exc)

    def hparams(self, cfg):
        """The run's values in the HParams dashboard, once a run (a new run: not on resume)."""
        with self._writing():
            write_hparams(self.writer, self.run_dir, cfg, cfg["data"])

    def epoch(self, model, test, show_images, tcfg, step, raw_test=None, class_names=None):
        """The test pass's scalars, per-class accuracies (by `class_names`), histograms and
        reconstructions (write_epoch_summaries)."""
        if self.chief:
            with self._writing():
                write_epoch_summaries(self.writer, model, test, show_images, tcfg, step, raw_test, class_names)

    def validation(self, validation, step):
        """The validation pass's scalars (validation/, beside test/: two curves apart)."""
        with self._writing(), self.writer.as_default(step=step):
            for key in ("loss", "margin_loss", "reconstruction_loss", "accuracy"):
                tf.summary.scalar(f"validation/{key}", validation[key])

    def figures(self, model, images, labels, step, class_names=None):
        """At the end of training: capsnet.figures' pictures of `model` on the labelled test
        examples `images`, `labels` in the Images tab (figures/<name>), the figures left out
        (no decoder, the CNN baseline) as figures/notes text."""
        if not self.chief:
            return
        drawn = model_figures(model, images, labels, class_names=class_names)
        with self._writing(), self.writer.as_default(step=step):
            for name, image in drawn.images.items():
                image = np.asarray(image)
                tf.summary.image(f"figures/{name}", (image / 255.0 if image.dtype == np.uint8 else image)[None],
                                 max_outputs=1)
            if drawn.notes:
                tf.summary.text("figures/notes", "\n".join(drawn.notes))
            self.writer.flush()

    def collapse(self, step, test, collapse, epoch_number):
        """The collapse check's values (training.health.collapse_reason): the longest capsule, whether collapsed, why."""
        with self._writing(), self.writer.as_default(step=step):
            tf.summary.scalar("test/max_capsule_length", test["max_length"])
            tf.summary.scalar("test/collapsed", float(collapse is not None))
            if collapse is not None:
                tf.summary.text("test/collapse", f"epoch {epoch_number}: {collapse}")

    def epoch_end(self, step, phases, history):
        """Where the epoch's wall time went (time/<phase>_seconds), and the run's mean speed so far."""
        with self._writing():
            with self.writer.as_default(step=step):
                for phase, seconds in phases.items():
                    tf.summary.scalar(f"time/{phase}_seconds", seconds)
            write_run_scalars(self.writer, history, step)
            self.writer.flush()

    def close(self):
        with self._writing():
            self.writer.close()
