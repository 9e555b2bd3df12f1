"""Export a trained CapsNet as a TensorFlow SavedModel, and load one back.

- `export(checkpoint, output, ...) -> dict`: `python export.py` without Hydra. The model
  is rebuilt from the run's saved `config.yaml` and restored from the checkpoint the way
  `capsnet.evaluation.evaluate` does, then written with Keras' `ExportArchive` (what
  `model.export()` uses) as a SavedModel with two endpoints:

      serving_default (= serve)  images float32 (N, H, W, C) in [0, 1]
      serve_uint8                images uint8   (N, H, W, C) in [0, 255] (scaled by 1/255,
                                 exactly as the training and test pipelines do)

  Both return a dict:
      "lengths":         float32 (N, classes), the capsule lengths |v_j| (class scores);
      "predictions":     int32 (N,), the longest capsule; MultiMNIST runs (two digits per
                         image): (N, 2), the two longest capsules, longest first; -1 for
                         an image whose lengths are not finite (a NaN or inf pixel): no
                         class, its lengths NaN;
      "reconstructions": float32 (N, H, W, C), the decoder's image from the predicted
                         capsule; MultiMNIST (N, 2, H, W, C), one per predicted digit
                         (absent when the run had no decoder).
- custom_op=False (the default): the graph has only standard TensorFlow ops (the matmul
  path, routing in TF), so plain `tf.saved_model.load` and TF Serving load it on a machine
  without capsnet. custom_op=True: the graph holds the compiled op
  (`Capsnet>CapsuleRouting` with the run's fused routing, else `Capsnet>CapsulePrediction`);
  call `capsnet.ops.load_op_library()` before loading it.
- `load(path)`: `tf.saved_model.load`, with a one-line `OpLibraryError` that says what to
  do when the export holds the compiled op and the op library is not loaded.

The export is written to a temporary directory beside `output` and renamed at the end:
an error leaves nothing behind, and an existing `output` is never overwritten, nor is one
made inside a run's checkpoints/. One left by a killed export (`.<name>.partial-<pid>-<hex>`
holding the marker file `PARTIAL_MARKER`, its process gone) is removed by the next export of
the same output; a folder that merely looks like one (no marker, another pattern) is the
user's and is never touched.
Next to the graph, `assets.extra/` (the SavedModel place for files the graph does not
read) holds `capsnet_export.json` (where the weights came from, the signatures, the ops
needed) and a `README.txt` with how to load it.
"""
import glob
import json
import os
import re
import secrets
import shutil
from pathlib import Path

import keras
import tensorflow as tf

from capsnet.errors import CheckpointError, OpLibraryError
from capsnet.evaluation import WEIGHT_NAMES, resolve_member
from capsnet.outputs import check_export_output
from capsnet.tasks import task_for
from capsnet.tasks.labels import NO_CLASS, ONE_LABEL
from capsnet.training.checkpoints import restore_model
from capsnet.training.model_setup import build_capsnet, check_op_library

# The compiled op's graph names (ops/, REGISTER_OP "Capsnet>..."): a graph holding one
# of these needs capsnet.ops.load_op_library() before it loads.
OP_PREFIX = "Capsnet>"
METADATA = "capsnet_export.json"
# Written first into an export's scratch folder (and removed before the rename): only a
# folder holding it was made by export(), so only such a folder is ever deleted as stale.
PARTIAL_MARKER = ".capsnet-export-partial"
# Op types that write files, run Python, print or log, which no export of this project
# holds outside its saver (side_effect_ops): loading and calling a SavedModel runs its graph.
SIDE_EFFECT_OPS = frozenset({
    "WriteFile", "Save", "SaveV2", "SaveSlices", "MergeV2Checkpoints", "DeleteSessionTensor",
    "PyFunc", "PyFuncStateless", "EagerPyFunc", "Print", "PrintV2",
    "CreateSummaryFileWriter", "CreateSummaryDbWriter", "WriteSummary", "WriteScalarSummary",
    "WriteHistogramSummary", "WriteImageSummary", "WriteAudioSummary", "WriteGraphSummary",
    "WriteRawProtoSummary", "ImportEvent", "FlushSummaryWriter", "DatasetToTFRecord",
    "ExperimentalDatasetToTFRecord", "SaveDataset", "SaveDatasetV2", "DebugIdentityV2", "DebugIdentityV3",
    "ReadFile", "MatchingFiles", "ImmutableConst",
})
_LOAD_OPS = "call capsnet.ops.load_op_library() first (or export with custom_op=false for a portable graph)"


# --------------------------------------------------------------------------- graph

def serving_outputs(model, images, label_format=ONE_LABEL, prepare=None):
    """The exported signature's outputs for float32 images in [0, 1]: lengths,
    predictions and (with a decoder) the reconstructions of the predicted capsule(s).

    No labels go into the model, so its decoder reconstructs from the longest capsule,
    as in evaluation (make_eval_step); the task's label_format (capsnet.tasks.labels) says
    what is predicted and reconstructed (MultiMNIST's TWO_DIGITS: the two longest capsules,
    each reconstructed). prepare: the task's test-time step between the [0, 1] images and
    the model (Task.serving_images: per-image standardisation), or None. An image whose
    capsule lengths are not all finite (a NaN or inf pixel) is predicted NO_CLASS (-1;
    both of a two-digit model's), never a class; its lengths stay NaN/inf.
    """
    outputs = model(images if prepare is None else prepare(images), training=False)
    lengths = outputs["lengths"]                                                  # (N, classes)
    predictions = label_format.serving_predictions(lengths)                       # (N,) or (N, 2)
    served = {"lengths": lengths, "predictions": predictions}
    if "reconstructions" in outputs:
        served["reconstructions"] = label_format.served_reconstructions(model, outputs, predictions)
    return served


def export_archive(model, label_format=ONE_LABEL, prepare=None):
    """A Keras ExportArchive of `model` (built, weights loaded) with the endpoints
    `serve` (float32 images in [0, 1]; also `serving_default`) and `serve_uint8`
    (uint8 images in [0, 255])."""
    shape = (None, *model.image_shape)
    archive = keras.export.ExportArchive()
    archive.track(model)
    # The first endpoint added is also written as "serving_default" (TF Serving's default).
    archive.add_endpoint("serve", lambda images: serving_outputs(model, checked_images(images, model.image_shape),
                                                                 label_format, prepare),
                         input_signature=[tf.TensorSpec(shape, tf.float32, name="images")])
    # The pipelines' own scaling (capsnet.data): cast, then divide by 255.
    archive.add_endpoint(
        "serve_uint8",
        lambda images: serving_outputs(model, tf.cast(checked_images(images, model.image_shape), tf.float32) / 255.0,
                                       label_format, prepare),
        input_signature=[tf.TensorSpec(shape, tf.uint8, name="images")])
    return archive


def checked_images(images, image_shape):
    """`images` once its runtime shape is (N, *image_shape), else InvalidArgument naming the
    expected and received shapes.

    A signature called through `model.signatures[...]` does not check its input against the
    input signature: the graph is built for rank 4, so a 3-D batch reaches kernels that index
    a 4th dimension (a CHECK failure that aborts the process) and images of another size are
    reshaped into fewer, wrong predictions. One condition covers rank and size: the
    dimensions after the first are padded with zeros before the comparison, so that no op
    compares tensors of different lengths whatever the rank received.
    """
    rank = len(image_shape) + 1
    expected = "(N, " + ", ".join(str(d) for d in image_shape) + ")"
    dims = tf.shape(images)
    received = tf.strings.reduce_join(tf.strings.as_string(dims), separator=", ")
    trailing = tf.concat([dims[1:], tf.zeros([rank], tf.int32)], axis=0)[:rank - 1]
    ok = tf.logical_and(tf.equal(tf.size(dims), rank),
                        tf.reduce_all(tf.equal(trailing, tf.constant(image_shape, tf.int32))))
    message = tf.strings.join([f"images must have the shape {expected}; received shape: (", received, ")"])
    check = tf.debugging.Assert(ok, [message], name="check_images_shape")
    with tf.control_dependencies([check]):
        return tf.identity(images)


def graph_op_types(saved_model_dir):
    """Every op type in a SavedModel's graphs (the functions included), read from its
    saved_model.pb without loading it."""
    from tensorflow.core.protobuf import saved_model_pb2

    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString((Path(saved_model_dir) / "saved_model.pb").read_bytes())
    types = set()
    for meta_graph in saved_model.meta_graphs:
        types.update(node.op for node in meta_graph.graph_def.node)
        for function in meta_graph.graph_def.library.function:
            types.update(node.op for node in function.node_def)
    return types


def side_effect_ops(saved_model_dir):
    """The SIDE_EFFECT_OPS in a SavedModel's graphs (sorted names; [] for an export of this
    project), read from its saved_model.pb without loading it. Every function is searched,
    and the top-level graph, except the saver's save function (the SaveV2 and
    MergeV2Checkpoints every SavedModel holds: run by a save of the loaded object, never by
    a load or a signature) where nothing else calls it."""
    from tensorflow.core.protobuf import saved_model_pb2

    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString((Path(saved_model_dir) / "saved_model.pb").read_bytes())
    found = set()
    for meta_graph in saved_model.meta_graphs:
        functions = {f.signature.name: f for f in meta_graph.graph_def.library.function}

        def callees(nodes):
            names = set()
            for node in nodes:
                names.update({node.op} & functions.keys())
                for attr in node.attr.values():
                    names.update(f.name for f in ([attr.func] if attr.HasField("func") else list(attr.list.func)))
            return names & functions.keys()

        def reach(names):
            seen, todo = set(), list(names)
            while todo:
                name = todo.pop()
                if name not in seen:
                    seen.add(name)
                    todo.extend(callees(functions[name].node_def))
            return seen

        save_node = meta_graph.saver_def.save_tensor_name.split(":")[0]
        top = [node for node in meta_graph.graph_def.node if node.name != save_node]
        saver_own = reach(callees(node for node in meta_graph.graph_def.node if node.name == save_node))
        exempt = saver_own - reach(callees(top) | (functions.keys() - saver_own))
        found.update(node.op for node in top)
        for name in functions.keys() - exempt:
            found.update(node.op for node in functions[name].node_def)
    return sorted(found & SIDE_EFFECT_OPS)


# --------------------------------------------------------------------------- export

def export(checkpoint, output, *, which=None, weights=None, custom_op=False):
    """Export `checkpoint` as a SavedModel in the new directory `output`; returns a report.

    Args:
        checkpoint: a run dir (which: "best", "latest", or None: best where the run chose
            it on a validation split, else latest) or a checkpoint path (.../checkpoints/latest/ckpt-3).
        output: the SavedModel directory to create; it must not exist (its parent is
            created if needed).
        weights: None = the run's moving average of the weights if it kept one
            (train.ema_decay > 0), else the trained weights; "ema" or "raw" to choose.
        custom_op: False = only standard TensorFlow ops (portable); True = the compiled
            op (the run's fused routing where it applies), needing
            capsnet.ops.load_op_library() before loading.

    Returns:
        dict with output, checkpoint, run_dir, epoch, weights, custom_op, dataset,
        input_shape, num_classes, two_digits, signatures, op_library_ops (the
        Capsnet> ops in the graph; [] = portable).
    """
    output = check_export_output(output)

    # Everything that can fail on the user's input fails here, before anything is written.
    member = resolve_member(checkpoint, which=which, custom_op=custom_op, weights=weights)
    cfg = member["cfg"]
    if member["custom_op"]:
        check_op_library()
    # Routed as config.router_spec decides for custom_op: false routes the same W in TF ops.
    # float32 whatever the run's train.precision (the weights are float32 in every precision):
    # the export serves on any device, and a CPU computes 16-bit types no faster.
    model = build_capsnet(cfg["model"], member["custom_op"])
    epoch = restore_model(model, member["prefix"], member["weights"])
    dataset = cfg["data"]["name"]
    task = task_for(cfg["data"])
    archive = export_archive(model, task.label_format, task.serving_images)
    names = task.class_names(model.num_classes)

    report = {
        "output": str(output),
        "checkpoint": member["prefix"],
        "run_dir": str(member["run_dir"]),
        "epoch": epoch,
        "weights": member["weights"],
        "custom_op": member["custom_op"],
        "dataset": dataset,
        "input_shape": list(model.image_shape),
        "num_classes": model.num_classes,
        "two_digits": task.label_format.per_example == 2,
        # predict.py names the classes by them (a folder's: its class folders).
        "class_names": None if names is None else list(names),
        "signatures": signature_descriptions(model, task.label_format),
    }
    created = [p for p in [output.parent, *output.parent.parents] if not p.exists()]
    partial = None
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        # Beside `output` (same file system): the final rename is atomic.
        # mkdir, not tempfile.mkdtemp: the export gets the usual (umask) permissions, not 0700,
        # so that a server running as another user can read it.
        remove_stale_partials(output)
        partial = output.parent / f".{output.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        partial.mkdir()
        (partial / PARTIAL_MARKER).write_text(f"{os.getpid()}\n")
        archive.write_out(str(partial), verbose=False)
        report["op_library_ops"] = sorted(t for t in graph_op_types(partial) if t.startswith(OP_PREFIX))
        extra = partial / "assets.extra"
        extra.mkdir(exist_ok=True)
        # With the run's data section: predict makes an image file the model's input as the
        # run's pipeline did (Task.file_image: its size, crop, data.max_pixels).
        metadata = {**{k: v for k, v in report.items() if k != "output"}, "data": cfg["data"]}
        (extra / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")
        (extra / "README.txt").write_text(readme_text(report))
        (partial / PARTIAL_MARKER).unlink()
        os.rename(partial, output)
    except BaseException as exc:  # KeyboardInterrupt included: nothing half-written stays
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        for directory in created:  # innermost first
            try:
                directory.rmdir()
            except OSError:
                break
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot write the export {output}: {exc.strerror or exc}") from exc
        if isinstance(exc, tf.errors.OpError):  # TensorFlow's own file writes (a full disk, say)
            raise CheckpointError(f"cannot write the export {output}: {exc.message.strip().splitlines()[0]}") from exc
        raise
    return report


def remove_stale_partials(output):
    """Remove what an earlier export of `output` killed mid-write (SIGKILL, power loss: no
    cleanup ran) left beside it: folders named exactly `.<name>.partial-<pid>-<8 hex>` that
    hold PARTIAL_MARKER and whose process is gone. A folder of an export of the same output
    still running in another process is kept, and so is anything export() did not make (a
    user's `.<name>.partial-keep`, a symlink, a folder without the marker)."""
    pattern = re.compile(rf"\.{re.escape(output.name)}\.partial-(\d+)-[0-9a-f]{{8}}")
    for stale in output.parent.glob(f".{glob.escape(output.name)}.partial-*"):
        match = pattern.fullmatch(stale.name)
        if (match is None or stale.is_symlink() or not stale.is_dir() or not (stale / PARTIAL_MARKER).is_file()
                or process_alive(int(match.group(1)))):
            continue
        shutil.rmtree(stale, ignore_errors=True)


def process_alive(pid):
    """Whether a process `pid` exists on this machine (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signature_descriptions(model, label_format):
    """What each signature takes and returns, in words (the report and README)."""
    h, w, c = model.image_shape
    k = model.num_classes
    pred, recon = label_format.signature_words(h, w, c)
    baseline = not hasattr(model, "digit_caps")  # the CNN baseline: its "lengths" are softmax probabilities
    if baseline:
        pred = "int32 (N,): the most probable class"
    pred += f"; {NO_CLASS} where the lengths are not finite (a NaN or inf pixel)"
    outputs = {"lengths": f"float32 (N, {k}): class probabilities (softmax; a CapsNet's capsule lengths)" if baseline
               else f"float32 (N, {k}): capsule lengths (class scores)", "predictions": pred}
    if model.use_decoder:
        outputs["reconstructions"] = f"{recon} in [0, 1]: the decoder's image of the predicted capsule(s)"
    return {
        "serving_default": {"images": f"float32 (N, {h}, {w}, {c}) in [0, 1]", "outputs": outputs},
        "serve_uint8": {"images": f"uint8 (N, {h}, {w}, {c}) in [0, 255]", "outputs": outputs},
    }


def readme_text(report):
    """assets.extra/README.txt: what the export is and how to load it."""
    ops = report.get("op_library_ops") or []
    if ops:
        loading = (f"This export holds the compiled capsnet op ({', '.join(ops)}): TensorFlow cannot load it\n"
                   "until the op library is registered. Install capsnet (with `make ops`), then:\n\n"
                   "    import capsnet.ops, tensorflow as tf\n"
                   "    capsnet.ops.load_op_library()          # registers the Capsnet> ops\n"
                   "    model = tf.saved_model.load(path)\n\n"
                   "Without it, loading fails with \"Op type not registered 'Capsnet>...'\".\n"
                   "Re-export with custom_op=false for a graph of standard TensorFlow ops.\n")
    else:
        loading = ("Standard TensorFlow ops only: no capsnet needed.\n\n"
                   "    import tensorflow as tf\n"
                   "    model = tf.saved_model.load(path)\n")
    lines = [f"CapsNet SavedModel exported from {report['checkpoint']} (epoch {report['epoch']}, "
             f"{report['weights']} weights, dataset {report['dataset']}).", "", loading, "Signatures:"]
    for name, signature in report["signatures"].items():
        lines.append(f"  {name}: images {signature['images']}")
        lines += [f"    -> {key}: {text}" for key, text in signature["outputs"].items()]
    lines += ["", "    out = model.signatures['serving_default'](images=tf.constant(x))   # x float32 in [0, 1]",
              "    out['predictions'], out['lengths']", ""]
    return "\n".join(lines)


def format_summary(report):
    """A human-readable summary of an export: where, from what, its signatures."""
    ops = report["op_library_ops"]
    lines = [f"exported {report['checkpoint']} (epoch {report['epoch']}, {WEIGHT_NAMES[report['weights']]}) "
             f"to {report['output']}",
             "graph: " + (f"the compiled capsnet op ({', '.join(ops)}): call capsnet.ops.load_op_library() "
                          "before loading it" if ops else "standard TensorFlow ops only (loads without capsnet)")]
    for name, signature in report["signatures"].items():
        lines.append(f"signature {name}: images {signature['images']}")
        lines += [f"  {key}: {text}" for key, text in signature["outputs"].items()]
    return "\n".join(lines)


# --------------------------------------------------------------------------- load

def load(path):
    """`tf.saved_model.load(path)` of an export; an export holding the compiled op while
    the op library is not loaded → OpLibraryError (one line: call
    capsnet.ops.load_op_library() first), a missing or unreadable directory →
    CheckpointError."""
    path = str(path)
    try:
        return tf.saved_model.load(path)
    except (RuntimeError, tf.errors.NotFoundError) as exc:  # TF 2.21: RuntimeError
        message = str(getattr(exc, "message", exc))
        if "Op type not registered" in message and OP_PREFIX in message:
            op = message.split("Op type not registered", 1)[1].split("'")[1] if "'" in message else OP_PREFIX
            raise OpLibraryError(f"the SavedModel {path} holds the compiled capsnet op {op} (exported with "
                                 f"custom_op=true): {_LOAD_OPS}") from exc
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot load the SavedModel {path}: {' '.join(str(exc).split())[:200]}") from exc
