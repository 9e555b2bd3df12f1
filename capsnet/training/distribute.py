"""Several devices (`distribute`, configs/distribute/; `make_strategy`).

`mirrored` runs one replica per local GPU (tf.distribute.MirroredStrategy),
`multi_worker` one per GPU of every machine of a TF_CONFIG cluster
(MultiWorkerMirroredStrategy; `read_tf_config`); `none` (default) is the one-device code
path, untouched. train.batch_size is the GLOBAL batch (`check_global_batch`): the
(seed, epoch)-ordered batches of capsnet.data are split evenly over the replicas
(`distribute_dataset`), each replica's loss is its share of the global-batch mean, the
optimizer sums the replicas' gradients, so a step is the one-device step on the same
batch up to float rounding (capsnet.training.steps). distribute.scale_lr scales the
learning rate with the global batch (capsnet.training.optimizer.scaled_learning_rate).

Only the chief (`is_chief`: worker 0, or the task "chief") writes into the run dir; the
other workers save their checkpoints into a scratch directory of their own and write
nothing else. Every worker must resume from the same checkpoint
(`check_workers_agree`). Evaluation runs on one device of every worker, as without a
strategy, and a distributed run's checkpoints are ordinary ones (a mirrored variable is
saved once).

The section's choices and value checks are capsnet.config's (DistributeConfig); what it
needs of the process (TF_CONFIG, the devices TensorFlow sees) is checked here.
"""
import json
import logging
import os

import numpy as np
import tensorflow as tf

from capsnet.console import count
from capsnet.errors import AllReduceError, CheckpointError, ConfigError

log = logging.getLogger(__name__)

TF_CONFIG_EXAMPLE = ('{"cluster": {"worker": ["host1:12345", "host2:12345"]}, '
                     '"task": {"type": "worker", "index": 0}}')


def set_memory_growth():
    """Every GPU's memory taken as needed, not all at the start (before the first op: TensorFlow
    fixes it when it sets up its devices): a second training or an evaluation on the same GPU,
    or XLA's autotuning of a convolution, then finds room. A process that has set up its
    devices already keeps them. Called by each entry point after its own device settings:
    listing the GPUs makes TensorFlow read TF_XLA_FLAGS, which train.py sets first (the XLA
    cache)."""
    for gpu in tf.config.list_physical_devices("GPU"):
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except (RuntimeError, ValueError):  # devices set up already (train() run twice in one process)
            pass


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


def check_tf_config(strategy):
    """What the distribute section needs of the process (its values are config.check's):
    multi_worker a valid TF_CONFIG (read_tf_config); the others warn that a TF_CONFIG set
    is not used."""
    if strategy == "multi_worker":
        read_tf_config()
    elif os.environ.get("TF_CONFIG"):
        log.warning("TF_CONFIG is set but distribute=%s: this process trains alone (distribute=multi_worker "
                    "joins the cluster)", strategy)


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
    """The tf.distribute strategy of a checked distribute section (config.check); None
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
        # auto, collective, xla: TensorFlow's default, its collective ops (NCCL when every device
        # is a GPU), which inside an XLA function (xla) lower to a collective XLA compiles.
        cross_device_ops = None
        if dcfg["all_reduce"] == "nccl":
            cross_device_ops = tf.distribute.NcclAllReduce()
        elif dcfg["all_reduce"] == "one_device":
            cross_device_ops = tf.distribute.ReductionToOneDevice()
        return tf.distribute.MirroredStrategy(devices=dcfg["devices"], cross_device_ops=cross_device_ops)
    # (Listing the GPUs does not start TensorFlow's runtime: the collective ops can still be configured.)
    all_reduce = multi_worker_all_reduce(dcfg["all_reduce"], bool(tf.config.list_physical_devices("GPU")))
    implementation = {"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
                      "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
                      "ring": tf.distribute.experimental.CommunicationImplementation.RING}[all_reduce]
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(implementation=implementation))
    except RuntimeError as exc:
        # "Collective ops must be configured at program startup"
        raise ConfigError(f"distribute=multi_worker must be set up before TensorFlow starts, once per process "
                          f"(one training per process, no -m sweep): {' '.join(str(exc).split())}") from exc


def resolve_all_reduce(all_reduce, strategy_name, xla, precision, devices, weight_decay=0.0):
    """What distribute.all_reduce=auto means for a mirrored run (`strategy_name`: distribute.strategy):
    "xla" (the all-reduce and Adam's update inside each replica's compiled step,
    capsnet.training.steps) where it applies — train.xla=jit, several replicas, every one a
    GPU, no loss scaling, no weight decay — else "collective" (TensorFlow's own all-reduce between the
    compiled steps). On 2 H200s "xla" was 9-11% faster in mixed_bfloat16 (three runs) and
    between -2% and +6% in float32 (the op path's five runs and the matmul path's two;
    docs/benchmarks.md).
    Under multi_worker: multi_worker_all_reduce's. Other values are returned as they are.
    `devices`: the strategy's worker devices (this worker's)."""
    if strategy_name == "multi_worker":
        return multi_worker_all_reduce(all_reduce, _all_gpus(devices))
    if all_reduce != "auto" or strategy_name != "mirrored":
        return all_reduce
    gpus = len(devices) > 1 and _all_gpus(devices)
    plain_adam = precision != "mixed_float16" and not weight_decay  # what the compiled update applies
    return "xla" if xla == "jit" and gpus and plain_adam else "collective"


def multi_worker_all_reduce(all_reduce, gpus):
    """What distribute.all_reduce=auto means under multi_worker: "nccl" when the worker's
    devices are GPUs (`gpus`), else "auto" (TensorFlow's pick, its ring). TensorFlow's own
    auto takes the ring, which sums through the hosts: two workers of one H200 each trained
    paper_mnist's epoch (batch 1024) in 5.1-5.3 s with it and in 0.39 s with NCCL, the same
    losses (docs/benchmarks.md, "Multi-GPU scaling")."""
    if all_reduce != "auto":
        return all_reduce
    return "nccl" if gpus else "auto"


def _all_gpus(devices):
    return all(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in devices)


def check_global_batch(batch_size, strategy):
    """train.batch_size is the global batch: it must split evenly over the replicas."""
    replicas = strategy.num_replicas_in_sync
    if batch_size % replicas:
        raise ConfigError(f"train.batch_size={batch_size} is the global batch and must divide evenly over the "
                          f"{replicas} replicas ({', '.join(strategy.extended.worker_devices)}"
                          f"{' on this worker' if len(strategy.extended.worker_devices) < replicas else ''}): "
                          f"use a multiple of {replicas}")


def check_all_reduce(strategy, shapes, compiled=False):
    """The strategy's gradient all-reduce must run and sum, checked once before training.

    The replicas all-reduce tensors of `shapes` (train() passes the model's trainable
    variables': the optimizer's all-reduce of the gradients, the same sizes packed the same
    way) from the replica context in a tf.function, as the optimizer does: replica i sends
    i + 1 everywhere, so every replica must get n(n + 1)/2 back. An all-reduce that runs but
    does not sum (an NCCL library this TensorFlow cannot use) would otherwise train silently
    wrong: every step would look like a step. Raises an AllReduceError in one line naming
    the devices, the implementation, the first wrong value and what to try; nothing to
    check on one replica. Tested on CPU devices (tests/test_distribute.py); on 2 H100s it
    passes with NCCL's CUDA 12 and CUDA 13 builds, both of which sum (docs/benchmarks.md).
    (Under multi_worker, building the model already broadcasts the variables from worker 0:
    a communication that does not run at all fails there first, as a TensorFlow error.)
    """
    if strategy.num_replicas_in_sync == 1:
        return
    devices = ", ".join(strategy.extended.worker_devices)
    implementation = "XLA's all-reduce in a compiled function" if compiled else _all_reduce_implementation(strategy)

    def probe():
        context = tf.distribute.get_replica_context()
        value = tf.cast(context.replica_id_in_sync_group + 1, tf.float32)
        return context.all_reduce(tf.distribute.ReduceOp.SUM, [tf.fill(shape, value) for shape in shapes])

    replica_fn = probe
    if compiled:  # distribute.all_reduce=xla's: inside each replica's own XLA function
        check_compiled_all_reduce_devices(strategy)
        replica_fn = compiled_per_replica(lambda replica: probe)
    try:
        sums = tf.function(lambda: strategy.run(replica_fn), autograph=False)()
        # [local replica][tensor], as numbers (reading them waits for the all-reduce to run).
        received = [[tensor.numpy() for tensor in replica]
                    for replica in zip(*(strategy.experimental_local_results(s) for s in sums))]
    except tf.errors.OpError as exc:
        raise AllReduceError(f"distribute: the all-reduce over {devices} ({implementation}) does not run: "
                             f"{' '.join(exc.message.split())[:300]}. {_all_reduce_advice(strategy, compiled)}") from exc
    error = all_reduce_error(received, strategy.num_replicas_in_sync)
    if error is not None:
        raise AllReduceError(f"distribute: the gradient all-reduce over {devices} ({implementation}) does not sum: "
                             f"{error}; training would not follow the gradients. {_all_reduce_advice(strategy, compiled)}")


def check_compiled_all_reduce_devices(strategy):
    """distribute.all_reduce=xla needs mirrored GPU replicas: XLA compiles no collective for
    a CPU device ("Collectives are not yet implemented for CPU devices when compiling with
    XLA", TensorFlow 2.21). One replica has nothing to all-reduce."""
    if not isinstance(strategy, tf.distribute.MirroredStrategy):
        raise ConfigError(f"distribute.all_reduce=xla is for distribute=mirrored (one process), not "
                          f"{type(strategy).__name__}")
    devices = strategy.extended.worker_devices
    if len(devices) > 1 and not _all_gpus(devices):
        raise ConfigError(f"distribute.all_reduce=xla needs GPUs: XLA compiles no collective for CPU devices "
                          f"(the replicas are on {', '.join(devices)}); use distribute.all_reduce=collective")


def compiled_per_replica(make_fn):
    """A function for strategy.run (in replica context) that calls make_fn(replica id)'s
    function, jit-compiled once per replica: each replica's is traced on its own device and
    captures its own resources (one function traced once would capture the first
    replica's, which XLA refuses on another device). Mirrored replicas only: their ids are
    this process's (a multi_worker id counts every worker's)."""
    compiled = {}

    def run(*args):
        replica = int(tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group))
        if replica not in compiled:
            compiled[replica] = tf.function(make_fn(replica), jit_compile=True, autograph=False)
        return compiled[replica](*args)

    return run


def _all_reduce_implementation(strategy):
    """The name of what sums a strategy's replicas (a private attribute of TensorFlow's
    strategies, so "unknown" rather than an error where it is missing)."""
    implementation = getattr(strategy.extended, "_cross_device_ops", None)
    name = type(implementation).__name__ if implementation is not None else "unknown implementation"
    options = getattr(strategy.extended, "_communication_options", None)
    if name == "CollectiveAllReduce" and getattr(options, "implementation", None) is not None:
        name += f", {options.implementation.name}"  # NCCL or RING: only collective ops use it
    return name


def _all_reduce_advice(strategy, compiled=False):
    """What to try when the all-reduce fails: another distribute.all_reduce of the
    strategy's (config.ALL_REDUCE), or the NCCL library TensorFlow was built against."""
    nccl = "the NCCL library this TensorFlow was built against (nvidia-nccl-cu12 for TensorFlow 2.21)"
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return f"Try distribute.all_reduce=ring, or {nccl}; or another worker failed first: see its log"
    if compiled:
        return f"Try distribute.all_reduce=collective (TensorFlow's, outside the compiled step), or {nccl}"
    if isinstance(getattr(strategy.extended, "_cross_device_ops", None), tf.distribute.ReductionToOneDevice):
        return "The sum on one device (no NCCL) failed: distribute=none trains on one device"
    return f"Try distribute.all_reduce=one_device, or {nccl}"


def all_reduce_error(received, replicas):
    """What check_all_reduce's probe got wrong, in words, or None: `received` holds each
    local replica's list of all-reduced arrays; each element must be replicas(replicas + 1)/2."""
    expected = replicas * (replicas + 1) / 2
    for index, arrays in enumerate(received):
        for array in map(np.asarray, arrays):
            wrong = np.flatnonzero(array != expected)
            if wrong.size:
                return (f"local replica {index} received {array.flat[wrong[0]]:g} where {expected:g} (the sum of "
                        f"1..{replicas}) was expected, in {wrong.size} of {array.size} elements")
    return None


def is_chief(strategy):
    """Whether this process writes the run dir: always without a strategy or with mirrored
    (one process); under multi_worker the task "chief", else worker 0."""
    return strategy is None or strategy.extended.should_checkpoint


def distribute_dataset(strategy, dataset):
    """`dataset`'s batches (global batches) split over the strategy's replicas, in order.

    Each global batch is cut into one contiguous slice per replica, in replica order, of
    ⌈size / replicas⌉ examples each but the last ones (a full batch: equal slices,
    check_global_batch; a short last batch of 5 over 4 replicas: 2, 2, 1 and 0, seen on
    TensorFlow 2.21), so step k of every replica together sees global batch k of a
    one-device run (MirroredTrainingSet gathers the same slices). Every worker builds the whole (seed,
    epoch)-ordered dataset and keeps its replicas' slices (DATA sharding: the examples
    are tensors in memory, not files, so there are no files to split, and its
    augmentation is keyed by the example, not by the worker).
    """
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return strategy.experimental_distribute_dataset(dataset.with_options(options))


def default_device():
    """The device one-device training runs on: the first GPU TensorFlow sees, else None
    (the CPU, where tf.data runs)."""
    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name if gpus else None


def trains_on_gpu(strategy=None):
    """Whether the training steps run on a GPU: a replica's device under `strategy`, else
    default_device()."""
    devices = strategy.extended.worker_devices if strategy is not None else [default_device() or "/CPU:0"]
    return any(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in devices)


def input_iterator(dataset, strategy=None, device=None):
    """The iterator make_train_loop's steps read their batches from, the batches already
    on the devices that train on them.

    Under a strategy: split over its replicas (distribute_dataset; tf.distribute prefetches
    each slice to its replica's device). On one device: prefetched to `device` (default:
    the first GPU, if there is one); otherwise each step's first op waits for its batch's
    host-to-device copy (measured on an H200: docs/benchmarks.md).
    """
    dataset = without_autotune_thread(dataset)
    if strategy is not None:
        return iter(distribute_dataset(strategy, dataset))
    if device is None:
        device = default_device()
    if device is None or tf.DeviceSpec.from_string(device).device_type != "GPU":
        return iter(dataset)  # the CPU trains where tf.data runs: nothing to copy
    with tf.device(device):  # the iterator of a copy_to_device dataset lives on the target device
        return iter(dataset.apply(tf.data.experimental.prefetch_to_device(device, buffer_size=2)))


def without_autotune_thread(dataset):
    """`dataset` without tf.data's autotuning model thread (options.autotune.enabled=False).

    Why: deleting an iterator joins that thread, and on a busy CPU the join waited until
    the thread's next optimization round: 10-55 s between an epoch's last line and the next
    epoch (the epoch's iterator deleted when the next one replaces it) and before exit,
    with the main thread in ~RootDataset::Iterator (py-spy --native). Without it the
    AUTOTUNE map runs on every core and prefetch keeps its own buffer tuning; the batches
    are the same (the map is deterministic)."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def check_workers_agree(strategy, epochs_done, step):
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
            f"the workers restored different checkpoints (this one: {count(epochs_done, 'epoch')} done, step {step}; mean over "
            f"the replicas: {total[0][0] / n:g} epochs, step {total[0][1] / n:g}): every worker needs the same run dir "
            "(hydra.run.dir) on a filesystem they share")
