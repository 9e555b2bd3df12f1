"""Evaluate a trained CapsNet on a test split.

- `evaluate(checkpoint, ...) -> dict`: `python evaluate.py` without Hydra. `checkpoint`
  is a run dir (its BEST checkpoint by default, `which="latest"` for the last epoch
  saved) or a checkpoint path (`.../checkpoints/latest/ckpt-3`). The model is rebuilt
  from the run's saved `config.yaml`; the report is also written as JSON next to the
  evaluated checkpoint (`<checkpoint>.eval.json`).
- `make_eval_step`, `evaluate_model`, `capsnet_losses`: the test pass the trainer runs
  after every epoch, so training and evaluation report the same numbers.
- `predict`, `correct_predictions`: the scoring, one label per example (argmax) or two
  (MultiMNIST, labels (batch, 2): right iff the two longest capsules are the two labels).
- `confusion_report(confusion)`: accuracy and per-class accuracy from a confusion
  matrix (pure NumPy); `score(labels, predictions)` picks it or `pair_report`.
- `evaluate([checkpoint, ...])`: an ensemble, each example scored by its capsule
  lengths averaged over the members (`ensemble_report`).
"""
import hashlib
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import tensorflow as tf
import yaml

from capsnet.errors import CheckpointError, ConfigError, DataError
from capsnet.losses import _check_margins, margin_loss, reconstruction_loss
from capsnet.validation import boolean, finite_float, positive_int

WHICH = ("best", "latest")


# --------------------------------------------------------------------------- losses

def capsnet_losses(images, labels, outputs, *, m_plus, m_minus, lambda_, reconstruction_weight, targets=None):
    """The paper's total loss per example: margin + reconstruction_weight · reconstruction.

    Returns (total, margin, reconstruction), each (batch,). Without a decoder
    (no "reconstructions" output) the reconstruction term is zero. `targets`: what the
    reconstructions are compared with; None = the images. Two-digit data passes labels
    (batch, 2) and targets (batch, 2, H, W, C), each digit alone: the reconstruction
    term is then the sum over the two digits.
    """
    margin = margin_loss(labels, outputs["lengths"], m_plus, m_minus, lambda_)          # (B,)
    if "reconstructions" in outputs:
        targets = images if targets is None else targets
        reconstruction = reconstruction_loss(targets, outputs["reconstructions"])         # (B,)
    else:
        reconstruction = tf.zeros_like(margin)
    return margin + reconstruction_weight * reconstruction, margin, reconstruction


LOSS_KEYS = ("m_plus", "m_minus", "lambda_", "reconstruction_weight")


def loss_params(train_cfg):
    """The loss arguments of capsnet_losses from a config's `train` section, checked:
    finite numbers, 0 <= m_minus < m_plus <= 1, lambda_ >= 0, reconstruction_weight >= 0
    (else ConfigError naming the keys)."""
    params = {}
    for key in LOSS_KEYS:
        if key not in train_cfg:
            raise ConfigError(f"train.{key} is missing")
        params[key] = finite_float(f"train.{key}", train_cfg[key], error=ConfigError)
    try:
        # The margin loss's own rule, checked now rather than when the first step is traced.
        _check_margins(params["m_plus"], params["m_minus"], params["lambda_"])
    except ValueError as exc:
        reason = str(exc).removeprefix("margin_loss: ")
        raise ConfigError(f"train.m_plus, train.m_minus, train.lambda_: {reason}") from exc
    if params["reconstruction_weight"] < 0:
        raise ConfigError(f"train.reconstruction_weight must be >= 0, got {params['reconstruction_weight']!r}")
    return params


# --------------------------------------------------------------------------- scoring

def predict(lengths, labels):
    """The predicted classes, shaped like `labels`: (batch,) the longest capsule, or for
    labels (batch, 2) the two longest capsules (batch, 2), longest first."""
    if labels.shape.rank == 2:
        return tf.math.top_k(lengths, k=labels.shape[1]).indices             # (B, 2) int32
    return tf.argmax(lengths, axis=-1, output_type=tf.int32)                  # (B,)


def correct_predictions(predictions, labels):
    """(batch,) float32, 1 where the prediction is right: the class (one label), or, with
    two labels, both (the paper's MultiMNIST scoring: the two longest capsules are exactly
    the two labels, in either order; the two labels of an example differ)."""
    if labels.shape.rank == 2:
        found = tf.reduce_any(labels[:, :, None] == predictions[:, None, :], axis=-1)  # (B, 2): label among top 2
        return tf.cast(tf.reduce_all(found, axis=-1), tf.float32)
    return tf.cast(tf.equal(predictions, labels), tf.float32)


def label_order(predictions, labels):
    """Two predicted classes (batch, 2) in the labels' order where one of them is a label
    of the other slot (swapped), so that each reconstruction from a rightly predicted
    capsule is compared with that label's digit."""
    swap = (predictions[:, 0] == labels[:, 1]) | (predictions[:, 1] == labels[:, 0])  # (B,)
    return tf.where(swap[:, None], predictions[:, ::-1], predictions)                  # (B, 2)


# --------------------------------------------------------------------------- test pass

def make_eval_step(model, image_shape, *, m_plus, m_minus, lambda_, reconstruction_weight, jit_compile=False,
                   two_digits=False):
    """A compiled test step: sums of the losses, predictions, capsule lengths.

    No labels go into the model, so the decoder reconstructs from the PREDICTED
    class, as at test time in the paper; the reconstruction loss is measured on that.
    jit_compile=True compiles the step with XLA (train.xla=jit; matmul path only: XLA
    cannot compile the custom op).
    two_digits=True (MultiMNIST): the step takes (images, labels (B, 2), digits
    (B, 2, H, W, C)); the two longest capsules are the prediction, each reconstructs one
    digit (in the labels' order where it names one) and is compared with that digit.
    """
    signature = [tf.TensorSpec([None, *image_shape], tf.float32), tf.TensorSpec([None], tf.int32)]
    if two_digits:
        signature = [signature[0], tf.TensorSpec([None, 2], tf.int32),
                     tf.TensorSpec([None, 2, *image_shape], tf.float32)]

    @tf.function(input_signature=signature, jit_compile=jit_compile)
    def eval_step(images, labels, digits=None):
        outputs = model(images, training=False)
        predictions = predict(outputs["lengths"], labels)  # (B,) or (B, 2)
        if digits is not None and "reconstructions" in outputs:
            # The model reconstructed from the longest capsule only; here from the two longest.
            outputs = {**outputs, "reconstructions": model.reconstruct(outputs["v_j"],
                                                                      label_order(predictions, labels))}
        total, margin, reconstruction = capsnet_losses(
            images, labels, outputs, m_plus=m_plus, m_minus=m_minus, lambda_=lambda_,
            reconstruction_weight=reconstruction_weight, targets=digits)
        return {
            "loss": tf.reduce_sum(total),
            "margin_loss": tf.reduce_sum(margin),
            "reconstruction_loss": tf.reduce_sum(reconstruction),
            "predictions": predictions,
            "lengths": outputs["lengths"],
        }

    return eval_step


def evaluate_model(eval_step, dataset, num_classes, keep_lengths=False):
    """One pass over `dataset` → mean losses, accuracy, confusion matrix, images/s.

    `dataset` yields (images, labels) or, two-digit data, (images, labels (B, 2), digits):
    accuracy is then the fraction with both digits right, per_class_accuracy the recall
    of each class (how often it is among the two longest capsules when present;
    pair_report), and there is no confusion matrix (None).
    images/s leaves out the first batch, which includes tracing/compiling the step.
    keep_lengths=True adds "lengths" (N, classes) and "labels", every example's capsule
    lengths and labels in the dataset's order (an ensemble averages the lengths).
    """
    sums = {"loss": 0.0, "margin_loss": 0.0, "reconstruction_loss": 0.0}
    all_labels, all_predictions, all_lengths = [], [], []
    timed_images, timed_seconds = 0, 0.0
    start = time.perf_counter()
    for batch, inputs in enumerate(dataset):
        out = eval_step(*inputs)
        # .numpy() waits for the step, so the clock below measures finished work.
        all_predictions.append(out["predictions"].numpy())
        all_labels.append(inputs[1].numpy())
        if keep_lengths:
            all_lengths.append(out["lengths"].numpy())
        for key in sums:
            sums[key] += float(out[key].numpy())
        now = time.perf_counter()
        if batch > 0:
            timed_images += len(all_predictions[-1])
            timed_seconds += now - start
        start = now
    if not all_labels:
        raise DataError("the test split is empty: nothing to evaluate (check data.limit_test)")
    labels = np.concatenate(all_labels)
    n = len(labels)
    result = {key: value / n for key, value in sums.items()}
    result.update(score(labels, np.concatenate(all_predictions), num_classes))
    result["images_per_sec"] = timed_images / timed_seconds if timed_seconds > 0 else float("nan")
    result["num_examples"] = n
    if keep_lengths:
        result["lengths"], result["labels"] = np.concatenate(all_lengths), labels
    return result


def score(labels, predictions, num_classes):
    """The report's scores (pure NumPy) of predictions shaped like `labels`: one label per
    example → confusion_report; two (N, 2) → pair_report."""
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    if labels.ndim == 2:
        return pair_report(labels, predictions, num_classes)
    confusion = np.zeros((num_classes, num_classes), np.int64)  # rows: true class, cols: predicted
    np.add.at(confusion, (labels, predictions), 1)
    return confusion_report(confusion)


def confusion_report(confusion):
    """accuracy, per_class_accuracy (None for a class with no examples), confusion_matrix (lists)."""
    confusion = np.asarray(confusion, np.int64)
    per_class_total = confusion.sum(axis=1)
    per_class = [None if total == 0 else float(confusion[k, k] / total)
                 for k, total in enumerate(per_class_total)]
    return {
        "accuracy": float(np.trace(confusion) / max(confusion.sum(), 1)),
        "per_class_accuracy": per_class,
        "confusion_matrix": confusion.tolist(),
    }


def pair_report(labels, predictions, num_classes):
    """Scores of two-digit examples (pure NumPy): labels and predictions int (N, 2).

    accuracy: the fraction whose two predictions are exactly the two labels (either
    order); per_class_accuracy[k]: the recall of class k, the fraction of the examples
    containing k that have k among their two predictions (None: no example contains k);
    per_class_examples[k]: how many examples contain k; confusion_matrix: None.
    """
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    found = (labels[:, :, None] == predictions[:, None, :]).any(axis=-1)  # (N, 2): each label among the predictions
    present = np.zeros(num_classes, np.int64)
    hits = np.zeros(num_classes, np.int64)
    np.add.at(present, labels.ravel(), 1)
    np.add.at(hits, labels.ravel(), found.ravel().astype(np.int64))
    return {
        "accuracy": float(found.all(axis=1).mean()),
        "per_class_accuracy": [None if p == 0 else float(h / p) for h, p in zip(hits, present)],
        "per_class_examples": present.tolist(),
        "confusion_matrix": None,
    }


def format_report(report):
    """A human-readable table: summary, per-class accuracy, confusion matrix (two-digit
    data, pair_report: per-class recall among the top two, no confusion matrix)."""
    pairs = report.get("confusion_matrix") is None
    if pairs:
        examples, kind = report["per_class_examples"], "two-digit examples"
        scored, column = "accuracy (both digits right)", "recall (among the two longest capsules when present)"
    else:
        confusion = np.asarray(report["confusion_matrix"])
        examples, kind, scored, column = confusion.sum(axis=1), "examples", "accuracy", "accuracy"
    if "members" in report:
        lines = [f"ensemble of {len(report['members'])} checkpoints (class scores: their capsule lengths averaged)"]
        lines += [f"  {m['checkpoint']} (epoch {m['epoch']}, {WEIGHT_NAMES[m['weights']]}, custom_op={m['custom_op']}): "
                  f"{scored} {m['accuracy']:.4%}, loss {m['loss']:.5f}" for m in report["members"]]
        lines += [f"dataset: {report['dataset']} test, {report['num_examples']} {kind}",
                  f"ensemble {scored} {report['accuracy']:.4%}  {report['images_per_sec']:.1f} images/s"]
    else:
        lines = [
            f"checkpoint: {report['checkpoint']} (epoch {report['epoch']}, {WEIGHT_NAMES[report['weights']]})",
            f"dataset: {report['dataset']} test, {report['num_examples']} {kind}, custom_op={report['custom_op']}",
            f"{scored} {report['accuracy']:.4%}  loss {report['loss']:.5f}  "
            f"(margin {report['margin_loss']:.5f}, reconstruction {report['reconstruction_loss']:.3f})  "
            f"{report['images_per_sec']:.1f} images/s",
        ]
    lines += [
        "",
        f"class  examples  {column}",
    ]
    for c, (present, accuracy) in enumerate(zip(examples, report["per_class_accuracy"])):
        shown = "-" if accuracy is None else f"{accuracy:.2%}"
        lines.append(f"{c:>5}  {int(present):>8}  {shown:>8}")
    if not pairs:
        k = len(confusion)
        width = max(5, len(str(confusion.max())) + 1)
        lines += ["", "confusion matrix (rows: true class, columns: predicted)",
                  " " * 6 + "".join(f"{c:>{width}}" for c in range(k))]
        for c in range(k):
            lines.append(f"{c:>5} " + "".join(f"{n:>{width}}" for n in confusion[c]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- checkpoints

def read_run_config(run_dir):
    """The plain-dict config a run was trained with (config.yaml, else Hydra's .hydra/config.yaml)."""
    for candidate in (Path(run_dir) / "config.yaml", Path(run_dir) / ".hydra" / "config.yaml"):
        if candidate.is_file():
            try:
                cfg = yaml.safe_load(candidate.read_text())
            except yaml.YAMLError as exc:
                raise CheckpointError(f"cannot parse the run config {candidate}: {exc}".splitlines()[0]) from exc
            if not isinstance(cfg, dict) or "model" not in cfg:
                raise CheckpointError(f"the run config {candidate} has no model section")
            return cfg
    return None


def _is_checkpoint_prefix(path):
    return Path(str(path) + ".index").is_file()


def resolve_checkpoint(checkpoint, which="best"):
    """Map a run dir or a checkpoint path to (checkpoint prefix, run dir, run config).

    A run dir uses checkpoints/best (or checkpoints/latest with which="latest");
    a directory holding a TF `checkpoint` state file uses its newest checkpoint;
    a prefix (`.../ckpt-3`, or its `.index` file) is used as is. The run config is
    looked up in the checkpoint's parent directories.
    """
    if which not in WHICH:
        raise ConfigError(f"which must be one of {', '.join(WHICH)}, got {which!r}")
    path = Path(os.path.expanduser(str(checkpoint)))
    if path.suffix == ".index":
        path = path.with_suffix("")
    if path.is_dir() and (path / "checkpoints").is_dir():
        managed = path / "checkpoints" / which
        prefix = tf.train.latest_checkpoint(str(managed))
        if prefix is None:
            raise CheckpointError(f"run dir {path} has no {which} checkpoint in {managed}")
    elif path.is_dir():
        prefix = tf.train.latest_checkpoint(str(path))
        if prefix is None:
            raise CheckpointError(
                f"no checkpoint in {path}: expected a run dir (with checkpoints/) or a checkpoint path like "
                f".../checkpoints/latest/ckpt-3")
    elif _is_checkpoint_prefix(path):
        prefix = str(path)
    else:
        raise CheckpointError(
            f"checkpoint not found: {checkpoint} (expected a run dir or a checkpoint path like "
            f".../checkpoints/latest/ckpt-3)")
    # The run dir is the nearest ancestor holding the run's config.
    for parent in list(Path(prefix).parents)[:4]:
        cfg = read_run_config(parent)
        if cfg is not None:
            return prefix, parent, cfg
    raise CheckpointError(f"no config.yaml for checkpoint {prefix} in its run dir: cannot rebuild the model")


def checkpoint_weights(model):
    """The model's weights by their path inside the model ("decoder/fc1/kernel"), for tf.train.Checkpoint.

    This dict, not the Keras model object, is what training checkpoints hold: it keys
    every weight by a stable, readable name that follows the layer names, not the
    Python attributes that hold the layers, and it is the checkpoint format (existing
    run dirs load through it). Checkpointing the model object itself also sees every
    weight now (the layers hold no sublayers in Python lists, which Keras 3 hides from
    tf.train.Checkpoint), but under other names.
    """
    weights = {}
    for variable in model.weights:
        path = variable.path
        name = path[len(model.name) + 1:] if path.startswith(model.name + "/") else path
        if name in weights:
            raise RuntimeError(f"two model weights share the path {name!r}: checkpoint names must be unique")
        weights[name] = variable
    return weights


# evaluate(weights=...): the trained weights (checkpoint node "model") or their moving
# average (node "ema", kept by runs with train.ema_decay > 0; the same names below it).
WEIGHTS = {"raw": "model", "ema": "ema"}
WEIGHT_NAMES = {"raw": "trained weights", "ema": "moving average of the weights"}


def restore_model(model, prefix, weights="raw"):
    """Load the model weights (only) from a training checkpoint: the trained ones (weights="raw")
    or their moving average ("ema"); returns the epoch it was saved at."""
    epoch = tf.Variable(0, dtype=tf.int64, trainable=False)
    checkpoint = tf.train.Checkpoint(**{WEIGHTS[weights]: checkpoint_weights(model)}, epoch=epoch)
    try:
        status = checkpoint.read(prefix)
        # The optimizer state in the file is not needed here (expect_partial), but every
        # model weight must come from the file: a silent miss would evaluate random weights.
        status.expect_partial()
        status.assert_existing_objects_matched()
    except (tf.errors.OpError, ValueError, AssertionError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"cannot load the model from checkpoint {prefix}: {message} "
            f"(does the run's config.yaml match the checkpoint?)") from exc
    return int(epoch.numpy())


# --------------------------------------------------------------------------- evaluate

def evaluate(checkpoint, *, which="best", data_name=None, data_dir=None, limit_test=None,
             custom_op=None, batch_size=None, weights=None, output=None):
    """Evaluate `checkpoint` on the test split; returns the report and writes it as JSON.

    Args:
        checkpoint: run dir or checkpoint path (see resolve_checkpoint), or a list of
            them: an ensemble, each example scored by its capsule lengths averaged over
            the members (trained for the same dataset and number of classes).
        which: "best" (highest test accuracy) or "latest" checkpoint of a run dir.
        data_name, data_dir, limit_test: None = as in the (first) run's config. A different
            data_name without data_dir reads tensorflow-datasets (the run's data.dir
            holds the other dataset's files).
        custom_op: None = as trained; True/False picks the capsule-prediction path.
        batch_size: None = the (first) run's train.batch_size.
        weights: None = the run's moving average of the weights if it kept one
            (train.ema_decay > 0), else the trained weights; "ema" or "raw" to choose.
        output: JSON path; None = `<checkpoint>.eval.json` (an ensemble:
            `<first checkpoint>.ensemble-<hash of the members>.eval.json`).

    Returns:
        dict with accuracy, loss, margin_loss, reconstruction_loss, images_per_sec,
        per_class_accuracy, confusion_matrix, num_examples, checkpoint, epoch,
        dataset, custom_op, weights. MultiMNIST (two digits per example): accuracy = both
        digits right, per_class_accuracy = per-class recall among the top two,
        per_class_examples, confusion_matrix None (pair_report). An ensemble's report
        has the ensemble's accuracy, per-class scores, num_examples, images/s, dataset,
        batch_size, and `members`: each member's checkpoint, run_dir, epoch, weights,
        custom_op, accuracy, losses and images/s (the losses, checkpoint and epoch are
        only there: the average of lengths has no reconstruction).
    """
    # Imported here: capsnet.training imports this module.
    from capsnet.data import example_shape, is_overlay, load_split, make_split_dataset
    from capsnet.training import build_capsnet, check_labels, check_op_library

    checkpoints = list(checkpoint) if isinstance(checkpoint, (list, tuple)) else [checkpoint]
    if not checkpoints:
        raise ConfigError("checkpoint=[] names no checkpoint: give a run dir or checkpoint path "
                          "(a list of several evaluates their ensemble)")
    members = [_member(c, which=which, custom_op=custom_op, weights=weights) for c in checkpoints]
    first = members[0]
    prefixes = [member["prefix"] for member in members]
    repeated = sorted({prefix for prefix in prefixes if prefixes.count(prefix) > 1})
    if repeated:
        # A member twice would weigh it double without saying so.
        raise ConfigError(f"the ensemble names a checkpoint more than once: {', '.join(repeated)}")
    data_cfg = dict(first["cfg"].get("data") or {})
    if data_name is not None and data_name != data_cfg.get("name") and data_dir is None:
        data_cfg["dir"] = None
    if data_name is not None:
        data_cfg["name"] = data_name
    if data_dir is not None:
        data_cfg["dir"] = str(data_dir)
    if limit_test is not None:
        data_cfg["limit_test"] = limit_test
    if batch_size is None:
        batch_size, where = first["cfg"]["train"].get("batch_size"), \
            f"the run config's train.batch_size ({first['run_dir']})"
    else:
        where = "batch_size"
    batch_size = positive_int(where, batch_size, expected="a positive integer (or null: the run's train.batch_size)",
                              error=ConfigError)
    # One test split for all (data.name may pick another): members trained for different
    # datasets have capsules that mean different things, whatever split they are scored on.
    trained_on = [(member["cfg"].get("data") or {}).get("name") for member in members]
    for member, name in zip(members[1:], trained_on[1:]):
        if name != trained_on[0]:
            raise ConfigError(f"ensemble members trained on different datasets: {trained_on[0]} "
                              f"({first['run_dir']}) and {name} ({member['run_dir']})")

    if any(member["custom_op"] for member in members):
        check_op_library()
    for member in members:
        model_cfg = dict(member["cfg"]["model"])
        if not member["custom_op"]:
            # The fused routing op is the compiled op too; without it the same W routes in TF.
            model_cfg["fused_routing"] = False
        member["model"] = build_capsnet(model_cfg, member["custom_op"])  # its config errors before the data is read
    model = first["model"]
    for member in members[1:]:
        shapes = [(m["model"].image_shape, m["model"].num_classes) for m in (first, member)]
        if shapes[0] != shapes[1]:
            raise ConfigError(
                f"ensemble members differ in (image shape, classes): {shapes[0]} ({first['run_dir']}) and "
                f"{shapes[1]} ({member['run_dir']}): their capsule lengths cannot be averaged")
    images, labels = load_split(data_cfg["name"], "test", data_dir=data_cfg.get("dir"),
                                limit=data_cfg.get("limit_test"))
    # MultiMNIST: the test pairs on the canvas of the run's shift (the paper's 4 px).
    shift_pixels = data_cfg.get("shift_pixels", 2)
    check_labels(labels, images, model=model, split=f"{data_cfg['name']} test",
                 image_shape=example_shape(data_cfg["name"], images.shape[1:], shift_pixels))
    for member in members:
        member["epoch"] = restore_model(member["model"], member["prefix"], member["weights"])

    dataset = make_split_dataset(data_cfg["name"], images, labels, batch_size=batch_size, training=False,
                                 shift_pixels=shift_pixels)
    ensemble = len(members) > 1
    reports, results = [], []
    for member in members:
        eval_step = make_eval_step(member["model"], model.image_shape, **member["losses"],
                                   two_digits=is_overlay(data_cfg["name"]))
        result = evaluate_model(eval_step, dataset, model.num_classes, keep_lengths=ensemble)
        results.append(result)
        reports.append({
            "accuracy": result["accuracy"],
            "loss": result["loss"],
            "margin_loss": result["margin_loss"],
            "reconstruction_loss": result["reconstruction_loss"],
            "images_per_sec": result["images_per_sec"],
            "per_class_accuracy": result["per_class_accuracy"],
            "confusion_matrix": result["confusion_matrix"],
            **({"per_class_examples": result["per_class_examples"]} if "per_class_examples" in result else {}),
            "num_examples": result["num_examples"],
            "checkpoint": member["prefix"],
            "run_dir": str(member["run_dir"]),
            "epoch": member["epoch"],
            "dataset": data_cfg["name"],
            "custom_op": member["custom_op"],
            "batch_size": batch_size,
            "weights": member["weights"],
        })
    if ensemble:
        report = ensemble_report(reports, results, model.num_classes)
        digest = hashlib.sha1(json.dumps([[m["checkpoint"], m["weights"], m["custom_op"]] for m in reports])
                              .encode()).hexdigest()[:8]
        default_output = f"{first['prefix']}.ensemble-{digest}.eval.json"
    else:
        report, default_output = reports[0], first["prefix"] + ".eval.json"
    output = Path(output) if output is not None else Path(default_output)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(json_safe(report), indent=2) + "\n")
    except OSError as exc:
        raise CheckpointError(f"cannot write the evaluation report {output}: {exc.strerror}") from exc
    report["output"] = str(output)
    return report


def _member(checkpoint, *, which, custom_op, weights):
    """One checkpoint to evaluate, resolved and its run config checked (no model yet):
    prefix, run_dir, cfg, custom_op, losses, weights."""
    from capsnet.training import ema_decay

    prefix, run_dir, cfg = resolve_checkpoint(checkpoint, which)
    prefix, run_dir = str(Path(prefix).resolve()), Path(run_dir).resolve()
    # Only real booleans and integers: bool('no') is True, int(2.7) is 2, and 0 would mean "unset".
    if custom_op is None:
        custom_op = cfg.get("custom_op", False)
        where = f"the run config's custom_op ({run_dir / 'config.yaml'})"
    else:
        where = "custom_op"
    boolean(where, custom_op, expected="true or false (or null: as trained)", error=ConfigError)
    if not isinstance(cfg.get("train"), dict):
        cfg["train"] = {}
    try:
        losses = loss_params(cfg["train"])
        kept_average = ema_decay(cfg["train"]) > 0
    except ConfigError as exc:
        raise ConfigError(f"the run config of {run_dir}: {exc}") from exc
    if weights is None:
        weights = "ema" if kept_average else "raw"
    if weights not in WEIGHTS:
        raise ConfigError(f"weights must be one of {', '.join(WEIGHTS)} (or null: the run's average if it kept one), "
                          f"got {weights!r}")
    if weights == "ema" and not kept_average:
        raise ConfigError(f"weights=ema: the run {run_dir} kept no average of its weights (train.ema_decay was 0); "
                          "use weights=raw (an ensemble: weights=null, each member's own)")
    return {"prefix": prefix, "run_dir": run_dir, "cfg": cfg, "custom_op": custom_op, "losses": losses,
            "weights": weights}


def ensemble_report(reports, results, num_classes):
    """The ensemble's report from its members' reports and passes (keep_lengths): every
    example scored by the members' capsule lengths averaged, as one model's would be."""
    labels = results[0]["labels"]
    for result in results[1:]:
        if not np.array_equal(result["labels"], labels):  # the test split is not shuffled: never expected
            raise RuntimeError("the ensemble members' test passes saw the examples in different orders")
    lengths = np.mean([result["lengths"] for result in results], axis=0)   # (N, classes)
    predictions = predict(tf.constant(lengths), tf.constant(labels)).numpy()
    scores = score(labels, predictions, num_classes)
    member_keys = ("checkpoint", "run_dir", "epoch", "weights", "custom_op", "accuracy", "loss", "margin_loss",
                   "reconstruction_loss", "images_per_sec")
    return {
        **scores,
        "num_examples": len(labels),
        # Members run one after another: their seconds per image add up.
        "images_per_sec": 1.0 / sum(1.0 / r["images_per_sec"] for r in reports),
        "dataset": reports[0]["dataset"],
        "batch_size": reports[0]["batch_size"],
        "ensemble": f"mean capsule lengths of {len(reports)} members",
        "members": [{key: r[key] for key in member_keys} for r in reports],
    }


def json_safe(value):
    """`value` with every NaN/inf float replaced by None: JSON has no NaN (json.dumps
    would write invalid JSON), so they are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return value


def to_json_line(report):
    """The report as one line of valid JSON (NaN → null)."""
    return json.dumps(json_safe(report))
