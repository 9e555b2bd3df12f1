"""Classify image files with a trained CapsNet: `python predict.py` without Hydra.

- `predict(checkpoint, images, ...) -> list of records`, one per image, in input order:

      {"image": path as given, "class": the predicted class's name,
       "top_k": [[name, capsule length], ...] (the top_k longest capsules, longest first),
       "lengths": [every class's capsule length, in class order],
       "classes": [first, second]        (two-digit models, MultiMNIST: the two predicted digits),
       "reconstruction": PNG path        (with reconstruct=DIR)}

  An image that cannot be read or decoded gives `{"image": path, "error": "..."}` instead,
  and the others are still predicted (`iter_predictions` yields them as they are computed).
- `checkpoint` is a run dir (its best checkpoint; which="latest" for the last one saved), a
  checkpoint path (.../checkpoints/latest/ckpt-3) or a SavedModel directory written by
  export.py (its `serving_default` signature). A run's model is rebuilt from its config.yaml
  and restored as evaluate.py does (capsnet.evaluation.resolve_member,
  capsnet.training.checkpoints.restore_model) and called as the export's signature calls it
  (capsnet.export.serving_outputs), in float32 whatever the run's train.precision.
- `images`: an image file, a directory (its IMAGE_SUFFIXES files, subdirectories included,
  sorted), a glob (`digits/*.png`, `**` recursive) or a list of these; relative paths are
  relative to the working directory. A file named directly or by a glob is read whatever
  its suffix.

The model's input, from any PNG, JPEG, BMP or GIF (its first frame): decoded to 8 bits, an
alpha channel dropped, scaled to [0, 1] by p / 255 as the training pipelines scale, made grey
(tf.image.rgb_to_grayscale) or RGB as the model's input is, and resized to the model's height
and width with tf.image.resize (`area` when shrinking, bilinear with antialiasing otherwise;
the aspect ratio is not kept). An image already of the model's size and channels is used as
it is: its lengths are the test pipeline's. Colours are never inverted: the MNIST-family
datasets have light digits on a dark background, and a light image given to such a model is
named in a notice (`notice`), not changed.

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
from capsnet.datasets import DATASETS, spec_class_names
from capsnet.errors import CheckpointError, ConfigError, DataError

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
    """A model to predict with: image_shape (H, W, C), num_classes, two_digits, has_decoder,
    dataset (None where unknown), names; calling it on float32 images (N, H, W, C) in [0, 1]
    returns numpy lengths, predictions and (with a decoder) reconstructions, as the
    export's serving_default signature does."""

    def __init__(self, call, image_shape, num_classes, two_digits, has_decoder, dataset, source, stored_names=None):
        self.call, self.image_shape, self.num_classes = call, tuple(image_shape), num_classes
        self.two_digits, self.has_decoder, self.dataset, self.source = two_digits, has_decoder, dataset, source
        self.names = class_names(dataset, num_classes, stored_names)

    def __call__(self, images):
        import tensorflow as tf

        return {key: value.numpy() for key, value in self.call(tf.constant(images, tf.float32)).items()}


def load_classifier(checkpoint, *, which=None, weights=None, custom_op=None):
    """The Classifier of a run dir or checkpoint path (rebuilt and restored as evaluate.py
    does), or of a SavedModel directory written by export.py (its serving_default)."""
    # Whatever the loaders print (a checkpoint state-file notice) goes to stderr: stdout is
    # the JSON lines.
    with contextlib.redirect_stdout(sys.stderr):
        if checkpoint_kind(checkpoint) == "export":
            given = [f"{key}={value}" for key, value in (("which", which), ("weights", weights),
                                                          ("custom_op", custom_op)) if value is not None]
            if given:
                raise ConfigError(f"{', '.join(given)}: not for an exported SavedModel ({checkpoint} holds one set of "
                                  "weights in a fixed graph); give the run dir instead, or leave them null")
            return _export_classifier(checkpoint)
        return _checkpoint_classifier(checkpoint, which=which or "best", weights=weights, custom_op=custom_op)


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
    two_digits = task.two_digits
    call = tf.function(lambda images: serving_outputs(model, images, two_digits, task.serving_images),
                       input_signature=[tf.TensorSpec((None, *model.image_shape), tf.float32)])
    return Classifier(call, model.image_shape, model.num_classes, two_digits, model.use_decoder, dataset,
                      member["prefix"], task.class_names(model.num_classes))


def _export_classifier(directory):
    from capsnet import export as capsnet_export  # TensorFlow's, as above

    path = Path(os.path.expanduser(str(directory)))
    metadata = {}
    if (path / EXPORT_METADATA).is_file():
        try:
            metadata = json.loads((path / EXPORT_METADATA).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read the export's {path / EXPORT_METADATA}: {exc}") from exc
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
    classifier = Classifier(lambda images: signature(images=images), shape, int(outputs["lengths"].shape[-1]),
                            outputs["predictions"].shape.rank == 2, "reconstructions" in outputs,
                            metadata.get("dataset"), str(path), metadata.get("class_names"))
    classifier.loaded = loaded  # the signature's functions live as long as the object they came from
    return classifier


# --------------------------------------------------------------------------- images

class UnreadableImage(Exception):
    """An image file that cannot be read or decoded; str(err) says which and why."""


def load_image(path, image_shape):
    """The image file at `path` as the model's input: float32 numpy (H, W, C) in [0, 1]
    (see the module doc); UnreadableImage if it cannot be read or decoded."""
    import tensorflow as tf

    height, width, channels = image_shape
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UnreadableImage(f"cannot read image {path}: {exc.strerror or exc}") from exc
    try:
        image = tf.io.decode_image(data, channels=0, dtype=tf.uint8, expand_animations=False)
    except (tf.errors.OpError, ValueError) as exc:
        # Without TensorFlow's wrapping: "{{function_node ...}} <reason> [Op:DecodeImage]".
        reason = re.sub(r"\{\{function_node [^}]*\}\}|\[Op:\w+\]", "", str(getattr(exc, "message", exc)))
        reason = " ".join(reason.split()) or type(exc).__name__
        raise UnreadableImage(f"cannot decode image {path}: {reason}") from exc
    if image.shape[-1] in (2, 4):  # grey + alpha, RGBA: the alpha channel is dropped
        image = image[..., :-1]
    image = tf.cast(image, tf.float32) / 255.0  # as the pipelines scale (capsnet.data)
    if channels == 1 and image.shape[-1] == 3:
        image = tf.image.rgb_to_grayscale(image)
    elif channels == 3 and image.shape[-1] == 1:
        image = tf.image.grayscale_to_rgb(image)
    if tuple(image.shape[:2]) != (height, width):
        shrinking = image.shape[0] >= height and image.shape[1] >= width
        image = tf.image.resize(image, (height, width), method="area" if shrinking else "bilinear",
                                antialias=not shrinking)
        image = tf.clip_by_value(image, 0.0, 1.0)
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
            batch_size=64, notice=None):
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
    """
    return list(iter_predictions(checkpoint, images, top_k=top_k, reconstruct=reconstruct, which=which,
                                 weights=weights, custom_op=custom_op, batch_size=batch_size, notice=notice))


def iter_predictions(checkpoint, images, *, top_k=3, reconstruct=None, which=None, weights=None, custom_op=None,
                     batch_size=64, notice=None):
    """predict()'s records, yielded a batch at a time (each batch as soon as it is predicted).
    The arguments are checked, the paths (check_inputs) and the model loaded before the first."""
    args = config.check_section(config.PredictAppConfig, {
        "checkpoint": checkpoint, "images": images, "top_k": top_k, "reconstruct": reconstruct, "which": which,
        "weights": weights, "custom_op": custom_op, "batch_size": batch_size})
    _, paths, outputs = check_inputs(args["checkpoint"], args["images"], args["reconstruct"])
    classifier = load_classifier(args["checkpoint"], which=which, weights=weights, custom_op=custom_op)
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
            loaded.append((path, load_image(path, classifier.image_shape)))
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
            predicted = np.atleast_1d(served["predictions"][i])
            order = np.argsort(-lengths, kind="stable")[:top_k]
            record = {"image": path, "class": names[predicted[0]],
                      "top_k": [[names[c], float(lengths[c])] for c in order],
                      "lengths": [float(v) for v in lengths]}
            if classifier.two_digits:
                record["classes"] = [names[c] for c in predicted]
            if outputs is not None:
                reconstruction = served["reconstructions"][i]
                if classifier.two_digits:  # (2, H, W, C): side by side, the longest capsule's on the left
                    reconstruction = np.concatenate(list(reconstruction), axis=1)
                try:
                    write_png(outputs[path], reconstruction)
                except OSError as exc:
                    raise DataError(f"cannot write the reconstruction {outputs[path]}: {exc.strerror or exc}") from exc
                record["reconstruction"] = str(outputs[path])
            records[path] = record
    for path in paths:
        yield records[path]
