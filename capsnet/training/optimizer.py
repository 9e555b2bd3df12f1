"""The optimizer: the paper's Adam (or SGD with Nesterov momentum, train.optimizer=sgd) on a
decaying learning rate, optionally with decoupled weight decay.

- `learning_rate_schedule(train_cfg, steps_per_epoch)`: lr(step), a pure function of the
  optimizer's step counter (restoring the counter restores the LR): the paper's
  exponential decay (`exponential_decay`) or a warm-up and cosine decay to 0 at the end
  of training (`cosine_decay`, train.lr_schedule=cosine).
- `scaled_learning_rate`: train.learning_rate scaled with the global batch
  (distribute.scale_lr).
- `build_optimizer(train_cfg, steps_per_epoch, model)` → (optimizer, schedule); with
  train.precision=mixed_float16 a LossScaleOptimizer (`checkpoint_nodes`, `loss_scale`).
- `steps_done(optimizer)`: the step counter as an int.
"""
import math

import keras

from capsnet.precision import needs_loss_scaling


def exponential_decay(learning_rate, decay_rate, decay_steps, staircase=False, floor=0.0):
    """lr(step) = max(learning_rate · decay_rate^(step / decay_steps), floor) (the exponent
    floored with staircase): the paper's schedule; the authors' code floors it at 1e-6."""
    schedule = keras.optimizers.schedules.ExponentialDecay(
        initial_learning_rate=learning_rate, decay_steps=decay_steps, decay_rate=decay_rate,
        staircase=staircase)
    return FlooredSchedule(schedule, floor) if floor else schedule


@keras.saving.register_keras_serializable(package="capsnet")
class FlooredSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """max(schedule(step), floor): a decay that stops at `floor` (train.lr_decay_floor)."""

    def __init__(self, schedule, floor):
        self.schedule = keras.optimizers.schedules.deserialize(schedule) if isinstance(schedule, dict) else schedule
        self.floor = float(floor)

    def __call__(self, step):
        return keras.ops.maximum(self.schedule(step), self.floor)

    def get_config(self):
        return {"schedule": keras.optimizers.schedules.serialize(self.schedule), "floor": self.floor}


def cosine_decay(learning_rate, total_steps, warmup_steps=0):
    """lr rises linearly from 0 to learning_rate over warmup_steps, then falls along half a
    cosine to 0 at total_steps (Loshchilov & Hutter 2017, without restarts; Goyal et al.
    2017's warm-up), and stays at 0 after it. For a fixed number of epochs: the whole
    run is one decay, so the last epochs train at a rate near 0 whatever their number.
    With a warm-up, the first update (step 0) has rate 0: Adam's moments take in its
    gradient, the weights do not move. The step is Adam's counter of applied updates: with
    mixed_float16's overflow-skipped steps the run ends that many steps before 0."""
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"cosine_decay needs 0 <= warmup_steps < total_steps, got {warmup_steps} and {total_steps}")
    if not warmup_steps:
        return keras.optimizers.schedules.CosineDecay(learning_rate, decay_steps=total_steps)
    return keras.optimizers.schedules.CosineDecay(0.0, decay_steps=total_steps - warmup_steps,
                                                  warmup_target=learning_rate, warmup_steps=warmup_steps)


def learning_rate_schedule(train_cfg, steps_per_epoch):
    """The schedule a config's `train` section names, over epochs of `steps_per_epoch`
    steps: exponential (lr_decay_rate per lr_decay_steps, null = one epoch) or cosine
    (warmup_epochs of warm-up, then down to 0 at the end of train.epochs)."""
    if train_cfg["lr_schedule"] == "cosine":
        # Whole warm-up steps, rounded down: fewer than the run's (warmup_epochs < epochs).
        return cosine_decay(train_cfg["learning_rate"], train_cfg["epochs"] * steps_per_epoch,
                            math.floor(train_cfg["warmup_epochs"] * steps_per_epoch))
    return exponential_decay(train_cfg["learning_rate"], train_cfg["lr_decay_rate"],
                             train_cfg["lr_decay_steps"] or steps_per_epoch, train_cfg["lr_staircase"],
                             train_cfg.get("lr_decay_floor", 0.0))


def scaled_learning_rate(learning_rate, batch_size, scale_lr, base_batch_size):
    """The learning rate train() uses: train.learning_rate, scaled with the global batch.

    linear: × batch_size / base_batch_size (Goyal et al. 2017, for SGD); sqrt:
    × √(batch_size / base_batch_size), the rule for Adam (Malladi et al. 2022: the
    gradient noise falls as 1/√batch, and Adam's update divides by its scale);
    none: unchanged. base_batch_size is the batch `learning_rate` was tuned for.
    """
    ratio = batch_size / base_batch_size
    return learning_rate * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[scale_lr]


def build_optimizer(train_cfg, steps_per_epoch, model):
    """The optimizer for `model`: train.optimizer on the LR schedule of `train_cfg`, with
    decoupled weight decay where train.weight_decay > 0 (Keras' own: w -= lr · decay · w
    each update, biases excluded).

    adam: the paper's. sgd: SGD with Nesterov momentum train.momentum (Sutskever et al.
    2013), the ResNet CIFAR-10 recipes' optimizer (Page's ResNet-9 reaches 94% in 24
    epochs with it, where Adam is known to end lower on such networks). Its decay is
    decoupled too: Page's coupled L2 of 5e-4 under momentum 0.9 shrinks the weights about
    as much as a decoupled 5e-3 (the momentum sums ~1 / (1 - 0.9) of each step's term).

    Returns (optimizer, schedule). `train_cfg` is a config's `train` section (see
    learning_rate_schedule for `steps_per_epoch`). The optimizer's slots are created
    now (optimizer.build), so a checkpoint restore fills them in place instead of being
    deferred to the first step, and the first compiled step creates no variables.
    train.precision=mixed_float16 wraps it in Keras' LossScaleOptimizer (dynamic loss
    scaling: the train step multiplies the loss by optimizer.scale_loss, apply_gradients
    divides the gradients back and skips a step whose gradients overflowed, halving the
    scale; it doubles after 2000 finite steps).
    """
    schedule = learning_rate_schedule(train_cfg, steps_per_epoch)
    weight_decay = train_cfg.get("weight_decay", 0.0) or None
    if train_cfg.get("optimizer", "adam") == "sgd":
        optimizer = keras.optimizers.SGD(learning_rate=schedule, momentum=train_cfg.get("momentum", 0.9),
                                         nesterov=True, weight_decay=weight_decay)
    else:
        optimizer = keras.optimizers.Adam(learning_rate=schedule, weight_decay=weight_decay)
    if weight_decay:
        # Decoupled (Loshchilov & Hutter 2019, AdamW): each update also shrinks the weights by
        # lr · weight_decay, apart from the optimizer's own step. Biases are left alone, as usual:
        # the layers' `bias` and DigitCaps' `b_j` (variable names, matched as Keras does).
        optimizer.exclude_from_weight_decay(var_names=["bias", "b_j"])
    if needs_loss_scaling(train_cfg.get("precision", "float32")):
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    optimizer.build(model.trainable_variables)
    return optimizer, schedule


def checkpoint_nodes(optimizer):
    """The optimizer's nodes of a training checkpoint: {"optimizer": Adam} and, with loss
    scaling, {"loss_scale": its scale and step counter}.

    Adam is saved under "optimizer" in every precision (the LossScaleOptimizer's inner
    one), so checkpoints are interchangeable: a float32 run resumes in mixed_float16
    (the scale starts afresh) and back (the saved scale is left unread).
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return {"optimizer": optimizer.inner_optimizer,
                "loss_scale": {"scale": optimizer.dynamic_scale, "step_counter": optimizer.step_counter}}
    return {"optimizer": optimizer}


def loss_scale(optimizer):
    """The dynamic loss scale variable (mixed_float16), else None."""
    return optimizer.dynamic_scale if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None


def steps_done(optimizer):
    """The optimizer's step counter as an int (.numpy(): int() of the Keras variable fails
    when a strategy made it a MirroredVariable)."""
    return int(optimizer.iterations.numpy())


def compile_replica_updates(optimizer):
    """Under a tf.distribute strategy (mirrored or multi_worker), make each device's Adam
    update ONE XLA computation.

    Keras applies the all-reduced gradients in cross-replica context one variable at a
    time (its `_distributed_tf_update_step`: `strategy.extended.update` per variable),
    so a step of the paper model runs Adam as ~250 small TensorFlow kernels a GPU,
    dispatched by the host between the all-reduce and the next step: 0.67 ms of GPU
    time and a large part of the idle of a 2-GPU step (H100s, docs/benchmarks.md), where one
    GPU's whole-step jit fuses the same update into a few kernels. This replaces that
    loop (on this optimizer, or a LossScaleOptimizer's inner Adam) with one
    `strategy.extended.update` whose function runs, on each device in turn, a
    jit-compiled function of Keras' own `update_step` over that device's copies of
    every variable: the same arithmetic, and everything Keras does around it
    (unscaling, clipping, weight decay, the step counter) untouched. One compiled
    function per device: each captures its own device's variables.

    Relies on the TensorFlow backend's private `_distributed_tf_update_step` (Keras 3);
    tests/test_distribute.py checks that the replaced loop runs and that mirrored jit
    steps still match one device's. Idempotent.
    """
    import tensorflow as tf

    adam = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(adam, "_capsnet_replica_updates", False):
        return
    if not hasattr(adam, "_distributed_tf_update_step"):
        raise RuntimeError("compile_replica_updates: this Keras has no _distributed_tf_update_step to replace")
    compiled = {}  # (device, variable ids) → that device's jit-compiled update

    def distributed_update_step(distribution, grads_and_vars, learning_rate):
        if not grads_and_vars:  # (Keras' apply() filters empty gradients before this)
            return
        grads, variables = zip(*grads_and_vars)  # Mirrored gradients, mirrored tf.Variables
        replicas = [distribution.experimental_local_results(v) for v in variables]  # [variable][replica]

        def update_device(anchor, grads, learning_rate):
            # In strategy.extended.update's context for one device: `anchor` is that device's copy
            # of variables[0]; grads are that device's copies of the all-reduced gradients.
            replica = next(i for i, copy in enumerate(replicas[0]) if copy is anchor)
            local = [copies[replica] for copies in replicas]
            key = (anchor.device, tuple(id(v) for v in local))
            if key not in compiled:
                def update(grads, learning_rate):
                    for grad, variable in zip(grads, local):
                        adam.update_step(grad, variable, learning_rate)
                compiled[key] = tf.function(update, jit_compile=True, autograph=False)
            # A tensor: a constant learning rate arrives as Keras' LR variable.
            compiled[key](list(grads), tf.convert_to_tensor(learning_rate))

        distribution.extended.update(variables[0], update_device, args=(list(grads), learning_rate), group=False)

    adam._distributed_tf_update_step = distributed_update_step
    adam._capsnet_replica_updates = True
