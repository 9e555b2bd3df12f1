"""Evaluate a trained CapsNet on a test split.

- `evaluate(checkpoint, ...) -> dict`: `python evaluate.py` without Hydra. `checkpoint`
  is a run dir (by default its best checkpoint where the run chose it on a validation
  split, else its last epoch saved; `which="best"` / `"latest"` to choose) or a checkpoint
  path (`.../checkpoints/latest/ckpt-3`). The model is rebuilt
  from the run's saved `config.yaml`; the report is also written as JSON into the run's
  `evaluations/` folder (`report_path`: `evaluations/best-ckpt-7.json` for checkpoints/best/ckpt-7).
- `evaluate([checkpoint, ...])`: an ensemble, each example scored by its capsule
  lengths averaged over the members (`ensemble_report`).
- `evaluate(..., tta="flip"|"shift")`: test-time augmentation, each example scored by its
  capsule lengths averaged over views of the image (for each member: the image and its
  mirror image, or the image and its four one-pixel shifts), as an ensemble of the passes.
- `format_report(report)`: the report as a table; `to_json_line(report)`: as one JSON line.

The pieces it shares with training: the test pass (capsnet.training.steps:
`make_eval_step`, `evaluate_model`, the same numbers the trainer reports after every
epoch), the scoring (capsnet.scoring: `predict`, `score`, `confusion_report`,
`pair_report`), the model (capsnet.training.model_setup) and the checkpoints
(capsnet.training.checkpoints: `resolve_checkpoint`, `restore_model`).
"""
import errno
import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import tensorflow as tf

from capsnet import config
from capsnet.augment import shift_batch
from capsnet.datasets import DATASETS
from capsnet.tasks import task_for
from capsnet.errors import CheckpointError, ConfigError, DataError
from capsnet.losses import loss_params
from capsnet.outputs import check_output
from capsnet.precision import set_tensor_float_32
from capsnet.scoring import json_safe, predict, score
from capsnet.training.checkpoints import best_chosen_on, resolve_checkpoint, restore_model
from capsnet.training.model_setup import build_capsnet, check_op_library
from capsnet.training.steps import eval_batch_size, evaluate_model, make_eval_step
from capsnet.validation import boolean

# How format_report names the weights evaluated (evaluate(weights=...): config.WEIGHTS).
WEIGHT_NAMES = {"raw": "trained weights", "ema": "moving average of the weights"}


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
        views = list(dict.fromkeys(m["view"] for m in report["members"] if "view" in m))  # in pass order
        if views:  # tta: each checkpoint's passes over the views of the images
            lines = [f"ensemble of {len(report['members'])} passes: {len(report['members']) // len(views)} "
                     f"checkpoint(s) x {len(views)} views, {', '.join(views[:-1])} and {views[-1]} "
                     f"(tta={report.get('tta', 'flip')}; class scores: their capsule lengths averaged)"]
        else:
            lines = [f"ensemble of {len(report['members'])} checkpoints (class scores: their capsule lengths averaged)"]
        lines += [f"  {m['checkpoint']}{' ' + m['view'] if 'view' in m else ''} (epoch {m['epoch']}, "
                  f"{WEIGHT_NAMES[m['weights']]}, custom_op={m['custom_op']}): "
                  f"{scored} {m['accuracy']:.4%}, loss {m['loss']:.5f}" for m in report["members"]]
        lines += [f"dataset: {report['dataset']} test, {report['num_examples']} {kind}{pairs_shown(report)}",
                  f"ensemble {scored} {report['accuracy']:.4%}  {rate_text(report['images_per_sec'])}"]
    else:
        lines = [
            f"checkpoint: {report['checkpoint']} (epoch {report['epoch']}, {WEIGHT_NAMES[report['weights']]})",
            f"dataset: {report['dataset']} test, {report['num_examples']} {kind}{pairs_shown(report)}, "
            f"custom_op={report['custom_op']}, "
            f"precision={report['precision']}, tf32={report['tf32']}, xla={report['xla']}",
            f"{scored} {report['accuracy']:.4%}  loss {report['loss']:.5f}  "
            f"(margin {report['margin_loss']:.5f}, reconstruction {report['reconstruction_loss']:.3f})  "
            f"{rate_text(report['images_per_sec'])}",
        ]
    if report.get("best_chosen_on") == "test" or any(m.get("best_chosen_on") == "test"
                                                     for m in report.get("members", [])):
        lines.append("note: checkpoints/best was chosen on this test set (the run held no validation split out): "
                     "its accuracy here is optimistic; which=latest is the final checkpoint")
    lines += [
        "",
        f"class  examples  {column}",
    ]
    names = report.get("class_names")
    if names and all(str(name) == str(c) for c, name in enumerate(names)):
        names = None  # MNIST's names are the indices: one column of them is enough
    for c, (present, accuracy) in enumerate(zip(examples, report["per_class_accuracy"])):
        shown = "-" if accuracy is None else f"{accuracy:.2%}"
        lines.append(f"{c:>5}  {int(present):>8}  {shown:>8}" + (f"  {names[c]}" if names else ""))
    if not pairs:
        k = len(confusion)
        width = max(5, len(str(confusion.max())) + 1)
        lines += ["", "confusion matrix (rows: true class, columns: predicted)",
                  " " * 6 + "".join(f"{c:>{width}}" for c in range(k))]
        for c in range(k):
            lines.append(f"{c:>5} " + "".join(f"{n:>{width}}" for n in confusion[c]) + (f"  {names[c]}" if names else ""))
    return "\n".join(lines)


def pairs_shown(report):
    """', pairs shifted ±s px, canvas border p' for a report of two-digit test pairs."""
    pairs = report.get("test_pairs")
    return "" if not pairs else f" (shifted ±{pairs['shift_pixels']} px, canvas border {pairs['pad_pixels']} px)"


# The run's folder of evaluate()'s reports at their default place (report_path). Not under
# checkpoints/, whose files a training running in the run dir deletes: best/ drops the previous
# best epoch's, latest/ prunes past train.keep_checkpoints, a saved epoch removes interrupted/.
REPORTS_DIR = "evaluations"


def report_path(member, variant=None):
    """The default report of `member` (resolve_member's: prefix and run_dir, both resolved):
    <run dir>/evaluations/<checkpoint>[.<variant>].json, <checkpoint> its path below the run's
    checkpoints/ with '-' for '/' (best-ckpt-7, latest-ckpt-3, interrupted-ckpt-1200; a
    checkpoint elsewhere in the run dir by its path below the run dir). `variant`: what sets
    the report apart from the checkpoint's own ("affnist", "pairs-shift1-pad4", "ensemble-<hash>")."""
    prefix, run_dir = Path(member["prefix"]), Path(member["run_dir"])
    try:
        parts = prefix.relative_to(run_dir).parts
    except ValueError:  # checkpoints/ links elsewhere: its folder and name are what tells it apart
        parts = (prefix.parent.name, prefix.name)
    if len(parts) > 1 and parts[0] == "checkpoints":
        parts = parts[1:]
    name = "-".join(parts)
    return run_dir / REPORTS_DIR / (f"{name}.{variant}.json" if variant else f"{name}.json")


def evaluate(checkpoint, *, which=None, data_name=None, data_dir=None, limit_test=None, shift_pixels=None,
             pad_pixels=None, custom_op=None, batch_size=None, weights=None, precision=None, tf32=None, xla=None, output=None,
             overwrite=False, tta="none"):
    """Evaluate `checkpoint` on the test split; returns the report and writes it as JSON.

    Args:
        checkpoint: run dir or checkpoint path (see resolve_checkpoint), or a list of
            them: an ensemble, each example scored by its capsule lengths averaged over
            the members (trained for the same dataset and number of classes).
        which: "best" or "latest" checkpoint of a run dir; None: best where the run chose it
            on a validation split, else latest (checkpoints.default_which). The report of a
            best/ checkpoint says what it was chosen on (`best_chosen_on`: "validation" or
            "test", format_report's note for "test").
        data_name, data_dir, limit_test: None = as in the (first) run's config. A different
            data_name without data_dir reads tensorflow-datasets (the run's data.dir
            holds the other dataset's files).
        shift_pixels, pad_pixels: None = the run's; MultiMNIST only: the test pairs' shifts
            and canvas border (a run scored on other pairs, e.g. the authors' generator's
            shift_pixels=6 with pad_pixels=4). A shift given alone keeps the run's canvas.
            The report names its pairs (`test_pairs`); pairs other than the run's are written
            to `evaluations/<checkpoint>.pairs-shift<s>-pad<p>.json` by default, not over the
            run's own.
        custom_op: None = as trained; True/False picks the capsule-prediction path.
        batch_size: None = the (first) run's test pass batch: its train.test_batch_size, or
            train.batch_size where that is null.
        weights: None = the run's moving average of the weights if it kept one
            (train.ema_decay > 0), else the trained weights; "ema" or "raw" to choose.
        precision: None = the run's train.precision; or one of config.PRECISIONS (the
            weights are float32 in every precision).
        tf32: None = the run's train.tf32; or True / False: TensorFloat-32 for the pass's
            float32 matmuls and convolutions on GPUs that have it (set for each member's pass).
        xla: None = as the run's per-epoch test pass was compiled: "jit" for a run trained
            with train.xla=jit, else "none"; or "none" / "jit". In 16-bit precisions the
            XLA-compiled pass rounds differently, so only the run's own setting reproduces
            its in-run test score exactly.
        output: JSON path; None = the run's `evaluations/<checkpoint>.json` (report_path:
            `evaluations/best-ckpt-7.json`; another dataset than the run's:
            `evaluations/<checkpoint>.<dataset>.json`; settings other than the run's test
            pass: `evaluations/<checkpoint>.custom_op-true.json` (other_settings: custom_op,
            weights, precision, tf32, xla, data.limit_test); an ensemble or tta: the first member's
            run's `evaluations/<first checkpoint>.ensemble-<hash of the passes>.json`),
            replaced if it exists. A path given is refused before the pass if it exists
            (unless `overwrite`) or is a run's own file (check_output).
        tta: "none"; "flip": every member also scores the test images mirrored
            left-right, only for runs trained on mirrored images (data.flip=true: a digit's
            mirror image is not that digit); "shift": every member also scores them moved one
            pixel right, left, down and up (the border filled as the run's training shifts
            fill it), only for runs trained on shifted images (data.shift_pixels > 0). Each
            example is then scored by the capsule lengths averaged over all the passes
            (members × views).

    Returns:
        dict with accuracy, loss, margin_loss, reconstruction_loss, images_per_sec,
        per_class_accuracy, confusion_matrix, num_examples, checkpoint, epoch,
        dataset, custom_op, weights, precision, tf32, xla. MultiMNIST (two digits per example):
        accuracy = both digits right, per_class_accuracy = per-class recall among the top two,
        per_class_examples, confusion_matrix None (pair_report). An ensemble's report
        has the ensemble's accuracy, per-class scores, num_examples, images/s, dataset,
        batch_size, and `members`: each member's checkpoint, run_dir, epoch, weights,
        custom_op, accuracy, losses and images/s (the losses, checkpoint and epoch are
        only there: the average of lengths has no reconstruction). With tta the report
        is an ensemble's whose `members` are the passes, each with its `view` ("plain",
        "mirrored"; "right", "left", "down", "up"), and it names its `tta`.
    """
    checkpoints = list(checkpoint) if isinstance(checkpoint, (list, tuple)) else [checkpoint]
    if not checkpoints:
        raise ConfigError("checkpoint=[] names no checkpoint: give a run dir or checkpoint path "
                          "(a list of several evaluates their ensemble)")
    # The arguments by configs/eval.yaml's field checks, in the words evaluate.py's users see
    # (evaluate.py has checked them already; tests and scripts call evaluate() directly).
    args = config.check_section(config.EvalAppConfig, {
        "checkpoint": checkpoints, "which": which, "custom_op": custom_op, "batch_size": batch_size,
        "weights": weights, "precision": precision, "tf32": tf32, "xla": xla, "output": output,
        "overwrite": overwrite, "tta": tta,
        "data": {"name": data_name, "dir": data_dir, "limit_test": limit_test, "shift_pixels": shift_pixels,
                 "pad_pixels": pad_pixels}})
    if args["output"] is not None:
        check_output(Path(args["output"]), args["overwrite"])
    members = resolve_members(checkpoints, which=which, custom_op=custom_op, weights=weights, precision=precision,
                              tf32=tf32, xla=xla)
    first = members[0]
    data_cfg, task, test_pairs, other_pairs = test_data_section(first["cfg"]["data"], args["data"])
    batch_size = args["batch_size"] or eval_batch_size(first["cfg"]["train"])
    check_members(members, task, data_cfg["name"], args["tta"])
    model = build_member_models(members)
    # MultiMNIST: the test pairs of the run's shift and canvas (the paper's 4 px).
    test_split = load_run_test_split(task, from_run=args["data"]["dir"] is None, run_dir=first["run_dir"])
    task.check(test_split, model, "test")
    for member in members:
        member["epoch"] = restore_model(member["model"], member["prefix"], member["weights"])
    check_writable(Path(args["output"]).parent if args["output"] is not None else report_path(first).parent)

    dataset = task.dataset(test_split, batch_size=batch_size, training=False)
    names = task.class_names(model.num_classes)
    ensemble = len(members) > 1 or args["tta"] != "none"
    reports, results = [], []
    shared = {"dataset": data_cfg["name"], "batch_size": batch_size, "class_names": names, "test_pairs": test_pairs}
    for member in members:
        set_tensor_float_32(member["tf32"])  # process-wide: before the member's pass is traced and run
        eval_step = make_eval_step(member["model"], model.image_shape, **member["losses"],
                                   jit_compile=member["xla"] == "jit", label_format=task.label_format)
        views = tta_views(dataset, args["tta"], shift_fill=member["cfg"]["data"]["shift_fill"])
        for view, view_dataset in views.items():
            result = evaluate_model(eval_step, view_dataset, model.num_classes, keep_lengths=ensemble)
            results.append(result)
            reports.append(member_report(result, member, view if len(views) > 1 else None, **shared))
    report, variant = final_report(reports, results, first, model.num_classes, ensemble=ensemble,
                                   tta=args["tta"], names=names, test_pairs=test_pairs, other_pairs=other_pairs,
                                   settings=other_settings(first, data_cfg["limit_test"]))
    output = Path(args["output"]) if args["output"] is not None else report_path(first, variant)
    write_report(output, report)
    report["output"] = str(output)
    return report


def write_report(output, report):
    """`report` as JSON at `output`, whole or not at all: written to a temporary file beside
    it and renamed, so that a failed write (a full disk) leaves no empty or truncated report
    that a rerun would refuse to overwrite (CheckpointError, one line)."""
    temporary = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(json_safe(report), indent=2) + "\n")
        os.replace(temporary, output)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        full = " (is the disk full?)" if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else ""
        raise CheckpointError(f"cannot write the evaluation report {output}: {exc.strerror or exc}{full}") from exc


def check_writable(directory):
    """CheckpointError (one line) before the test pass when the report could not be written
    into `directory` (or the nearest folder above it that exists): a read-only run dir would
    otherwise fail only after a pass that can take minutes."""
    existing = Path(directory).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK):
        raise CheckpointError(f"cannot write the evaluation report into {directory}: {existing} is read-only; "
                              "output=PATH writes it elsewhere")


def resolve_members(checkpoints, **options):
    """resolve_member of each checkpoint (`options`: its keywords); ConfigError for a checkpoint
    named twice (a member twice would weigh it double without saying so)."""
    members = [resolve_member(c, **options) for c in checkpoints]
    prefixes = [member["prefix"] for member in members]
    repeated = sorted({prefix for prefix in prefixes if prefixes.count(prefix) > 1})
    if repeated:
        raise ConfigError(f"the ensemble names a checkpoint more than once: {', '.join(repeated)}")
    return members


def test_data_section(run_data, data_args):
    """(data_cfg, task, test_pairs, other_pairs): the run's data section `run_data` with
    evaluate's data arguments over it. A different data.name without data.dir reads
    tensorflow-datasets, unless both names are made of the same files (expanded_mnist and
    affnist of MNIST's: the run's data.dir holds them); MultiMNIST: the test pairs' shifts
    and canvas (a shift given alone keeps the run's canvas), `other_pairs` those given;
    other datasets refuse them."""
    data_cfg = dict(run_data)
    name = data_args["name"]
    if name is not None and name != data_cfg["name"] and data_args["dir"] is None and not same_files(
            name, data_cfg["name"]):
        data_cfg["dir"] = None
    other_pairs = {key: data_args[key] for key in ("shift_pixels", "pad_pixels") if data_args[key] is not None}
    run_border = data_cfg["shift_pixels"] if data_cfg.get("pad_pixels") is None else data_cfg["pad_pixels"]
    data_cfg.update({key: value for key, value in data_args.items() if value is not None})
    task, test_pairs = task_for(data_cfg).for_test_pairs(other_pairs, run_border)
    return task.cfg, task, test_pairs, other_pairs


def same_files(name, other):
    """Whether datasets `name` and `other` are read from the same files (one tfds name, e.g.
    mnist for expanded_mnist and affnist): a run's data.dir of one holds the other's."""
    specs = [DATASETS.get(n) for n in (name, other)]
    return all(specs) and specs[0].tfds_name is not None and specs[0].tfds_name == specs[1].tfds_name


def check_members(members, task, data_name, tta):
    """The members were trained on one dataset (members trained for different datasets have
    capsules that mean different things, whatever split they are scored on), and on the
    images that `tta`'s views make (ConfigError, one line)."""
    trained_on = [member["cfg"]["data"]["name"] for member in members]
    for member, name in zip(members[1:], trained_on[1:]):
        if name != trained_on[0]:
            raise ConfigError(f"ensemble members trained on different datasets: {trained_on[0]} "
                              f"({members[0]['run_dir']}) and {name} ({member['run_dir']})")
    check_member_class_names(members)
    for member in members:
        trained = member["cfg"]["data"]
        if tta == "flip" and not trained["flip"]:
            raise ConfigError(f"tta=flip: the run {member['run_dir']} was not trained on mirrored images "
                              f"(data.flip=false; a mirrored {trained['name']} image need not be of its class): "
                              "use tta=none")
        if tta == "shift" and not trained["shift_pixels"]:
            raise ConfigError(f"tta=shift: the run {member['run_dir']} was not trained on shifted images "
                              "(data.shift_pixels=0): use tta=none")
    if tta != "none" and task.label_format.targets:
        # Its test pairs carry their digits as the decoder's targets, which a view would have to move too.
        raise ConfigError(f"tta={tta}: not for {data_name} (its test pairs carry each digit as "
                          "a reconstruction target): use tta=none")


def check_member_class_names(members):
    """The members name their classes alike, in the same order (a folder's class folders: two
    runs on folders of other names, or another order, have capsule k meaning different
    things): ConfigError naming the first difference."""
    named = [(member, task_for(member["cfg"]["data"]).class_names(member["cfg"]["model"]["num_classes"]))
             for member in members]
    first, first_names = named[0]
    for member, names in named[1:]:
        if names is None or first_names is None or list(names) == list(first_names):
            continue
        k = next((k for k, pair in enumerate(zip(first_names, names)) if pair[0] != pair[1]),
                 min(len(names), len(first_names)))
        at = (f"class {k} is {first_names[k]!r} in {first['run_dir']} but {names[k]!r} in {member['run_dir']}"
              if k < min(len(names), len(first_names)) else
              f"{len(first_names)} classes in {first['run_dir']}, {len(names)} in {member['run_dir']}")
        raise ConfigError(f"ensemble members name their classes differently: {at} ({', '.join(first_names)} vs "
                          f"{', '.join(names)}): their capsule lengths cannot be averaged")


def build_member_models(members):
    """Each member's model (member["model"]), built before the data is read; the first's is
    returned. ConfigError where members differ in image shape or classes."""
    if any(member["custom_op"] for member in members):
        check_op_library()
    for member in members:
        # Routed as config.router_spec decides for the member's custom_op: custom_op=false
        # routes the same W in TF (or XLA) whatever the run routed with.
        member["model"] = build_capsnet(member["cfg"]["model"], member["custom_op"], member["precision"])
    first = members[0]
    for member in members[1:]:
        shapes = [(m["model"].image_shape, m["model"].num_classes) for m in (first, member)]
        if shapes[0] != shapes[1]:
            raise ConfigError(
                f"ensemble members differ in (image shape, classes): {shapes[0]} ({first['run_dir']}) and "
                f"{shapes[1]} ({member['run_dir']}): their capsule lengths cannot be averaged")
    return first["model"]


def member_report(result, member, view, *, dataset, batch_size, class_names, test_pairs):
    """One pass's report: evaluate_model's `result` for `member` (its `view` with tta, else None)."""
    return {
        "accuracy": result["accuracy"],
        "loss": result["loss"],
        "margin_loss": result["margin_loss"],
        "reconstruction_loss": result["reconstruction_loss"],
        "images_per_sec": measured_rate(result["images_per_sec"]),
        "per_class_accuracy": result["per_class_accuracy"],
        "confusion_matrix": result["confusion_matrix"],
        **({"class_names": list(class_names)} if class_names is not None else {}),
        **({"per_class_examples": result["per_class_examples"]} if "per_class_examples" in result else {}),
        "num_examples": result["num_examples"],
        "checkpoint": member["prefix"],
        "run_dir": str(member["run_dir"]),
        "epoch": member["epoch"],
        "dataset": dataset,
        "custom_op": member["custom_op"],
        "batch_size": batch_size,
        "weights": member["weights"],
        "precision": member["precision"],
        "tf32": member["tf32"],
        "xla": member["xla"],
        **({"test_pairs": test_pairs} if test_pairs else {}),
        **({"view": view} if view is not None else {}),
        **({"best_chosen_on": member["best_chosen_on"]} if member["best_chosen_on"] else {}),
    }


def measured_rate(images_per_sec):
    """A test pass's images/s, or None where it was not measured: the clock leaves the first
    batch out (its wait includes the compile), so a test split of one batch times nothing."""
    return images_per_sec if math.isfinite(images_per_sec) and images_per_sec > 0 else None


def rate_text(images_per_sec):
    return f"{images_per_sec:.1f} images/s" if images_per_sec is not None else "images/s not measured (one batch)"


def final_report(reports, results, first, num_classes, *, ensemble, tta, names, test_pairs, other_pairs,
                 settings=None):
    """(report, variant for report_path): the one pass's report, or the ensemble's over all
    the passes (its variant "ensemble-<hash of the passes>", named after the first checkpoint);
    test pairs other than the run's ("pairs-shift<s>-pad<p>"), another dataset than the
    run's ("affnist" for an expanded_mnist run), or settings other than the run's own test
    pass (`settings`, other_settings': "custom_op-true") go to their own file, not over the
    run's report (None: compare_runs reads that one as the run's final)."""
    dataset = reports[0]["dataset"]
    other_dataset = dataset if dataset != first["cfg"]["data"]["name"] else None
    if ensemble:
        report = ensemble_report(reports, results, num_classes)
        if names is not None:
            report["class_names"] = list(names)
        if tta != "none":
            report["tta"] = tta
        if test_pairs:
            report["test_pairs"] = test_pairs
        passes = [[m["checkpoint"], m["weights"], m["custom_op"], *([m["view"]] if "view" in m else [])] for m in reports]
        if other_pairs:
            passes.append(test_pairs)
        if other_dataset:
            passes.append(["dataset", other_dataset])
        digest = hashlib.sha1(json.dumps(passes).encode()).hexdigest()[:8]
        return report, f"ensemble-{digest}"
    test_set = f"pairs-shift{test_pairs['shift_pixels']}-pad{test_pairs['pad_pixels']}" if other_pairs else other_dataset
    return reports[0], "+".join(part for part in (test_set, settings) if part) or None


def load_run_test_split(task, *, from_run, run_dir):
    """The test split of `task` (Task.load, as a Split). `from_run`: its data.dir is the one the run
    saved in its config.yaml (an absolute path at training time): if the data is no longer
    there, the one-line error says where the path came from and that data.dir= overrides it."""
    data_cfg = task.cfg
    data_dir = data_cfg.get("dir")
    origin = f"the run's data.dir, from {Path(run_dir) / 'config.yaml'}"
    what = "folder of its images" if task.kind == "images" else "folder with the IDX files"
    if from_run and data_dir is not None and not Path(data_dir).is_dir():
        raise DataError(f"data dir {data_dir} does not exist ({origin}): if the data moved, give its place with "
                        f"data.dir=<{what}>")
    try:
        return task.load("test", limit=data_cfg.get("limit_test"))
    except DataError as exc:
        if not from_run or data_dir is None:
            raise
        raise DataError(f"{exc} ({origin}; data.dir=<{what}> overrides it)") from exc


def resolve_member(checkpoint, *, which, custom_op, weights, precision=None, tf32=None, xla=None):
    """One checkpoint to evaluate, resolved and its run config checked (no model yet):
    prefix, run_dir, cfg (config.check's), custom_op, losses, weights, precision, tf32 and
    xla (None: the run's). The arguments are checked as evaluate()'s are (export calls this alone)."""
    config.check_section(config.EvalAppConfig, {"checkpoint": checkpoint, "which": which, "custom_op": custom_op,
                                                "weights": weights, "precision": precision, "tf32": tf32,
                                                "xla": xla})
    prefix, run_dir, saved = resolve_checkpoint(checkpoint, which)
    prefix, run_dir = str(Path(prefix).resolve()), Path(run_dir).resolve()
    cfg = check_run_config(saved, run_dir)
    own = own_settings(cfg)
    custom_op = own["custom_op"] if custom_op is None else custom_op
    weights = own["weights"] if weights is None else weights
    xla = own["xla"] if xla is None else xla
    if weights == "ema" and cfg["train"]["ema_decay"] <= 0:
        raise ConfigError(f"weights=ema: the run {run_dir} kept no average of its weights (train.ema_decay was 0); "
                          "use weights=raw (an ensemble: weights=null, each member's own)")
    if xla == "jit" and cfg["model"]["routing"]["backend"] == "xla":
        raise ConfigError(f"xla=jit: the run {run_dir} routes with model.routing=xla, an XLA computation of its own "
                          "that cannot be nested in a compiled test pass: use xla=none")
    return {"prefix": prefix, "run_dir": run_dir, "cfg": cfg, "custom_op": custom_op,
            "best_chosen_on": best_chosen_on(prefix, cfg),
            "losses": loss_params(cfg["train"]), "weights": weights,
            "precision": own["precision"] if precision is None else precision,
            "tf32": own["tf32"] if tf32 is None else tf32, "xla": xla}


def own_settings(cfg):
    """The settings of the test pass of the run whose config is `cfg` (config.check's): what
    evaluate's keys left null stand for."""
    return {"custom_op": cfg["custom_op"],
            "weights": "ema" if cfg["train"]["ema_decay"] > 0 else "raw",  # the average, where the run kept one
            # Compiled with the step under train.xla=jit (autocluster is a process-wide setting,
            # not the eval step's, so such runs are evaluated without XLA).
            "xla": "jit" if cfg["train"]["xla"] == "jit" else "none",
            "precision": cfg["train"]["precision"], "tf32": cfg["train"]["tf32"]}


def other_settings(member, limit_test):
    """The settings of `member`'s pass (resolve_member's) that differ from its run's own test
    pass, and a data.limit_test other than the run's, as a report name's variant:
    "custom_op-true", "weights-raw+xla-jit", "limit_test-100" (key-value joined by +, as run
    names are); None where the pass is the run's own."""
    own = own_settings(member["cfg"])
    given = {key: member[key] for key in own}
    own["limit_test"], given["limit_test"] = member["cfg"]["data"]["limit_test"], limit_test
    differ = [f"{key}-{str(value).lower() if isinstance(value, bool) else value}"
              for key, value in given.items() if value != own[key]]
    return "+".join(differ) or None


def check_run_config(saved, run_dir):
    """A run's saved config (read_run_config's: in today's shape) checked by config.check,
    a bad value named as the run's ("the run config of <run dir>: ...")."""
    # Only a real boolean: bool('no') is True.
    boolean(f"the run config's custom_op ({run_dir / 'config.yaml'})", saved.get("custom_op"), error=ConfigError)
    try:
        return config.check({**saved, "run_dir": str(run_dir)})  # where it is now (it may have moved)
    except ConfigError as exc:
        raise ConfigError(f"the run config of {run_dir}: {exc}") from exc


# tta's views besides the plain one: name -> (the batch's images (B, H, W, C), fill) -> the view.
# A one-pixel shift is shift_batch's crop at the corner (1 - dy, 1 - dx) of the image padded by 1.
_SHIFTS = {"right": (0, 1), "left": (0, -1), "down": (1, 0), "up": (-1, 0)}
TTA_VIEWS = {
    "none": {},
    "flip": {"mirrored": lambda x, fill: tf.reverse(x, axis=[2])},  # W mirrored
    "shift": {name: (lambda x, fill, dy=dy, dx=dx: shift_batch(
        x, tf.tile([[1 - dy, 1 - dx]], [tf.shape(x)[0], 1]), 1, fill=fill)) for name, (dy, dx) in _SHIFTS.items()},
}


def tta_views(dataset, tta, *, shift_fill="zero"):
    """{view name: the test dataset of that view}: "plain" (the images as they are), then
    tta's views (TTA_VIEWS; a shift fills the border as `shift_fill`, the run's training
    shifts' fill)."""
    return {"plain": dataset, **{name: dataset.map(lambda x, y, view=view: (view(x, shift_fill), y))
                                 for name, view in TTA_VIEWS[tta].items()}}


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
    member_keys = ("checkpoint", "run_dir", "epoch", "weights", "custom_op", "precision", "xla", "accuracy", "loss",
                   "margin_loss", "reconstruction_loss", "images_per_sec", "view", "best_chosen_on")
    return {
        **scores,
        "num_examples": len(labels),
        # Members run one after another: their seconds per image add up.
        "images_per_sec": (None if any(r["images_per_sec"] is None for r in reports)
                           else 1.0 / sum(1.0 / r["images_per_sec"] for r in reports)),
        "dataset": reports[0]["dataset"],
        "batch_size": reports[0]["batch_size"],
        "ensemble": f"mean capsule lengths of {len(reports)} {'passes' if 'view' in reports[0] else 'members'}",
        "members": [{key: r[key] for key in member_keys if key in r} for r in reports],
    }


def to_json_line(report):
    """The report as one line of valid JSON (NaN → null)."""
    return json.dumps(json_safe(report))
