"""Classify image files with a trained CapsNet: `python predict.py` without Hydra.

- `predict(checkpoint, images, ...) -> list of records`, one per image, in input order:

      {"image": path as given, "class": the predicted class's name,
       "top_k": [[name, capsule length], ...] (the top_k longest capsules, longest first),
       "lengths": {class name: its capsule length, ...} (every class, in class order),
       "classes": [first, second]        (two-digit models, MultiMNIST: the two predicted digits),
       "reconstruction": PNG path        (with reconstruct=DIR)}

  An image that cannot be read or decoded gives `{"image": path, "error": "..."}` instead,
  and the others are still predicted (`iter_predictions` yields them as they are computed).
- `checkpoint` is a run dir (`which`: as evaluate's, None its best where chosen on a validation
  split, else its last saved), a
  checkpoint path (.../checkpoints/latest/ckpt-3) or a SavedModel directory written by
  export.py (its `serving_default` signature). A run's model is rebuilt from its config.yaml
  and restored as evaluate.py does (capsnet.evaluation.resolve_member,
  capsnet.training.checkpoints.restore_model) and called as the export's signature calls it
  (capsnet.export.serving_outputs), in float32 whatever the run's train.precision.
- `images`: an image file, a directory (its IMAGE_SUFFIXES files, subdirectories included,
  sorted), a glob (`digits/*.png`, `**` recursive) or a list of these; relative paths are
  relative to the working directory. A file named directly or by a glob is read whatever
  its suffix.

The model's input, from any PNG, JPEG, BMP or GIF (its first frame), is made by the run's own
Task (capsnet.tasks: `file_image`), with the code of its pipeline: decoded to 8 bits, an alpha
channel dropped, made grey or RGB, the shorter side resized and the centre cropped square
(capsnet.folder.decode_image_bytes, the folder pipeline's decoding: for a natural-image
run at its data.image_size, then its test-time centre data.crop), scaled to [0, 1] by p / 255;
the per-image standardisation of a run trained with data.standardize is the model's
(Task.serving_images, in the export's signature too). A test-split file gives the lengths
evaluate.py computes for it. An export records its run's data section (capsnet_export.json
"data"); one written before that is read as the MNIST family's (the decoding at the model's
size). Colours are never inverted: the MNIST-family datasets have light digits on a dark
background, and a light image given to such a model is named in a notice (`notice`), not
changed.

A file is not predicted, and its record says why ("error"), when it cannot be read or
decoded, when its header declares more pixels than the run's data.max_pixels (it is then
never decoded), or when the model's capsule lengths for it are not finite (NaN or inf: no
class is named; the export's signatures answer prediction -1 for it).

A SavedModel is a program: loading and calling one runs its graph. An export is loaded only
when it carries this project's marker (assets.extra/capsnet_export.json) and its graph holds
none of the ops that write files, run Python or print (capsnet.export.side_effect_ops);
trust_export=True loads any SavedModel (only one from a source you trust).

Reconstructions (reconstruct=DIR): the decoder's image of the predicted capsule, at the
model's size, one PNG per image at DIR/<the image's path relative to the images' common
directory, suffix .png> (two inputs that would share a name keep their own suffix:
`7.jpg.png`); a two-digit model's PNG holds the two predicted digits' reconstructions side by
side, the longest capsule's on the left. Existing files are never overwritten: predict refuses
before reading any image.

Everything checked from paths alone (the checkpoint exists, the images match, the
reconstructions are new) is checked before TensorFlow is imported (`check_inputs`):
this module imports TensorFlow only inside the functions that need it.
"""
import contextlib
import glob
import json
import os
import re
import sys
from pathlib import Path

from capsnet import config
from capsnet.datasets import DATASETS, DEFAULT_MAX_PIXELS, spec_class_names
from capsnet.errors import CheckpointError, ConfigError, DataError
from capsnet.folder import oversized

# What a directory's listing counts as images (TensorFlow's tf.io.decode_image reads these).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
# Class names of the datasets known by name: capsnet.datasets' DatasetSpec.class_names; any
# other class is named by its index. Datasets of light shapes on a dark background
# (DatasetSpec.dark_background): a mostly light image given to their models is probably
# the other way round (the notice says so; the image is not changed).

LIGHT_MEAN = 0.5
EXPORT_METADATA = Path("assets.extra") / "capsnet_export.json"  # capsnet.export.METADATA, where export writes it


# --------------------------------------------------------------------------- paths (no TensorFlow)

def checkpoint_kind(checkpoint):
    """'export' (a SavedModel directory) or 'checkpoint' (a run dir, a directory of
    checkpoints or a checkpoint prefix), from the path alone; CheckpointError if it is none."""
    path = Path(os.path.expanduser(str(checkpoint)))
    if path.is_dir():
        if (path / "saved_model.pb").is_file():
            return "export"
        if (path / "checkpoints").is_dir() or (path / "checkpoint").is_file() or any(path.glob("ckpt-*.index")):
            return "checkpoint"
        raise CheckpointError(f"no checkpoint in {checkpoint}: expected a run dir (with checkpoints/), a checkpoint "
                              "path like .../checkpoints/latest/ckpt-3, or a SavedModel directory written by export.py")
    if path.suffix == ".index" and path.is_file() or Path(f"{path}.index").is_file():
        return "checkpoint"
    raise CheckpointError(f"checkpoint not found: {checkpoint} (expected a run dir, a checkpoint path like "
                          ".../checkpoints/latest/ckpt-3, or a SavedModel directory written by export.py)")


def find_images(images):
    """The image paths `images` names (a file, a directory, a glob, or a list of these), in
    order, each once; DataError for an item that names nothing."""
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    if not items:
        raise DataError("images=[] names no image")
    found = []
    for item in items:
        text = os.path.expanduser(str(item))
        path = Path(text)
        if path.is_file():
            matches = [text]
        elif path.is_dir():
            matches = sorted(str(p) for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
            if not matches:
                raise DataError(f"no image in the directory {item} (looked for {', '.join(IMAGE_SUFFIXES)} files, "
                                "subdirectories included)")
        elif glob.has_magic(text):
            matches = sorted(m for m in glob.glob(text, recursive=True) if os.path.isfile(m))
            if not matches:
                raise DataError(f"images={item} matches no file")
        else:
            raise DataError(f"image not found: {item}")
        found.extend(matches)
    seen = set()
    unique = []
    for path in found:
        key = os.path.realpath(path)
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


def reconstruction_paths(paths, directory):
    """{image path: its reconstruction's PNG path in `directory`} (see the module doc);
    ConfigError if `directory` is a file or any of them exists already."""
    directory = Path(os.path.expanduser(str(directory)))
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"reconstruct={directory}: not a directory")
    absolute = [Path(os.path.abspath(p)) for p in paths]
    common = Path(os.path.commonpath([str(a.parent) for a in absolute]))
    relative = [a.relative_to(common) for a in absolute]
    by_stem = {}
    for r in relative:
        by_stem.setdefault(r.with_suffix(".png"), []).append(r)
    outputs = {}
    for path, r in zip(paths, relative):
        shared = len(by_stem[r.with_suffix(".png")]) > 1
        outputs[path] = directory / (r.with_name(r.name + ".png") if shared else r.with_suffix(".png"))
    existing = [str(o) for o in outputs.values() if o.exists() or o.is_symlink()]
    if existing:
        more = f" and {len(existing) - 1} more" if len(existing) > 1 else ""
        raise ConfigError(f"reconstruct={directory}: {existing[0]}{more} exist(s) already; predict never overwrites "
                          "a file: choose another directory or remove them")
    return outputs


def check_inputs(checkpoint, images, reconstruct=None):
    """What the paths alone decide, before TensorFlow: (checkpoint kind, image paths,
    {image: reconstruction path} or None)."""
    kind = checkpoint_kind(checkpoint)
    paths = find_images(images)
    outputs = reconstruction_paths(paths, reconstruct) if reconstruct is not None else None
    return kind, paths, outputs


def class_names(dataset, num_classes, stored=None):
    """The names of a model's classes: `stored` (an export's, when it has them), else the
    dataset's (capsnet.datasets), else each class's index as a string."""
    for names in (stored, spec_class_names(dataset, num_classes) if dataset in DATASETS else None):
        if names is not None and len(names) == num_classes:
            return [str(name) for name in names]
    return [str(c) for c in range(num_classes)]


# --------------------------------------------------------------------------- models (TensorFlow)

class Classifier:
    """A model to predict with: image_shape (H, W, C), num_classes, label_format (its task's,
    capsnet.tasks.labels: what a record holds of its predictions), has_decoder,
    dataset (None where unknown), names; `prepare` makes an image file's bytes its input
    (Task.file_image), `max_pixels` the most pixels a file may declare (data.max_pixels);
    calling it on float32 images (N, H, W, C) in [0, 1] returns numpy lengths, predictions
    and (with a decoder) reconstructions, as the export's serving_default signature does."""

    def __init__(self, call, image_shape, num_classes, label_format, has_decoder, dataset, source, stored_names=None,
                 *, prepare, max_pixels):
        self.call, self.image_shape, self.num_classes = call, tuple(image_shape), num_classes
        self.label_format, self.has_decoder, self.dataset, self.source = label_format, has_decoder, dataset, source
        self.names = class_names(dataset, num_classes, stored_names)
        self.prepare, self.max_pixels = prepare, max_pixels

    def __call__(self, images):
        import tensorflow as tf

        return {key: value.numpy() for key, value in self.call(tf.constant(images, tf.float32)).items()}


def load_classifier(checkpoint, *, which=None, weights=None, custom_op=None, trust_export=False):
    """The Classifier of a run dir or checkpoint path (rebuilt and restored as evaluate.py
    does), or of a SavedModel directory written by export.py (its serving_default; checked
    by check_export first unless `trust_export`)."""
    # Whatever the loaders print (a checkpoint state-file notice) goes to stderr: stdout is
    # the JSON lines.
    with contextlib.redirect_stdout(sys.stderr):
        if checkpoint_kind(checkpoint) == "export":
            given = [f"{key}={value}" for key, value in (("which", which), ("weights", weights),
                                                          ("custom_op", custom_op)) if value is not None]
            if given:
                raise ConfigError(f"{', '.join(given)}: not for an exported SavedModel ({checkpoint} holds one set of "
                                  "weights in a fixed graph); give the run dir instead, or leave them null")
            return _export_classifier(checkpoint, trust_export)
        return _checkpoint_classifier(checkpoint, which=which, weights=weights, custom_op=custom_op)


def _checkpoint_classifier(checkpoint, *, which, weights, custom_op):
    import tensorflow as tf

    # TensorFlow's modules, here: check_inputs runs before the TensorFlow import.
    from capsnet.evaluation import resolve_member
    from capsnet.export import serving_outputs
    from capsnet.tasks import task_for
    from capsnet.training.checkpoints import restore_model
    from capsnet.training.model_setup import build_capsnet, check_op_library

    # xla="none": predict runs the model as the export's signature does, never in the
    # run's compiled test pass (nothing for resolve_member to check about it).
    member = resolve_member(checkpoint, which=which, custom_op=custom_op, weights=weights, xla="none")
    if member["custom_op"]:
        check_op_library()
    model = build_capsnet(member["cfg"]["model"], member["custom_op"])
    restore_model(model, member["prefix"], member["weights"])
    dataset = member["cfg"]["data"]["name"]
    task = task_for(member["cfg"]["data"])
    call = tf.function(lambda images: serving_outputs(model, images, task.label_format, task.serving_images),
                       input_signature=[tf.TensorSpec((None, *model.image_shape), tf.float32)])
    return Classifier(call, model.image_shape, model.num_classes, task.label_format, model.use_decoder, dataset,
                      member["prefix"], task.class_names(model.num_classes),
                      prepare=lambda data: task.file_image(data, model.image_shape),
                      max_pixels=member["cfg"]["data"]["max_pixels"])


def read_export_metadata(path):
    """The export's capsnet_export.json (a dict), or None where it has none."""
    if not (path / EXPORT_METADATA).is_file():
        return None
    try:
        metadata = json.loads((path / EXPORT_METADATA).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the export's {path / EXPORT_METADATA}: {exc}") from exc
    if not isinstance(metadata, dict):
        raise CheckpointError(f"the export's {path / EXPORT_METADATA} is not a JSON object")
    return metadata


def check_export(path, metadata):
    """Refuse (CheckpointError, one line) to load a SavedModel that export.py did not write (no
    capsnet_export.json) or whose graph holds ops that write files, run Python or print
    (capsnet.export.side_effect_ops): loading and calling a SavedModel runs its graph."""
    from capsnet.export import side_effect_ops  # TensorFlow's: check_inputs runs before the TensorFlow import

    if metadata is None:
        raise CheckpointError(f"the SavedModel {path} has no {EXPORT_METADATA} (not written by export.py): a "
                              "SavedModel is a program and predict runs only this project's exports; give "
                              "trust_export=true to run one from a source you trust")
    found = side_effect_ops(path)
    if found:
        raise CheckpointError(f"the SavedModel {path} holds ops that write files, run Python or print "
                              f"({', '.join(found)}), which no export.py export holds: refused (a SavedModel is a "
                              "program); give trust_export=true to run one from a source you trust")


def _export_classifier(directory, trust_export):
    # TensorFlow's modules, as above.
    from capsnet import export as capsnet_export
    from capsnet.tasks import task_for
    from capsnet.tasks.base import default_file_image
    from capsnet.tasks.labels import LABEL_FORMATS

    path = Path(os.path.expanduser(str(directory)))
    metadata = read_export_metadata(path)
    if not trust_export:
        check_export(path, metadata)
    metadata = metadata or {}
    if metadata.get("op_library_ops"):
        from capsnet import ops  # TensorFlow's (the export holds the compiled op: its kernels first)

        ops.load_op_library()
    loaded = capsnet_export.load(path)
    signature = loaded.signatures.get("serving_default")
    if signature is None:
        raise CheckpointError(f"the SavedModel {directory} has no serving_default signature (it has "
                              f"{', '.join(loaded.signatures) or 'none'}): export it with export.py")
    inputs = signature.structured_input_signature[1]
    outputs = signature.structured_outputs
    if list(inputs) != ["images"] or "lengths" not in outputs or "predictions" not in outputs:
        raise CheckpointError(f"the SavedModel {directory}'s serving_default takes {sorted(inputs)} and returns "
                              f"{sorted(outputs)}: expected images -> lengths, predictions (an export.py export)")
    spec = inputs["images"]
    shape = tuple(spec.shape[1:])
    if len(shape) != 3 or None in shape:
        raise CheckpointError(f"the SavedModel {directory}'s serving_default takes images of shape {spec.shape}: "
                              "expected (N, H, W, C) with H, W, C fixed")
    data = metadata.get("data")  # the run's data section (exports since it is recorded)
    task = task_for(data) if isinstance(data, dict) and data.get("name") in DATASETS else None
    # The signature's predictions say the label format: (N,) one label, (N, 2) two digits.
    label_format = LABEL_FORMATS[2 if outputs["predictions"].shape.rank == 2 else 1]
    classifier = Classifier(lambda images: signature(images=images), shape, int(outputs["lengths"].shape[-1]),
                            label_format, "reconstructions" in outputs,
                            metadata.get("dataset"), str(path), metadata.get("class_names"),
                            prepare=lambda image: (task.file_image(image, shape) if task is not None
                                                   else default_file_image(image, shape)),
                            max_pixels=(data or {}).get("max_pixels") or DEFAULT_MAX_PIXELS)
    classifier.loaded = loaded  # the signature's functions live as long as the object they came from
    return classifier


# --------------------------------------------------------------------------- images

class UnreadableImage(Exception):
    """An image file that cannot be read or decoded; str(err) says which and why."""


def load_image(path, classifier):
    """The image file at `path` as `classifier`'s input: float32 numpy (H, W, C) in [0, 1]
    (see the module doc); UnreadableImage if it cannot be read or decoded, or its header
    declares more than classifier.max_pixels pixels (then it is not decoded)."""
    import tensorflow as tf

    size = oversized(path, classifier.max_pixels)
    if size is not None:
        raise UnreadableImage(f"image {path} is {size} pixels, more than the run's data.max_pixels="
                              f"{classifier.max_pixels}: not decoded")
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UnreadableImage(f"cannot read image {path}: {exc.strerror or exc}") from exc
    try:
        image = classifier.prepare(data)
    except (tf.errors.OpError, ValueError) as exc:
        # Without TensorFlow's wrapping: "{{function_node ...}} <reason> [Op:DecodeImage]".
        reason = re.sub(r"\{\{function_node [^}]*\}\}|\[Op:\w+\]", "", str(getattr(exc, "message", exc)))
        reason = " ".join(reason.split()) or type(exc).__name__
        raise UnreadableImage(f"cannot decode image {path}: {reason}") from exc
    return image.numpy()


def write_png(path, image):
    """float image (H, W, C) in [0, 1] → a new PNG at `path` (never over an existing file)."""
    import numpy as np
    import tensorflow as tf

    pixels = np.round(np.clip(image, 0.0, 1.0) * 255.0).astype(np.uint8)
    encoded = tf.io.encode_png(pixels).numpy()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "xb") as f:
        f.write(encoded)


# --------------------------------------------------------------------------- predict

def predict(checkpoint, images, *, top_k=3, reconstruct=None, which=None, weights=None, custom_op=None,
            batch_size=64, notice=None, trust_export=False):
    """Predict the class of each image file; returns the records (see the module doc), in
    the order of `images` (an unreadable image's record has "error" instead).

    Args:
        checkpoint: a run dir, a checkpoint path or a SavedModel directory written by export.py.
        images: an image file, a directory, a glob, or a list of these.
        top_k: how many of the longest capsules each record lists (at most the classes).
        reconstruct: None, or a directory for the reconstructions' PNGs (its files must not
            exist yet).
        which, weights, custom_op: as evaluate()'s (None = the run's best checkpoint, its
            average of the weights if it kept one, as trained); only for a run dir.
        batch_size: images per forward pass.
        notice: a callable taking one line (a light image given to a dark-background model);
            None: no notices.
        trust_export: True loads a SavedModel that export.py did not write, or whose graph
            writes files, runs Python or prints (check_export): only one you trust.
    """
    return list(iter_predictions(checkpoint, images, top_k=top_k, reconstruct=reconstruct, which=which,
                                 weights=weights, custom_op=custom_op, batch_size=batch_size, notice=notice,
                                 trust_export=trust_export))


def iter_predictions(checkpoint, images, *, top_k=3, reconstruct=None, which=None, weights=None, custom_op=None,
                     batch_size=64, notice=None, trust_export=False):
    """predict()'s records, yielded a batch at a time (each batch as soon as it is predicted).
    The arguments are checked, the paths (check_inputs) and the model loaded before the first."""
    args = config.check_section(config.PredictAppConfig, {
        "checkpoint": checkpoint, "images": images, "top_k": top_k, "reconstruct": reconstruct, "which": which,
        "weights": weights, "custom_op": custom_op, "batch_size": batch_size, "trust_export": trust_export})
    _, paths, outputs = check_inputs(args["checkpoint"], args["images"], args["reconstruct"])
    classifier = load_classifier(args["checkpoint"], which=which, weights=weights, custom_op=custom_op,
                                 trust_export=args["trust_export"])
    if classifier.image_shape[-1] not in (1, 3):
        raise ConfigError(f"the model of {classifier.source} takes {classifier.image_shape[-1]}-channel images: "
                          "predict reads grey or RGB image files only")
    if top_k > classifier.num_classes:
        raise ConfigError(f"top_k={top_k}: the model has {classifier.num_classes} classes")
    if outputs is not None and not classifier.has_decoder:
        raise ConfigError(f"reconstruct={reconstruct}: the model of {classifier.source} has no decoder "
                          "(model.decoder=false): leave reconstruct null")
    for start in range(0, len(paths), args["batch_size"]):
        yield from _predict_batch(classifier, paths[start:start + args["batch_size"]], top_k, outputs, notice)


def _predict_batch(classifier, paths, top_k, outputs, notice):
    import numpy as np

    loaded, records = [], {}
    for path in paths:
        try:
            loaded.append((path, load_image(path, classifier)))
        except UnreadableImage as exc:
            records[path] = {"image": path, "error": str(exc)}
    if loaded:
        served = classifier(np.stack([image for _, image in loaded]))
        names = classifier.names
        for i, (path, image) in enumerate(loaded):
            if notice is not None and classifier.dataset in DATASETS and DATASETS[classifier.dataset].dark_background and image.mean() > LIGHT_MEAN:
                notice(f"notice: {path} is mostly light (mean {image.mean():.2f} in [0, 1]); the "
                       f"{classifier.dataset} model was trained on light shapes on a dark background: if this "
                       "one is dark on light, invert it before predicting")
            lengths = served["lengths"][i]
            if not np.all(np.isfinite(lengths)):  # the signature's prediction -1: no class to name
                records[path] = {"image": path, "error": f"the model's capsule lengths for image {path} are not "
                                                         "finite (NaN or inf): no class predicted"}
                continue
            predicted = np.atleast_1d(served["predictions"][i])
            order = np.argsort(-lengths, kind="stable")[:top_k]
            record = {"image": path, "class": names[predicted[0]],
                      "top_k": [[names[c], float(lengths[c])] for c in order],
                      "lengths": {names[c]: float(v) for c, v in enumerate(lengths)}}
            record.update(classifier.label_format.record(names, predicted))
            if outputs is not None:
                reconstruction = served["reconstructions"][i]
                reconstruction = classifier.label_format.reconstruction_image(reconstruction)
                try:
                    write_png(outputs[path], reconstruction)
                except OSError as exc:
                    raise DataError(f"cannot write the reconstruction {outputs[path]}: {exc.strerror or exc}") from exc
                record["reconstruction"] = str(outputs[path])
            records[path] = record
    for path in paths:
        yield records[path]
