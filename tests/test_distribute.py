"""distribute=mirrored / multi_worker against a one-device run of the same data.

The reference is train() on one device (distribute=none). MirroredStrategy runs over two
logical CPU devices, which must be set up before TensorFlow starts, so in a subprocess;
MultiWorkerMirroredStrategy runs as two train.py processes on localhost, each with its
TF_CONFIG. Both must reproduce the reference step by step: the per-step training losses
(TensorBoard, log_every_steps=1) and the final checkpoint, optimizer moments included.

The data: 53 training images at batch 16, so an epoch is 3 full batches and a short one
of 5, which the two replicas split 3 + 2: the loss must be the mean over the GLOBAL
batch for the steps to match. The Adam moments are compared too: they scale with the
gradient, which Adam's update divides out where gradients are large against its epsilon.
"""
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import yaml

from capsnet.errors import CheckpointError, ConfigError
from capsnet.training import train
from capsnet.training.optimizer import scaled_learning_rate
from conftest import REPO, compose_config, entry_point_env, read_events, repo_env, run_entry_point, tiny_overrides

# 53 = 3 × 16 + 5: a short last batch, split unevenly over two replicas; every step logged.
DATA = ["data.limit_train=53", "data.limit_test=48", "train.log_every_steps=1"]
STEPS_PER_EPOCH = 4
# float32 (eps 1.2e-7): a replicated step adds the same per-example terms in another order
# (two partial sums, then the all-reduce; under xla=jit also XLA's fusions), so the weights
# drift from the reference by about eps per step, compounded by Adam. Seen on CPU: per-step
# losses within 2e-7 relative (6e-7 with jit) and every checkpoint tensor within 1.2e-5 of
# its largest value after 12 steps; the bounds leave 90× room or more. A loss averaged per
# replica instead of over the global batch, or a gradient twice too large, broke the loss
# bound at 8 and at 11 of the 12 steps.
LOSS_RTOL = 1e-4
CHECKPOINT_TOL = 1e-3  # × the tensor's largest |value|
SUBPROCESS_TIMEOUT = 600  # seconds: a hang (a collective waiting for a peer) fails instead of blocking CI


def run_json_script(script, *args):
    """Run `script` (Python source) in a fresh interpreter with the repository importable,
    without TF_CONFIG and with no GPU visible (logical CPUs stand for the devices, also on a
    machine with a GPU); its last stdout line parsed as JSON. A failure shows its stderr."""
    env = repo_env()
    env.pop("TF_CONFIG", None)
    env["CUDA_VISIBLE_DEVICES"] = "-1"
    result = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def step_losses(run_dir):
    """The per-step training losses of a run (all its event files): [(step, loss)]."""
    return [(step, float(tf.make_ndarray(value.tensor))) for step, value in read_events(run_dir)["train/loss"]]


def assert_steps_match(run_dir, reference, steps):
    """The run logged steps 1..steps, with the reference's losses."""
    ours, theirs = step_losses(run_dir), reference["losses"][:steps]
    assert [s for s, _ in ours] == list(range(1, steps + 1))
    np.testing.assert_allclose([v for _, v in ours], [v for _, v in theirs], rtol=LOSS_RTOL)


def assert_checkpoints_match(prefix, reference_prefix):
    """Every tensor of two training checkpoints (weights, Adam moments and step, epoch,
    best accuracy) agrees, each within CHECKPOINT_TOL of its largest value."""
    ours, theirs = tf.train.load_checkpoint(str(prefix)), tf.train.load_checkpoint(str(reference_prefix))
    names = set(theirs.get_variable_to_shape_map()) - {"_CHECKPOINTABLE_OBJECT_GRAPH"}
    assert set(ours.get_variable_to_shape_map()) - {"_CHECKPOINTABLE_OBJECT_GRAPH"} == names
    assert any(name.startswith("optimizer/") for name in names)
    for name in sorted(names):
        mine, ref = ours.get_tensor(name), theirs.get_tensor(name)
        if np.asarray(ref).dtype.kind in "SUO":  # a string of the training state: the same
            np.testing.assert_array_equal(mine, ref, err_msg=name)
            continue
        np.testing.assert_allclose(mine, ref, rtol=0, atol=CHECKPOINT_TOL * float(np.abs(ref).max()), err_msg=name)


@pytest.fixture(scope="module")
def reference(tiny_idx_dir, tmp_path_factory):
    """The one-device run the distributed ones must reproduce: 3 epochs of 4 steps."""
    run_dir = tmp_path_factory.mktemp("one_device") / "run"
    metrics = train(compose_config("train", tiny_overrides(tiny_idx_dir, run_dir, *DATA, "train.epochs=3")))
    losses = step_losses(run_dir)
    assert [s for s, _ in losses] == list(range(1, 3 * STEPS_PER_EPOCH + 1))
    return {"run_dir": run_dir, "metrics": metrics, "losses": losses}


# --------------------------------------------------------------------------- mirrored

# In a fresh process: two logical CPU devices (before TensorFlow starts), a spy that notes
# where each replica's compiled op runs, then train() on the configs of argv[1] in order.
# Prints {name: metrics or the ConfigError, "op_devices": [...]} as JSON on its last line.
MIRRORED_SCRIPT = r"""
import json, sys
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import numpy as np
from capsnet import ops
from capsnet.errors import ConfigError, TrainingDiverged
from capsnet.training import train
from capsnet.training import steps as steps_module

op_devices = []

def spy_on(name):
    real_op = getattr(ops, name)

    def spy(u, W, *args, **kwargs):
        out = real_op(u, W, *args, **kwargs)
        if not tf.executing_eagerly():  # the train step, traced once per replica (not check_op_library's probe)
            op_devices.append((out[0] if isinstance(out, tuple) else out).device)
        return out

    setattr(ops, name, spy)

spy_on("capsule_prediction")  # model.routing=tf
spy_on("capsule_routing")     # custom_op=true's default
real_losses = steps_module.capsnet_losses


def nan_after(k):
    # The loss of every replica's capsnet_losses call after the k-th is NaN (the guard's test).
    calls = tf.Variable(0)

    def poisoned(*args, **kwargs):
        total, margin, reconstruction = real_losses(*args, **kwargs)
        calls.assign_add(1)
        return tf.where(calls > k, np.nan, total), margin, reconstruction

    return poisoned


# distribute.all_reduce=xla's replica step without XLA (which compiles no collective for a
# CPU): each replica's own function, called as it is, its all-reduce then a merge of the
# replicas' threads, and the devices' check skipped. What remains under test: each replica
# updating its own copies and step counter with the all-reduced gradients.
from capsnet.training import distribute as distribute_module

real_compiled, real_check = distribute_module.compiled_per_replica, distribute_module.check_compiled_all_reduce_devices


def uncompiled_per_replica(make_fn):
    made = {}

    def run(*args):
        replica = int(tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group))
        if replica not in made:
            made[replica] = make_fn(replica)
        return made[replica](*args)

    return run


def uncompiled(on):
    for module in (distribute_module, steps_module):
        module.compiled_per_replica = uncompiled_per_replica if on else real_compiled
        module.check_compiled_all_reduce_devices = (lambda strategy: None) if on else real_check


report = {}
for name, cfg in json.loads(sys.argv[1]):
    steps_module.capsnet_losses = nan_after(5) if name == "diverging" else real_losses
    uncompiled(name.startswith("uncompiled"))
    try:
        metrics = train(cfg)
        report[name] = {k: metrics[k] for k in ("test_accuracy", "test_loss", "global_step", "epochs", "replicas",
                                                "distribute", "resumed_from")}
        # Which replica step ran (the uncompiled stand-in must not outlive its config).
        report[name]["compiled_helper"] = steps_module.compiled_per_replica is real_compiled
    except ConfigError as exc:
        report[name] = {"error": str(exc)}
    except TrainingDiverged as exc:
        report[name] = {"diverged": str(exc)}
report["op_devices"] = sorted(set(op_devices))
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def mirrored(tiny_idx_dir, tmp_path_factory):
    """The mirrored runs, over /cpu:0 and /cpu:1, in one subprocess:
    indivisible: train.batch_size=15 (a ConfigError); run: 2 epochs, then resumed for a third
    with custom_op=true; jit: 1 epoch with train.xla=jit (jit_op: with custom_op=true too);
    diverging: NaN losses from the 6th replica loss call on; loop: 3 epochs with
    train.steps_per_execution=3; ema: 1 epoch with train.ema_decay=0.5; fp16: 1 epoch with
    train.precision=mixed_float16 and custom_op=true (fp16_jit: and train.xla=jit)."""
    root = tmp_path_factory.mktemp("mirrored")
    two_cpus = ["distribute=mirrored", "distribute.devices=[/cpu:0,/cpu:1]"]

    def cfg(run_dir, *extra):
        return compose_config("train", tiny_overrides(tiny_idx_dir, root / run_dir, *DATA, *two_cpus, *extra))

    configs = [
        ("indivisible", cfg("indivisible", "train.batch_size=15")),
        ("first", cfg("run", "train.epochs=2")),
        ("resumed", cfg("run", "train.epochs=3", "custom_op=true")),
        ("jit", cfg("jit", "train.epochs=1", "train.xla=jit")),
        # The whole replica step under jit with the compiled (fused) op in it: XLA custom calls.
        ("jit_op", cfg("jit_op", "train.epochs=1", "train.xla=jit", "custom_op=true")),
        # The non-finite guard under the strategy: NaN losses from the 6th replica call on.
        ("diverging", cfg("diverging", "train.epochs=2")),
        # Several steps per call (a loop over the distributed iterator): calls of 1 + 3 steps
        # an epoch, the 3 ending at the log step.
        ("loop", cfg("loop", "train.epochs=3", "train.steps_per_execution=3", "train.log_every_steps=4")),
        # A moving average of the weights, updated in each replica's step.
        ("ema", cfg("ema", "train.epochs=1", "train.ema_decay=0.5")),
        # Mixed precision under the strategy: the fused op in float16 with loss scaling.
        ("fp16", cfg("fp16", "train.epochs=1", "train.precision=mixed_float16", "custom_op=true")),
        # The same under jit: each device's Adam update compiled inside the loss scaling's
        # skip-on-overflow (compile_replica_updates).
        ("fp16_jit", cfg("fp16_jit", "train.epochs=1", "train.precision=mixed_float16", "custom_op=true",
                         "train.xla=jit")),
        # The all-reduce and Adam's update compiled into the replica's step: XLA has no
        # collective for CPU devices, so two are refused; on one the all-reduce is the identity
        # and the compiled update must train as Keras' does (3 epochs: its checkpoint too).
        ("xla_cpus", cfg("xla_cpus", "train.epochs=1", "train.xla=jit", "distribute.all_reduce=xla")),
        # The same replica step on both CPUs, run without XLA (MIRRORED_SCRIPT's uncompiled):
        # each replica's copies and step counter; with a weight average, updated after it.
        ("uncompiled_xla", cfg("uncompiled_xla", "train.epochs=1", "distribute.all_reduce=xla", "train.xla=jit",
                               "train.ema_decay=0.5")),
        ("xla_one", compose_config("train", tiny_overrides(
            tiny_idx_dir, root / "xla_one", *DATA, "distribute=mirrored", "distribute.devices=[/cpu:0]",
            "train.epochs=3", "train.xla=jit", "distribute.all_reduce=xla", "custom_op=true"))),
    ]
    return root, run_json_script(MIRRORED_SCRIPT, json.dumps(configs))


@pytest.mark.slow
def test_mirrored_over_two_devices_steps_like_one_device(mirrored, reference):
    root, report = mirrored
    first, resumed = report["first"], report["resumed"]
    assert (first["replicas"], first["distribute"], first["global_step"]) == (2, "mirrored", 2 * STEPS_PER_EPOCH)
    # Resumed under the strategy, with the compiled op this time: the third epoch continues the run.
    assert resumed["resumed_from"].endswith("checkpoints/latest/ckpt-2")
    assert (resumed["epochs"], resumed["global_step"]) == (3, 3 * STEPS_PER_EPOCH)
    assert_steps_match(root / "run", reference, 3 * STEPS_PER_EPOCH)  # across the two event files
    assert_checkpoints_match(root / "run" / "checkpoints" / "latest" / "ckpt-3",
                             reference["run_dir"] / "checkpoints" / "latest" / "ckpt-3")
    assert resumed["test_loss"] == pytest.approx(reference["metrics"]["test_loss"], rel=LOSS_RTOL)


@pytest.mark.slow
def test_mirrored_runs_the_compiled_op_on_every_replica(mirrored):
    _, report = mirrored
    devices = report["op_devices"]
    assert any(d.endswith("device:CPU:0") for d in devices) and any(d.endswith("device:CPU:1") for d in devices), \
        devices


@pytest.mark.slow
def test_mirrored_with_xla_jit_compiles_each_replica_and_steps_like_one_device(mirrored, reference):
    root, report = mirrored
    assert report["jit"]["global_step"] == STEPS_PER_EPOCH
    assert_steps_match(root / "jit", reference, STEPS_PER_EPOCH)


@pytest.mark.slow
def test_mirrored_with_xla_jit_and_the_op_steps_like_one_device(mirrored, reference):
    root, report = mirrored
    assert report["jit_op"]["global_step"] == STEPS_PER_EPOCH
    assert_steps_match(root / "jit_op", reference, STEPS_PER_EPOCH)


@pytest.mark.slow
def test_all_reduce_compiled_into_the_step_trains_like_keras_apply(mirrored, reference):
    """distribute.all_reduce=xla on one replica: the compiled step's own Adam update (Keras'
    update_step on the replica's copies, the LR from its counter, the counter +1) gives the
    one-device run's losses and every checkpoint tensor (weights, moments, step counter)."""
    root, report = mirrored
    run = report["xla_one"]
    assert (run["replicas"], run["global_step"], run["compiled_helper"]) == (1, 3 * STEPS_PER_EPOCH, True)
    assert_steps_match(root / "xla_one", reference, 3 * STEPS_PER_EPOCH)
    assert_checkpoints_match(root / "xla_one" / "checkpoints" / "latest" / "ckpt-3",
                             reference["run_dir"] / "checkpoints" / "latest" / "ckpt-3")


@pytest.mark.slow
def test_all_reduce_in_the_replica_step_updates_every_replicas_copies_like_one_device(mirrored, reference):
    """distribute.all_reduce=xla's replica step over two CPU replicas, without XLA (which
    compiles no collective for CPUs; its all-reduce is then a merge): each replica updates
    its own copies of the weights, Adam's moments and the step counter from the summed
    gradients: the losses (each replica's share computed with its own copies) follow the
    one-device run's, and the checkpoint (the first copies, and the moving average updated
    after each step) equals that of the `ema` run, the same training through
    TensorFlow's all-reduce and Keras' apply."""
    root, report = mirrored
    run = report["uncompiled_xla"]
    assert (run["replicas"], run["global_step"], run["compiled_helper"]) == (2, STEPS_PER_EPOCH, False)
    assert_steps_match(root / "uncompiled_xla", reference, STEPS_PER_EPOCH)
    assert_checkpoints_match(root / "uncompiled_xla" / "checkpoints" / "latest" / "ckpt-1",
                             root / "ema" / "checkpoints" / "latest" / "ckpt-1")


# distribute.compiled_per_replica over two CPU devices with XLA (a function with no
# collective, which XLA compiles for a CPU): each replica's function is made once, traced on
# its device, and reads and writes its own copy of a mirrored variable (10 and 20).
PER_REPLICA_SCRIPT = r"""
import json
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from capsnet.training.distribute import compiled_per_replica

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    v = tf.Variable(0.0)
for i, copy in enumerate(strategy.experimental_local_results(v)):
    copy.assign(10.0 * (i + 1))
made = []

def make(replica):
    made.append(replica)
    copy = strategy.experimental_local_results(v)[replica]

    def add(x):
        copy.assign_add(x)
        return copy.read_value() * 2.0

    return add

step = compiled_per_replica(make)
run = tf.function(lambda x: strategy.run(step, args=(x,)), autograph=False)
out = [[float(t) for t in strategy.experimental_local_results(run(tf.constant(1.0)))] for _ in range(2)]
print(json.dumps({"out": out, "made": made, "copies": [float(c) for c in strategy.experimental_local_results(v)]}))
"""


@pytest.mark.slow
def test_compiled_per_replica_gives_each_replica_its_own_compiled_function():
    report = run_json_script(PER_REPLICA_SCRIPT)
    assert sorted(report["made"]) == [0, 1]  # once each, not again on the second call
    assert report["out"] == [[22.0, 42.0], [24.0, 44.0]]  # each its own copy, + 1 a call, × 2
    assert report["copies"] == [12.0, 22.0]


@pytest.mark.slow
def test_mirrored_non_finite_guard_stops_at_the_first_nan_step(mirrored):
    """Each replica's loss call counts: the 6th call is a replica's of step 3, so step 3
    is the first non-finite one (its sum over the replicas is NaN); nothing is saved."""
    root, report = mirrored
    message = report["diverging"]["diverged"]
    assert message.startswith("training diverged at epoch 1, step 3: the loss is nan"), message
    assert not list((root / "diverging").glob("checkpoints/latest/ckpt-*.index"))


@pytest.mark.slow
def test_mirrored_with_several_steps_per_call_steps_like_one_device(mirrored, reference):
    root, report = mirrored
    assert report["loop"]["global_step"] == 3 * STEPS_PER_EPOCH
    # Logged every 4 steps: each value is the example-weighted mean of an epoch's 4 steps
    # (16, 16, 16 and 5 examples), which the reference logged one by one.
    losses = np.array([v for _, v in reference["losses"]]).reshape(3, STEPS_PER_EPOCH)
    examples = np.array([16, 16, 16, 5])
    ours = step_losses(root / "loop")
    assert [s for s, _ in ours] == [4, 8, 12]
    np.testing.assert_allclose([v for _, v in ours], losses @ examples / examples.sum(), rtol=LOSS_RTOL)
    assert_checkpoints_match(root / "loop" / "checkpoints" / "latest" / "ckpt-3",
                             reference["run_dir"] / "checkpoints" / "latest" / "ckpt-3")


@pytest.mark.slow
def test_mirrored_keeps_the_weight_average_like_one_device(mirrored, tiny_idx_dir, tmp_path):
    """train.ema_decay under the strategy: the averages (checkpoint node ema/, decay 0.5 so
    that 4 steps move them well away from the start) match a one-device run's, as do the
    weights and the test pass made with the averages."""
    root, report = mirrored
    one_device = tmp_path / "one_device"
    metrics = train(compose_config("train", tiny_overrides(tiny_idx_dir, one_device, *DATA, "train.epochs=1",
                                                           "train.ema_decay=0.5")))
    assert report["ema"]["global_step"] == STEPS_PER_EPOCH
    assert report["ema"]["test_loss"] == pytest.approx(metrics["test_loss"], rel=LOSS_RTOL)
    prefix = root / "ema" / "checkpoints" / "latest" / "ckpt-1"
    assert any(name.startswith("ema/") for name in tf.train.load_checkpoint(str(prefix)).get_variable_to_shape_map())
    assert_checkpoints_match(prefix, one_device / "checkpoints" / "latest" / "ckpt-1")


@pytest.mark.slow
@pytest.mark.parametrize("run", ["fp16", "fp16_jit"])
def test_mirrored_trains_in_mixed_float16_like_one_device_in_float32(mirrored, reference, run):
    """The LossScaleOptimizer under the strategy: every step applied (no overflow at the
    initial scale on this model), each within float16's rounding of the float32 reference."""
    root, report = mirrored
    assert report[run]["global_step"] == STEPS_PER_EPOCH
    ours = step_losses(root / run)
    assert [s for s, _ in ours] == list(range(1, STEPS_PER_EPOCH + 1))
    np.testing.assert_allclose([v for _, v in ours], [v for _, v in reference["losses"][:STEPS_PER_EPOCH]],
                               rtol=2e-2)
    saved = tf.train.load_checkpoint(str(root / run / "checkpoints" / "latest" / "ckpt-1"))
    names = saved.get_variable_to_shape_map()
    assert any(name.startswith("loss_scale/") for name in names)


@pytest.mark.slow
@pytest.mark.parametrize("run, start, detail", [
    ("indivisible", "train.batch_size=15 is the global batch and must divide evenly over the 2 replicas",
     "use a multiple of 2"),
    # distribute.all_reduce=xla over CPU replicas: XLA compiles no collective for them.
    ("xla_cpus", "distribute.all_reduce=xla needs GPUs: XLA compiles no collective for CPU devices", "CPU:1"),
])
def test_mirrored_refusals_are_one_line_before_the_run_dir(mirrored, run, start, detail):
    root, report = mirrored
    message = report[run]["error"]
    assert message.startswith(start)
    assert detail in message and "\n" not in message
    assert not (root / run).exists()  # refused before the run dir was made


# check_all_reduce over two logical CPU devices (a fresh process): the strategy's own
# all-reduce, then three broken ones patched into the replica context (one returns zeros,
# one each replica's own value unsummed, one fails when it runs), then train() of argv[1]'s
# config with the zeros one; prints {name: null or the AllReduceError's message, "train":
# ..., "first_gradient_elements": the size of the model's first trainable variable}.
ALL_REDUCE_SCRIPT = r"""
import json, math, sys
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from capsnet.errors import AllReduceError
from capsnet.training import train
from capsnet.training.distribute import check_all_reduce
from capsnet.training.model_setup import build_capsnet

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
real = tf.distribute.ReplicaContext.all_reduce
zeros = lambda self, op, value, options=None: [tf.zeros_like(v) for v in value]
report = {}
fails = lambda self, op, value, options=None: [tf.debugging.check_numerics(v * float("nan"), "probe") for v in value]
for name, patched in (("sums", real), ("zeros", zeros), ("unsummed", lambda self, op, value, options=None: value),
                      ("fails", fails)):
    tf.distribute.ReplicaContext.all_reduce = patched
    try:
        check_all_reduce(strategy, [(1 << 18,), (3, 3)])
        report[name] = None
    except AllReduceError as error:
        report[name] = str(error)
cfg = json.loads(sys.argv[1])
model = build_capsnet(cfg["model"], cfg["custom_op"], "float32")
report["first_gradient_elements"] = math.prod(model.trainable_variables[0].shape)
tf.distribute.ReplicaContext.all_reduce = zeros
try:
    train(cfg)
    report["train"] = None
except AllReduceError as error:
    report["train"] = str(error)
print(json.dumps(report))
"""


@pytest.mark.slow
def test_an_all_reduce_that_does_not_sum_is_refused_before_training(tiny_idx_dir, tmp_path):
    run_dir = tmp_path / "run"
    cfg = compose_config("train", tiny_overrides(tiny_idx_dir, run_dir, *DATA, "train.epochs=1", "distribute=mirrored",
                                                 "distribute.devices=[/cpu:0,/cpu:1]"))
    report = run_json_script(ALL_REDUCE_SCRIPT, json.dumps(cfg))
    assert report["sums"] is None
    assert report["zeros"] is not None, "an all-reduce that returns zeros passed the check"
    assert report["zeros"].startswith("distribute: the gradient all-reduce over /job:localhost/replica:0/task:0/"
                                      "device:CPU:0, /job:localhost/replica:0/task:0/device:CPU:1 "
                                      "(CollectiveAllReduce, RING) does not sum: local replica 0 received 0 where 3 (the "
                                      "sum of 1..2) was expected, in 262144 of 262144 elements"), report["zeros"]
    assert report["zeros"].endswith("Try distribute.all_reduce=one_device, or the NCCL library this TensorFlow was "
                                    "built against (nvidia-nccl-cu12 for TensorFlow 2.21)")
    # Replica 0 keeps its own 1, where 1 + 2 was due.
    assert report["unsummed"] is not None and "local replica 0 received 1 where 3" in report["unsummed"]
    assert report["fails"] is not None and report["fails"].startswith(
        "distribute: the all-reduce over /job:localhost/replica:0/task:0/device:CPU:0, "), report["fails"]
    assert "(CollectiveAllReduce, RING) does not run: " in report["fails"] and "probe" in report["fails"]
    # train() checks before its first step, on the gradients' shapes: the first is conv1's kernel.
    n = report["first_gradient_elements"]
    assert report["train"] is not None, "train() ran with an all-reduce that returns zeros"
    assert report["train"].startswith("distribute: the gradient all-reduce over ") and \
        f"local replica 0 received 0 where 3 (the sum of 1..2) was expected, in {n} of {n} elements" in \
        report["train"], report["train"]
    assert all("\n" not in report[name] for name in ("zeros", "unsummed", "fails", "train"))
    assert not list(run_dir.glob("checkpoints/latest/ckpt-*.index"))  # nothing trained, nothing saved


REPLICA_UPDATES_SCRIPT = r"""
import json
import keras
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from capsnet.training.optimizer import compile_replica_updates
from capsnet.training.steps import overflow_on_every_replica

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
rng = np.random.default_rng(0)
init = [rng.normal(size=(3, 4)).astype("float32"), rng.normal(size=(4,)).astype("float32")]
grads = [np.stack([rng.normal(size=w.shape) for _ in range(2)]).astype("float32") for w in init]  # [var][replica]
report = {"calls": 0}


def run(kind, compiled):
    with strategy.scope():
        variables = [keras.Variable(w) for w in init]
        schedule = keras.optimizers.schedules.ExponentialDecay(0.01, 1, 0.5)
        optimizer = keras.optimizers.Adam(learning_rate=0.01 if kind == "constant" else schedule)
        if kind == "loss_scale":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        optimizer.build(variables)
    adam = getattr(optimizer, "inner_optimizer", optimizer)
    if compiled:
        compile_replica_updates(optimizer)
        compile_replica_updates(optimizer)  # idempotent
        replaced = adam._distributed_tf_update_step

        def counted(*args):  # Keras must still call the method it replaced
            report["calls"] += 1
            return replaced(*args)
        adam._distributed_tf_update_step = counted

    @tf.function
    def step(i):
        def replica():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            scale = tf.cast(i + 1, tf.float32)
            local = [tf.gather(tf.constant(g), r) * scale for g in grads]
            if kind == "loss_scale":  # step 1 overflows on replica 1 alone: skipped on both, the scale halved
                local[0] *= tf.where(tf.logical_and(tf.equal(i, 1), tf.equal(r, 1)), np.inf, 1.0)
                finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in local])
                local = overflow_on_every_replica(local, finite)  # as the distributed train step does
            optimizer.apply_gradients(zip(local, variables))
        strategy.run(replica)
    for i in range(3):
        step(tf.constant(i))
    # [variable][replica copy]: the weights, then Adam's moments; and Adam's step counter
    tracked = [v.value for v in variables] + [m.value for m in adam._momentums + adam._velocities]
    return {"tracked": [[c.numpy().tolist() for c in strategy.experimental_local_results(t)] for t in tracked],
            "iterations": int(adam.iterations.numpy())}


for kind in ("schedule", "constant", "loss_scale"):
    report[kind] = {"keras": run(kind, False), "compiled": run(kind, True)}
print(json.dumps(report))
"""


def numpy_adam(weights, summed_grads, updates):
    """Keras' Adam (its defaults) in float64: weights, then first and second moments, after
    the `updates`, each (gradient factor, learning rate) applied to the summed gradients."""
    weights = [w.astype(np.float64) for w in weights]
    m, v = [np.zeros_like(w) for w in weights], [np.zeros_like(w) for w in weights]
    for t, (factor, lr) in enumerate(updates, start=1):
        alpha = lr * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        for k, g in enumerate(summed_grads):
            g = g * factor
            m[k] += (g - m[k]) * 0.1
            v[k] += (g * g - v[k]) * 0.001
            weights[k] -= m[k] * alpha / (np.sqrt(v[k]) + 1e-7)
    return weights + m + v


@pytest.mark.slow
def test_each_devices_adam_update_compiled_matches_numpy_adam_on_every_copy(tmp_path):
    """compile_replica_updates: the update of every device's copies, as one jit-compiled
    function a device, against NumPy's Adam on the summed gradients and against Keras' own
    per-variable loop (two logical CPUs, three steps): on a decaying LR, on a constant one
    (Keras passes its LR variable), and under a LossScaleOptimizer whose second step
    overflows on one replica alone (overflow_on_every_replica: skipped on every copy, the
    scale halves from 32768; without it Keras applied the step and every weight was NaN)."""
    report = run_json_script(REPLICA_UPDATES_SCRIPT)
    assert report["calls"] >= 3, "Keras did not call the replaced _distributed_tf_update_step"
    rng = np.random.default_rng(0)
    weights = [rng.normal(size=(3, 4)).astype("float32"), rng.normal(size=(4,)).astype("float32")]
    summed = [np.stack([rng.normal(size=w.shape) for _ in range(2)]).astype("float32").sum(axis=0) for w in weights]
    decaying = [0.01 * 0.5 ** step for step in range(3)]  # by Adam's counter of applied updates
    updates = {"schedule": [(1, decaying[0]), (2, decaying[1]), (3, decaying[2])],
               "constant": [(1, 0.01), (2, 0.01), (3, 0.01)],
               "loss_scale": [(1 / 32768, decaying[0]), (3 / 16384, decaying[1])]}
    for kind, applied in updates.items():
        expected = numpy_adam(weights, summed, applied)
        for path in ("keras", "compiled"):
            ran = report[kind][path]
            assert ran["iterations"] == len(applied), (kind, path)
            for tracked, want in zip(ran["tracked"], expected):
                assert len(tracked) == 2  # both devices' copies
                for copy in tracked:
                    # atol relative to the tensor: the loss-scaled moments are ~1e-10
                    np.testing.assert_allclose(np.array(copy), want, rtol=1e-5, atol=1e-6 * np.abs(want).max(),
                                               err_msg=f"{kind} {path}")


def test_all_reduce_error_names_the_first_wrong_element():
    from capsnet.training.distribute import all_reduce_error

    assert all_reduce_error([[np.full(5, 6.0), np.full((3, 3), 6.0)]] * 3, 3) is None
    assert all_reduce_error([[np.full(5, 6.0)], [np.array([6.0, 6.0, 2.0, 6.0, 0.0])]], 3) == (
        "local replica 1 received 2 where 6 (the sum of 1..3) was expected, in 2 of 5 elements")


@pytest.mark.slow
def test_a_mirrored_checkpoint_evaluates_on_one_device(mirrored, tmp_path):
    """evaluate.py is unchanged: the distributed run's checkpoint is an ordinary one."""
    from capsnet.evaluation import evaluate

    root, report = mirrored
    result = evaluate(root / "run", which="latest", output=tmp_path / "eval.json")
    assert result["epoch"] == 3
    assert result["accuracy"] == report["resumed"]["test_accuracy"]
    assert result["loss"] == pytest.approx(report["resumed"]["test_loss"], rel=1e-5)


# --------------------------------------------------------------------------- multi_worker

def free_ports(count):
    """Ports free right now on localhost (the OS picks them; closed again for the workers to bind)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_workers(data_dir, run_dirs, *overrides):
    """`python train.py distribute=multi_worker` as two workers on localhost, worker i writing
    to (and resuming from) run_dirs[i]; returns [(pid, CompletedProcess-like)] per worker."""
    cluster = {"worker": [f"localhost:{port}" for port in free_ports(len(run_dirs))]}
    workers = []
    for index, run_dir in enumerate(run_dirs):
        env = entry_point_env()
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        env["CUDA_VISIBLE_DEVICES"] = "-1"  # one CPU replica per worker, also on a machine with a GPU
        args = [*tiny_overrides(data_dir, run_dir, *DATA, *overrides), "distribute=multi_worker",
                f"hydra.run.dir={run_dir}"]
        workers.append(subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT
    results = []
    try:
        for worker in workers:
            stdout, stderr = worker.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((worker.pid, subprocess.CompletedProcess(worker.args, worker.returncode, stdout, stderr)))
    except subprocess.TimeoutExpired:
        for worker in workers:
            worker.kill()
            worker.communicate()
        pytest.fail(f"the workers did not finish in {SUBPROCESS_TIMEOUT} s (a collective waiting for a peer?)")
    return results


def event_file_pids(run_dir):
    # events.out.tfevents.<time>.<host>.<pid>.<n>.v2 (the host may contain dots)
    return {int(path.name.split(".")[-3]) for path in Path(run_dir).glob("events.out.tfevents.*")}


@pytest.mark.slow
def test_multi_worker_trains_like_one_device_writes_from_the_chief_only_and_resumes(
        tiny_idx_dir, tmp_path, reference):
    run_dir, worker_dir = tmp_path / "run", tmp_path / "worker1"

    # Two epochs. Worker 1 gets a run dir of its own, so that what it writes shows: nothing.
    (chief_pid, chief), (_, worker) = run_workers(tiny_idx_dir, [run_dir, worker_dir], "train.epochs=2")
    assert chief.returncode == 0 and worker.returncode == 0, chief.stderr[-2000:] + worker.stderr[-2000:]
    assert "not the chief" in worker.stdout and "not the chief" not in chief.stdout
    assert not worker_dir.exists() or not any(worker_dir.iterdir())
    assert {"config.yaml", "history.jsonl", "metrics.json", "checkpoints"} <= {p.name for p in run_dir.iterdir()}
    assert event_file_pids(run_dir) == {chief_pid}
    # Every worker evaluated the same weights: the same epoch lines (but for their seconds, the last part).
    epoch_lines = [[line.rsplit(" | ", 1)[0] for line in out.stdout.splitlines()
                    if line.startswith("epoch ") and ":" in line] for out in (chief, worker)]
    assert len(epoch_lines[0]) == 2 and epoch_lines[0] == epoch_lines[1]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics["replicas"], metrics["distribute"], metrics["global_step"]) == (2, "multi_worker", 8)

    # A third epoch, both workers on the shared run dir, with the compiled op per replica.
    (chief_pid_2, chief), (_, worker) = run_workers(tiny_idx_dir, [run_dir, run_dir], "train.epochs=3",
                                                    "custom_op=true")
    assert chief.returncode == 0 and worker.returncode == 0, chief.stderr[-2000:] + worker.stderr[-2000:]
    assert "resumed from" in worker.stdout and "ckpt-2" in worker.stdout
    assert event_file_pids(run_dir) == {chief_pid, chief_pid_2}  # worker 1 wrote no event file
    assert_steps_match(run_dir, reference, 3 * STEPS_PER_EPOCH)
    assert_checkpoints_match(run_dir / "checkpoints" / "latest" / "ckpt-3",
                             reference["run_dir"] / "checkpoints" / "latest" / "ckpt-3")
    assert len((run_dir / "history.jsonl").read_text().splitlines()) == 3
    history = (run_dir / "history.jsonl").read_text()

    # Worker 1 pointed at another (empty) run dir: it would start over while the chief goes on.
    # Both stop with one line instead of pairing different epochs' batches, or hanging.
    results = run_workers(tiny_idx_dir, [run_dir, worker_dir], "train.epochs=4")
    for _, result in results:
        assert result.returncode == 2, result.stderr[-2000:]
        assert "error: the workers restored different checkpoints" in result.stderr
        assert "every worker needs the same run dir" in result.stderr
    assert (run_dir / "history.jsonl").read_text() == history


# --------------------------------------------------------------------------- config

@pytest.mark.slow
def test_distribute_config_group_composes():
    for option, strategy in (("none", "none"), ("mirrored", "mirrored"), ("multi_worker", "multi_worker")):
        cfg = compose_config("train", [f"distribute={option}", "run_dir=/unused"])
        assert cfg["distribute"]["strategy"] == strategy
        assert set(cfg["distribute"]) == {"strategy", "devices", "all_reduce", "scale_lr", "lr_base_batch_size"}
    assert compose_config("train", ["run_dir=/unused"])["distribute"]["strategy"] == "none"  # the default


TF_CONFIG_ONE_WORKER = json.dumps({"cluster": {"worker": ["localhost:12345"]}, "task": {"type": "worker", "index": 0}})


@pytest.mark.slow
@pytest.mark.parametrize("overrides, tf_config, message", [
    (["distribute.strategy=horovod"], None,
     "distribute.strategy must be one of none, mirrored, multi_worker, got 'horovod'"),
    (["distribute.devices=[/cpu:0]"], None, "distribute.devices applies to distribute=mirrored only"),
    (["distribute=mirrored", "distribute.devices=[]"], None, "distribute.devices must be null or a non-empty list"),
    (["distribute=mirrored", "distribute.devices=[/cpu:0,/cpu:0]"], None,
     "distribute.devices lists a device more than once: ['/cpu:0', '/cpu:0']"),
    (["distribute=mirrored", "distribute.devices=[/gpu:7]"], None,
     "distribute.devices: /gpu:7 is not a device TensorFlow sees here"),
    (["distribute=mirrored", "distribute.all_reduce=ring"], None,
     "distribute.all_reduce must be one of auto, collective, xla, nccl, one_device with distribute=mirrored, got 'ring'"),
    (["distribute=mirrored", "distribute.all_reduce=xla"], None,
     "distribute.all_reduce=xla compiles the all-reduce into each replica's XLA step: it needs train.xla=jit, "
     "got train.xla='none'"),
    (["distribute=mirrored", "distribute.all_reduce=xla", "train.xla=jit", "train.precision=mixed_float16"], None,
     "distribute.all_reduce=xla has no loss scaling in its compiled update"),
    (["distribute.scale_lr=cubic"], None, "distribute.scale_lr must be one of none, linear, sqrt, got 'cubic'"),
    (["distribute.lr_base_batch_size=0"], None, "distribute.lr_base_batch_size must be a positive integer, got 0"),
    (["distribute=multi_worker"], None, "distribute=multi_worker needs the cluster in the TF_CONFIG environment"),
    (["distribute=multi_worker"], "{not json", "TF_CONFIG is not valid JSON"),
    (["distribute=multi_worker"], json.dumps({"cluster": {"worker": ["h:1"]}, "task": {"type": "ps", "index": 0}}),
     'TF_CONFIG needs a "task" with type "chief" or "worker"'),
    (["distribute=multi_worker"], json.dumps({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 1}}),
     "TF_CONFIG task index 1 is not one of the 1 worker address(es)"),
    # TensorFlow has started in this process: too late for collective ops (a -m sweep's second job).
    (["distribute=multi_worker"], TF_CONFIG_ONE_WORKER, "distribute=multi_worker must be set up before TensorFlow"),
])
def test_bad_distribute_values_are_one_line_config_errors_before_any_work(
        tiny_config, tmp_path, monkeypatch, overrides, tf_config, message):
    tf.constant(0.0)  # TensorFlow has started (as it has in a sweep's second job)
    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", tf_config)
    with pytest.raises(ConfigError) as err:
        train(tiny_config(*overrides))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


GPUS = ["/job:localhost/replica:0/task:0/device:GPU:0", "/job:localhost/replica:0/task:0/device:GPU:1"]
CPUS = ["/job:localhost/replica:0/task:0/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:1"]


@pytest.mark.parametrize("all_reduce, strategy, xla, precision, devices, resolved", [
    ("auto", "mirrored", "jit", "float32", GPUS, "xla"),
    ("auto", "mirrored", "jit", "mixed_bfloat16", GPUS, "xla"),
    ("auto", "mirrored", "jit", "mixed_float16", GPUS, "collective"),  # no loss scaling in the compiled update
    ("auto", "mirrored", "none", "float32", GPUS, "collective"),       # no compiled step to put it in
    ("auto", "mirrored", "autocluster", "float32", GPUS, "collective"),
    ("auto", "mirrored", "jit", "float32", CPUS, "collective"),        # XLA compiles no collective for CPUs
    ("auto", "mirrored", "jit", "float32", GPUS[:1], "collective"),    # one replica: nothing to all-reduce
    ("auto", "mirrored", "jit", "float32", [GPUS[0], CPUS[0]], "collective"),
    ("auto", "multi_worker", "jit", "float32", GPUS[:1], "nccl"),      # TensorFlow's auto would sum through the hosts
    ("auto", "multi_worker", "jit", "float32", CPUS[:1], "auto"),      # TensorFlow's pick: its ring
    ("ring", "multi_worker", "jit", "float32", GPUS, "ring"),
    ("collective", "mirrored", "jit", "float32", GPUS, "collective"),  # an explicit value is kept
    ("nccl", "mirrored", "jit", "float32", GPUS, "nccl"),
    ("xla", "mirrored", "jit", "float32", GPUS, "xla"),
])
def test_auto_all_reduce_is_the_compiled_one_where_it_applies(all_reduce, strategy, xla, precision, devices,
                                                              resolved):
    from capsnet.training.distribute import resolve_all_reduce

    assert resolve_all_reduce(all_reduce, strategy, xla, precision, devices) == resolved
    if resolved == "xla" and all_reduce == "auto":
        # Weight decay is applied outside the compiled update: auto falls back to TensorFlow's all-reduce.
        assert resolve_all_reduce(all_reduce, strategy, xla, precision, devices, weight_decay=0.01) == "collective"


@pytest.mark.slow
def test_the_compiled_all_reduce_with_weight_decay_is_a_one_line_config_error(tiny_config):
    from capsnet.config import check

    with pytest.raises(ConfigError, match=r"^distribute\.all_reduce=xla applies plain Adam updates, without weight "
                                          r"decay: set distribute\.all_reduce=collective or train\.weight_decay=0 "
                                          r"\(got 0\.01\)$"):
        check(tiny_config("distribute=mirrored", "train.xla=jit", "distribute.all_reduce=xla", "train.weight_decay=0.01"))


@pytest.mark.parametrize("scale_lr, base, factor", [("none", 100, 1.0), ("linear", 8, 2.0), ("linear", 64, 0.25),
                                                    ("sqrt", 4, 2.0), ("sqrt", 64, 0.5)])
def test_scaled_learning_rate(scale_lr, base, factor):
    assert scaled_learning_rate(0.01, 16, scale_lr, base) == pytest.approx(0.01 * factor)


@pytest.mark.slow
@pytest.mark.parametrize("scale_lr, base", [("linear", 8), ("sqrt", 4)])
def test_scale_lr_sets_the_learning_rate_train_uses(tiny_config, scale_lr, base):
    metrics = train(tiny_config(*DATA, "train.epochs=1", f"distribute.scale_lr={scale_lr}",
                                f"distribute.lr_base_batch_size={base}"))
    # 0.01 × 2 (batch 16 from 8 linearly, or from 4 by the square root), decayed over one epoch.
    assert metrics["history"][0]["learning_rate"] == pytest.approx(0.02 * 0.9, rel=1e-6)


@pytest.mark.slow
def test_resume_refuses_another_lr_scaling_and_accepts_a_run_dir_from_before_distribute(
        reference, tiny_config, tmp_path):
    run_dir = tmp_path / "copy"
    shutil.copytree(reference["run_dir"], run_dir)
    with pytest.raises(CheckpointError, match=r"distribute\.scale_lr: 'none' -> 'linear'"):
        train(tiny_config(*DATA, "train.epochs=3", "distribute.scale_lr=linear", run_dir=run_dir))
    # The strategy may change (a run may move to more GPUs), and a config.yaml without a
    # distribute section is one that trained on one device without LR scaling.
    # (a run dir of the code before distribute existed: no marker, its config read by migrate)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    del saved["distribute"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    (run_dir / ".capsnet-run").unlink()
    metrics = train(tiny_config(*DATA, "train.epochs=3", "distribute=mirrored", run_dir=run_dir))
    assert metrics["resumed_from"].endswith("ckpt-3") and metrics["epochs"] == 3


# --------------------------------------------------------------------------- scripts/benchmark_scale.py

@pytest.mark.slow
@pytest.mark.parametrize("step_input", ["pipeline", "device"])
def test_benchmark_scale_script_times_one_device_and_mirrored_on_the_same_data(tmp_path, step_input):
    """A CPU smoke run over two logical devices (the op library must be built), with train()'s
    input pipeline and with --input device (the pipeline's first batch on each replica's
    device once, repeated): in each, the mirrored rows follow the 1-device row's losses."""
    from conftest import TINY_MODEL

    output = tmp_path / "scale.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "benchmark_scale.py"), "--device", "cpu", "--replicas", "1,2",
         "--batch-sizes", "4,8", "--steps", "2", "--repeats", "2", "--warmup", "1", "--variants", "op",
         "--input", step_input, "--json", str(output), *TINY_MODEL,
         # A steep decay (×0.995 a step at 4 per GPU; epochs of the global batch would make it
         # ×0.991 at ×2): a mirrored row on another schedule than its 1-device row's would leave
         # the losses' tolerance.
         "train.lr_decay_rate=1e-30"],
        env=entry_point_env(), capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(output.read_text())
    assert report["errors"] == [] and report["failures"] == [] and report["not_training"] == []
    assert report["environment"]["NCCL_NVLS_ENABLE"] is not None and report["input"] == step_input
    rows = {(row["config"], row["batch_size"]): row for row in report["results"]}
    assert sorted(rows) == sorted((config, b) for config in ("1 device", "mirrored ×1", "mirrored ×2")
                                  for b in (4, 8))
    for (config, batch), row in rows.items():
        replicas = {"1 device": 1, "mirrored ×1": 1, "mirrored ×2": 2}[config]
        assert row["replicas"] == replicas and row["global_batch_size"] == replicas * batch
        median = float(np.median(row["repeat_seconds"]))
        assert row["images_per_sec"] == pytest.approx(2 * replicas * batch / median)
        assert row["scaling"] == pytest.approx(row["images_per_sec"] / rows[("1 device", batch)]["images_per_sec"])
    # Same seed: every replica trains on the one-device batch from the same weights, so each
    # mirrored row follows its 1-device row's losses (the same gradient, summed in another order).
    for config in ("mirrored ×1", "mirrored ×2"):
        for batch in (4, 8):
            for loss in ("first_loss", "last_loss"):
                assert rows[(config, batch)][loss] == pytest.approx(rows[("1 device", batch)][loss], rel=LOSS_RTOL)
    # auto resolved as train() resolves it: CPU replicas sum through TensorFlow's collective.
    assert "| custom_op=true xla=none | mirrored ×2 | auto (collective) | 4 | 8 |" in result.stdout
    for row in rows.values():  # every row trains: the loss of its last step is below its first's
        assert row["last_loss"] < row["first_loss"], row
        assert f"| {row['first_loss']:.4f} → {row['last_loss']:.4f} |" in result.stdout



@pytest.mark.slow
def test_benchmark_scale_script_times_the_device_loop_under_mirrored(tmp_path):
    """--input on_device (train.data_on_device=true's loop over a synthetic training set): the
    mirrored ×1 row trains on the 1-device row's batches (one replica's slice is the whole
    global batch), so it follows that row's losses; mirrored ×2, on global batches of 8
    split over two CPU devices, trains."""
    from conftest import TINY_MODEL

    output = tmp_path / "scale.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "benchmark_scale.py"), "--device", "cpu", "--replicas", "1,2",
         "--batch-sizes", "4", "--steps", "2", "--repeats", "1", "--warmup", "3", "--variants", "op+jit",
         "--input", "on_device", "--json", str(output), *TINY_MODEL],
        env=entry_point_env(), capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(output.read_text())
    assert report["errors"] == [] and report["failures"] == [] and report["input"] == "on_device"
    rows = {row["config"]: row for row in report["results"]}
    assert sorted(rows) == ["1 device", "mirrored ×1", "mirrored ×2"]
    assert rows["mirrored ×2"]["global_batch_size"] == 8
    for loss in ("first_loss", "last_loss"):
        assert rows["mirrored ×1"][loss] == pytest.approx(rows["1 device"][loss], rel=LOSS_RTOL)
    assert rows["mirrored ×2"]["last_loss"] < rows["mirrored ×2"]["first_loss"]


@pytest.mark.slow
def test_benchmark_scale_flags_a_mirrored_row_whose_loss_did_not_fall():
    from conftest import load_script

    benchmark_scale = load_script("benchmark_scale")
    single = {"config": "1 device", "replicas": 1, "all_reduce": None, "batch_size": 512, "global_batch_size": 512,
              "steps_per_execution": 50, "images_per_sec": 82314.0, "ms_per_step": 6.22, "first_loss": 0.84243,
              "last_loss": 0.28332}
    mirrored = {**single, "config": "mirrored ×2", "replicas": 2, "all_reduce": "auto", "global_batch_size": 1024,
                "images_per_sec": 122213.2, "ms_per_step": 8.38, "first_loss": 0.84242, "last_loss": 0.84263}
    # A mirrored row whose loss stayed where its 1-device row's fell to 0.28.
    rows = benchmark_scale.with_scaling([{"variant": "op+fused+jit", "results": [single, mirrored]}])
    assert [row["trains"] for row in rows] == [None, False]
    table = benchmark_scale.format_table(rows)
    assert "| 0.8424 → 0.8426 (NOT TRAINING) |" in table and "| 0.8424 → 0.2833 |" in table
    # A mirrored row that fell by half of the one-device fall trains; one whose
    # one-device row did not fall either (a warm-up from a learning rate of 0) is not judged.
    assert benchmark_scale.trains({**mirrored, "last_loss": 0.56}, single) is True
    assert benchmark_scale.trains({**mirrored, "last_loss": 0.80}, single) is False
    assert benchmark_scale.trains(mirrored, {**single, "last_loss": 0.84243}) is None
    assert benchmark_scale.trains(mirrored, None) is None


@pytest.mark.slow
def test_benchmark_scale_script_rejects_bad_arguments(tmp_path):
    for args, message in ((["--all-reduce", "ring"], "unknown all-reduce ring"),
                          (["--replicas", "0"], "positive integers"),
                          (["distribute=mirrored"], "distribute is set by the benchmark"),
                          (["train.batch_size=64"], "train.batch_size is set by the benchmark")):
        result = run_entry_point("scripts/benchmark_scale.py", *args, cwd=tmp_path, timeout=120)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- train.data_on_device

# In a fresh process over two logical CPU devices: each replica's slice of every batch of
# two epochs (the last one short), gathered on its device by MirroredTrainingSet, and the
# slices distribute_dataset gives the replicas of make_dataset's batches, as lists.
ON_DEVICE_SPLIT_SCRIPT = r"""
import json
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from capsnet.data import make_dataset
from capsnet.training.device_input import MirroredTrainingSet
from capsnet.training.distribute import distribute_dataset

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
rng = np.random.default_rng(3)
images, labels = rng.integers(1, 256, (29, 12, 12, 1), dtype=np.uint8), rng.integers(0, 10, 29)
augmentation = {"shift_pixels": 2, "flip": True, "erase_probability": 0.5}
training_set = MirroredTrainingSet(strategy, images, labels, batch_size=8, seed=11, **augmentation)
traced = set()

def replica_batch(draws, step, size):
    positions = training_set.positions(step, size)
    images, labels = training_set.examples(draws, positions)
    traced.add((images.device, str(training_set.sets[int(tf.get_static_value(
        tf.distribute.get_replica_context().replica_id_in_sync_group))].images.device)))
    return images, labels

def local(values):
    return [[part.numpy().tolist() for part in strategy.experimental_local_results(v)] for v in values]

got, want = [], []
for epoch in (0, 2):
    draws = training_set.epoch(epoch).draws
    for step, size in enumerate([8, 8, 8, 5]):
        got.append(local(strategy.run(lambda d: replica_batch(d, step, size), args=(draws,))))
    dataset = make_dataset(images, labels, batch_size=8, training=True, seed=11, epoch=epoch, **augmentation)
    want += [local(batch) for batch in distribute_dataset(strategy, dataset)]
print(json.dumps({"got": got, "want": want, "traced": sorted(traced)}))
"""


@pytest.mark.slow
def test_mirrored_on_device_replicas_gather_the_slices_the_pipeline_gives_them():
    """train.data_on_device under the strategy: every replica's (images, labels) of every
    step equal what distribute_dataset gives that replica of make_dataset's batch of the
    same (seed, epoch), flips, shifts and erased boxes included, the short last batch of 5
    split 3 + 2; each replica gathers from the copy on its own device."""
    report = run_json_script(ON_DEVICE_SPLIT_SCRIPT)
    got, want = report["got"], report["want"]
    assert len(got) == len(want) == 8
    assert [[len(replica) for replica in labels] for _, labels in want[:4]] == [[4, 4]] * 3 + [[3, 2]]
    for got_step, want_step in zip(got, want):
        for got_part, want_part in zip(got_step, want_step):  # images, labels: [replica 0, replica 1]
            for got_replica, want_replica in zip(got_part, want_part, strict=True):
                np.testing.assert_array_equal(np.array(got_replica), np.array(want_replica))
    # (the device of each replica's batch, of the copy it gathered from)
    assert [[device.split("/")[-1] for device in pair] for pair in report["traced"]] == [["device:CPU:0"] * 2,
                                                                                          ["device:CPU:1"] * 2]


@pytest.mark.slow
def test_mirrored_on_device_trains_the_steps_of_the_pipeline(tiny_idx_dir, tmp_path):
    """train.data_on_device=true under distribute=mirrored over two CPU devices (train.xla=jit,
    TensorFlow's all-reduce) against one device fed by the tf.data pipeline (xla=none: the
    same batches, tests/test_device_input.py) on the same data (flips, shifts and erasing
    on; 53 = 3 × 16 + 5, the short batch split 3 + 2): the same logged losses and
    checkpoint (weights, Adam's moments); calls of 1, 1 and 2 steps, the last call's two
    steps of two sizes. With distribute.all_reduce=xla's replica step too (uncompiled: XLA
    compiles no collective for a CPU), and a global batch of 15 refused in one line before
    the run dir."""
    common = [*DATA, "train.epochs=1", "train.log_every_steps=2", "train.steps_per_execution=2", "data.flip=true",
              "data.erase_probability=0.5"]
    on_device = ["distribute=mirrored", "distribute.devices=[/cpu:0,/cpu:1]", "train.xla=jit",
                 "train.data_on_device=true"]

    def cfg(name, *extra):
        return compose_config("train", tiny_overrides(tiny_idx_dir, tmp_path / name, *common, *extra))

    configs = [("pipeline", cfg("pipeline")), ("mirrored", cfg("mirrored", *on_device)),
               ("uncompiled_xla", cfg("uncompiled_xla", *on_device, "distribute.all_reduce=xla")),
               ("indivisible", cfg("indivisible", *on_device, "train.batch_size=15"))]
    report = run_json_script(MIRRORED_SCRIPT, json.dumps(configs))
    reference = step_losses(tmp_path / "pipeline")
    assert [s for s, _ in reference] == [2, 4]
    for name in ("mirrored", "uncompiled_xla"):
        assert (report[name]["replicas"], report[name]["global_step"]) == (2, STEPS_PER_EPOCH), report[name]
        ours = step_losses(tmp_path / name)
        assert [s for s, _ in ours] == [2, 4]
        np.testing.assert_allclose([v for _, v in ours], [v for _, v in reference], rtol=LOSS_RTOL)
        assert_checkpoints_match(tmp_path / name / "checkpoints" / "latest" / "ckpt-1",
                                 tmp_path / "pipeline" / "checkpoints" / "latest" / "ckpt-1")
    message = report["indivisible"]["error"]
    assert message.startswith("train.batch_size=15 is the global batch and must divide evenly over the 2 replicas")
    assert "\n" not in message and not (tmp_path / "indivisible").exists()
