"""train.data_on_device: the training split in device memory, each step's batch gathered
and augmented there, and a call's steps one XLA program (`make_device_train_loop`).

Why: fed by tf.data (make_train_loop), each step's batch is copied to the GPU, and the copy
queues behind the compute already there; at batch 512 the GPU waited ~0.7 ms of a 6 ms step
between kernels, most of it before such copies (docs/benchmarks.md; what the input's
share is was not settled there). Here no step copies anything: the batch is gathered from
device memory inside the step. Measured: +7 to +16% (docs/benchmarks.md). The host still
launches every step's ~90 kernels (XLA's own loop), which is why an XLA loop over batches
stacked by TensorFlow ops (2d1cd98, reverted) gained nothing at batch 128. A loop whose length is a value of the call also
reads each iteration's condition on the host (a copy and a wait); the longest call an
epoch makes (steps_per_execution steps, or fewer: make_device_train_loop's static_steps)
runs a program of that constant length instead, which need not: +5 to +8% at batch 128,
nothing measurable at 512 (docs/benchmarks.md).

The batches are make_dataset's, bit for bit: the same per-epoch draws
(capsnet.data.epoch_draws: the order, flips, shifts, erased boxes, the elastic noise's
seed, drawn on the host once an epoch and copied to the device, 8-64 bytes an example)
and the same batch_from_draws, here inside the step. The elastic noise itself (H·W·2
floats an example) is drawn there too, from the seed and the example's index, bit for
bit; the distortion's convolutions and sums, compiled by XLA, round apart from
TensorFlow's kernels (within 1e-5; tests/test_device_input.py). MultiMNIST's pairs
(DevicePairSet) likewise: multimnist_draws on the host, pairs_from_draws in the step, the
same pairs as make_multimnist_dataset's. What the mode needs (one device or
distribute=mirrored, train.xla=jit, no per-example augmentation: rotation and zoom) is
config.check_data_on_device's.

Under distribute=mirrored (MirroredTrainingSet): every replica holds the split on its own
device, an epoch's draws are made once on the host and copied to each, and each replica
gathers its slice of every global batch inside its compiled step (make_train_step's
`examples`), the slice distribute_dataset gives it of make_dataset's batch; the gradients'
all-reduce is the mirrored step's. A call's steps are then a TensorFlow loop over that
step (strategy.run is not an XLA op), each step one XLA program a replica where
distribute.all_reduce=xla compiles the all-reduce into it, else the step's programs with
TensorFlow's all-reduce between them. (A call as one XLA program a replica would put
that all-reduce inside an XLA while loop, which XLA compiles for GPUs only, and which has
not been run on a GPU yet.)
"""
import itertools

import numpy as np
import tensorflow as tf

from capsnet.config import AUGMENTATION_OFF, PER_EXAMPLE_AUGMENTATION
from capsnet.data.multimnist import check_pair_elastic, check_pair_shifts, multimnist_draws, pairs_from_draws
from capsnet.data.pipeline import batch_from_draws, epoch_draws, uint8_levels
from capsnet.errors import ConfigError
from capsnet.training.distribute import check_global_batch
from capsnet.training.steps import STEP_VALUES, steps_until_non_finite
from capsnet.validation import integer


def training_device():
    """Where a one-device run's variables live by default: the first GPU, else the CPU."""
    return "/GPU:0" if tf.config.list_logical_devices("GPU") else "/CPU:0"


class DeviceTrainingSet:
    """The training split on `device` (images uint8 (N, H, W, C), labels (N,)), copied once,
    with what make_dataset takes besides (batch_size, seed, shift_pixels and its augmentation
    keywords, the per-example ones off: config.check_data_on_device).

    `epoch(index)` → that epoch's DeviceEpoch; `batch(draws, step, size)` → the epoch's
    batch number `step` (of `size` examples: the last one may be short), as make_dataset
    batches it, for use inside a compiled step."""

    def __init__(self, images, labels, *, batch_size, seed, shift_pixels, flip=False, shift_fill="zero",
                 elastic_alpha=0.0, elastic_sigma=4.0, erase_probability=0.0, erase_max_area=0.4, device=None,
                 **per_example):
        unknown = sorted(set(per_example) - set(AUGMENTATION_OFF))
        if unknown:
            raise TypeError(f"DeviceTrainingSet: unknown augmentation argument(s) {', '.join(unknown)}")
        on = [f"data.{key}={per_example[key]}" for key in PER_EXAMPLE_AUGMENTATION if per_example.get(key)]
        if on:  # config.check_data_on_device's rule, for a caller without a config
            raise ConfigError(f"train.data_on_device=true augments whole batches on the device (flip, shift, "
                              f"elastic, erase); {', '.join(on)} runs per example in tf.data")
        self.batch_size, self.seed, self.shape = int(batch_size), int(seed), images.shape
        # make_dataset's check (the range is the image's), as the same config key.
        self.shift_pixels = integer("data.shift_pixels", shift_pixels, minimum=0, maximum=min(images.shape[1:3]) - 1,
                                    error=ConfigError)
        self.shift_fill = shift_fill
        self.elastic = {"elastic_alpha": float(elastic_alpha), "elastic_sigma": float(elastic_sigma)}
        self.augmentation = {"shift_pixels": self.shift_pixels, "flip": bool(flip),
                             "erase_probability": float(erase_probability), "erase_max_area": float(erase_max_area),
                             "elastic": elastic_alpha > 0}
        self.device = device or training_device()
        with tf.device(self.device):
            self.images = tf.identity(tf.constant(images))
            self.labels = tf.identity(tf.constant(np.asarray(labels, np.int64)))  # int64: _on_device says why
            self.levels = tf.identity(tf.constant(uint8_levels()))  # the pixel values (batch_from_draws: why)

    def epoch(self, index):
        """Epoch `index`'s draws (epoch_draws', keyed by (seed, index)) on the device."""
        return DeviceEpoch(self.on_device(self.host_draws(index)))

    def host_draws(self, index):
        """Epoch `index`'s draws where they are drawn (the host), before on_device."""
        return self._draws(index, self.shape)

    def on_device(self, draws):
        with tf.device(self.device):
            return {key: tf.identity(tf.cast(value, _on_device(value.dtype))) for key, value in draws.items()}

    def draws_signature(self):
        """The TensorSpecs of an epoch's draws (DeviceEpoch.draws), what epoch() makes: those
        of one example's draws, for N examples."""
        one = self._draws(0, (1, *self.shape[1:]))
        return {key: tf.TensorSpec([self.shape[0], *value.shape[1:]], _on_device(value.dtype))
                for key, value in one.items()}

    def _draws(self, index, shape):
        with tf.device("/CPU:0"):  # drawn where make_dataset draws them: the same kernels
            return epoch_draws(shape, training=True, seed=self.seed, epoch=index, **self.augmentation)

    def batch(self, draws, step, size):
        """(images float32 (size, H, W, C), labels int32 (size,)): the examples at positions
        step · batch_size ... + size of the epoch (`draws`: DeviceEpoch.draws)."""
        return self.examples(draws, tf.cast(step, tf.int64) * self.batch_size + tf.range(size, dtype=tf.int64))

    def examples(self, draws, positions):
        """`batch`'s (images, labels) of the examples at `positions` (int64) of the epoch."""
        picked = {key: tf.gather(value, positions) for key, value in draws.items()}
        images, labels = batch_from_draws(self.images, self.labels, picked, shift_pixels=self.shift_pixels,
                                          shift_fill=self.shift_fill, levels=self.levels, **self.elastic)
        return images, tf.cast(labels, tf.int32)


class MirroredTrainingSet:
    """train.data_on_device under a MirroredStrategy: a DeviceTrainingSet (its keywords) on
    every replica's device, the split copied to each once.

    `epoch(index)` → a DeviceEpoch whose draws are per-replica values: drawn once on the
    host (DeviceTrainingSet.host_draws), copied to every replica. In replica context,
    `positions(step, size)` → the replica's positions in global batch `step` of `size`
    examples, and `examples(draws, positions)` → its (images, labels), gathered from its own
    device's copy: make_train_step's `examples`. Replica r of R takes the examples
    [r·c, min((r + 1)·c, size)) of the batch, c = ⌈size / R⌉: distribute_dataset's split of
    make_dataset's batch (a full batch in R equal slices, check_global_batch; a short last
    batch of 5 over 2 replicas: 3 and 2, of 1: 1 and none), so the replicas train on the
    examples they would with the tf.data pipeline."""

    def __init__(self, strategy, images, labels, **keywords):
        if not isinstance(strategy, tf.distribute.MirroredStrategy):  # replica ids here are this process's
            raise ConfigError(f"train.data_on_device=true trains on the devices of one machine: distribute=none or "
                              f"mirrored, not {type(strategy).__name__}")
        check_global_batch(int(keywords["batch_size"]), strategy)
        self.strategy, self.replicas = strategy, strategy.num_replicas_in_sync
        self.sets = [DeviceTrainingSet(images, labels, device=device, **keywords)
                     for device in strategy.extended.worker_devices]
        self.batch_size, self.shape = self.sets[0].batch_size, self.sets[0].shape

    def epoch(self, index):
        draws = self.sets[0].host_draws(index)
        copies = [training_set.on_device(draws) for training_set in self.sets]
        return DeviceEpoch(self.strategy.experimental_distribute_values_from_function(
            lambda context: copies[context.replica_id_in_sync_group]))

    def positions(self, step, size):
        share = -(-size // self.replicas)
        start = min(_replica() * share, size)
        return (tf.cast(step, tf.int64) * self.batch_size + start
                + tf.range(min(share, size - start), dtype=tf.int64))

    def examples(self, draws, positions):
        # The replica's own copy: one on another device would be copied over at every step.
        return self.sets[_replica()].examples(draws, positions)


def _replica():
    """The replica whose step is being traced (a constant under MirroredStrategy)."""
    return int(tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group))


class DevicePairSet:
    """DeviceTrainingSet's twin for MultiMNIST: the base digits on `device` (images uint8
    (N, H, W, C), labels (N,)); each epoch's pairs drawn on the host (multimnist_draws;
    48 bytes a pair there) and the batch paired, shifted and overlaid inside the step
    (pairs_from_draws): `batch` → make_multimnist_dataset's batch, (images float32
    (size, H', W', C), labels int32 (size, 2), digits float32 (size, 2, H', W', C)), each
    digit elastically distorted first if elastic_alpha > 0 (its noise drawn in the step)."""

    def __init__(self, images, labels, *, batch_size, seed, shift_pixels, pad_pixels=None, elastic_alpha=0.0,
                 elastic_sigma=4.0, device=None):
        self.batch_size, self.seed, self.shape = int(batch_size), int(seed), images.shape
        self.shift_pixels, self.pad_pixels = check_pair_shifts(shift_pixels, pad_pixels)
        self.elastic = check_pair_elastic(elastic_alpha, elastic_sigma)
        self.host_labels = np.asarray(labels)
        self.device = device or training_device()
        with tf.device(self.device):
            self.images = tf.identity(tf.constant(images))
            self.labels = tf.identity(tf.constant(self.host_labels.astype(np.int64)))  # int64: _on_device says why
            self.levels = tf.identity(tf.constant(uint8_levels()))
        self._signature = None

    def epoch(self, index):
        with tf.device(self.device):
            return DeviceEpoch({key: tf.identity(tf.cast(value, _on_device(value.dtype)))
                                for key, value in self._draws(index).items()})

    def draws_signature(self):
        if self._signature is None:  # an epoch's draws have the same specs every epoch
            self._signature = {key: tf.TensorSpec(value.shape, _on_device(value.dtype))
                               for key, value in self._draws(0).items()}
        return self._signature

    def _draws(self, index):
        with tf.device("/CPU:0"):
            return multimnist_draws(self.host_labels, training=True, seed=self.seed, epoch=index,
                                    shift_pixels=self.shift_pixels, elastic=self.elastic["elastic_alpha"] > 0)

    def batch(self, draws, step, size):
        positions = tf.cast(step, tf.int64) * self.batch_size + tf.range(size, dtype=tf.int64)
        picked = {key: tf.gather(value, positions) for key, value in draws.items()}
        images, labels, digits = pairs_from_draws(self.images, self.labels, picked, shift_pixels=self.shift_pixels,
                                                  pad_pixels=self.pad_pixels, levels=self.levels, **self.elastic)
        return images, tf.cast(labels, tf.int32), digits


def _on_device(dtype):
    # An int32 tensor "on a GPU" is kept in host memory by TensorFlow, and would be copied
    # to the device at every call: int64 there (batch_from_draws takes either).
    return tf.int64 if dtype == tf.int32 else dtype


class DeviceEpoch:
    """An epoch's draws on the device ({name: (N, ...) tensor}) and the number of its
    steps run so far: what make_device_train_loop's calls take in place of an iterator."""

    def __init__(self, draws):
        self.draws, self.steps_run = draws, 0


def make_device_train_loop(train_step, training_set, *, steps_per_execution, trace_sizes=(), static_steps="full"):
    """make_train_loop's twin for train.data_on_device: (epoch, batch_sizes) →
    {name: (K,) per-step values}, `epoch` a DeviceEpoch (its next K steps are run) and
    `batch_sizes` as make_train_loop's (the sizes of the K steps to run, then zeros;
    K ≤ steps_per_execution; only an epoch's last batch may be short).

    The K steps are one XLA program (a while loop over `train_step`, make_train_step's with
    xla="jit", with the batch gathered and augmented in each iteration). A batch size is a
    program of its own (a short last batch: a second one), and so is a call of
    `static_steps` steps at that size (default "full": steps_per_execution; train() passes
    the longest call its epochs make): that loop's trip count is a constant, which lets XLA
    run the body that many times without reading the loop's condition on the host at each
    iteration (a device-to-host copy and a wait); other calls (an epoch's first step, the
    steps up to a log step or to the epoch's end) share one program whose trip count is a
    tensor. `static_steps=None`: that one program for every call. The programs, keyed by
    (size, static_steps or None), are the returned function's `programs`.
    The non-finite guard as make_train_loop's: the values stop at the first step whose loss
    or grad_norm is not finite; the program runs all K steps.

    `trace_sizes`: the sizes the epochs' batches have (the full one, and the last one's if
    short), whose programs that can be called are traced here (a short batch is an epoch's
    last, a call of one step), before any other thread runs: a program traced
    later, beside train()'s thread that draws the next epoch (built_ahead), took the
    numbers in its loop's function names from a counter that thread moves too, so its XLA
    computation differed from run to run and train.xla_cache_dir never had it (seen on an
    H200: while_body_1165 in one run, while_body_1149 in the next). Other sizes are traced
    at their first call.

    `training_set` a MirroredTrainingSet (`train_step` then the mirrored step made with its
    `examples`): each call's steps are a TensorFlow loop over the mirrored step
    (mirrored_program), one program for every call of a size: its trip count is the loop's
    own, read on the host either way. Its programs are traced at their first call.
    """
    programs = {}
    mirrored = isinstance(training_set, MirroredTrainingSet)

    def program(size, steps=None):
        if mirrored:
            if (size, None) not in programs:
                programs[size, None] = mirrored_program(train_step, training_set, size, steps_per_execution)
            return programs[size, None]
        # One per (batch size, steps: None or static_steps), compiled at its first call;
        # where the steps start is a tensor, and so is their number (count) where `steps`
        # is None, so no other value compiles another.
        if (size, steps) not in programs:
            @tf.function(jit_compile=True, autograph=False)
            def run(draws, first_step, count):
                trip_count = count if steps is None else steps
                def body(i, values):
                    # A gather, not a slice, picks the batch: tf2xla takes a slice's start as a
                    # compile-time constant, which compiled the program again for every call.
                    # (images, labels), or MultiMNIST's (images, labels, digits)
                    out = train_step(*training_set.batch(draws, first_step + tf.cast(i, tf.int64), size))
                    at = tf.range(steps_per_execution) == i
                    return i + 1, {name: tf.where(at, tf.cast(out[name], tf.float32), values[name])
                                   for name in STEP_VALUES}

                empty = {name: tf.zeros([steps_per_execution], tf.float32) for name in STEP_VALUES}
                _, values = tf.while_loop(lambda i, _: i < trip_count, body, (tf.constant(0), empty))
                return values

            programs[size, steps] = run
        return programs[size, steps]

    if static_steps == "full":
        static_steps = steps_per_execution
    if mirrored:
        static_steps, trace_sizes = None, ()
    if static_steps is not None:
        static_steps = integer("static_steps", static_steps, minimum=1, maximum=steps_per_execution)
    for size in sorted(set(trace_sizes)):
        for steps in (None, static_steps):
            if _can_call(size, steps, training_set.batch_size, static_steps):
                program(size, steps).get_concrete_function(
                    training_set.draws_signature(), tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int32))

    def train_steps(epoch, batch_sizes):
        sizes = [int(size) for size in np.asarray(batch_sizes) if size]  # a host constant: no wait
        if not sizes:
            return {name: tf.zeros([0], tf.float32) for name in STEP_VALUES}
        end = epoch.steps_run * training_set.batch_size + sum(sizes)
        if end > training_set.shape[0]:
            # XLA's gather would clamp the positions past the epoch: wrong batches, no error.
            raise ValueError(f"make_device_train_loop: steps {epoch.steps_run + 1}-{epoch.steps_run + len(sizes)} "
                             f"of sizes {sizes} need examples up to {end}, past the epoch's "
                             f"{training_set.shape[0]}")
        parts = []
        for size, group in itertools.groupby(sizes):
            count = len(list(group))
            steps = count if count == static_steps else None
            values = program(size, steps)(epoch.draws, tf.constant(epoch.steps_run, tf.int64),
                                          tf.constant(count, tf.int32))
            parts.append({name: value[:count] for name, value in values.items()})
            epoch.steps_run += count
        stacked = parts[0] if len(parts) == 1 else {name: tf.concat([part[name] for part in parts], 0)
                                                     for name in STEP_VALUES}
        ran = steps_until_non_finite(stacked, len(sizes))
        return {name: value[:ran] for name, value in stacked.items()}

    train_steps.programs = programs
    return train_steps


def mirrored_program(train_step, training_set, size, steps_per_execution):
    """make_device_train_loop's program of global batches of `size` under a MirroredTrainingSet:
    (per-replica draws, first step, count) → {name: (steps_per_execution,) values}, the first
    `count` those of steps first_step, first_step + 1, ... . Not one XLA program: each step is
    strategy.run's (the mirrored `train_step`), given each replica's positions in the batch."""
    strategy = training_set.strategy

    @tf.function(autograph=False)
    def run(draws, first_step, count):
        def body(i, values):
            step = first_step + tf.cast(i, tf.int64)
            positions = strategy.run(lambda: training_set.positions(step, size))
            out = train_step(draws, positions, size)
            at = tf.range(steps_per_execution) == i
            return i + 1, {name: tf.where(at, tf.cast(out[name], tf.float32), values[name]) for name in STEP_VALUES}

        empty = {name: tf.zeros([steps_per_execution], tf.float32) for name in STEP_VALUES}
        _, values = tf.while_loop(lambda i, _: i < count, body, (tf.constant(0), empty))
        return values

    return run


def _can_call(size, steps, batch_size, static_steps):
    """Whether make_device_train_loop's calls can run the program of (size, steps), static_steps
    being the longest call (as train() passes it; a longer call still runs, its program
    traced at that call): a short batch is an epoch's last, a call of one step; a call of
    static_steps steps runs its own program, so with static_steps == 1 every call does and
    none runs the shared one."""
    if steps is None:
        return static_steps != 1
    return size == batch_size or steps == 1
