"""Train CapsNet: `train(cfg) -> metrics`, the body of `python train.py`.

Reads top to bottom like the loop it is: config → setup → data → model and optimizer
(new, or resumed from the run dir's last checkpoint) → compiled steps → epochs →
final metrics. `cfg` is a plain dict shaped like configs/train.yaml (train.py converts
Hydra's config at the boundary); nothing here sees a Hydra object. `train_epoch` runs
one epoch's compiled calls, fetching and timing them.

The run dir (what it holds, who writes it, how a failed write ends): RunDir
(capsnet.training.run_dir); TensorBoard: RunSummaries (capsnet.training.summaries).
Rerunning with the same run dir resumes it; how, what an epoch commits and which config
changes a resume refuses: capsnet.training.checkpoints. Several devices (the chief
alone writes the run dir): capsnet.training.distribute. The weight average:
capsnet.training.weight_average.
"""
import concurrent.futures
import contextlib
import functools
import logging
import math
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from capsnet import config, console
from capsnet.cli import complete_run_notice, set_memory_growth
from capsnet.console import say
from capsnet.errors import CapsnetError, ConfigError, Interrupted
from capsnet.losses import loss_params
from capsnet.precision import set_tensor_float_32
from capsnet.training.control import RunControl, on_schedule
from capsnet.training.checkpoints import checkpoint_weights
from capsnet.training.device_input import (DevicePairSet, DeviceTrainingSet, MirroredTrainingSet,
                                           make_device_train_loop)
from capsnet.training.health import NonFiniteStep, collapse_reason, collapsed, collapsed_for, diverged
from capsnet.training.distribute import (check_all_reduce, check_global_batch, check_tf_config, check_workers_agree,
                                         input_iterator, is_chief, make_strategy, resolve_all_reduce,
                                         trains_on_gpu, without_autotune_thread)
from capsnet.tasks import task_for
from capsnet.training.model_setup import build_capsnet, check_op_library
from capsnet.training.optimizer import build_optimizer, checkpoint_nodes, loss_scale, scaled_learning_rate, steps_done
from capsnet.training.run_dir import RunDir, last_epoch_was_best  # noqa: F401  (last_epoch_was_best: loop's rule)
from capsnet.training.steps import (align_trace_names, compile_eval_step, eval_batch_size, evaluate_model,
                                    execution_lengths, make_eval_step, make_train_loop, make_train_step,
                                    next_execution_length, set_determinism)
from capsnet.training.summaries import MetricWindow, RunSummaries, mean_images_per_sec, write_train_scalars
from capsnet.training.weight_average import WeightAverage
from capsnet.training.xla_flags import set_xla_flags

log = logging.getLogger(__name__)


def train(cfg, *, checked=False, hydra_files=None, resume_command=None):
    """Train (or resume) the run in cfg["run_dir"]; returns the final metrics (also metrics.json).

    `checked`: cfg is config.check's result already (train.py checks it before importing
    TensorFlow); else it is checked here. `hydra_files`: Hydra's .hydra/ snapshot, written
    once the run dir is locked (RunDir.take). `resume_command`: the command that resumes
    the run, named in the Ctrl-C and SIGTERM lines (train.py's, with hydra.run.dir).

    The run dir (capsnet.training.run_dir.RunDir) is locked for the run's life (one training
    per run dir), released however train() ends. SIGTERM (a job's time limit, a preemption)
    stops the run at the end of the epoch it is in, saved (errors.Terminated); a second
    SIGTERM stops it at once. Ctrl-C (SIGINT) stops it after the steps running, saved
    (checkpoints/interrupted/, errors.Interrupted naming the step); a second Ctrl-C at once
    (capsnet.training.control.RunControl)."""
    control = RunControl(resume_command)
    try:
        return _train(cfg if checked else config.check(cfg), control, hydra_files)
    except KeyboardInterrupt as interrupt:
        if isinstance(interrupt, Interrupted):
            raise
        raise Interrupted(control.interrupted()) from None
    finally:
        control.restore_signals()
        if control.run is not None:
            control.run.close()


def _train(cfg, control, hydra_files):
    """train()'s body: set-up, then the epoch loop; keeps `control` (RunControl) told where
    the run is, its RunDir in control.run (closed by train())."""
    marks = [("start", time.perf_counter())]  # where the set-up's seconds go, logged before the first epoch
    model_cfg, data_cfg, tcfg, dcfg = (dict(cfg[section]) for section in ("model", "data", "train", "distribute"))
    check_tf_config(dcfg["strategy"])
    if data_cfg.get("dir") is not None:  # absolute, so evaluate.py finds the data from any working directory
        data_cfg["dir"] = str(Path(data_cfg["dir"]).expanduser().resolve())
    cfg = {**cfg, "data": data_cfg}
    run = control.run = RunDir.open(cfg)  # ours? resumable with this config? before any work
    seed, batch_size = int(cfg["seed"]), int(tcfg["batch_size"])
    strategy = set_up_devices(cfg)
    scope = strategy.scope if strategy is not None else contextlib.nullcontext
    run.take(is_chief(strategy), hydra_files)  # locked before the data is read
    control.handle_signals(multi_worker=dcfg["strategy"] == "multi_worker")  # a SIGTERM in the load: one line
    say(f"run dir: {run.path}")  # where evaluate.py, TensorBoard and a resume find this run
    all_reduce = distribution(strategy, dcfg, tcfg)
    keras.utils.set_random_seed(seed)  # Python, NumPy and TF seeds: the initial weights
    if cfg["custom_op"]:  # each replica runs the op on its own device
        check_op_library(strategy.extended.worker_devices if strategy is not None else None)
    with scope():  # the model first: its config errors come before the data is read
        model = build_capsnet(model_cfg, cfg["custom_op"], tcfg["precision"])
    if strategy is not None:  # an all-reduce that runs but does not sum would train silently wrong
        check_all_reduce(strategy, [v.shape for v in model.trainable_variables], compiled=all_reduce == "xla")
    marks.append(("devices and model", time.perf_counter()))
    data = load_data(data_cfg, tcfg, model)
    marks.append(("data", time.perf_counter()))
    state = TrainingState(model, tcfg, dcfg, data.steps_per_epoch, scope)
    resumed_from = run.restore(state.checkpoint, state.required, state.epoch, state.step_in_epoch,
                               data.steps_per_epoch)
    if resumed_from:
        log.info("resumed from %s: %d of %d epochs done, step %d", resumed_from, int(state.epoch), tcfg["epochs"],
                 steps_done(state.optimizer))
        if int(state.epoch) >= tcfg["epochs"]:
            say(complete_run_notice(run.path, int(state.epoch)))
    if dcfg["strategy"] == "multi_worker":
        check_workers_agree(strategy, int(state.epoch), steps_done(state.optimizer))
    marks.append(("optimizer and checkpoints", time.perf_counter()))
    summaries = RunSummaries(run.path, run.chief)
    if not resumed_from:
        summaries.hparams(cfg)
    marks.append(("TensorBoard", time.perf_counter()))
    log.info("set-up %.2f s: %s", marks[-1][1] - marks[0][1],
             ", ".join(f"{name} {end - begin:.2f}" for (_, begin), (name, end) in zip(marks, marks[1:])))
    steps = CompiledSteps(model, state, data, cfg, strategy, all_reduce)

    # ---- the loop
    first_step = int(state.step_in_epoch)  # > 0: a Ctrl-C's checkpoint resumed mid-epoch
    resumed_epoch = int(state.epoch)
    # The steps run, counted on the host (reading Adam's counter would wait for the device, and
    # with mixed_float16 it leaves out the steps skipped for overflow).
    global_step = resumed_epoch * data.steps_per_epoch + first_step
    control.start(resumed_epoch)
    report = Progress(epochs=tcfg["epochs"], steps_per_epoch=data.steps_per_epoch, batch_size=batch_size,
                      test_examples=data.test_examples, test_every_epochs=tcfg["test_every_epochs"],
                      every=tcfg["progress_every_seconds"], live=live_progress_bar(tcfg["progress_bar"]))
    test = raw_test = None
    epochs = range(resumed_epoch, tcfg["epochs"])
    for epoch_index, iterator in built_ahead(lambda e: steps.epoch_input(e, first_step, resumed_epoch), epochs):
        number = epoch_index + 1
        control.epoch = number
        start_step = first_step if epoch_index == resumed_epoch else 0
        say(f"epoch {number}/{tcfg['epochs']}" + (f" (from step {start_step})" if start_step else ""))
        clock = [time.perf_counter()]  # the epoch's phases end: train, test (with its summaries), save
        report.start_epoch(number)
        train_means, global_step = steps.train(iterator, global_step, start_step, summaries, report, control)
        state.step_in_epoch.assign(0)  # the epochs' checkpoints start their next epoch at its first step
        clock.append(time.perf_counter())
        test = raw_test = collapse = None
        if on_schedule(number, tcfg["test_every_epochs"], tcfg["epochs"]):
            test, raw_test = steps.test_pass(summaries, global_step)
            report.tested(time.perf_counter() - clock[-1])
            collapse = collapse_reason(test, number, model.num_classes, data.labels_per_example)
            summaries.collapse(global_step, test, collapse, number)
        is_best = test is not None and test["accuracy"] > float(state.best_accuracy)
        state.epoch.assign(number)
        if is_best:
            state.best_accuracy.assign(test["accuracy"])
        run.append_history(history_entry(number, global_step, steps.next_learning_rate(), train_means, test,
                                         raw_test, collapse))
        clock.append(time.perf_counter())
        stopping = collapse is not None and collapsed_for(run.history, tcfg["collapse_patience"])
        terminating = control.terminate  # read once: a SIGTERM from here on stops at the next epoch's end
        interrupting = control.interrupt  # a Ctrl-C during the test pass: saved, then stopped
        # The commit point: until a checkpoint of this epoch exists, a restart redoes it (and the
        # epochs since the last one saved: train.save_every_epochs > 1 saves only every Nth and the
        # last; a new best is always saved, best/ being links to its files, and so is a stop).
        if is_best or stopping or terminating or interrupting or on_schedule(number, tcfg["save_every_epochs"],
                                                                             tcfg["epochs"]):
            run.save_epoch(number, is_best)
            control.done = number
            if epoch_index == resumed_epoch and first_step:
                run.drop_interrupted()  # superseded (after the commit)
        control.trained = number
        clock.append(time.perf_counter())
        phases = dict(zip(("train", "test", "save"), np.diff(clock)))  # where the epoch's wall time went
        summaries.epoch_end(global_step, phases, run.history)
        control.epoch = None
        say(epoch_line(number, train_means, test, raw_test, is_best, collapse, clock[-1] - clock[0], phases))
        if (interrupting or terminating) and number < tcfg["epochs"]:
            summaries.close()
            raise control.stopped_after(number, terminating)
        if stopping:
            summaries.close()
            raise collapsed(number, collapse, run.path, tcfg["collapse_patience"], tcfg["test_every_epochs"])

    # ---- final metrics
    if test is None:  # nothing left to train (a finished run rerun): measure the checkpoint as it is
        test, raw_test = steps.test_pass()
    steps.figures(summaries, global_step)
    metrics = final_metrics(test, raw_test, run, state, global_step, strategy, dcfg)
    summaries.close()
    run.finish(metrics)
    say(f"done: {run.path} (python evaluate.py checkpoint={run.path})")
    return metrics


def set_up_devices(cfg):
    """Process-wide TensorFlow settings, before anything touches a device, then the strategy
    (None = one device; multi_worker configures the process's collective ops then)."""
    tcfg, dcfg = cfg["train"], cfg["distribute"]
    replaced = set_xla_flags(tcfg["xla"], tcfg["xla_cache_dir"])
    if replaced:
        say(f"notice: {replaced}")
    set_memory_growth()
    set_determinism(cfg["deterministic"])
    set_tensor_float_32(tcfg["tf32"])
    strategy = make_strategy(dcfg)
    # One notice at most: the device loop (which runs under jit) is the far slower of the two.
    if tcfg["data_on_device"] and not trains_on_gpu(strategy):
        # Measured (docs/benchmarks.md, paper model, batch 100, 2 cores): two steps unfinished
        # after 5 minutes, against ~10 s with the tf.data pipeline. In the device loop's optimized
        # HLO XLA's CPU compiler leaves the convolution gradients in the dimension orders it does
        # not hand to Eigen; the single jit step has none.
        say("notice: train.data_on_device=true on a CPU: the paper model's steps take minutes each "
            "(docs/benchmarks.md); it is for GPUs (on a CPU: speed=none, or train.data_on_device=false)")
    elif tcfg["xla"] == "jit" and not trains_on_gpu(strategy):
        # Measured (docs/benchmarks.md, paper model, batch 100, 2 cores): 1,274-1,433 ms a step
        # against 1,203 with train.xla=none (with PrimaryCaps on blocks under jit; with its
        # strided convolution XLA's CPU input gradient made it ~20x).
        say("notice: train.xla=jit on a CPU: each step is slower than with train.xla=none "
            "(1.06-1.19x measured, docs/benchmarks.md); jit is for GPUs")
    return strategy


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


def distribution(strategy, dcfg, tcfg):
    """The all-reduce of a strategy's gradients (checked against the batch), logged; dcfg's for one device."""
    if strategy is None:
        return dcfg["all_reduce"]
    batch_size = int(tcfg["batch_size"])
    check_global_batch(batch_size, strategy)
    all_reduce = resolve_all_reduce(dcfg["all_reduce"], dcfg["strategy"], tcfg["xla"], tcfg["precision"],
                                    strategy.extended.worker_devices, tcfg["weight_decay"])
    log.info("distribute=%s: %d replicas, global batch %d = %d per replica, all-reduce %s; this process: %s%s",
             dcfg["strategy"], strategy.num_replicas_in_sync, batch_size, batch_size // strategy.num_replicas_in_sync,
             all_reduce, ", ".join(strategy.extended.worker_devices),
             "" if is_chief(strategy) else " (not the chief: writes nothing into the run dir)")
    return all_reduce


class RunData:
    """The run's data, through its Task (capsnet.tasks.task_for(data_cfg)): the splits (loaded
    once; the task's dataset scales, shuffles and augments them per (seed, epoch); MultiMNIST
    pairs and overlays the digits), checked against the model, the epoch's steps, the test
    pass's dataset and the fixed images of the summaries."""

    def __init__(self, data_cfg, tcfg, model):
        batch_size = int(tcfg["batch_size"])
        self.task = task = task_for(data_cfg)
        self.name = task.name
        self.train_split = task.load("train", limit=data_cfg.get("limit_train"))
        test_split = task.load("test", limit=data_cfg.get("limit_test"))
        task.check(self.train_split, model, "train")
        task.check(test_split, model, "test")
        # MultiMNIST: labels (B, 2) and the digits (B, 2, H, W, C); one device (config.check).
        self.two_digits = task.two_digits
        self.labels_per_example = task.labels_per_example
        n_train = len(self.train_split)
        # train.drop_remainder: only full batches (a different few examples left out each epoch,
        # the order being shuffled), so the compiled step sees one batch shape, not two.
        if tcfg["drop_remainder"]:
            if n_train < batch_size:
                raise ConfigError(f"train.batch_size={batch_size} with train.drop_remainder=true leaves no batch of "
                                  f"the {n_train} training examples of {self.name}")
            self.steps_per_epoch = n_train // batch_size
            self.examples_per_epoch = self.steps_per_epoch * batch_size
        else:
            self.steps_per_epoch = math.ceil(n_train / batch_size)
            self.examples_per_epoch = n_train
        self.test_examples = len(test_split)
        # The test split: no augmentation (MultiMNIST: shift_pixels and pad_pixels set its fixed
        # pairs' shifts). Without the autotune thread, whose join made deleting each test pass's
        # iterator wait (as the epochs').
        self.test_ds = without_autotune_thread(task.dataset(test_split, batch_size=eval_batch_size(tcfg),
                                                            training=False))
        # A fixed set of test images for the reconstruction grid and the histograms, every epoch
        # (MultiMNIST: the first test pairs, made from the whole test split as in test_ds).
        n_show = min(len(test_split), max(tcfg["num_images"], tcfg["histogram_examples"]))
        self.show_images = next(iter(self.test_ds.unbatch().batch(n_show)))[0]  # (n_show, H, W, C)

    def train_dataset(self, *, batch_size, seed, epoch, drop_remainder):
        """One epoch of training batches, shuffled and augmented by (seed, epoch)."""
        return self.task.dataset(self.train_split, batch_size=batch_size, training=True, seed=seed, epoch=epoch,
                                 drop_remainder=drop_remainder)


def load_data(data_cfg, tcfg, model):
    return RunData(data_cfg, tcfg, model)


class TrainingState:
    """What a checkpoint holds: the optimizer (Adam on the run's learning rate schedule), the
    weight average (train.ema_decay), the epochs done, the best accuracy so far and, in a
    Ctrl-C's checkpoint, the steps of the next epoch done (`step_in_epoch`)."""

    def __init__(self, model, tcfg, dcfg, steps_per_epoch, scope):
        batch_size = int(tcfg["batch_size"])
        self.learning_rate = scaled_learning_rate(tcfg["learning_rate"], batch_size, dcfg["scale_lr"],
                                                  dcfg["lr_base_batch_size"])
        if dcfg["scale_lr"] != "none":
            log.info("learning rate %g: train.learning_rate %g scaled (distribute.scale_lr=%s) from batch %d to %d",
                     self.learning_rate, tcfg["learning_rate"], dcfg["scale_lr"], dcfg["lr_base_batch_size"],
                     batch_size)
        with scope():  # the Keras optimizer keeps the strategy it is made under
            self.optimizer, self.schedule = build_optimizer({**tcfg, "learning_rate": self.learning_rate},
                                                            steps_per_epoch, model)
            # The run's test passes, best checkpoint and evaluate.py use the average's weights.
            self.average = (WeightAverage(model, tcfg["ema_decay"], self.optimizer.iterations)
                            if tcfg["ema_decay"] else None)
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")  # epochs done
        self.best_accuracy = tf.Variable(-1.0, dtype=tf.float64, trainable=False, name="best_accuracy")
        # "loss_scale" (mixed_float16) is optional on resume: checkpoints are shared by every precision.
        optimizer_nodes = checkpoint_nodes(self.optimizer)
        self.required = {"model": checkpoint_weights(model), "optimizer": optimizer_nodes.pop("optimizer"),
                         "epoch": self.epoch, "best_accuracy": self.best_accuracy,
                         **({"ema": self.average.weights()} if self.average is not None else {})}
        # The steps of the epoch after `epoch` that a Ctrl-C's checkpoint (interrupted/) holds; 0 in
        # the epochs' checkpoints (optional: those saved before it existed have none).
        self.step_in_epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="step_in_epoch")
        self.checkpoint = tf.train.Checkpoint(**self.required, **optimizer_nodes, step_in_epoch=self.step_in_epoch)


class CompiledSteps:
    """The run's compiled train and test steps (xla=autocluster switches XLA on for the whole
    process), each epoch's input, and the epoch's training (`train`) and test pass (`test_pass`)."""

    def __init__(self, model, state, data, cfg, strategy, all_reduce):
        tcfg = cfg["train"]
        self.model, self.state, self.data, self.tcfg, self.strategy = model, state, data, tcfg, strategy
        self.seed, self.batch_size = int(cfg["seed"]), int(tcfg["batch_size"])
        losses = loss_params(tcfg)
        done = int(state.epoch)
        # (a finished run rerun: nothing to copy)
        on_device = tcfg["data_on_device"] and done < tcfg["epochs"]
        self.training_set = device_training_set(data, tcfg, self.seed, strategy) if on_device else None
        # Under a strategy each replica gathers its slice of the batch inside its step.
        examples = self.training_set.examples if on_device and strategy is not None else None
        train_step = make_train_step(model, state.optimizer, input_shape=model.image_shape, losses=losses,
                                     xla=tcfg["xla"], strategy=strategy, all_reduce=all_reduce,
                                     two_digits=data.two_digits, weight_average=state.average, examples=examples)
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
                                        two_digits=data.two_digits, **losses)
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
            sizes = sorted({min(test_batch, data.test_examples), data.test_examples % test_batch} - {0})
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
        """One epoch (train_epoch) → (train means, global step); Ctrl-C's save and Interrupted, a
        non-finite step's TrainingDiverged, a device out of memory in one line."""
        tcfg, epoch_number = self.tcfg, int(self.state.epoch) + 1
        try:
            means, global_step, stopped_at = train_epoch(
                self.train_steps, iterator, global_step=global_step, num_examples=self.data.examples_per_epoch,
                batch_size=self.batch_size, steps_per_execution=tcfg["steps_per_execution"],
                log_every_steps=tcfg["log_every_steps"], writer=summaries.writer,
                learning_rate=self.next_learning_rate, progress_bar=tcfg["progress_bar"],
                loss_scale=loss_scale(self.state.optimizer), first_step=start_step,
                # train.data_on_device's epochs cannot start mid-way: a Ctrl-C there stops at the epoch's end.
                stop=control.stop_asked if self.training_set is None else None, report=report,
                after_compile=self.start_eval_compile)
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
            control.run.save_interrupted(global_step)
            summaries.close()
            raise Interrupted(f"interrupted at step {stopped_at} of {self.data.steps_per_epoch} in epoch "
                              f"{epoch_number}: saved; {control.resume_hint()} from there")
        return means, global_step

    def start_eval_compile(self):
        """The test step's compilation, in its thread (compile_eval_step), if it is still to start."""
        if self.eval_compile is not None:
            self.eval_compiled, self.eval_compile = self.eval_compile(), None

    def test_pass(self, summaries=None, step=None):
        """(test, raw_test): the test split through eval_step with the run's weights (with a
        weight average, the average's; raw_test then the trained weights', else None); with
        `summaries`, the epoch's test summaries at `step` too."""
        average, model, data = self.state.average, self.model, self.data
        if self.eval_compiled is not None:  # the test step's compilation, started beside the training
            self.eval_compiled.result()
        self.eval_compile = self.eval_compiled = None  # (an epoch of one call: compiled here)
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

    def figures(self, summaries, step):
        """train.figures: capsnet.figures' pictures of the run's weights (the test pass's: with a
        weight average, the average's) on the first FIGURE_EXAMPLES test examples, in TensorBoard
        (RunSummaries.figures). Not for two-digit data (its examples have two labels)."""
        if not self.tcfg["figures"] or self.data.two_digits or not summaries.chief:
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
    if data.two_digits:
        return DevicePairSet(split.images, split.labels, batch_size=batch_size, seed=seed,
                             shift_pixels=augmentation["shift_pixels"], pad_pixels=task.cfg.get("pad_pixels"),
                             **{key: augmentation[key] for key in config.OVERLAY_AUGMENTATION})
    return DeviceTrainingSet(split.images, split.labels, batch_size=batch_size, seed=seed, **augmentation)


def epoch_line(number, train_means, test, raw_test, is_best, collapse, seconds, phases):
    """The epoch's line: its train and test results, and where its wall time went."""
    test_line = ""
    if test is not None:
        raw = f" (trained weights: {raw_test['accuracy']:.4f})" if raw_test is not None else ""
        test_line = (f" | test loss {test['loss']:.4f} acc {test['accuracy']:.4f}{raw}"
                     f"{' (best)' if is_best else ''}{f' [COLLAPSED: {collapse}]' if collapse else ''}")
    return (f"epoch {number}: train loss {train_means['loss']:.4f} acc {train_means['accuracy']:.4f}{test_line} | "
            f"{seconds:.2f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))


def final_metrics(test, raw_test, run, state, global_step, strategy, dcfg):
    """metrics.json's values: the last test pass, the history's, the run's."""
    history = run.history
    tested = [h for h in history if "test_accuracy" in h]
    return {
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "test_margin_loss": test["margin_loss"],
        "test_reconstruction_loss": test["reconstruction_loss"],
        "test_per_class_accuracy": test["per_class_accuracy"],
        "test_raw_accuracy": raw_test["accuracy"] if raw_test is not None else None,  # the trained weights' (EMA on)
        "train_loss": history[-1]["train_loss"] if history else None,
        "train_accuracy": history[-1]["train_accuracy"] if history else None,
        "images_per_sec": mean_images_per_sec(history),
        "test_images_per_sec": test["images_per_sec"],
        "best_test_accuracy": float(state.best_accuracy),
        "best_epoch": max(tested, key=lambda h: h["test_accuracy"])["epoch"] if tested else None,
        "epochs": int(state.epoch),
        "global_step": global_step,  # the steps run
        "optimizer_updates": steps_done(state.optimizer),  # the steps applied: fewer by the overflow-skipped
        "resumed_from": run.resumed_from,
        "run_dir": str(run.path),
        "distribute": dcfg["strategy"],
        "replicas": strategy.num_replicas_in_sync if strategy is not None else 1,
        "history": history,
    }


def built_ahead(build, items):
    """(item, build(item)) for each of `items`, the next one's build(item) running on a
    thread while the caller works on this one.

    Why: an epoch's input (its draws, its tf.data pipeline, its iterator and the captured
    images) takes ~0.25 s to build on 2 cores (MNIST, docs/benchmarks.md), time the GPU
    would wait between epochs. Built during the epoch before, it is ready when the epoch
    starts. What build(item) returns does not depend on when or on which thread it runs
    (each epoch's batches are keyed by (seed, epoch)); its exceptions reach the caller at
    that item.
    """
    items = list(items)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="capsnet-next-epoch") as ahead:
        upcoming = ahead.submit(build, items[0]) if items else None
        for i, item in enumerate(items):
            built = upcoming.result()
            upcoming = ahead.submit(build, items[i + 1]) if i + 1 < len(items) else None
            yield item, built


def live_progress_bar(progress_bar):
    """Whether train.progress_bar draws a live bar (on a terminal; in a log file: one line
    per epoch instead)."""
    return bool(progress_bar) and sys.stdout.isatty()


def steps_per_call(steps_per_epoch, steps_per_execution, progress_bar):
    """The most steps train_epoch runs in one call: steps_per_execution, or with a live
    progress bar (train.progress_bar on a terminal) at most 1/20 of the epoch: the bar moves
    only when a call's values are fetched, so it then moves ~20 times an epoch whatever
    steps_per_execution is (the same steps and values; at 469 steps an epoch, 24-step
    calls, whose host overhead is negligible)."""
    if live_progress_bar(progress_bar):
        return min(steps_per_execution, max(1, math.ceil(steps_per_epoch / 20)))
    return steps_per_execution


def format_duration(seconds):
    """'42 s', '7 min 05 s', '2 h 13 min'."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """The progress of a run inside its epochs: train_epoch's `report`.

    Estimates the run's time left from the step time measured (the steps left of this and
    the later epochs) and the test passes left (the last one's time; before the first, the
    test split at the training's images/s), prints once, after the first timed steps of
    this process, the estimated time of the whole run, and, when stdout is not a terminal
    (a log file, a job scheduler: no live bar), a line every `every` seconds inside an
    epoch: steps done, images/s, the ETA of the epoch and of the run. `run_eta`: the
    latest estimate of the run's seconds left (the live bar shows it)."""

    def __init__(self, *, epochs, steps_per_epoch, batch_size, test_examples, test_every_epochs, every, live):
        self.epochs, self.steps_per_epoch, self.batch_size = epochs, steps_per_epoch, batch_size
        self.test_examples, self.test_every_epochs = test_examples, test_every_epochs
        self.every, self.live = every, live
        self.epoch = None  # 1-based, the epoch training
        self.test_seconds = None  # the last test pass's
        self.run_eta = None
        self.announced = False
        self.last_line = None

    def start_epoch(self, epoch_number):
        self.epoch = epoch_number
        self.last_line = time.perf_counter()

    def tested(self, seconds):
        self.test_seconds = seconds

    def __call__(self, step_in_epoch, seconds_per_step, images_per_sec=None):
        epoch_left = (self.steps_per_epoch - step_in_epoch) * seconds_per_step
        later_epochs = self.epochs - self.epoch
        tests_left = sum(1 for e in range(self.epoch, self.epochs + 1) if on_schedule(e, self.test_every_epochs,
                                                                                        self.epochs))
        test_seconds = (self.test_seconds if self.test_seconds is not None else
                        self.test_examples * seconds_per_step / self.batch_size)
        self.run_eta = epoch_left + later_epochs * self.steps_per_epoch * seconds_per_step + tests_left * test_seconds
        if not self.announced:
            self.announced = True
            total = self.epochs * self.steps_per_epoch * seconds_per_step + self.test_passes() * test_seconds
            say(f"estimated time of the run: {format_duration(total)} for {self.epochs} epochs "
                f"({format_duration(self.run_eta)} left; {seconds_per_step:.3g} s a step, "
                f"{self.steps_per_epoch} steps an epoch)")
        now = time.perf_counter()
        if not self.live and self.every and now - self.last_line >= self.every and step_in_epoch < self.steps_per_epoch:
            self.last_line = now
            speed = f", {images_per_sec:.1f} images/s" if images_per_sec else ""
            say(f"epoch {self.epoch}: step {step_in_epoch}/{self.steps_per_epoch}{speed}, epoch ETA "
                f"{format_duration(epoch_left)}, run ETA {format_duration(self.run_eta)}")

    def test_passes(self):
        return sum(1 for e in range(1, self.epochs + 1) if on_schedule(e, self.test_every_epochs, self.epochs))


# The longest a train_steps call may take, as far as the step time allows (at least one
# step a call): Ctrl-C acts between calls, so on a CPU, where a paper-model step takes
# ~1.2 s, a call of steps_per_execution=50 steps kept it waiting ~60 s. On a GPU a call of
# 50 steps takes well under this: steps_per_execution decides there.
CALL_SECONDS = 1.0


def train_epoch(train_steps, iterator, *, global_step, num_examples, batch_size, steps_per_execution,
                log_every_steps, writer, learning_rate, progress_bar=True, loss_scale=None, first_step=0,
                stop=None, report=None, after_compile=None):
    """One epoch of `train_steps` calls (make_train_loop, or make_device_train_loop with a
    DeviceEpoch as `iterator`) over `iterator`'s batches, from step `first_step` of the
    epoch on (a resumed epoch: `iterator` then starts at that step's batch).

    Returns (means, global_step, stopped_at): the epoch's example-weighted step values (loss,
    margin_loss, reconstruction_loss, accuracy; images_per_sec and step_time_ms of the
    timed steps) of the steps run here, the global step after them (`global_step`: before
    them), and None, or, if `stop()` turned true (Ctrl-C), the step of the epoch that the
    steps ran up to (the epoch unfinished; every step run is fetched and checked).
    The train/ scalars go to `writer` every log_every_steps steps and at the epoch's end,
    with the LR of the next update (`learning_rate()`, read after the steps are fetched) and
    the dynamic loss scale (a variable, mixed_float16) if `loss_scale` is one.
    `report(step_in_epoch, seconds_per_step)`, if given, is called after each fetch of timed
    steps (the progress lines and the run's ETA: capsnet.training.loop.Progress);
    `after_compile()`, if given, once the epoch's first timed steps are fetched: the calls that
    compile (the first, of one step, and the first of full length) have returned by then.

    The calls run on a worker thread while this (the main) thread waits for them: Python
    runs a signal handler only between bytecodes of the main thread, so Ctrl-C's handler
    runs at once, not when a call of several seconds returns.
    """
    steps_per_epoch = math.ceil(num_examples / batch_size)
    live = live_progress_bar(progress_bar)
    bar = Progbar(steps_per_epoch, verbose=1 if live else 2,
                  stateful_metrics=["loss", "accuracy", "images/s", "run ETA"]) if progress_bar else None
    per_call = steps_per_call(steps_per_epoch, steps_per_execution, progress_bar)
    epoch_window, log_window = MetricWindow(), MetricWindow()
    pending = []  # (per-step outputs still on the device, their batch sizes)
    tick = time.perf_counter()
    step_in_epoch = first_step
    seconds_per_step = None  # of the timed steps so far: bounds a call's length (CALL_SECONDS)
    stopped_at = None
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="capsnet-steps") as worker:
        while step_in_epoch < steps_per_epoch:
            first = step_in_epoch == first_step
            length = 1 if first else next_execution_length(steps_per_epoch - step_in_epoch, global_step, per_call,
                                                           log_every_steps)
            if seconds_per_step:
                length = max(1, min(length, int(CALL_SECONDS / seconds_per_step)))
            # The global batch of each step: full but for an epoch's last (counted here: under
            # a strategy, a replica's batch holds only its slice of it).
            sizes = [min(batch_size, num_examples - (step_in_epoch + i) * batch_size) for i in range(length)]
            batch_sizes = tf.constant(sizes + [0] * (steps_per_execution - length), tf.int32)  # (steps_per_execution,)
            pending.append((worker.submit(train_steps, iterator, batch_sizes).result(), sizes, global_step))
            step_in_epoch += length
            global_step += length
            log_now = global_step % log_every_steps == 0
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
            if not first:
                if seconds_per_step is None and after_compile is not None:
                    after_compile()
                seconds_per_step = (now - tick) / len(fetched)
            pending, tick = [], now
            if log_now or (stopping and log_window.examples):
                write_train_scalars(writer, log_window, learning_rate(), global_step, loss_scale)
                log_window = MetricWindow()
            if bar is not None:
                means = epoch_window.means()
                shown = [("loss", means["loss"]), ("accuracy", means["accuracy"])]
                if "images_per_sec" in means:  # none yet after the epoch's first (untimed) step
                    shown.append(("images/s", means["images_per_sec"]))
                if live and report is not None and report.run_eta is not None:
                    # A value of its own: the bar's ETA is the epoch's.
                    shown.append(("run ETA", format_duration(report.run_eta)))
                bar.update(step_in_epoch, shown)
                console.bar_line_open(live and not last)  # at the epoch's end the bar ends its line
            if report is not None and seconds_per_step is not None:
                report(step_in_epoch, seconds_per_step, epoch_window.means().get("images_per_sec"))
            if stopping and not last:
                stopped_at = step_in_epoch
                break
    assert not pending, "the last step run is always fetched"
    if log_window.examples:
        write_train_scalars(writer, log_window, learning_rate(), global_step, loss_scale)
    return epoch_window.means(), global_step, stopped_at


class Progbar(keras.utils.Progbar):
    """keras' progress bar, where a value given as text is shown as it is in the live bar
    (verbose=1): the run's ETA in format_duration's words, as the progress lines say it
    ("run ETA: 3 min 28 s"), not a float of minutes: keras' own update takes numbers only."""

    def update(self, current, values=None, finalize=None):
        numbers = []
        for name, value in values or []:
            if name not in self._values_order:  # in the order given, texts among numbers
                self._values_order.append(name)
            if isinstance(value, str):
                self._values[name] = value  # not a [sum, count] list: the live bar writes it as it is
            else:
                numbers.append((name, value))
        super().update(current, numbers, finalize)


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


def history_entry(epoch, global_step, learning_rate, train_means, test=None, raw_test=None, collapse=None):
    """The epoch's line of history.jsonl: train_* means, and for an epoch with a test pass
    (test not None) its test_* results (and the trained weights' test_raw_* beside a weight
    average's test) and whether it looked collapsed (collapse_reason: `collapsed`, and the
    reason as `collapse`)."""
    entry = {"epoch": epoch, "global_step": global_step, "learning_rate": learning_rate,
             **{f"train_{k}": v for k, v in train_means.items()}}
    if test is None:
        return entry
    return {**entry,
            **{f"test_{k}": test[k] for k in ("loss", "margin_loss", "reconstruction_loss", "accuracy",
                                              "images_per_sec")},
            "test_max_length": test.get("max_length"), "collapsed": collapse is not None,
            **({"collapse": collapse} if collapse is not None else {}),
            **({f"test_raw_{k}": raw_test[k] for k in ("loss", "accuracy")} if raw_test is not None else {})}
