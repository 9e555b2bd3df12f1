"""Train CapsNet: `train(cfg) -> metrics`, the body of `python train.py`.

Reads top to bottom like the loop it is: config → setup → data → model and optimizer
(new, or resumed from the run dir's last checkpoint) → compiled steps → epochs →
final metrics. `cfg` is a plain dict shaped like configs/train.yaml (train.py converts
Hydra's config at the boundary); nothing here sees a Hydra object.

The pieces train() is made of, shared with scripts/benchmark_train.py:
`build_capsnet(model_cfg, custom_op)`, `build_optimizer(train_cfg, steps_per_epoch,
model)`, `make_train_step(model, optimizer, input_shape=..., losses=..., xla=...)`
with xla none | jit | autocluster (train.xla; see set_autoclustering), and
`make_train_loop(train_step)`, which runs train.steps_per_execution steps per compiled
call over `input_iterator(dataset)` (the batches prefetched to the device).

A run dir holds:
    config.yaml                the resolved config (evaluate.py rebuilds the model from it)
    events.out.tfevents.*      TensorBoard: scalars, reconstructions, histograms, HParams
    checkpoints/latest/ckpt-N  the last `train.keep_checkpoints` epochs (N = epochs done)
    checkpoints/best/ckpt-N    the epoch with the highest test accuracy (of the epochs done)
    history.jsonl              one line of metrics per finished epoch
    metrics.json               the final metrics, written at the end

Resume: rerunning with the same run dir restores model weights, optimizer state
(Adam moments and its step counter, from which the LR schedule follows), the epoch
counter and the best accuracy so far, then continues with the next epoch. The only
randomness after weight initialization is the data's: order and shifts are stateless
functions of (seed, epoch) (capsnet.data), so there is no generator state to save, and
with deterministic=true a resumed run ends bitwise equal to an uninterrupted one.
A run killed mid-epoch loses that epoch only. TensorBoard's step is the global step
(optimizer.iterations), so the curves continue where the checkpoint left them.

Weight average (train.ema_decay > 0, WeightAverage): an exponential moving average of
the weights is updated after every step and saved in every checkpoint (node "ema",
restored on resume). The per-epoch test pass, TensorBoard's test/ curves, the best
checkpoint and evaluate.py (weights=null) use the averaged weights; the trained ones'
test loss and accuracy are logged beside them (test/raw_*, history's test_raw_*).

An epoch ends with: its history line, its best checkpoint (if it is the best), and
LAST checkpoints/latest/ckpt-N, the commit point: a run killed before it redoes the
epoch, and whatever that epoch wrote before (a history line, best/ckpt-N) is
superseded or deleted on restart (see _BestCheckpoint).

Resuming refuses a config that would change the run's trajectory (RESUME_KEYS: the
model, the data, the seed, the optimizer and loss values) and names what differs;
train.epochs (to extend a run), custom_op, train.xla, model.jit_routing,
deterministic, logging and progress keys may change, and so may the distribute
strategy and devices (a run started on one GPU may continue on two).

Several devices (`distribute`, configs/distribute/; make_strategy): `mirrored` runs one
replica per local GPU (tf.distribute.MirroredStrategy), `multi_worker` one per GPU of
every machine of a TF_CONFIG cluster (MultiWorkerMirroredStrategy); `none` (default)
is the one-device code path, untouched. train.batch_size is the GLOBAL batch: the
(seed, epoch)-ordered batches of capsnet.data are split evenly over the replicas
(distribute_dataset), each replica's loss is its share of the global-batch mean, the
optimizer sums the replicas' gradients, so a step is the one-device step on the same
batch up to float rounding. distribute.scale_lr scales the learning rate with the
global batch (scaled_learning_rate). Only the chief (worker 0, or the task "chief")
writes into the run dir; the other workers save their checkpoints into a scratch
directory of their own and write nothing else. Evaluation runs on one device of
every worker, as without a strategy, and a distributed run's checkpoints are
ordinary ones (a mirrored variable is saved once).
"""
import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
import yaml
from tensorflow.python.framework import config as tf_config

from capsnet import ops
from capsnet.data import (AUGMENTATION_KEYS, AUGMENTATION_OFF, augmentation_options, check_augmentation, example_shape,
                          is_overlay, load_split, make_split_dataset)
from capsnet.errors import CheckpointError, ConfigError, OpLibraryError
from capsnet.evaluation import (
    capsnet_losses, checkpoint_weights, correct_predictions, evaluate_model, json_safe, loss_params, make_eval_step,
    predict, read_run_config,
)
from capsnet.model import build_model
from capsnet.validation import boolean, float_in_range, integer, positive_float, positive_int

log = logging.getLogger(__name__)

# Values shown side by side in TensorBoard's HParams dashboard, and the metrics they explain.
HPARAMS = ("custom_op", "xla", "dataset", "batch_size", "routing_iterations", "seed", "learning_rate", "decoder")
HPARAM_METRICS = ("test/accuracy", "train/images_per_sec")


# --------------------------------------------------------------------------- small pure helpers

def learning_rate_schedule(learning_rate, decay_rate, decay_steps, staircase=False):
    """lr(step) = learning_rate · decay_rate^(step / decay_steps); a Keras schedule of
    the optimizer's step counter, so restoring the counter restores the LR."""
    return keras.optimizers.schedules.ExponentialDecay(
        initial_learning_rate=learning_rate, decay_steps=decay_steps, decay_rate=decay_rate,
        staircase=staircase)


def image_grid(images, reconstructions):
    """Inputs over reconstructions: two rows of N tiles, (N, H, W, C) x 2 → (1, 2H, N·W, C)."""
    images = np.asarray(images, np.float32)
    reconstructions = np.asarray(reconstructions, np.float32)
    if images.ndim != 4 or images.shape != reconstructions.shape:
        raise ValueError(f"image_grid: need two (N, H, W, C) arrays of one shape, got "
                         f"{images.shape} and {reconstructions.shape}")
    n, h, w, c = images.shape
    rows = np.stack([images, reconstructions])                        # (2, N, H, W, C)
    grid = rows.transpose(0, 2, 1, 3, 4).reshape(2 * h, n * w, c)     # (2H, N·W, C)
    return np.clip(grid, 0.0, 1.0)[None]                              # (1, 2H, N·W, C)


def check_labels(labels, images, *, model, split, image_shape=None):
    """The data must fit the model: image shape = input_shape, labels in [0, num_classes).

    `model` is a built CapsNet: its input_shape and num_classes have been checked
    (build_capsnet), unlike the raw config values. image_shape: the shape of the
    examples the model will see, when the pipeline makes them from `images`
    (MultiMNIST: capsnet.data.example_shape); None = the images' own.
    """
    input_shape = tuple(model.image_shape)
    image_shape = tuple(images.shape[1:]) if image_shape is None else tuple(image_shape)
    if image_shape != input_shape:
        raise ConfigError(f"{split} images have shape {image_shape} but model.input_shape is "
                          f"{list(input_shape)}")
    num_classes = int(model.num_classes)
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise ConfigError(f"{split} labels lie in [{labels.min()}, {labels.max()}] but model.num_classes is "
                          f"{num_classes}")


def build_capsnet(model_cfg, custom_op):
    """The CapsNet of a config's `model` section; bad values (a non-integer num_classes,
    input_shape=5, an unknown key, ...) → ConfigError naming them.

    The values go to CapsNet as they are: it checks them (and turns lists into
    tuples), so a bool(...) or tuple(...) here cannot misread or crash on them first.
    """
    model_cfg = dict(model_cfg)
    if model_cfg.get("fused_routing", False) is None:
        # null (the config's default): the fused routing op wherever it applies, so that
        # custom_op=true alone is the fastest setting (docs/benchmarks.md).
        model_cfg["fused_routing"] = fused_routing_applies(model_cfg, custom_op)
    try:
        return build_model(**model_cfg, custom_op=custom_op)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"model: {' '.join(str(exc).split())}") from exc


def fused_routing_applies(model_cfg, custom_op):
    """Whether model.fused_routing=null turns the fused op on: with the compiled op
    (custom_op=true), stop-gradient routing (the gradient the op implements) and no
    jit_routing (the other way to speed the routing up; asking for it wins)."""
    return (custom_op is True and model_cfg.get("stop_gradient_routing", True) is True
            and not model_cfg.get("jit_routing", False))


def check_op_library(devices=None):
    """custom_op=true must use the compiled op: fail now, with the op's one-line error, if
    it cannot run (not built, stale, or built without CUDA while TensorFlow sees a GPU)
    rather than deep inside the first compiled step.

    devices: where the op will run (a strategy's replica devices, each of which runs it
    on its own slice of the batch); None = the default device.
    """
    if tf.config.list_physical_devices("GPU") and ops.build_stamp(ops.library_path()).get("cuda") is False:
        # The op has only a CPU kernel: TensorFlow would place it on the CPU and copy u and
        # u_hat across every step, silently, while the rest of the model runs on the GPU.
        raise OpLibraryError(f"the capsnet op library {ops.library_path()} was built without CUDA, but TensorFlow "
                             "sees a GPU (the op would run on the CPU): run `make ops-cuda` (needs nvcc), "
                             "or set custom_op=false")
    for device in devices or [None]:
        with tf.device(device):
            u = tf.zeros((1, 1, 1))        # (batch, in_caps, in_dim)
            W = tf.zeros((1, 1, 1, 1))     # (in_caps, out_caps, out_dim, in_dim)
            try:
                ops.capsule_prediction(u, W)
            except OpLibraryError:
                raise
            except tf.errors.OpError as exc:
                where = f" on {device}" if device else ""
                raise OpLibraryError(f"the capsule-prediction op library does not run{where}: {exc.message}; "
                                     "rebuild it with `make ops`") from exc


def build_optimizer(train_cfg, steps_per_epoch, model):
    """The paper's optimizer for `model`: Adam on an exponentially decaying LR.

    Returns (optimizer, schedule). `train_cfg` is a config's `train` section;
    lr_decay_steps null decays once per `steps_per_epoch`. Adam's moments are created
    now (optimizer.build), so a checkpoint restore fills them in place instead of being
    deferred to the first step, and the first compiled step creates no variables.
    """
    decay_steps = train_cfg["lr_decay_steps"] or steps_per_epoch
    schedule = learning_rate_schedule(train_cfg["learning_rate"], train_cfg["lr_decay_rate"], decay_steps,
                                      train_cfg["lr_staircase"])
    optimizer = keras.optimizers.Adam(learning_rate=schedule)
    optimizer.build(model.trainable_variables)
    return optimizer, schedule


class WeightAverage:
    """An exponential moving average of a model's trainable weights, kept beside them
    (train.ema_decay; Polyak averaging, as in the Inception-v3 and EfficientNet recipes):
    after training step t (the optimizer's step counter, counted after the step),

        shadow <- d_t * shadow + (1 - d_t) * weight,   d_t = min(decay, (1 + t) / (10 + t)),

    which is tf.train.ExponentialMovingAverage with num_updates = the step counter: the
    ramp of d_t keeps the first steps' average from remembering the random start.

    Why: while the learning rate is large the weights jitter around their trend; their
    average over the last ~1 / (1 - decay) steps is a point the training passed near that
    tests better. Measured (docs/results.md, sixth attempt): +0.4 to +0.6 points over
    epochs 30-60 on Fashion-MNIST, +1.3 to +1.6 on MultiMNIST, nothing on MNIST (its
    training set is fit); at the end of a fully decayed schedule, a few images either way.

    Make it under the strategy's scope and before a checkpoint restore (the shadows are
    created now, equal to the weights, and a restore then fills them). `update()` goes into
    the training step after the optimizer's; `weights()` is the checkpoint node "ema";
    `in_model()` puts the averages into the model for a while (the test pass).
    """

    def __init__(self, model, decay, step):
        # The tf.Variables under Keras's wrappers: ExponentialMovingAverage needs those.
        self._variables = [variable.value for variable in model.trainable_variables]
        self._model = model
        self._ema = tf.train.ExponentialMovingAverage(decay, num_updates=step, name="weight_average")
        # Creates the shadows as copies of the weights; the update it also makes is a no-op
        # (shadow - (shadow - weight) * (1 - d) with shadow = weight).
        self._ema.apply(self._variables)

    def update(self):
        """One averaging step (call after the optimizer's step; in a replica context under a
        strategy, it averages the replicas' identical weights)."""
        return self._ema.apply(self._variables)

    def weights(self):
        """The averaged weights keyed like checkpoint_weights(model): a training checkpoint
        holds them as its "ema" node, which restore_model(..., weights="ema") loads into a
        model. A weight that is not trained is its own average."""
        return {name: self._ema.average(variable.value) if variable.trainable else variable
                for name, variable in checkpoint_weights(self._model).items()}

    def _exchange(self, variable):
        shadow = self._ema.average(variable)
        trained = tf.identity(variable)
        variable.assign(shadow)
        shadow.assign(trained)

    @contextlib.contextmanager
    def in_model(self):
        """The averaged weights in the model inside the block; the trained ones back after
        it (the averages are exchanged with them, so nothing is copied twice). Whatever
        ends the block, every exchanged weight is exchanged back."""
        exchanged = []
        try:
            for variable in self._variables:
                self._exchange(variable)
                exchanged.append(variable)
            yield
        finally:
            for variable in exchanged:
                self._exchange(variable)


# --------------------------------------------------------------------------- compiled steps

XLA_MODES = ("none", "autocluster", "jit")


def check_xla(xla, custom_op, jit_routing=False):
    """`train.xla` must be one of XLA_MODES; jit cannot compile the custom op, and
    jit_routing (an XLA computation of its own) must not be nested inside jit."""
    if xla not in XLA_MODES:
        raise ConfigError(f"train.xla must be one of {', '.join(XLA_MODES)}, got {xla!r}")
    if xla == "jit" and custom_op:
        # XLA has no kernel for our op: jit_compile would fail on it at the first step.
        raise ConfigError("train.xla=jit cannot compile the custom op (custom_op=true): use train.xla=autocluster, "
                          "which compiles the TensorFlow ops around it")
    if xla == "jit" and jit_routing:
        # The whole step is one XLA computation already; the nested jit_compile function
        # aborted the process on an H200 (benchmark_train, 2026-11-21).
        raise ConfigError("model.jit_routing=true is redundant under train.xla=jit (the whole step is compiled): "
                          "set model.jit_routing=false")


def set_autoclustering(enabled):
    """Turn XLA autoclustering on or off for this PROCESS: it applies to every tf.function
    run afterwards (the train step, the eval step, and anything else).

    TensorFlow autoclusters only GPU ops unless --tf_xla_cpu_global_jit is in
    TF_XLA_FLAGS; enabling adds it, so that `autocluster` also works on a CPU-only
    machine. TensorFlow reads TF_XLA_FLAGS once per process, when it first sets up its
    devices (the first tensor, variable or device query): call this before that for
    the flag to count. Once read, the flag stays; set_jit alone then decides whether
    functions instantiated later are clustered.
    """
    if enabled:
        flags = os.environ.get("TF_XLA_FLAGS", "")
        if "--tf_xla_cpu_global_jit" not in flags:
            os.environ["TF_XLA_FLAGS"] = (flags + " --tf_xla_cpu_global_jit").strip()
    tf.config.optimizer.set_jit("autoclustering" if enabled else False)


def make_train_step(model, optimizer, *, input_shape, losses, xla="none", strategy=None, two_digits=False,
                    weight_average=None):
    """The compiled training step: (images, labels) → {loss, margin_loss, reconstruction_loss, accuracy}.

    One Adam step on the mean total loss of the batch; the returned values are batch
    means (tensors still on the device: reading one waits for the step).

    Args:
        model: a CapsNet (its `custom_op` decides whether jit is allowed).
        optimizer: a built Keras optimizer (build_optimizer).
        input_shape: image shape (H, W, C); the batch size may vary between calls.
        losses: capsnet_losses' keyword arguments (loss_params(train_cfg)).
        xla: "none"; "jit" compiles the whole step with XLA (tf.function(jit_compile=True),
            matmul path only); "autocluster" turns on XLA autoclustering for the process
            (set_autoclustering), so XLA compiles clusters of plain TF ops around the custom
            op. "none" and "jit" turn autoclustering off: the last step made decides.
        strategy: None (one device), or the tf.distribute strategy that `model` and
            `optimizer` were built under: the step is then
            (per-replica images, per-replica labels, global batch size) → the same dict,
            means over the global batch (_make_distributed_train_step).
        two_digits: MultiMNIST (one device only): the step takes (images, labels (B, 2),
            digits (B, 2, H, W, C)); the margin loss counts both classes present, the
            decoder reconstructs each digit from its own capsule against its own image
            (the reconstruction loss sums the two), and accuracy counts an example right
            iff the two longest capsules are its two labels.
        weight_average: a WeightAverage of `model` (train.ema_decay), updated after each
            step; None: none kept.
    """
    check_xla(xla, getattr(model, "custom_op", False), getattr(model, "jit_routing", False))
    set_autoclustering(xla == "autocluster")
    if strategy is not None:
        if two_digits:
            raise ConfigError("two-digit data (MultiMNIST) trains on one device only: set distribute=none")
        return _make_distributed_train_step(model, optimizer, losses=losses, xla=xla, strategy=strategy,
                                            weight_average=weight_average)
    image_spec = tf.TensorSpec([None, *input_shape], tf.float32)
    signature = [image_spec, tf.TensorSpec([None], tf.int32)]
    if two_digits:
        signature = [image_spec, tf.TensorSpec([None, 2], tf.int32), tf.TensorSpec([None, 2, *input_shape], tf.float32)]

    @tf.function(input_signature=signature, jit_compile=xla == "jit")
    def train_step(images, labels, digits=None):
        with tf.GradientTape() as tape:
            # Labels mask the decoder input: reconstruct the TRUE class(es) in training;
            # two labels: each digit from its own capsule, against its own image (digits).
            outputs = model(images, labels=labels, training=True)
            total, margin, reconstruction = capsnet_losses(images, labels, outputs, **losses,
                                                           targets=digits)  # (B,) each
            loss = tf.reduce_mean(total)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if weight_average is not None:
            weight_average.update()
        predictions = predict(outputs["lengths"], labels)  # (B,), two labels: (B, 2)
        return {
            "loss": loss,
            "margin_loss": tf.reduce_mean(margin),
            "reconstruction_loss": tf.reduce_mean(reconstruction),
            "accuracy": tf.reduce_mean(correct_predictions(predictions, labels)),
        }

    return train_step


# The sums each replica returns, in this order (stacked, so one all-reduce carries them).
_STEP_SUMS = ("loss", "margin_loss", "reconstruction_loss", "accuracy")


def _make_distributed_train_step(model, optimizer, *, losses, xla, strategy, weight_average=None):
    """make_train_step under a strategy: strategy.run of one replica's step on its slice
    of the global batch, then the batch means over all replicas (and workers).

    The returned function takes the per-replica images and labels of a distributed
    dataset (distribute_dataset) and the global batch size of the step (an int; the last
    batch of an epoch may be short, so it is passed rather than assumed).
    """

    def forward_backward(images, labels, global_batch_size):
        with tf.GradientTape() as tape:
            # Labels mask the decoder input: reconstruct the TRUE class in training.
            outputs = model(images, labels=labels, training=True)
            total, margin, reconstruction = capsnet_losses(images, labels, outputs, **losses)  # (b,) each
            # This replica's share of the GLOBAL batch mean: the sum of its per-example totals
            # (margin + weighted reconstruction) over the global batch size. The optimizer sums
            # the replicas' gradients (an all-reduce), which makes the gradient of the mean
            # over the whole batch, as on one device. A per-replica mean would weigh the
            # examples of a short last batch's unequal slices unequally.
            loss = tf.nn.compute_average_loss(total, global_batch_size=global_batch_size)
        grads = tape.gradient(loss, model.trainable_variables)
        correct = tf.reduce_sum(correct_predictions(predict(outputs["lengths"], labels), labels))
        sums = tf.stack([tf.reduce_sum(total), tf.reduce_sum(margin), tf.reduce_sum(reconstruction), correct])  # (4,)
        return grads, sums

    if xla == "jit":
        # A whole-step jit_compile cannot work here: the optimizer's gradient all-reduce is a
        # cross-replica step (MirroredStrategy: a merge of the replicas' threads), and XLA
        # refuses a function that reads variables on another replica's device. So XLA
        # compiles each replica's forward and backward pass; the all-reduce and the Adam
        # update (elementwise, cheap) run outside it.
        forward_backward = tf.function(forward_backward, jit_compile=True)

    def replica_step(images, labels, global_batch_size):
        grads, sums = forward_backward(images, labels, global_batch_size)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if weight_average is not None:
            weight_average.update()
        return sums

    # reduce_retracing: a short last batch changes the per-replica shapes; the second
    # trace generalises the batch dimension, so there is no third.
    @tf.function(reduce_retracing=True)
    def distributed_step(images, labels, global_batch_size):
        sums = strategy.run(replica_step, args=(images, labels, global_batch_size))
        means = strategy.reduce(tf.distribute.ReduceOp.SUM, sums, axis=None) / tf.cast(global_batch_size, tf.float32)
        return dict(zip(_STEP_SUMS, tf.unstack(means)))

    def train_step(images, labels, global_batch_size):
        # A tensor, not a Python int: an int would trace the step once per distinct value.
        return distributed_step(images, labels, tf.convert_to_tensor(global_batch_size, tf.int32))

    return train_step


def make_train_loop(train_step, *, strategy=None):
    """Several training steps in one call: (iterator, batch_sizes) → {name: (K,) per-step values}.

    Step i takes the next batch of `iterator` (a dataset's, or under `strategy` a
    distributed dataset's: distribute_dataset) and runs `train_step` (make_train_step's,
    made with the same strategy) on it. `batch_sizes` is an int32 vector of fixed length,
    the global batch size of each step to run followed by zeros (K = the number of
    non-zero entries): a fixed length traces the loop once, and the distributed step
    needs each step's global batch (the epoch's last one may be short).

    Why (train.steps_per_execution, after Keras's option of that name): every call of a
    compiled function costs the host a round trip (Python, the multi-device function
    call, the iterator) while the GPU waits: ~2.6 ms a step on an H200, a third of the
    paper model's step at batch 128 (docs/benchmarks.md). In a loop inside one call the
    next step's ops are dispatched as soon as their inputs are ready. The steps are the
    same steps: per-step values equal those of K single calls.
    """
    names = _STEP_SUMS  # the keys of both step kinds' outputs

    @tf.function
    def train_steps(iterator, batch_sizes):
        count = tf.math.count_nonzero(batch_sizes, dtype=tf.int32)
        values = {name: tf.TensorArray(tf.float32, size=count) for name in names}
        for i in tf.range(count):
            batch = next(iterator)  # (images, labels) or (images, labels, digits)
            out = train_step(*batch) if strategy is None else train_step(*batch, batch_sizes[i])
            values = {name: values[name].write(i, out[name]) for name in names}
        return {name: values[name].stack() for name in names}

    return train_steps


def execution_lengths(steps_per_epoch, start_step, steps_per_execution, log_every_steps):
    """How many steps each train_steps call of an epoch runs; start_step = the global step
    before the epoch.

    A call never crosses the epoch's end or a log step (global step % log_every_steps ==
    0), so TensorBoard's train scalars fall on the same steps whatever
    steps_per_execution is; the epoch's first call is a single step, so the one-off costs
    it carries (tracing, refilling the shuffle buffer) stay out of the images/s of the
    calls after it.
    """
    lengths, done = [], 0
    while done < steps_per_epoch:
        to_log = log_every_steps - (start_step + done) % log_every_steps
        length = 1 if done == 0 else min(steps_per_execution, steps_per_epoch - done, to_log)
        lengths.append(length)
        done += length
    return lengths


# --------------------------------------------------------------------------- tf.distribute

STRATEGIES = ("none", "mirrored", "multi_worker")
# distribute.all_reduce: how the replicas sum their gradients, per strategy.
ALL_REDUCE = {
    "none": ("auto",),
    "mirrored": ("auto", "nccl", "one_device"),
    "multi_worker": ("auto", "nccl", "ring"),
}
SCALE_LR = ("none", "linear", "sqrt")
# The distribute section of a config that has none (written before it existed).
DISTRIBUTE_DEFAULTS = {"strategy": "none", "devices": None, "all_reduce": "auto", "scale_lr": "none",
                       "lr_base_batch_size": 100}
TF_CONFIG_EXAMPLE = ('{"cluster": {"worker": ["host1:12345", "host2:12345"]}, '
                     '"task": {"type": "worker", "index": 0}}')


def distribute_config(cfg):
    """The checked `distribute` section of a config (absent = one device): ConfigError
    naming the key and value. multi_worker also needs a valid TF_CONFIG (read_tf_config)."""
    section = cfg.get("distribute", DISTRIBUTE_DEFAULTS)
    if not isinstance(section, dict):
        raise ConfigError(f"distribute must be a section of keys, got {section!r}")
    unknown = sorted(set(section) - set(DISTRIBUTE_DEFAULTS))
    if unknown:
        raise ConfigError(f"distribute has unknown key(s) {', '.join(unknown)} "
                          f"(known: {', '.join(DISTRIBUTE_DEFAULTS)})")
    dcfg = {**DISTRIBUTE_DEFAULTS, **section}
    strategy = dcfg["strategy"]
    if strategy not in STRATEGIES:
        raise ConfigError(f"distribute.strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if dcfg["all_reduce"] not in ALL_REDUCE[strategy]:
        raise ConfigError(f"distribute.all_reduce must be one of {', '.join(ALL_REDUCE[strategy])} with "
                          f"distribute={strategy}, got {dcfg['all_reduce']!r}")
    devices = dcfg["devices"]
    if devices is not None:
        if strategy != "mirrored":
            raise ConfigError(f"distribute.devices applies to distribute=mirrored only (distribute={strategy} "
                              f"{'uses one device' if strategy == 'none' else 'uses every GPU of each worker'}), "
                              f"got {devices!r}: set it to null")
        if (not isinstance(devices, (list, tuple)) or not devices
                or not all(isinstance(d, str) and d.strip() for d in devices)):
            raise ConfigError(f"distribute.devices must be null or a non-empty list of device names like "
                              f"[/gpu:0, /gpu:1], got {devices!r}")
        if len(set(devices)) != len(devices):
            raise ConfigError(f"distribute.devices lists a device more than once: {list(devices)}")
        dcfg["devices"] = list(devices)
    if dcfg["scale_lr"] not in SCALE_LR:
        raise ConfigError(f"distribute.scale_lr must be one of {', '.join(SCALE_LR)}, got {dcfg['scale_lr']!r}")
    positive_int("distribute.lr_base_batch_size", dcfg["lr_base_batch_size"], error=ConfigError)
    if strategy == "multi_worker":
        read_tf_config()
    elif os.environ.get("TF_CONFIG"):
        log.warning("TF_CONFIG is set but distribute=%s: this process trains alone (distribute=multi_worker "
                    "joins the cluster)", strategy)
    return dcfg


def read_tf_config():
    """The cluster and task of TF_CONFIG (MultiWorkerMirroredStrategy's source): a dict,
    checked enough that a mistake is a one-line ConfigError rather than a hang."""
    text = os.environ.get("TF_CONFIG")
    if not text:
        raise ConfigError(f"distribute=multi_worker needs the cluster in the TF_CONFIG environment variable, which "
                          f"is not set; on each worker e.g. TF_CONFIG='{TF_CONFIG_EXAMPLE}' (index: this worker's)")
    try:
        tf_config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"TF_CONFIG is not valid JSON ({exc}): {text!r}") from exc
    cluster = tf_config.get("cluster") if isinstance(tf_config, dict) else None
    task = tf_config.get("task") if isinstance(tf_config, dict) else None
    if (not isinstance(cluster, dict) or not cluster
            or not all(isinstance(v, list) and v and all(isinstance(a, str) for a in v) for v in cluster.values())):
        raise ConfigError(f"TF_CONFIG needs a \"cluster\" of task types to lists of host:port, got {text!r} "
                          f"(e.g. {TF_CONFIG_EXAMPLE})")
    if not isinstance(task, dict) or task.get("type") not in ("chief", "worker"):
        raise ConfigError(f"TF_CONFIG needs a \"task\" with type \"chief\" or \"worker\" (the tasks that train), "
                          f"got {text!r}")
    index = task.get("index", 0)
    hosts = cluster.get(task["type"], [])
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(hosts):
        raise ConfigError(f"TF_CONFIG task index {index!r} is not one of the {len(hosts)} {task['type']} "
                          f"address(es) of its cluster: {text!r}")
    return tf_config


def scaled_learning_rate(learning_rate, batch_size, scale_lr, base_batch_size):
    """The learning rate train() uses: train.learning_rate, scaled with the global batch.

    linear: × batch_size / base_batch_size (Goyal et al. 2017, for SGD); sqrt:
    × √(batch_size / base_batch_size), the rule for Adam (Malladi et al. 2022: the
    gradient noise falls as 1/√batch, and Adam's update divides by its scale);
    none: unchanged. base_batch_size is the batch `learning_rate` was tuned for.
    """
    ratio = batch_size / base_batch_size
    return learning_rate * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[scale_lr]


def _check_devices(devices):
    """Every name in distribute.devices must be a device TensorFlow sees (MirroredStrategy
    would only warn, then fail when it first places a variable there)."""
    visible = tf.config.list_logical_devices()
    known = {(d.device_type, tf.DeviceSpec.from_string(d.name).device_index) for d in visible}
    for name in devices:
        try:
            spec = tf.DeviceSpec.from_string(name)
        except ValueError as exc:
            raise ConfigError(f"distribute.devices: {name!r} is not a device name ({exc})") from exc
        if (str(spec.device_type).upper(), spec.device_index or 0) not in known:
            seen = ", ".join(d.name.split("device:")[-1] for d in visible)
            raise ConfigError(f"distribute.devices: {name} is not a device TensorFlow sees here (it sees {seen})")


def make_strategy(dcfg):
    """The tf.distribute strategy of a checked distribute section (distribute_config); None
    for `none`, which keeps the one-device code path.

    multi_worker must be made before TensorFlow starts (its first tensor or variable): it
    configures the collective ops of the process, so train() makes it first, and a
    second one in the same process (a -m sweep) is refused.
    """
    strategy = dcfg["strategy"]
    if strategy == "none":
        return None
    if strategy == "mirrored":
        if dcfg["devices"] is not None:
            _check_devices(dcfg["devices"])
        cross_device_ops = None  # auto: TensorFlow's pick, NCCL when every device is a GPU
        if dcfg["all_reduce"] == "nccl":
            cross_device_ops = tf.distribute.NcclAllReduce()
        elif dcfg["all_reduce"] == "one_device":
            cross_device_ops = tf.distribute.ReductionToOneDevice()
        return tf.distribute.MirroredStrategy(devices=dcfg["devices"], cross_device_ops=cross_device_ops)
    implementation = {"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
                      "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
                      "ring": tf.distribute.experimental.CommunicationImplementation.RING}[dcfg["all_reduce"]]
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(implementation=implementation))
    except RuntimeError as exc:
        # "Collective ops must be configured at program startup"
        raise ConfigError(f"distribute=multi_worker must be set up before TensorFlow starts, once per process "
                          f"(one training per process, no -m sweep): {' '.join(str(exc).split())}") from exc


def check_global_batch(batch_size, strategy):
    """train.batch_size is the global batch: it must split evenly over the replicas."""
    replicas = strategy.num_replicas_in_sync
    if batch_size % replicas:
        raise ConfigError(f"train.batch_size={batch_size} is the global batch and must divide evenly over the "
                          f"{replicas} replicas ({', '.join(strategy.extended.worker_devices)}"
                          f"{' on this worker' if len(strategy.extended.worker_devices) < replicas else ''}): "
                          f"use a multiple of {replicas}")


def is_chief(strategy):
    """Whether this process writes the run dir: always without a strategy or with mirrored
    (one process); under multi_worker the task "chief", else worker 0."""
    return strategy is None or strategy.extended.should_checkpoint


def distribute_dataset(strategy, dataset):
    """`dataset`'s batches (global batches) split over the strategy's replicas, in order.

    Each global batch is cut into one contiguous slice per replica (sizes differ by at
    most one example; a short last batch as well), so step k of every replica together
    sees global batch k of a one-device run. Every worker builds the whole (seed,
    epoch)-ordered dataset and keeps its replicas' slices (DATA sharding: the examples
    are tensors in memory, not files, so there are no files to split, and its
    augmentation is keyed by the example, not by the worker).
    """
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return strategy.experimental_distribute_dataset(dataset.with_options(options))


def input_iterator(dataset, strategy=None, device=None):
    """The iterator make_train_loop's steps read their batches from, the batches already
    on the devices that train on them.

    Under a strategy: split over its replicas (distribute_dataset; tf.distribute prefetches
    each slice to its replica's device). On one device: prefetched to `device` (default:
    the first GPU, if there is one); otherwise each step's first op waits for its batch's
    host-to-device copy (measured on an H200: docs/benchmarks.md).
    """
    if strategy is not None:
        return iter(distribute_dataset(strategy, dataset))
    if device is None:
        gpus = tf.config.list_logical_devices("GPU")
        device = gpus[0].name if gpus else None
    if device is None or tf.DeviceSpec.from_string(device).device_type != "GPU":
        return iter(dataset)  # the CPU trains where tf.data runs: nothing to copy
    with tf.device(device):  # the iterator of a copy_to_device dataset lives on the target device
        return iter(dataset.apply(tf.data.experimental.prefetch_to_device(device, buffer_size=2)))


def _check_workers_agree(strategy, epochs_done, step):
    """Every worker must continue from the same checkpoint: one that found none (another
    run dir, not on a shared filesystem) would start its epochs over while the others go
    on, and the step's collectives would pair different epochs' batches, or hang.

    All-reduces (v, v²) of v = (epochs done, step) over the replicas: every worker gets
    n·v and n·v² back iff all v are equal, so each worker sees a disagreement and stops.
    """
    local = tf.constant([epochs_done, step], tf.float64)
    per_replica = strategy.experimental_distribute_values_from_function(lambda _: tf.stack([local, local * local]))
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None).numpy()  # (2, 2)
    n = strategy.num_replicas_in_sync
    if not np.array_equal(total, n * np.stack([local.numpy(), local.numpy() ** 2])):
        raise CheckpointError(
            f"the workers restored different checkpoints (this one: {epochs_done} epochs done, step {step}; mean over "
            f"the replicas: {total[0][0] / n:g} epochs, step {total[0][1] / n:g}): every worker needs the same run dir "
            "(hydra.run.dir) on a filesystem they share")


# --------------------------------------------------------------------------- config checks

# (section, key, default when absent; None = required). Only real booleans pass: Hydra
# passes `custom_op=no` as the string 'no', which bool() would read as True.
BOOL_KEYS = (
    (None, "custom_op", None), (None, "deterministic", False), (None, "debug", False),
    ("train", "lr_staircase", None), ("train", "progress_bar", None),
    ("model", "decoder", True), ("model", "stop_gradient_routing", True), ("model", "jit_routing", False),
)


def _check_bools(cfg):
    for section, key, default in BOOL_KEYS:
        values = cfg[section] if section else cfg
        if not isinstance(values, dict):
            raise ConfigError(f"{section} must be a section of keys, got {values!r}")
        value = values[key] if default is None else values.get(key, default)
        boolean(f"{section}.{key}" if section else key, value, error=ConfigError)


def ema_decay(train_cfg):
    """train.ema_decay checked: a float in [0, 1) (0 = no weight average kept; 1 would
    never move the average from the initial weights)."""
    value = train_cfg.get("ema_decay", 0.0)
    try:
        decay = float_in_range("train.ema_decay", value, 0, 1)
    except ValueError:
        decay = None
    if decay is None or decay == 1:
        raise ConfigError(f"train.ema_decay must be a number in [0, 1) (0: no average; 0.999 averages over "
                          f"~1000 steps), got {value!r}")
    return decay


def _check_config(cfg):
    """Every value train() reads before the heavy work (data, model): ConfigError naming it.
    Returns the checked distribute section (distribute_config)."""
    _check_bools(cfg)
    train_cfg = cfg["train"]
    for key in ("epochs", "batch_size", "keep_checkpoints", "log_every_steps", "steps_per_execution", "num_images",
                "histogram_examples"):
        positive_int(f"train.{key}", train_cfg[key], error=ConfigError)
    positive_int("train.lr_decay_steps", train_cfg["lr_decay_steps"], allow_none=True, error=ConfigError)
    for key in ("learning_rate", "lr_decay_rate"):
        positive_float(f"train.{key}", train_cfg[key], error=ConfigError)
    loss_params(cfg["train"])  # m_plus, m_minus, lambda_, reconstruction_weight
    ema_decay(train_cfg)
    check_xla(cfg["train"]["xla"], cfg["custom_op"], cfg["model"].get("jit_routing", False))
    check_augmentation("data.", **augmentation_options(cfg["data"]))
    integer("seed", cfg["seed"], error=ConfigError)
    if not cfg.get("run_dir"):
        raise ConfigError("run_dir is not set (train.py sets it to Hydra's run dir; tests pass one)")
    return distribute_config(cfg)


# What a resumed run must share with the run it continues: everything that changes the
# trajectory of the weights. The model section is compared whole, except jit_routing and
# fused_routing (how routing is computed, not what: the same W and the same math).
RESUME_KEYS = {
    "data": ("name", "dir", "limit_train", "limit_test", *AUGMENTATION_KEYS),
    "train": ("batch_size", "learning_rate", "lr_decay_rate", "lr_decay_steps", "lr_staircase",
              "m_plus", "m_minus", "lambda_", "reconstruction_weight", "ema_decay"),
}
RESUME_FREE_MODEL_KEYS = ("jit_routing", "fused_routing")
# Keys added after the first release, with the value a run saved before them was trained with.
# (Augmentations added after a run was saved were off in it.)
ADDED_DEFAULTS = {"model": {"w_init_stddev": 0.1}, "data": AUGMENTATION_OFF, "train": {"ema_decay": 0.0}}


def _resume_values(cfg):
    """{dotted key: value} of a config over what a resume must not change (tuples as lists,
    as they come back from config.yaml)."""

    def section(name):
        values = cfg.get(name)
        return values if isinstance(values, dict) else {}

    def known(name):  # a saved section with the keys added after it at their old values
        return {**ADDED_DEFAULTS.get(name, {}), **section(name)} if section(name) else {}

    values = {"seed": cfg.get("seed")}
    values.update({f"model.{k}": v for k, v in known("model").items() if k not in RESUME_FREE_MODEL_KEYS})
    for name, keys in RESUME_KEYS.items():
        values.update({f"{name}.{k}": known(name).get(k) for k in keys})
    # Of distribute, only what sets the learning rate: the strategy, devices and all-reduce
    # do not change the trajectory (a run may move from one GPU to several and back). A run
    # dir from before distribute existed trained as its defaults do.
    distribute = {**DISTRIBUTE_DEFAULTS, **section("distribute")}
    values["distribute.scale_lr"] = distribute["scale_lr"]
    if distribute["scale_lr"] != "none":  # the base batch matters only when it scales
        values["distribute.lr_base_batch_size"] = distribute["lr_base_batch_size"]
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def _config_differences(saved, current):
    """'key: old -> new' for every resume-relevant value that differs (a missing key counts)."""
    saved, current = _resume_values(saved), _resume_values(current)

    def shown(values, key):
        return repr(values[key]) if key in values else "(absent)"

    return [f"{k}: {shown(saved, k)} -> {shown(current, k)}" for k in sorted(set(saved) | set(current))
            if k not in saved or k not in current or saved[k] != current[k]]


def _check_resumable(run_dir, cfg):
    """Resuming run_dir with `cfg` (data.dir resolved) must continue the same run: a changed
    seed, model, data or optimizer value would silently mix two runs. CheckpointError
    lists what differs."""
    if not (run_dir / "config.yaml").is_file():
        return  # nothing to compare (a run dir from before config.yaml was written)
    saved = read_run_config(run_dir)  # a corrupt config.yaml → CheckpointError
    differences = _config_differences(saved, cfg)
    if differences:
        raise CheckpointError(f"run dir {run_dir} was trained with a different config ({'; '.join(differences)}): "
                              "resume with the run's values (train.epochs may grow) or use a new hydra.run.dir")


class _BestCheckpoint:
    """checkpoints/best: the epoch with the highest test accuracy among the epochs done.

    Written in two phases around the epoch's commit point (latest.save), so that it
    never names an epoch a crash makes the run redo, and never loses the previous best
    before the new one counts: save(N) writes ckpt-N beside the current best;
    commit(N), once latest holds epoch N, points the `checkpoint` state file (which
    evaluate.py reads) at ckpt-N and deletes the old best. recover(epochs_done), on every
    (re)start, keeps the highest ckpt-N with N <= epochs_done (best epochs only grow, so
    that is the best as of the restored epoch) and deletes the rest: uncommitted ones
    and any left by a crash between commit's two steps.
    """

    def __init__(self, checkpoint, directory):
        self.checkpoint, self.directory = checkpoint, Path(directory)

    def numbers(self):
        """Epoch numbers N of the ckpt-N in the directory, ascending."""
        names = (p.name[len("ckpt-"):-len(".index")] for p in self.directory.glob("ckpt-*.index"))
        return sorted(int(n) for n in names if n.isdigit())

    def save(self, number):
        self.directory.mkdir(parents=True, exist_ok=True)
        self.checkpoint.write(str(self.directory / f"ckpt-{number}"))

    def commit(self, number):
        self._keep_only(number)

    def recover(self, epochs_done):
        done = [n for n in self.numbers() if n <= epochs_done]
        self._keep_only(done[-1] if done else None)

    def _keep_only(self, number):
        # The state file first (atomically): it must never name a deleted checkpoint.
        state = self.directory / "checkpoint"
        if number is None:
            state.unlink(missing_ok=True)
        else:
            # The CheckpointState text format tf.train.latest_checkpoint reads; relative
            # paths, so a copied or moved run dir still finds its checkpoint.
            temporary = self.directory / "checkpoint.tmp"
            temporary.write_text(f'model_checkpoint_path: "ckpt-{number}"\n'
                                 f'all_model_checkpoint_paths: "ckpt-{number}"\n')
            os.replace(temporary, state)
        for n in self.numbers():
            if n != number:
                # The checkpoint's own files only (an evaluation's ckpt-N.eval.json stays).
                for path in [self.directory / f"ckpt-{n}.index", *self.directory.glob(f"ckpt-{n}.data-*")]:
                    path.unlink(missing_ok=True)


def _steps_done(optimizer):
    """The optimizer's step counter as an int (.numpy(): int() of the Keras variable fails
    when a strategy made it a MirroredVariable)."""
    return int(optimizer.iterations.numpy())


def _read_history(path, epochs_done):
    """Per-epoch metrics of the epochs the checkpoint covers (a killed run may have logged more)."""
    if not path.is_file():
        return []
    by_epoch = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(entry, dict) and 1 <= entry.get("epoch", 0) <= epochs_done:
            by_epoch[entry["epoch"]] = entry
    return [by_epoch[e] for e in sorted(by_epoch)]


class _Window:
    """Example-weighted sums of step values over a window of steps, and the clock of its timed steps."""

    def __init__(self):
        self.sums, self.examples = {}, 0
        self.timed_steps, self.timed_images, self.timed_seconds = 0, 0, 0.0

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


# --------------------------------------------------------------------------- TensorBoard

def _write_hparams(writer, run_dir, cfg, data_cfg):
    from tensorboard.plugins.hparams import api as hp  # noqa: PLC0415  (only needed once)

    values = {
        "custom_op": bool(cfg["custom_op"]),
        "xla": str(cfg["train"]["xla"]),
        "dataset": str(data_cfg["name"]),
        "batch_size": int(cfg["train"]["batch_size"]),
        "routing_iterations": int(cfg["model"]["routing_iterations"]),
        "seed": int(cfg["seed"]),
        "learning_rate": float(cfg["train"]["learning_rate"]),
        "decoder": bool(cfg["model"]["decoder"]),
    }
    with writer.as_default():
        # Every run writes the same experiment config (no per-run domains), so a sweep's
        # runs merge into one HParams table.
        hp.hparams_config(hparams=[hp.HParam(name) for name in HPARAMS],
                          metrics=[hp.Metric(tag) for tag in HPARAM_METRICS])
        hp.hparams(values, trial_id=str(run_dir))


def _write_train_scalars(writer, window, learning_rate, step):
    means = window.means()
    with writer.as_default(step=step):
        for key in ("loss", "margin_loss", "reconstruction_loss", "accuracy", "images_per_sec", "step_time_ms"):
            if key in means:
                tf.summary.scalar(f"train/{key}", means[key])
        tf.summary.scalar("train/learning_rate", learning_rate)


def _write_epoch_summaries(writer, model, test, show_images, tcfg, step, raw_test=None):
    outputs = model(show_images, training=False)  # no labels: masked by the prediction, as at test time
    with writer.as_default(step=step):
        for key in ("loss", "margin_loss", "reconstruction_loss", "accuracy", "images_per_sec"):
            tf.summary.scalar(f"test/{key}", test[key])
        if raw_test is not None:  # train.ema_decay: `test` is the average's, these the trained weights'
            for key in ("loss", "accuracy"):
                tf.summary.scalar(f"test/raw_{key}", raw_test[key])
        n = tcfg["histogram_examples"]
        # The coupling coefficients after the last routing iteration and the class scores.
        tf.summary.histogram("routing/c_ij", outputs["c_ij"][:n])
        tf.summary.histogram("capsules/lengths", outputs["lengths"][:n])
        if "reconstructions" in outputs:
            n = tcfg["num_images"]
            tf.summary.image("reconstructions/inputs_over_reconstructions",
                             image_grid(show_images[:n], outputs["reconstructions"][:n]), max_outputs=1)
    writer.flush()


# --------------------------------------------------------------------------- train

def train(cfg):
    """Train (or resume) the run in cfg["run_dir"]; returns the final metrics (also metrics.json)."""
    # ---- config and setup
    dcfg = _check_config(cfg)
    model_cfg, data_cfg, tcfg = dict(cfg["model"]), dict(cfg["data"]), dict(cfg["train"])
    run_dir = Path(cfg["run_dir"]).expanduser().resolve()
    seed, custom_op = int(cfg["seed"]), cfg["custom_op"]
    if data_cfg.get("dir") is not None:
        # Absolute, so evaluate.py finds the data from any working directory.
        data_cfg["dir"] = str(Path(data_cfg["dir"]).expanduser().resolve())
    latest_dir = run_dir / "checkpoints" / "latest"
    if tf.train.latest_checkpoint(str(latest_dir)):
        _check_resumable(run_dir, {**cfg, "data": data_cfg})  # before the data is read
    # Before anything touches a device: on a CPU-only machine autoclustering needs a
    # TF_XLA_FLAGS flag that TensorFlow reads once, when it sets up its devices.
    set_autoclustering(tcfg["xla"] == "autocluster")
    if cfg.get("deterministic", False):
        tf.config.experimental.enable_op_determinism()
    elif tf_config.is_op_determinism_enabled():
        # A sweep (-m) runs its jobs in one process: a `true` job must not leave it on for the next.
        tf_config.disable_op_determinism()
    # Before the first tensor (multi_worker configures the process's collective ops then);
    # None = one device. Variables made in a scope() are mirrored over the replicas.
    strategy = make_strategy(dcfg)

    def scope():
        return strategy.scope() if strategy is not None else contextlib.nullcontext()

    chief = is_chief(strategy)
    batch_size = int(tcfg["batch_size"])
    if strategy is not None:
        check_global_batch(batch_size, strategy)
        log.info("distribute=%s: %d replicas, global batch %d = %d per replica; this process: %s%s",
                 dcfg["strategy"], strategy.num_replicas_in_sync, batch_size,
                 batch_size // strategy.num_replicas_in_sync, ", ".join(strategy.extended.worker_devices),
                 "" if chief else " (not the chief: writes nothing into the run dir)")
    keras.utils.set_random_seed(seed)  # Python, NumPy and TF seeds: the initial weights
    if custom_op:
        # Each replica runs the op on its own device.
        check_op_library(strategy.extended.worker_devices if strategy is not None else None)
    # The model first: its config errors (model.num_classes=abc) come before the data is read,
    # and check_labels compares the data with the checked values.
    with scope():
        model = build_capsnet(model_cfg, custom_op)
    two_digits = is_overlay(data_cfg["name"])  # MultiMNIST: labels (B, 2) and the digits (B, 2, H, W, C)
    if two_digits and strategy is not None:
        raise ConfigError(f"data.name={data_cfg['name']} trains on one device only: set distribute=none")

    # ---- data (uint8 in memory; make_dataset scales, shuffles and shifts per (seed, epoch);
    # for MultiMNIST make_multimnist_dataset also pairs and overlays the digits)
    train_images, train_labels = load_split(data_cfg["name"], "train", data_dir=data_cfg.get("dir"),
                                            limit=data_cfg.get("limit_train"))
    test_images, test_labels = load_split(data_cfg["name"], "test", data_dir=data_cfg.get("dir"),
                                          limit=data_cfg.get("limit_test"))
    image_shape = example_shape(data_cfg["name"], train_images.shape[1:], data_cfg["shift_pixels"])
    check_labels(train_labels, train_images, model=model, split=f"{data_cfg['name']} train", image_shape=image_shape)
    check_labels(test_labels, test_images, model=model, split=f"{data_cfg['name']} test", image_shape=image_shape)
    steps_per_epoch = math.ceil(len(train_labels) / batch_size)
    augmentation = {"shift_pixels": data_cfg["shift_pixels"], **augmentation_options(data_cfg)}
    # The test split: no augmentation (MultiMNIST: shift_pixels sets its fixed pairs' shifts).
    test_ds = make_split_dataset(data_cfg["name"], test_images, test_labels, batch_size=batch_size,
                                 training=False, shift_pixels=data_cfg["shift_pixels"])
    # A fixed set of test images for the reconstruction grid and the histograms, every epoch
    # (MultiMNIST: the first test pairs, made from the whole test split as in test_ds).
    n_show = min(len(test_labels), max(tcfg["num_images"], tcfg["histogram_examples"]))
    show_images = next(iter(test_ds.unbatch().batch(n_show)))[0]

    # ---- optimizer, checkpoints (new or resumed)
    learning_rate = scaled_learning_rate(tcfg["learning_rate"], batch_size, dcfg["scale_lr"],
                                         dcfg["lr_base_batch_size"])
    if dcfg["scale_lr"] != "none":
        log.info("learning rate %g: train.learning_rate %g scaled (distribute.scale_lr=%s) from batch %d to %d",
                 learning_rate, tcfg["learning_rate"], dcfg["scale_lr"], dcfg["lr_base_batch_size"], batch_size)
    with scope():  # the Keras optimizer keeps the strategy it is made under
        optimizer, schedule = build_optimizer({**tcfg, "learning_rate": learning_rate}, steps_per_epoch, model)
        # The run's test passes, best checkpoint and evaluate.py use the average's weights.
        decay = ema_decay(tcfg)
        average = WeightAverage(model, decay, optimizer.iterations) if decay else None
    epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")  # epochs done
    best_accuracy = tf.Variable(-1.0, dtype=tf.float64, trainable=False, name="best_accuracy")
    checkpoint = tf.train.Checkpoint(model=checkpoint_weights(model), optimizer=optimizer, epoch=epoch,
                                     best_accuracy=best_accuracy,
                                     **({"ema": average.weights()} if average is not None else {}))
    # Only the chief writes into the run dir. The other workers save too, into a scratch
    # dir of their own (deleted at the end), as tf.distribute's multi-worker guide asks:
    # saving may read variables through collectives that every worker must join.
    scratch = None if chief else tempfile.TemporaryDirectory(prefix="capsnet-worker-")
    checkpoints_dir = run_dir / "checkpoints" if chief else Path(scratch.name) / "checkpoints"
    latest = tf.train.CheckpointManager(checkpoint, str(checkpoints_dir / "latest"),
                                        max_to_keep=tcfg["keep_checkpoints"])
    best = _BestCheckpoint(checkpoint, checkpoints_dir / "best")
    history_path = run_dir / "history.jsonl"
    resumed_from = tf.train.latest_checkpoint(str(latest_dir))  # the chief's, on every worker
    if resumed_from:
        try:
            checkpoint.restore(resumed_from).assert_existing_objects_matched()
        except (tf.errors.OpError, ValueError, AssertionError) as exc:
            raise CheckpointError(f"cannot resume from {resumed_from}: "
                                  f"{str(exc).strip().splitlines()[0]}") from exc
        log.info("resumed from %s: %d of %d epochs done, step %d", resumed_from, int(epoch),
                 tcfg["epochs"], _steps_done(optimizer))
    if dcfg["strategy"] == "multi_worker":
        _check_workers_agree(strategy, int(epoch), _steps_done(optimizer))
    best.recover(int(epoch))  # drops a best checkpoint of an epoch that is to be redone
    history = _read_history(history_path, int(epoch))
    if chief:
        run_dir.mkdir(parents=True, exist_ok=True)
        saved_cfg = {**cfg, "run_dir": str(run_dir), "data": data_cfg}
        # Replaced whole (os.replace): other workers may be reading it (_check_resumable).
        temporary = run_dir / "config.yaml.tmp"
        temporary.write_text(yaml.safe_dump(saved_cfg, sort_keys=False))
        os.replace(temporary, run_dir / "config.yaml")

    # ---- TensorBoard: one writer per run dir, so `tensorboard --logdir outputs` lists runs side by side
    writer = tf.summary.create_file_writer(str(run_dir)) if chief else tf.summary.create_noop_writer()
    if chief and not resumed_from:
        _write_hparams(writer, run_dir, cfg, data_cfg)

    # ---- compiled steps (xla=autocluster switches XLA on for the whole process)
    losses = loss_params(tcfg)
    train_step = make_train_step(model, optimizer, input_shape=model.image_shape, losses=losses, xla=tcfg["xla"],
                                 strategy=strategy, two_digits=two_digits, weight_average=average)
    train_steps = make_train_loop(train_step, strategy=strategy)
    steps_per_execution = tcfg["steps_per_execution"]
    eval_step = make_eval_step(model, model.image_shape, jit_compile=tcfg["xla"] == "jit", two_digits=two_digits,
                               **losses)
    num_classes = model.num_classes

    def test_pass(summaries_step=None):
        """(test, raw_test): the test split through eval_step with the run's weights (with a
        weight average, the average's; raw_test then the trained weights', else None);
        with summaries_step, the chief also writes the epoch's test summaries."""
        raw_test = evaluate_model(eval_step, test_ds, num_classes) if average is not None else None
        with average.in_model() if average is not None else contextlib.nullcontext():
            test = evaluate_model(eval_step, test_ds, num_classes)
            if chief and summaries_step is not None:
                _write_epoch_summaries(writer, model, test, show_images, tcfg, summaries_step, raw_test)
        return test, raw_test

    # ---- the loop
    test = None
    interactive = sys.stdout.isatty()
    global_step = _steps_done(optimizer)  # counted on the host: reading the variable would wait for the device
    for epoch_index in range(int(epoch), tcfg["epochs"]):
        print(f"epoch {epoch_index + 1}/{tcfg['epochs']}", flush=True)
        # Interactive: a live bar; in a log file: one line per epoch.
        bar = keras.utils.Progbar(steps_per_epoch, verbose=1 if interactive else 2,
                                  stateful_metrics=["loss", "accuracy", "images/s"]) if tcfg["progress_bar"] else None
        train_ds = make_split_dataset(data_cfg["name"], train_images, train_labels, batch_size=batch_size,
                                      training=True, seed=seed, epoch=epoch_index, **augmentation)
        # On the training devices ahead of the steps (under a strategy: the same global
        # batches, split over the replicas).
        iterator = input_iterator(train_ds, strategy)
        epoch_window, log_window = _Window(), _Window()
        pending = []  # (per-step outputs still on the device, their batch sizes)
        tick = time.perf_counter()
        step_in_epoch = 0
        for length in execution_lengths(steps_per_epoch, global_step, steps_per_execution, tcfg["log_every_steps"]):
            # The global batch of each step: full but for an epoch's last (counted here: under
            # a strategy, a replica's batch holds only its slice of it).
            sizes = [min(batch_size, len(train_labels) - (step_in_epoch + i) * batch_size) for i in range(length)]
            batch_sizes = tf.constant(sizes + [0] * (steps_per_execution - length), tf.int32)
            pending.append((train_steps(iterator, batch_sizes), sizes))
            first = step_in_epoch == 0
            step_in_epoch += length
            global_step += length
            log_now = global_step % tcfg["log_every_steps"] == 0
            last = step_in_epoch == steps_per_epoch
            if not (first or log_now or last or time.perf_counter() - tick > 1.0):
                continue  # no fetch: the host queues the next call while the device runs this one
            # Fetching the values waits for the device, so the clock now measures finished
            # steps. That happens after the epoch's first step (it traces/compiles the steps or
            # refills the shuffle buffer: left out of images/s and step time), at log steps,
            # at the epoch's end and about once a second; not every call, which would make
            # the device idle while the host dispatches the next one.
            fetched = []  # (one step's values, its batch size)
            for out, sizes in pending:
                values = {k: v.numpy() for k, v in out.items()}  # (K,) each: one copy per tensor
                fetched += [({k: float(v[i]) for k, v in values.items()}, size) for i, size in enumerate(sizes)]
            now = time.perf_counter()
            for window in (epoch_window, log_window):
                for values, size in fetched:
                    window.add(values, size)
                if not first:
                    window.add_time(len(fetched), sum(size for _, size in fetched), now - tick)
            pending, tick = [], now
            if log_now:
                # The LR of the next update: the schedule at the step counter.
                _write_train_scalars(writer, log_window, schedule(global_step), global_step)
                log_window = _Window()
            if bar is not None:
                means = epoch_window.means()
                bar.update(step_in_epoch, [("loss", means["loss"]), ("accuracy", means["accuracy"]),
                                           ("images/s", means.get("images_per_sec", float("nan")))])
        assert not pending, "the last step of an epoch is always fetched"
        if log_window.examples:
            _write_train_scalars(writer, log_window, schedule(global_step), global_step)
        train_means = epoch_window.means()

        # Test pass, images and histograms; then the epoch's records, the checkpoint LAST.
        # On every worker (the same weights and data): each decides is_best and saves as the chief does.
        # With a weight average, the test is the average's, and the trained weights' is logged beside it.
        test, raw_test = test_pass(summaries_step=global_step)
        epoch.assign(epoch_index + 1)
        is_best = test["accuracy"] > float(best_accuracy)
        if is_best:
            best_accuracy.assign(test["accuracy"])
        entry = {"epoch": epoch_index + 1, "global_step": global_step,
                 "learning_rate": float(schedule(global_step)),
                 **{f"train_{k}": v for k, v in train_means.items()},
                 **{f"test_{k}": test[k] for k in ("loss", "margin_loss", "reconstruction_loss", "accuracy",
                                                   "images_per_sec")},
                 **({f"test_raw_{k}": raw_test[k] for k in ("loss", "accuracy")} if raw_test is not None else {})}
        history.append(entry)
        if chief:
            with history_path.open("a") as f:
                f.write(json.dumps(entry) + "\n")  # a redone epoch's line supersedes this one (_read_history)
        if is_best:
            best.save(epoch_index + 1)
        # The commit point: until this checkpoint exists, a restart redoes the epoch.
        latest.save(checkpoint_number=epoch_index + 1)
        if is_best:
            best.commit(epoch_index + 1)
        raw = f" (trained weights: {raw_test['accuracy']:.4f})" if raw_test is not None else ""
        print(f"epoch {epoch_index + 1}: train loss {train_means['loss']:.4f} acc {train_means['accuracy']:.4f}"
              f" | test loss {test['loss']:.4f} acc {test['accuracy']:.4f}{raw}"
              f"{' (best)' if is_best else ''}", flush=True)

    # ---- final metrics
    if test is None:
        # Nothing left to train (a finished run rerun): measure the checkpoint as it is.
        test, raw_test = test_pass()
    train_speeds = [h["train_images_per_sec"] for h in history if "train_images_per_sec" in h]
    best_epoch = max(history, key=lambda h: h["test_accuracy"])["epoch"] if history else None
    metrics = {
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "test_margin_loss": test["margin_loss"],
        "test_reconstruction_loss": test["reconstruction_loss"],
        "test_per_class_accuracy": test["per_class_accuracy"],
        "test_raw_accuracy": raw_test["accuracy"] if raw_test is not None else None,  # the trained weights' (EMA on)
        "train_loss": history[-1]["train_loss"] if history else None,
        "train_accuracy": history[-1]["train_accuracy"] if history else None,
        "images_per_sec": float(np.mean(train_speeds)) if train_speeds else None,
        "test_images_per_sec": test["images_per_sec"],
        "best_test_accuracy": float(best_accuracy),
        "best_epoch": best_epoch,
        "epochs": int(epoch),
        "global_step": _steps_done(optimizer),
        "resumed_from": resumed_from,
        "run_dir": str(run_dir),
        "distribute": dcfg["strategy"],
        "replicas": strategy.num_replicas_in_sync if strategy is not None else 1,
        "history": history,
    }
    writer.close()
    if chief:
        (run_dir / "metrics.json").write_text(json.dumps(json_safe(metrics), indent=2) + "\n")
    else:
        scratch.cleanup()
    return metrics
