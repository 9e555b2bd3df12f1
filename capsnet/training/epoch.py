"""The epoch: the run's compiled steps and one epoch of their calls.

`CompiledSteps` holds the run's compiled train and test steps (made once, in train()'s
set-up), builds each epoch's input, and runs an epoch's training (`train`: `train_epoch`,
with Ctrl-C's save, a non-finite step's TrainingDiverged and a device out of memory in one
line) and its test pass (`test_pass`). `train_epoch` runs one epoch's calls, fetching and
timing them: what every epoch has alike is an `EpochShape`, where its scalars go a
`TrainScalars`.
"""
import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import time

import numpy as np
import tensorflow as tf

from capsnet import config
from capsnet.errors import CapsnetError, Interrupted
from capsnet.losses import loss_params
from capsnet.training.device_input import (DevicePairSet, DeviceTrainingSet, MirroredTrainingSet,
                                           make_device_train_loop)
from capsnet.training.distribute import input_iterator
from capsnet.training.health import NonFiniteStep, diverged
from capsnet.training.optimizer import loss_scale, steps_done
from capsnet.training.progress import EpochBar, live_progress_bar, steps_per_call
from capsnet.training.steps import (align_trace_names, compile_eval_step, eval_batch_size, evaluate_model,
                                    execution_lengths, make_eval_step, make_train_loop, make_train_step,
                                    next_execution_length)
from capsnet.training.summaries import MetricWindow, write_train_scalars


def device_memory_error(exc):
    """The one line for a device that ran out of memory in the first steps (another process
    holds it), or None for another error."""
    text = str(exc)
    if isinstance(exc, tf.errors.ResourceExhaustedError) or "No valid config found" in text or \
            "out of memory" in text.lower():
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        return CapsnetError(
            f"the device ran out of memory in the first steps ({first[:200]}): another process may hold the GPU's "
            "memory (nvidia-smi shows it); wait for it, use another GPU (CUDA_VISIBLE_DEVICES), or a smaller "
            "train.batch_size")
    return None


class CompiledSteps:
    """The run's compiled train and test steps (xla=autocluster switches XLA on for the whole
    process), each epoch's input, and the epoch's training (`train`) and test pass (`test_pass`)."""

    def __init__(self, model, state, data, cfg, strategy, all_reduce):
        tcfg = cfg["train"]
        self.model, self.state, self.data, self.tcfg, self.strategy = model, state, data, tcfg, strategy
        self.seed, self.batch_size = int(cfg["seed"]), int(tcfg["batch_size"])
        self.shape = EpochShape(num_examples=data.examples_per_epoch, batch_size=self.batch_size,
                                steps_per_execution=tcfg["steps_per_execution"],
                                log_every_steps=tcfg["log_every_steps"], progress_bar=tcfg["progress_bar"])
        losses = loss_params(tcfg)
        done = int(state.epoch)
        # (a finished run rerun: nothing to copy)
        on_device = tcfg["data_on_device"] and done < tcfg["epochs"]
        self.training_set = device_training_set(data, tcfg, self.seed, strategy) if on_device else None
        # Under a strategy each replica gathers its slice of the batch inside its step.
        examples = self.training_set.examples if on_device and strategy is not None else None
        train_step = make_train_step(model, state.optimizer, input_shape=model.image_shape, losses=losses,
                                     xla=tcfg["xla"], strategy=strategy, all_reduce=all_reduce,
                                     label_format=data.task.label_format, weight_average=state.average,
                                     examples=examples)
        # The compiled programs are traced here, before the thread that builds the next epoch's
        # input starts (its traces move the same uid counter), each from an aligned uid
        # (align_trace_names): a rerun or resumed run finds them in train.xla_cache_dir.
        align_trace_names()
        if on_device:
            last_batch = data.examples_per_epoch - (data.steps_per_epoch - 1) * self.batch_size
            # The longest call train_epoch makes in the epochs left runs a loop of constant length
            # (make_device_train_loop says why).
            per_call = steps_per_call(data.steps_per_epoch, tcfg["steps_per_execution"], tcfg["progress_bar"])
            longest = max(max(execution_lengths(data.steps_per_epoch, d * data.steps_per_epoch, per_call,
                                                tcfg["log_every_steps"])) for d in range(done, tcfg["epochs"]))
            self.train_steps = make_device_train_loop(train_step, self.training_set,
                                                      steps_per_execution=tcfg["steps_per_execution"],
                                                      trace_sizes=(self.batch_size, last_batch), static_steps=longest)
        else:
            self.train_steps = make_train_loop(train_step, strategy=strategy)  # (traces nothing until called)
            if strategy is None and done < tcfg["epochs"]:
                train_step.get_concrete_function()  # the loop's trace then calls this one
        self.eval_step = make_eval_step(model, model.image_shape, jit_compile=tcfg["xla"] == "jit",
                                        label_format=data.task.label_format, **losses)
        align_trace_names()
        self.eval_step.get_concrete_function()
        # Under XLA the test step compiles beside the first epoch (compile_eval_step says why),
        # started once the training calls that compile have returned (train_epoch's after_compile):
        # beside the first call's compilation the two autotune on the GPU at once and that call
        # takes seconds longer.
        # One device only: under a strategy the replicas' steps have the devices to themselves.
        self.eval_compile, self.eval_compiled = None, None
        if tcfg["xla"] == "jit" and strategy is None and done < tcfg["epochs"]:
            test_batch = eval_batch_size(tcfg)
            sizes = sorted({size for n in (data.test_examples, data.validation_examples) if n
                            for size in (min(test_batch, n), n % test_batch)} - {0})
            self.eval_compile = functools.partial(compile_eval_step, self.eval_step, data.test_ds.element_spec,
                                                  sizes)

    def epoch_input(self, epoch_index, first_step, resumed_epoch):
        """The epoch's batches on the training devices ahead of the steps (under a strategy: the
        same global batches, split over the replicas); train.data_on_device: its draws there."""
        if self.training_set is not None:
            return self.training_set.epoch(epoch_index)
        train_ds = self.data.train_dataset(batch_size=self.batch_size, seed=self.seed, epoch=epoch_index,
                                           drop_remainder=self.tcfg["drop_remainder"])
        if epoch_index == resumed_epoch and first_step:
            # The epoch's order is a function of (seed, epoch): its batches from the step it stopped at.
            train_ds = train_ds.skip(first_step)
        return input_iterator(train_ds, self.strategy)

    def next_learning_rate(self):
        """The rate of the optimizer's next update: its schedule at Adam's step counter, not at the
        steps run (with mixed_float16 a step skipped for overflow does not advance it). Read where
        the steps were just fetched, so it waits for nothing."""
        return float(self.state.schedule(steps_done(self.state.optimizer)))

    def train(self, iterator, global_step, start_step, summaries, report, control):
        """One epoch (train_epoch) → (train means, global step, `resumed`: None, or for an epoch
        resumed mid-way its resumed_at_step and train_examples, the examples the means cover);
        Ctrl-C's save and Interrupted, a non-finite step's TrainingDiverged, a device out of
        memory in one line. An epoch resumed at `start_step` > 0 takes its means on from the
        Ctrl-C's checkpoint (state.epoch_window): over all the epoch's steps, where a
        checkpoint written before it kept them leaves only the steps run since."""
        tcfg, epoch_number = self.tcfg, int(self.state.epoch) + 1
        window = MetricWindow.from_json(self.state.epoch_window.numpy().decode() if start_step else "")
        try:
            means, global_step, stopped_at = train_epoch(
                self.train_steps, iterator, self.shape, global_step=global_step, first_step=start_step,
                scalars=TrainScalars(summaries.writer, self.next_learning_rate, loss_scale(self.state.optimizer)),
                # train.data_on_device's epochs cannot start mid-way: a Ctrl-C there stops at the epoch's end.
                stop=control.stop_asked if self.training_set is None else None, report=report,
                after_compile=self.start_eval_compile, window=window)
        except NonFiniteStep as stop:
            # Nothing of this epoch is saved (the weights in memory are diverged): the
            # checkpoints, best/ and history.jsonl keep what the last good epoch left.
            summaries.close()
            raise diverged(stop, epoch_number, control.run.last_good(), configured_rate=tcfg["learning_rate"],
                           learning_rate=self.state.learning_rate, precision=tcfg["precision"]) from None
        except tf.errors.OpError as exc:
            if summaries.write_failed(exc) is not None:  # the train/ scalars' event file
                raise summaries.write_failed(exc) from None
            if report.announced or device_memory_error(exc) is None:  # past the first steps: not the start's
                raise
            raise device_memory_error(exc) from None
        if stopped_at is not None:
            # Ctrl-C: the steps run so far saved (interrupted/), this epoch unfinished.
            self.state.step_in_epoch.assign(stopped_at)
            self.state.epoch_window.assign(window.to_json())
            control.run.save_interrupted(global_step)
            summaries.close()
            raise Interrupted(f"interrupted at step {stopped_at} of {self.data.steps_per_epoch} in epoch "
                              f"{epoch_number}: saved; {control.resume_hint()} from there")
        self.state.step_in_epoch.assign(0)  # the epochs' checkpoints start their next epoch at its first step
        self.state.epoch_window.assign("")
        return means, global_step, ({"resumed_at_step": start_step, "train_examples": window.examples}
                                    if start_step else None)

    def start_eval_compile(self):
        """The test step's compilation, in its thread (compile_eval_step), if it is still to start."""
        if self.eval_compile is not None:
            self.eval_compiled, self.eval_compile = self.eval_compile(), None

    def await_eval_compile(self):
        """Wait for the test step's compilation, started beside the training (the first pass over
        the validation or test split then finds its shapes compiled, and never compiles them a
        second time beside that thread)."""
        if self.eval_compiled is not None:
            self.eval_compiled.result()
        self.eval_compile = self.eval_compiled = None  # (an epoch of one call: compiled here)

    def test_pass(self, summaries=None, step=None):
        """(test, raw_test): the test split through eval_step with the run's weights (with a
        weight average, the average's; raw_test then the trained weights', else None); with
        `summaries`, the epoch's test summaries at `step` too."""
        average, model, data = self.state.average, self.model, self.data
        self.await_eval_compile()
        raw_test = evaluate_model(self.eval_step, data.test_ds, model.num_classes) if average is not None else None
        with average.in_model() if average is not None else contextlib.nullcontext():
            test = evaluate_model(self.eval_step, data.test_ds, model.num_classes, keep_lengths=True)
            # The longest capsule over the test set (collapse_reason), not the (N, classes) lengths.
            test["max_length"] = float(test.pop("lengths").max())
            test.pop("labels")
            if summaries is not None:
                summaries.epoch(model, test, data.show_images, self.tcfg, step, raw_test,
                                class_names=data.task.class_names(model.num_classes))
        return test, raw_test

    def validation_pass(self, summaries=None, step=None):
        """The validation split (data.validation_fraction) through eval_step with the run's
        weights, as test_pass's test (with a weight average, the average's); None where the
        run has none. With `summaries`, its validation/ scalars at `step`."""
        if self.data.validation_ds is None:
            return None
        self.await_eval_compile()
        average = self.state.average
        with average.in_model() if average is not None else contextlib.nullcontext():
            validation = evaluate_model(self.eval_step, self.data.validation_ds, self.model.num_classes)
        if summaries is not None:
            summaries.validation(validation, step)
        return validation

    def figures(self, summaries, step):
        """train.figures: capsnet.figures' pictures of the run's weights (the test pass's: with a
        weight average, the average's) on the first FIGURE_EXAMPLES test examples, in TensorBoard
        (RunSummaries.figures). Not for data with reconstruction targets (MultiMNIST's two labels
        and digits: the figures take one label an example)."""
        if not self.tcfg["figures"] or self.data.task.label_format.targets or not summaries.chief:
            return
        batches, count = [], 0
        for images, labels, *_ in self.data.test_ds:
            batches.append((images.numpy(), labels.numpy()))
            count += len(batches[-1][1])
            if count >= FIGURE_EXAMPLES:
                break
        images, labels = (np.concatenate(part)[:FIGURE_EXAMPLES] for part in zip(*batches))
        average, model = self.state.average, self.model
        with average.in_model() if average is not None else contextlib.nullcontext():
            summaries.figures(model, images, labels, step, class_names=self.data.task.class_names(model.num_classes))


# Test examples the end-of-training figures are drawn from (their confusion matrix counts them all).
FIGURE_EXAMPLES = 500


def device_training_set(data, tcfg, seed, strategy=None):
    """train.data_on_device: the training split copied to the device once (under a strategy, to
    every replica's device); each epoch only its draws."""
    batch_size, split, task = int(tcfg["batch_size"]), data.train_split, data.task
    augmentation = task.augmentation()  # the MNIST family's (natural images refuse the device loop in config)
    if strategy is not None:  # (two-digit data trains on one device: config.check)
        return MirroredTrainingSet(strategy, split.images, split.labels, batch_size=batch_size, seed=seed,
                                   **augmentation)
    if task.label_format.targets:  # MultiMNIST's pairs: their digits are the targets
        return DevicePairSet(split.images, split.labels, batch_size=batch_size, seed=seed,
                             shift_pixels=augmentation["shift_pixels"], pad_pixels=task.cfg.get("pad_pixels"),
                             **{key: augmentation[key] for key in config.OVERLAY_AUGMENTATION})
    return DeviceTrainingSet(split.images, split.labels, batch_size=batch_size, seed=seed, **augmentation)


# The longest a train_steps call may take, as far as the step time allows (at least one
# step a call): Ctrl-C acts between calls, so on a CPU, where a paper-model step takes
# ~1.2 s, a call of steps_per_execution=50 steps kept it waiting ~60 s. On a GPU a call of
# 50 steps takes well under this: steps_per_execution decides there. Before any step is
# timed, the epoch's first call (one step, with its compile: longer than any step after it)
# bounds the next: a full-length second call on a slow CPU (50 steps of ~10 s) kept the first
# timed steps, the run's estimate and its first progress line back by 8 minutes.
CALL_SECONDS = 1.0


@dataclasses.dataclass(frozen=True)
class EpochShape:
    """What every epoch of a run has alike: its examples (`num_examples`, in batches of
    `batch_size`), the most steps a call runs (train.steps_per_execution), how often the
    train/ scalars are written (train.log_every_steps), and train.progress_bar."""
    num_examples: int
    batch_size: int
    steps_per_execution: int
    log_every_steps: int
    progress_bar: bool = True

    @property
    def steps_per_epoch(self):
        return math.ceil(self.num_examples / self.batch_size)


@dataclasses.dataclass(frozen=True)
class TrainScalars:
    """Where the train/ scalars go (`writer`), with the LR of the next update
    (`learning_rate()`, read after the steps are fetched) and the dynamic loss scale (a
    variable, mixed_float16) if `loss_scale` is one."""
    writer: object
    learning_rate: object
    loss_scale: object = None

    def write(self, window, global_step):
        write_train_scalars(self.writer, window, self.learning_rate(), global_step, self.loss_scale)


def train_epoch(train_steps, iterator, shape, *, global_step, scalars, first_step=0, stop=None, report=None,
                after_compile=None, window=None):
    """One epoch (its EpochShape `shape`) of `train_steps` calls (make_train_loop, or
    make_device_train_loop with a DeviceEpoch as `iterator`) over `iterator`'s batches, from
    step `first_step` of the epoch on (a resumed epoch: `iterator` then starts at that
    step's batch).

    Returns (means, global_step, stopped_at): the epoch's example-weighted step values (loss,
    margin_loss, reconstruction_loss, accuracy; images_per_sec and step_time_ms of the
    timed steps) of the steps run here and those in `window` (a MetricWindow, added to in
    place: a resumed epoch's steps before the interruption), the global step after them (`global_step`: before
    them), and None, or, if `stop()` turned true (Ctrl-C), the step of the epoch that the
    steps ran up to (the epoch unfinished; every step run is fetched and checked).
    The train/ scalars (TrainScalars `scalars`) are written every log_every_steps steps and
    at the epoch's end. `report(step_in_epoch, seconds_per_step, images_per_sec)`, if given,
    is called after each fetch of timed steps (the progress lines and the run's ETA:
    capsnet.training.progress.Progress);
    `after_compile()`, if given, once the epoch's first timed steps are fetched: the calls that
    compile (the first, of one step, and the first of full length) have returned by then.

    The calls run on a worker thread while this (the main) thread waits for them: Python
    runs a signal handler only between bytecodes of the main thread, so Ctrl-C's handler
    runs at once, not when a call of several seconds returns.
    """
    num_examples, batch_size, steps_per_execution = shape.num_examples, shape.batch_size, shape.steps_per_execution
    steps_per_epoch = shape.steps_per_epoch
    bar = EpochBar(steps_per_epoch, live_progress_bar(shape.progress_bar)) if shape.progress_bar else None
    per_call = steps_per_call(steps_per_epoch, steps_per_execution, shape.progress_bar)
    epoch_window, log_window = window if window is not None else MetricWindow(), MetricWindow()
    pending = []  # (per-step outputs still on the device, their batch sizes)
    tick = time.perf_counter()
    step_in_epoch = first_step
    seconds_per_step = None  # of the timed steps so far: bounds a call's length (CALL_SECONDS)
    first_call_seconds = None  # the epoch's first call's: the bound until a step is timed
    stopped_at = None
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="capsnet-steps") as worker:
        while step_in_epoch < steps_per_epoch:
            first = step_in_epoch == first_step
            length = 1 if first else next_execution_length(steps_per_epoch - step_in_epoch, global_step, per_call,
                                                           shape.log_every_steps)
            if seconds_per_step or first_call_seconds:
                length = max(1, min(length, int(CALL_SECONDS / (seconds_per_step or first_call_seconds))))
            # The global batch of each step: full but for an epoch's last (counted here: under
            # a strategy, a replica's batch holds only its slice of it).
            sizes = [min(batch_size, num_examples - (step_in_epoch + i) * batch_size) for i in range(length)]
            batch_sizes = tf.constant(sizes + [0] * (steps_per_execution - length), tf.int32)  # (steps_per_execution,)
            pending.append((worker.submit(train_steps, iterator, batch_sizes).result(), sizes, global_step))
            step_in_epoch += length
            global_step += length
            log_now = global_step % shape.log_every_steps == 0
            last = step_in_epoch == steps_per_epoch
            stopping = stop is not None and stop()
            if not (first or log_now or last or stopping or time.perf_counter() - tick > 1.0):
                continue  # no fetch: the host queues the next call while the device runs this one
            # Fetching the values waits for the device, so the clock now measures finished
            # steps. That happens after the epoch's first step (it traces/compiles the steps or
            # refills the shuffle buffer: left out of images/s and step time), at log steps,
            # at the epoch's end and about once a second; not every call, which would make
            # the device idle while the host dispatches the next one.
            fetched = worker.submit(_fetch, pending).result()  # NonFiniteStep at the first non-finite step
            now = time.perf_counter()
            for window in (epoch_window, log_window):
                for values, size in fetched:
                    window.add(values, size)
                if not first:
                    window.add_time(len(fetched), sum(size for _, size in fetched), now - tick)
            if first:
                first_call_seconds = now - tick
            else:
                if seconds_per_step is None and after_compile is not None:
                    after_compile()
                seconds_per_step = (now - tick) / len(fetched)
            pending, tick = [], now
            if log_now or (stopping and log_window.examples):
                scalars.write(log_window, global_step)
                log_window = MetricWindow()
            if bar is not None:  # the run's ETA beside the bar's own, the epoch's
                bar.update(step_in_epoch, epoch_window.means(), report.run_eta if report is not None else None)
            if report is not None and seconds_per_step is not None:
                report(step_in_epoch, seconds_per_step, epoch_window.means().get("images_per_sec"))
            if stopping and not last:
                stopped_at = step_in_epoch
                break
    assert not pending, "the last step run is always fetched"
    if log_window.examples:
        scalars.write(log_window, global_step)
    return epoch_window.means(), global_step, stopped_at


def _fetch(pending):
    """[(one step's values, its batch size)] of the train_steps calls in `pending`, in
    order: [(outputs, batch sizes, global step before the call)], each output a dict of
    (K,) tensors for the K steps the call ran.

    A call that returned fewer values than it was given steps, or whose last value is not
    finite, met a non-finite step (make_train_loop cuts its values there): NonFiniteStep
    names that step (the steps and calls after it ran on diverged weights: they are not
    looked at)."""
    fetched = []
    for out, sizes, start in pending:
        values = {k: v.numpy() for k, v in out.items()}  # (K,) each: one copy per tensor
        ran = len(values["loss"])
        fetched += [({k: float(v[i]) for k, v in values.items()}, size) for i, size in enumerate(sizes[:ran])]
        if ran < len(sizes) or (ran and not all(math.isfinite(fetched[-1][0].get(k, 0.0))
                                                for k in ("loss", "grad_norm"))):
            raise NonFiniteStep(start + ran, fetched[-1][0] if ran else {})
    return fetched
