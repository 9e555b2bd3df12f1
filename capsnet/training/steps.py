"""The compiled steps: what train() and evaluate() run on the device.

- `make_train_step(model, optimizer, input_shape=..., losses=..., xla=...)`: one Adam
  step, with xla none | jit | autocluster (train.xla; the process flags it needs:
  capsnet.training.xla_flags),
  on one device or under a tf.distribute strategy.
- `make_train_loop(train_step)`: train.steps_per_execution steps per compiled call over
  `input_iterator(dataset)` (capsnet.training.distribute: the batches prefetched to the
  device); `execution_lengths` splits an epoch into such calls. (train.data_on_device's
  loop, one XLA program a call: capsnet.training.device_input.)
- `make_eval_step` and `evaluate_model`: the test pass the trainer runs after every
  epoch and evaluate.py runs on a checkpoint, so both report the same numbers.

scripts/benchmark_train.py times these same steps.
"""
import concurrent.futures
import time

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import config as tf_config
from tensorflow.python.framework import ops as tf_ops

from capsnet import config
from capsnet.errors import ConfigError, DataError
from capsnet.losses import capsnet_losses
from capsnet.scoring import correct_predictions, predict, score
from capsnet.tasks.labels import ONE_LABEL
from capsnet.training.distribute import check_compiled_all_reduce_devices, compiled_per_replica
from capsnet.training.optimizer import compile_replica_updates, loss_scale
from capsnet.training.xla_flags import set_autoclustering


# align_trace_names: the uid a compiled program's trace starts from is moved up to a multiple of this.
UID_ALIGNMENT = 1 << 16


def align_trace_names():
    """Move TensorFlow's process-wide uid counter to just past the next multiple of
    UID_ALIGNMENT; call right before tracing a compiled program.

    Why: XLA's persistent cache (train.xla_cache_dir) keys a computation by its HLO, whose
    names carry that counter (`__inference_train_step_9187`, its loops' bodies). A resumed
    run restores its checkpoint first and traced the same steps ~160 uids later than the
    fresh run that filled the cache (9350), so it never found them and compiled again: ~50 s
    of every resumed call of a MultiMNIST run on an H100. Aligned, a resumed call's first
    epoch took 6.6-6.9 s against a fresh call's 31.1 s on an H200 (docs/benchmarks.md).
    From an aligned counter the same program gets the same names
    whatever ran before it, unless a multiple falls between the two starts (for 160 uids,
    1 time in 400: then it compiles, as before).
    Costs at most UID_ALIGNMENT counter steps (~10 ms)."""
    while tf_ops.uid() % UID_ALIGNMENT:
        pass


def set_determinism(enabled):
    """Deterministic ops (the config's `deterministic`) on or off for this PROCESS."""
    if enabled:
        tf.config.experimental.enable_op_determinism()
    elif tf_config.is_op_determinism_enabled():
        # A sweep (-m) runs its jobs in one process: a `true` job must not leave it on for the next.
        tf_config.disable_op_determinism()


def make_train_step(model, optimizer, *, input_shape, losses, xla="none", strategy=None, all_reduce="collective",
                    label_format=ONE_LABEL, weight_average=None, guard=True, examples=None):
    """The compiled training step: (images, labels) → {loss, margin_loss, reconstruction_loss, accuracy,
    grad_norm} (STEP_VALUES).

    One Adam step on the mean total loss of the batch; the returned values are batch
    means (tensors still on the device: reading one waits for the step), and grad_norm
    the global norm of the step's gradients: make_train_loop's values stop at the first
    step whose loss or grad_norm is not finite (the non-finite guard), so a step kind that
    skips bad updates itself (a loss-scaling optimizer) should still report them here.

    Args:
        model: a CapsNet (its routing mode decides whether jit is allowed: config.check_xla).
        optimizer: a built Keras optimizer (build_optimizer).
        input_shape: image shape (H, W, C); the batch size may vary between calls.
        losses: capsnet_losses' keyword arguments (loss_params(train_cfg)).
        xla: "none"; "jit" compiles the whole step with XLA (tf.function(jit_compile=True));
            with custom_op the compiled ops run inside it as XLA custom calls of our kernels
            (ops/xla_kernels.cc); "autocluster" turns on XLA autoclustering for the process
            (set_autoclustering), so XLA compiles clusters of plain TF ops around the custom
            op. "none" and "jit" turn autoclustering off: the last step made decides.
        strategy: None (one device), or the tf.distribute strategy that `model` and
            `optimizer` were built under: the step is then
            (per-replica images, per-replica labels, global batch size) → the same dict,
            means over the global batch (_make_distributed_train_step).
        all_reduce: the run's distribute.all_reduce, resolved (distribute.resolve_all_reduce):
            "xla" (with xla="jit") compiles each replica's all-reduce and Adam update into its
            step (_all_reduce_in_compiled_step); any other value is the strategy's own all-reduce.
        label_format: the task's (capsnet.tasks.labels): the step takes its step_signature.
            MultiMNIST's TWO_DIGITS (one device only: its batches carry targets): (images,
            labels (B, 2), digits (B, 2, H, W, C)); the margin loss counts both classes
            present, the decoder reconstructs each digit from its own capsule against its
            own image (the reconstruction loss sums the two), and accuracy counts an example
            right iff the two longest capsules are its two labels.
        weight_average: a WeightAverage of `model` (train.ema_decay), updated after each
            step; None: none kept.
        guard: False leaves out what the non-finite guard costs the step (the gradients'
            global norm: grad_norm is then 0), only to measure that cost
            (scripts/benchmark_train.py --guard); train() always guards.
        examples: under a strategy, what makes a replica's (images, labels) of the step's
            per-replica inputs, in replica context, inside the replica's compiled step:
            train.data_on_device's MirroredTrainingSet.examples (its inputs: the epoch's draws
            and the replica's positions in it). None: the inputs are (images, labels).
    """
    if xla not in config.XLA_MODES:
        raise ValueError(f"make_train_step: xla must be one of {', '.join(config.XLA_MODES)}, got {xla!r}")
    # What config.check refuses, for a model built without a config (the rule's words).
    if hasattr(model, "router"):  # (a CNN baseline has none: nothing routes)
        config.check_xla(xla, model.router.backend)
    set_autoclustering(xla == "autocluster")
    if strategy is not None:
        if label_format.targets:
            raise ConfigError("data with reconstruction targets (MultiMNIST's digits) trains on one device only: "
                              "set distribute=none")
        if not guard:
            raise ValueError("make_train_step: guard=False is for one device only")
        config.check_all_reduce_in_step(all_reduce, xla, loss_scale(optimizer) is not None)
        return _make_distributed_train_step(model, optimizer, losses=losses, xla=xla, strategy=strategy,
                                            all_reduce=all_reduce, weight_average=weight_average, examples=examples)
    signature = label_format.step_signature(input_shape)

    # autograph=False: the step and the model have no Python control flow over tensors, and
    # converting the ~25 functions they call cost ~2.7 s of every run's start (CPU, measured).
    @tf.function(input_signature=signature, jit_compile=xla == "jit", autograph=False)
    def train_step(images, labels, digits=None):
        with tf.GradientTape() as tape:
            # Labels mask the decoder input: reconstruct the TRUE class(es) in training;
            # two labels: each digit from its own capsule, against its own image (digits).
            outputs = model(images, labels=labels, training=True)
            total, margin, reconstruction = model_losses(images, labels, outputs, **losses,
                                                           targets=digits)  # (B,) each
            loss = tf.reduce_mean(total)
            # × the loss scale under mixed_float16 (a LossScaleOptimizer, which divides the
            # gradients back), else × 1.
            scaled_loss = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled_loss, model.trainable_variables)
        # Before apply: that may change the scale.
        grad_norm = gradient_norm(grads, optimizer) if guard else tf.zeros((), tf.float32)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if weight_average is not None:
            weight_average.update()
        predictions = predict(outputs["lengths"], labels)  # (B,), two labels: (B, 2)
        return {
            "loss": loss,
            "margin_loss": tf.reduce_mean(margin),
            "reconstruction_loss": tf.reduce_mean(reconstruction),
            "accuracy": tf.reduce_mean(correct_predictions(predictions, labels)),
            "grad_norm": grad_norm,  # the non-finite guard's (make_train_loop)
        }

    return train_step


def model_losses(images, labels, outputs, *, m_plus, m_minus, lambda_, reconstruction_weight, targets=None):
    """The per-example loss of a model's outputs: (total, class term, reconstruction), each (batch,).

    A CapsNet's: capsnet_losses (margin + reconstruction_weight · reconstruction). A model with
    "logits" (the CNN baseline, capsnet.baseline): softmax cross-entropy, in the class term's
    place (the steps' margin_loss value, so history and TensorBoard keep one set of keys),
    and a zero reconstruction term; the margin arguments are unread.
    """
    if "logits" not in outputs:
        return capsnet_losses(images, labels, outputs, m_plus=m_plus, m_minus=m_minus, lambda_=lambda_,
                              reconstruction_weight=reconstruction_weight, targets=targets)
    cross_entropy = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=outputs["logits"])  # (B,)
    return cross_entropy, cross_entropy, tf.zeros_like(cross_entropy)


def gradient_norm(grads, optimizer):
    """The global norm of the loss's gradients, what the non-finite guard checks.

    mixed_float16 (a LossScaleOptimizer): `grads` are the scaled loss's; their norm is
    divided by the scale. A step whose scaled gradients overflowed is not a divergence:
    the optimizer skips it and halves the scale (capsnet.training.optimizer), so its norm
    counts as 0; a non-finite loss still stops the run.

    One reduction over the gradients laid end to end, not tf.linalg.global_norm's one per
    variable and a sum, so that inside an XLA step the concatenation can fuse into one
    reduction kernel instead of ~20 (a prediction, not timed apart; the guard's measured
    cost: docs/benchmarks.md).
    """
    flat = [tf.reshape(tf.cast(g.values if isinstance(g, tf.IndexedSlices) else g, tf.float32), [-1])
            for g in grads if g is not None]
    norm = tf.sqrt(tf.reduce_sum(tf.square(tf.concat(flat, axis=0))))
    scale = loss_scale(optimizer)
    if scale is None:
        return norm
    return tf.where(tf.math.is_finite(norm), norm / tf.cast(scale, norm.dtype), tf.zeros_like(norm))


def overflow_on_every_replica(grads, finite):
    """A replica's gradients, made non-finite when any replica's are (in replica context;
    `finite`: whether this replica's are, a boolean scalar).

    Keras' LossScaleOptimizer under a strategy decides between applying a step and
    skipping it (an overflow: the scale halves) on the FIRST replica's gradients alone,
    taking them to be all-reduced already, which they are not yet: an overflow on another
    replica alone was applied and every weight became NaN (mirrored, two CPU devices;
    tests/test_distribute.py), or, under multi_worker, left the workers hung in the
    all-reduce the overflowed one skipped (seen in review). So the replicas agree first (one boolean
    a replica a step): if any overflowed, every replica's gradients become NaN and the
    optimizer skips the step on all of them, as on one device.
    """
    context = tf.distribute.get_replica_context()
    if isinstance(context.strategy, tf.distribute.MultiWorkerMirroredStrategy):
        # Replicas on other workers too: a collective (one training per process here; under
        # mirrored a collective fell out of step with the gradients' when a second strategy
        # trained in the same process: the test fixture, a -m sweep).
        everywhere = context.all_reduce(tf.distribute.ReduceOp.SUM, 1.0 - tf.cast(finite, tf.float32)) == 0
    else:  # the local replicas' flags, read in cross-replica context: no collective
        everywhere = context.merge_call(
            lambda strategy, finite: tf.reduce_all(tf.stack(strategy.experimental_local_results(finite))),
            args=(finite,))
    # Dense (an IndexedSlices has no `* nan`); tf.cond returns tensors, not None.
    present = [tf.convert_to_tensor(g) for g in grads if g is not None]
    agreed = iter(tf.cond(everywhere, lambda: present, lambda: [g * float("nan") for g in present]))
    return [None if g is None else next(agreed) for g in grads]


# The sums each replica returns, in this order (stacked, so one all-reduce carries them).
_STEP_SUMS = ("loss", "margin_loss", "reconstruction_loss", "accuracy")
# What every train step returns (both kinds), per step: the batch means of _STEP_SUMS and
# grad_norm, which with the loss is what the non-finite guard checks (make_train_loop).
STEP_VALUES = (*_STEP_SUMS, "grad_norm")


def _all_reduce_in_compiled_step(forward_backward, model, optimizer, strategy):
    """distribute.all_reduce=xla: one replica's whole step — forward, backward, the
    gradients' all-reduce and Adam's update of its own copy of every variable — as ONE XLA
    computation, for strategy.run in replica context: (the step's inputs, global batch size)
    → (sums, grad_norm), forward_backward's.

    MirroredStrategy lowers an all-reduce inside an XLA function over GPUs to a
    CollectiveReduceV2 that XLA compiles (an XLA all-reduce over NCCL, launched by the
    compiled step itself) instead of a merge of the replicas' threads. So the host launches
    one program a replica a step, where the other modes launch three (forward and backward,
    TensorFlow's NCCL all-reduce between them, the update) and wait at the all-reduce for
    every replica's gradients. XLA compiles no collective for a CPU device: several CPU
    replicas are refused (ConfigError), as is multi_worker (a replica id there counts every
    worker's replicas, the copies here are this process's); with one replica the all-reduce
    is the identity. A weight average (train.ema_decay) is updated after this program, by
    the caller.

    Adam's update here is Keras' own `update_step` on this replica's copies, with the
    learning rate from its step counter, then the counter +1: what Keras' apply does for an
    optimizer without gradient clipping, weight decay, EMA, gradient accumulation or loss
    scaling, which is refused otherwise rather than silently left out. Each replica gets its
    own compiled function (traced on its device, capturing its own copies).
    """
    check_compiled_all_reduce_devices(strategy)  # (train.xla and loss scaling: make_train_step's check)
    extras = [name for name in ("clipnorm", "clipvalue", "global_clipnorm", "weight_decay",
                                "gradient_accumulation_steps", "use_ema", "loss_scale_factor")
              if getattr(optimizer, name, None)]
    if extras:
        raise ConfigError(f"distribute.all_reduce=xla applies plain Adam updates; this optimizer also has "
                          f"{', '.join(extras)}: use distribute.all_reduce=collective")

    def step_of(replica):
        # This replica's copies (variables read through a MirroredVariable in replica
        # context are these too; writing them through it would aggregate).
        local = [strategy.experimental_local_results(v.value)[replica] for v in model.trainable_variables]
        counter = strategy.experimental_local_results(optimizer.iterations.value)[replica]

        def step(inputs, global_batch_size):
            grads, sums, grad_norm, _ = forward_backward(inputs, global_batch_size)
            present = [(g, v) for g, v in zip(grads, local) if g is not None]
            summed = [g for g, _ in present]
            if strategy.num_replicas_in_sync > 1:  # (one replica: nothing to sum, and no GPU needed)
                summed = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, summed)
            learning_rate = optimizer.learning_rate  # lr(step counter), read before the update
            for grad, (_, variable) in zip(summed, present):
                optimizer.update_step(grad, variable, learning_rate)
            counter.assign_add(1)
            return sums, grad_norm

        return step

    return compiled_per_replica(step_of)


def _make_distributed_train_step(model, optimizer, *, losses, xla, strategy, all_reduce="collective",
                                 weight_average=None, examples=None):
    """make_train_step under a strategy: strategy.run of one replica's step on its slice
    of the global batch, then the batch means over all replicas (and workers).

    The returned function takes the per-replica images and labels of a distributed
    dataset (distribute_dataset), or with `examples` the per-replica inputs it takes, and
    the global batch size of the step (an int; the last batch of an epoch may be short, so
    it is passed rather than assumed).
    """

    scaled = loss_scale(optimizer) is not None

    def forward_backward(inputs, global_batch_size):
        # train.data_on_device: the replica's slice gathered here, inside its compiled pass.
        images, labels = inputs if examples is None else examples(*inputs)
        with tf.GradientTape() as tape:
            # Labels mask the decoder input: reconstruct the TRUE class in training.
            outputs = model(images, labels=labels, training=True)
            total, margin, reconstruction = model_losses(images, labels, outputs, **losses)  # (b,) each
            # This replica's share of the GLOBAL batch mean: the sum of its per-example totals
            # (margin + weighted reconstruction) over the global batch size. The optimizer sums
            # the replicas' gradients (an all-reduce), which makes the gradient of the mean
            # over the whole batch, as on one device. A per-replica mean would weigh the
            # examples of a short last batch's unequal slices unequally.
            loss = tf.nn.compute_average_loss(total, global_batch_size=global_batch_size)
            scaled_loss = optimizer.scale_loss(loss)  # mixed_float16: × the loss scale
        grads = tape.gradient(scaled_loss, model.trainable_variables)
        correct = tf.reduce_sum(correct_predictions(predict(outputs["lengths"], labels), labels))
        sums = tf.stack([tf.reduce_sum(total), tf.reduce_sum(margin), tf.reduce_sum(reconstruction), correct])  # (4,)
        # Under loss scaling, whether this replica's gradients are finite (the overflow test),
        # here so that under jit it is part of the compiled pass, not ~2 kernels a variable after.
        finite = (tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads if g is not None])
                  if scaled else tf.constant(True))
        return grads, sums, gradient_norm(grads, optimizer), finite

    if all_reduce == "xla":
        # (inputs, global batch size) → (sums, grad_norm), the update included.
        train_replica = _all_reduce_in_compiled_step(forward_backward, model, optimizer, strategy)
    else:
        if xla == "jit":
            # With TensorFlow's all-reduce (collective, nccl, one_device) the gradient
            # all-reduce is a cross-replica step (a merge of the replicas' threads), outside
            # any XLA function. So XLA compiles each replica's forward and backward pass, and,
            # after the all-reduce, each device's Adam update (compile_replica_updates).
            # distribute.all_reduce=xla puts all three into one compiled step
            # (_all_reduce_in_compiled_step).
            forward_backward = tf.function(forward_backward, jit_compile=True, autograph=False)
            compile_replica_updates(optimizer)

        def train_replica(inputs, global_batch_size):
            grads, sums, grad_norm, finite = forward_backward(inputs, global_batch_size)
            if scaled:
                grads = overflow_on_every_replica(grads, finite)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return sums, grad_norm

    def replica_step(inputs, global_batch_size):
        sums, grad_norm = train_replica(inputs, global_batch_size)
        if weight_average is not None:
            weight_average.update()
        return sums, grad_norm

    # reduce_retracing: a short last batch changes the per-replica shapes; the second
    # trace generalises the batch dimension, so there is no third.
    @tf.function(reduce_retracing=True, autograph=False)  # as make_train_step's
    def distributed_step(inputs, global_batch_size):
        sums, grad_norms = strategy.run(replica_step, args=(inputs, global_batch_size))
        means = strategy.reduce(tf.distribute.ReduceOp.SUM, sums, axis=None) / tf.cast(global_batch_size, tf.float32)
        # The sum of the replicas' norms of their own gradients (before the all-reduce): an
        # upper bound of the global norm that is not finite iff one replica's gradients are not.
        grad_norm = strategy.reduce(tf.distribute.ReduceOp.SUM, grad_norms, axis=None)
        return {**dict(zip(_STEP_SUMS, tf.unstack(means))), "grad_norm": grad_norm}

    def train_step(*inputs_and_global_batch_size):
        *inputs, global_batch_size = inputs_and_global_batch_size  # (images, labels, size) without `examples`
        # A tensor, not a Python int: an int would trace the step once per distinct value.
        return distributed_step(tuple(inputs), tf.convert_to_tensor(global_batch_size, tf.int32))

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

    The non-finite guard: the values returned stop at the first step whose loss or
    grad_norm is not finite (that step included: fewer than K values, or K whose last is
    not finite); the host sees it when it fetches them (epoch.train_epoch's _fetch), and
    train() stops without saving. The loop itself runs all K steps: its condition reads
    nothing the device computes, so the host never waits for a step to finish before
    dispatching the next one. (A loop that stopped at the bad step needs its finiteness
    on the host each iteration, a device-to-host copy per step: on an H100 that cost the
    jit step 6.3% at batch 128 when it read step i's, 2.7% when it read step i - 1's;
    docs/benchmarks.md.) The steps after a bad one run on diverged weights that nobody
    keeps, at most K - 1 of them, as the calls already queued behind it do.
    """
    names = STEP_VALUES  # the keys of both step kinds' outputs

    # autograph=False, the loop written as the tf.while_loop AutoGraph made of `for i in
    # tf.range(count)`: converting it cost ~0.45 s of the first call (2-core CPU, measured).
    @tf.function(autograph=False)
    def train_steps(iterator, batch_sizes):
        count = tf.math.count_nonzero(batch_sizes, dtype=tf.int32)

        def step(i, values):
            batch = next(iterator)  # (images, labels) or (images, labels, digits)
            out = train_step(*batch) if strategy is None else train_step(*batch, batch_sizes[i])
            return i + 1, {name: values[name].write(i, tf.cast(out[name], tf.float32)) for name in names}

        empty = {name: tf.TensorArray(tf.float32, size=count) for name in names}
        _, values = tf.while_loop(lambda i, _: i < count, step, (tf.constant(0), empty))
        stacked = {name: values[name].stack() for name in names}  # (K,) each
        ran = steps_until_non_finite(stacked, count)
        return {name: value[:ran] for name, value in stacked.items()}

    return train_steps


def steps_until_non_finite(values, count):
    """How many of the `count` steps of per-step `values` ({name: (≥ count,)}, STEP_VALUES)
    a train loop returns: up to and including the first whose loss or grad_norm is not
    finite, else all (an int32 scalar tensor: the non-finite guard's cut)."""
    bad = tf.math.logical_not(tf.math.logical_and(tf.math.is_finite(values["loss"][:count]),
                                                  tf.math.is_finite(values["grad_norm"][:count])))
    return tf.where(tf.reduce_any(bad), tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int32) + 1, count)


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
        length = 1 if done == 0 else next_execution_length(steps_per_epoch - done, start_step + done,
                                                           steps_per_execution, log_every_steps)
        lengths.append(length)
        done += length
    return lengths


def next_execution_length(remaining, start_step, steps_per_execution, log_every_steps):
    """The steps of a train_steps call after an epoch's first (execution_lengths' rule):
    steps_per_execution at most, ending at the epoch's end (`remaining` steps left) or at
    the next log step (`start_step`: the global step before the call)."""
    return min(steps_per_execution, remaining, log_every_steps - start_step % log_every_steps)


# --------------------------------------------------------------------------- test pass

def eval_batch_size(train_cfg):
    """The test pass's batch of a run's `train` section: train.test_batch_size, else (null,
    or a run saved before the key existed) train.batch_size."""
    return train_cfg.get("test_batch_size") or train_cfg["batch_size"]


def make_eval_step(model, image_shape, *, m_plus, m_minus, lambda_, reconstruction_weight, jit_compile=False,
                   label_format=ONE_LABEL):
    """A compiled test step: sums of the losses, predictions, capsule lengths.

    No labels go into the model, so the decoder reconstructs from the PREDICTED
    class, as at test time in the paper; the reconstruction loss is measured on that.
    jit_compile=True compiles the step with XLA (train.xla=jit; the compiled ops lower to
    XLA custom calls of our kernels, ops/xla_kernels.cc).
    label_format: the task's (capsnet.tasks.labels): the step takes its step_signature, and
    its test_outputs are what is scored. MultiMNIST's TWO_DIGITS: (images, labels (B, 2),
    digits (B, 2, H, W, C)); the two longest capsules are the prediction, each reconstructs
    one digit (in the labels' order where it names one) and is compared with that digit.
    """
    signature = label_format.step_signature(image_shape)

    @tf.function(input_signature=signature, jit_compile=jit_compile, autograph=False)  # as train_step
    def eval_step(images, labels, digits=None):
        outputs = model(images, training=False)
        predictions = predict(outputs["lengths"], labels)  # (B,) or (B, 2)
        outputs = label_format.test_outputs(model, outputs, predictions, labels)
        total, margin, reconstruction = model_losses(
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


def compile_eval_step(eval_step, element_spec, batch_sizes):
    """Start compiling `eval_step` (make_eval_step's, with jit_compile=True) for each of
    `batch_sizes` in a thread of its own, by calling it on zeros shaped as `element_spec`'s
    batches; returns the thread's future. A test step takes the weights as they are and
    changes nothing, so the call's only effect is XLA's compiled program for that shape,
    which the test pass then finds. Why: XLA compiles at the first call, and the first test
    pass waited for it (6 s of fast_mnist's cold start on an H200, beside 22 s for the first
    train step), while the compilation can run beside the first epoch's steps.
    An error of the call is left to the test pass, which makes the same call alone."""
    zeros = [[tf.zeros([size, *spec.shape[1:]], spec.dtype) for spec in element_spec] for size in batch_sizes]

    def compile_all():
        for inputs in zeros:
            try:
                eval_step(*inputs)
            except tf.errors.OpError:
                return

    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="capsnet-compile")
    future = executor.submit(compile_all)
    executor.shutdown(wait=False)
    return future


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
    losses = ("loss", "margin_loss", "reconstruction_loss")
    keys = ("predictions", *losses) + (("lengths",) if keep_lengths else ())
    all_labels, outputs, start = [], [], None
    for batch, inputs in enumerate(dataset):
        # Queued without reading: a read per batch would leave the device idle while the host
        # dispatches the next one. Only the first batch (tracing/compiling the step) is
        # waited for, so that the clock leaves it out.
        out = eval_step(*inputs)
        outputs.append({key: out[key] for key in keys})
        all_labels.append(inputs[1].numpy())
        if batch == 0:
            out["loss"].numpy()
            start = time.perf_counter()
    fetched = [{key: value.numpy() for key, value in out.items()} for out in outputs]  # waits for the last
    timed_seconds = time.perf_counter() - start if start is not None else 0.0
    timed_images = sum(len(labels) for labels in all_labels[1:])
    sums = {key: sum(float(out[key]) for out in fetched) for key in losses}
    all_predictions = [out["predictions"] for out in fetched]
    all_lengths = [out["lengths"] for out in fetched] if keep_lengths else []
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
