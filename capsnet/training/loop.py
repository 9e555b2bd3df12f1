"""Train CapsNet: `train(cfg) -> metrics`, the body of `python train.py`.

Reads top to bottom like the loop it is: config → set-up (devices, the run dir locked,
the model, the data, optimizer and checkpoint: new, or resumed from the run dir's last
checkpoint; the compiled steps) → epochs → final metrics. `cfg` is a plain dict shaped
like configs/train.yaml (train.py converts Hydra's config at the boundary); nothing here
sees a Hydra object.

Each piece has its module in capsnet.training: one epoch's steps (epoch), the signals and
where the run is (control), the progress bar, lines and ETA (progress), non-finite steps
and collapse (health), the process's XLA flags (xla_flags). The run dir (what it holds,
who writes it, how a failed write ends): RunDir (run_dir); TensorBoard: RunSummaries
(summaries). Rerunning with the same run dir resumes it; how, what an epoch commits and
which config changes a resume refuses: checkpoints. Several devices (the chief alone
writes the run dir): distribute.
"""
import concurrent.futures
import contextlib
import logging
import math
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from capsnet import config
from capsnet.console import say
from capsnet.errors import ConfigError, Interrupted
from capsnet.precision import set_tensor_float_32
from capsnet.tasks import task_for
from capsnet.tasks.images import files_gone
from capsnet.training.checkpoints import checkpoint_weights
from capsnet.training.control import RunControl, on_schedule
from capsnet.training.distribute import (check_all_reduce, check_global_batch, check_tf_config, check_workers_agree,
                                         is_chief, make_strategy, resolve_all_reduce, set_memory_growth,
                                         trains_on_gpu, without_autotune_thread)
from capsnet.training.epoch import CompiledSteps
from capsnet.training.health import collapse_reason, collapsed, collapsed_for
from capsnet.training.model_setup import build_capsnet, check_op_library
from capsnet.training.optimizer import build_optimizer, checkpoint_nodes, scaled_learning_rate, steps_done
from capsnet.training.progress import Progress, live_progress_bar
from capsnet.training.run_dir import RunDir, history_entry
from capsnet.training.run_lock import complete_run_notice
from capsnet.training.steps import eval_batch_size, set_determinism
from capsnet.training.summaries import RunSummaries, mean_images_per_sec
from capsnet.training.weight_average import WeightAverage
from capsnet.training.xla_flags import set_xla_flags

log = logging.getLogger(__name__)


def train(cfg, *, checked=False, hydra_files=None, resume_command=None, lock=None):
    """Train (or resume) the run in cfg["run_dir"]; returns the final metrics (also metrics.json).

    `checked`: cfg is config.check's result already (train.py checks it before importing
    TensorFlow); else it is checked here. `hydra_files`: Hydra's .hydra/ snapshot, written
    once the run dir is locked (RunDir.take). `resume_command`: the command that resumes
    the run, named in the Ctrl-C and SIGTERM lines (train.py's, with hydra.run.dir). `lock`:
    the run dir's RunLock if the caller took it (train.py, before its first log line).

    The run dir (capsnet.training.run_dir.RunDir) is locked for the run's life (one training
    per run dir) before anything is said, released however train() ends. SIGTERM (a job's time limit, a preemption)
    stops the run at the end of the epoch it is in, saved (errors.Terminated); a second
    SIGTERM stops it at once. Ctrl-C (SIGINT) stops it after the steps running, saved
    (checkpoints/interrupted/, errors.Interrupted naming the step); a second Ctrl-C at once
    (capsnet.training.control.RunControl)."""
    control = RunControl(resume_command)
    try:
        return _train(cfg if checked else config.check(cfg), control, hydra_files, lock)
    except KeyboardInterrupt as interrupt:
        if isinstance(interrupt, Interrupted):
            raise
        raise Interrupted(control.interrupted()) from None
    except tf.errors.NotFoundError as exc:  # an image file gone mid-epoch (data.cache=none): one line
        raise files_gone(exc) or exc
    finally:
        control.restore_signals()
        if control.run is not None:
            control.run.close()
        elif lock is not None:
            lock.release()


def _train(cfg, control, hydra_files, lock):
    """train()'s body: set-up, then the epoch loop; keeps `control` (RunControl) told where
    the run is, its RunDir in control.run (closed by train())."""
    marks = [("start", time.perf_counter())]  # where the set-up's seconds go, logged before the first epoch
    model_cfg, data_cfg, tcfg, dcfg = (dict(cfg[section]) for section in ("model", "data", "train", "distribute"))
    check_tf_config(dcfg["strategy"])
    if data_cfg.get("dir") is not None:  # absolute, so evaluate.py finds the data from any working directory
        data_cfg["dir"] = str(Path(data_cfg["dir"]).expanduser().resolve())
    cfg = {**cfg, "data": data_cfg}
    run = control.run = RunDir.open(cfg, lock)  # ours? resumable with this config? before any work
    seed, batch_size = int(cfg["seed"]), int(tcfg["batch_size"])
    strategy, notices = set_up_devices(cfg)
    scope = strategy.scope if strategy is not None else contextlib.nullcontext
    run.take(is_chief(strategy), hydra_files)  # locked before anything is said or the data read
    control.handle_signals(multi_worker=dcfg["strategy"] == "multi_worker")  # a SIGTERM in the load: one line
    for notice in notices:
        say(notice)
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
                      test_examples=data.test_examples + data.validation_examples,  # the passes after an epoch
                      test_every_epochs=tcfg["test_every_epochs"],
                      every=tcfg["progress_every_seconds"], live=live_progress_bar(tcfg["progress_bar"]),
                      long_run_seconds=0 if trains_on_gpu(strategy) else 60 * tcfg["long_run_notice_minutes"])
    test = raw_test = None
    epochs = range(resumed_epoch, tcfg["epochs"])
    for epoch_index, iterator in built_ahead(lambda e: steps.epoch_input(e, first_step, resumed_epoch), epochs):
        number = epoch_index + 1
        control.epoch = number
        start_step = first_step if epoch_index == resumed_epoch else 0
        say(f"epoch {number}/{tcfg['epochs']}" + (f" (from step {start_step})" if start_step else ""))
        clock = [time.perf_counter()]  # the epoch's phases end: train, test (with its summaries), save
        report.start_epoch(number)
        train_means, global_step, resumed = steps.train(iterator, global_step, start_step, summaries, report,
                                                        control)
        clock.append(time.perf_counter())
        test = raw_test = validation = collapse = None
        if on_schedule(number, tcfg["test_every_epochs"], tcfg["epochs"]):
            validation = steps.validation_pass(summaries, global_step)
            test, raw_test = steps.test_pass(summaries, global_step)
            report.tested(time.perf_counter() - clock[-1])
            collapse = collapse_reason(test, number, model.num_classes, data.task.label_format.per_example)
            summaries.collapse(global_step, test, collapse, number)
        is_best = state.new_best(validation if data.validation_ds is not None else test)
        state.epoch.assign(number)
        run.append_history(history_entry(number, global_step, steps.next_learning_rate(), train_means, test,
                                         raw_test, collapse, validation, resumed))
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
        say(epoch_line(number, train_means, test, raw_test, is_best, collapse, clock[-1] - clock[0], phases,
                       validation))
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
    (None = one device; multi_worker configures the process's collective ops then): (strategy,
    the notices to say once the run dir is locked)."""
    tcfg, dcfg = cfg["train"], cfg["distribute"]
    replaced = set_xla_flags(tcfg["xla"], tcfg["xla_cache_dir"])
    notices = [f"notice: {replaced}"] if replaced else []
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
        notices.append("notice: train.data_on_device=true on a CPU: the paper model's steps take minutes each "
                       "(docs/benchmarks.md); it is for GPUs (on a CPU: speed=none, or train.data_on_device=false)")
    elif tcfg["xla"] == "jit" and not trains_on_gpu(strategy):
        # Measured (docs/benchmarks.md, paper model, batch 100, 2 cores): 1,274-1,433 ms a step
        # against 1,203 with train.xla=none (with PrimaryCaps on blocks under jit; with its
        # strided convolution XLA's CPU input gradient made it ~20x).
        notices.append("notice: train.xla=jit on a CPU: each step is slower than with train.xla=none "
                       "(1.06-1.19x measured, docs/benchmarks.md); jit is for GPUs")
    return strategy, notices


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
        # data.validation_fraction: held out of the training split (capsnet.tasks.holdout).
        self.train_split, validation_split = task.load_train_validation(
            limit=data_cfg.get("limit_train"), fraction=data_cfg.get("validation_fraction") or 0.0)
        test_split = task.load("test", limit=data_cfg.get("limit_test"))
        task.check(self.train_split, model, "train")
        task.check(test_split, model, "test")
        self.validation_examples = len(validation_split) if validation_split is not None else 0
        self.validation_ds = None  # the validation pass's batches, as the test pass's
        if validation_split is not None:
            task.check(validation_split, model, "validation")
            self.validation_ds = without_autotune_thread(task.dataset(validation_split,
                                                                      batch_size=eval_batch_size(tcfg), training=False))
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
        # With it, the sums of that epoch's step values so far (MetricWindow.to_json; optional too).
        self.epoch_window = tf.Variable("", dtype=tf.string, trainable=False, name="epoch_window")
        self.checkpoint = tf.train.Checkpoint(**self.required, **optimizer_nodes, step_in_epoch=self.step_in_epoch,
                                              epoch_window=self.epoch_window)

    def new_best(self, result):
        """Whether the epoch's `result` (of the pass best/ is chosen on: the validation split's
        where the run holds one out, else the test split's; None: not tested) beats the best
        accuracy so far, which it then becomes."""
        if result is None or result["accuracy"] <= float(self.best_accuracy):
            return False
        self.best_accuracy.assign(result["accuracy"])
        return True


def epoch_line(number, train_means, test, raw_test, is_best, collapse, seconds, phases, validation=None):
    """The epoch's line: its train, validation (where the run holds one out) and test results,
    "(best)" beside the one best/ is chosen on, and where its wall time went."""
    test_line = ""
    if validation is not None:
        test_line = (f" | val loss {validation['loss']:.4f} acc {validation['accuracy']:.4f}"
                     f"{' (best)' if is_best else ''}")
    if test is not None:
        raw = f" (trained weights: {raw_test['accuracy']:.4f})" if raw_test is not None else ""
        test_line += (f" | test loss {test['loss']:.4f} acc {test['accuracy']:.4f}{raw}"
                      f"{' (best)' if is_best and validation is None else ''}"
                      f"{f' [COLLAPSED: {collapse}]' if collapse else ''}")
    return (f"epoch {number}: train loss {train_means['loss']:.4f} acc {train_means['accuracy']:.4f}{test_line} | "
            f"{seconds:.2f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))


def final_metrics(test, raw_test, run, state, global_step, strategy, dcfg):
    """metrics.json's values: the last test pass, the history's, the run's."""
    history = run.history
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
        **best_metrics(history, float(state.best_accuracy)),
        "epochs": int(state.epoch),
        "global_step": global_step,  # the steps run
        "optimizer_updates": steps_done(state.optimizer),  # the steps applied: fewer by the overflow-skipped
        "resumed_from": run.resumed_from,
        "run_dir": str(run.path),
        "distribute": dcfg["strategy"],
        "replicas": strategy.num_replicas_in_sync if strategy is not None else 1,
        "history": history,
    }


def best_metrics(history, best_accuracy):
    """metrics.json's account of checkpoints/best: the epoch chosen (`best_epoch`), what it was
    chosen on (`best_chosen_on`: "validation" where the run held a validation split out, else
    "test": then its test accuracy was the choice, an optimistic estimate) and its test accuracy
    (`best_test_accuracy`); with a validation split, `best_validation_accuracy` too."""
    tested = [h for h in history if "test_accuracy" in h]
    on = "validation" if any("validation_accuracy" in h for h in tested) else "test"
    best = next((h for h in tested if h[f"{on}_accuracy"] == max(t[f"{on}_accuracy"] for t in tested)), None)
    return {"best_epoch": best["epoch"] if best else None, "best_chosen_on": on,
            "best_test_accuracy": best["test_accuracy"] if on == "validation" and best else best_accuracy,
            **({"best_validation_accuracy": best_accuracy} if on == "validation" else {})}


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
