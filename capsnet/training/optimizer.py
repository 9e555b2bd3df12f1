"""The paper's optimizer: Adam on an exponentially decaying learning rate.

- `learning_rate_schedule`: lr(step), a pure function of the optimizer's step counter
  (restoring the counter restores the LR).
- `scaled_learning_rate`: train.learning_rate scaled with the global batch
  (distribute.scale_lr).
- `build_optimizer(train_cfg, steps_per_epoch, model)` → (optimizer, schedule); with
  train.precision=mixed_float16 a LossScaleOptimizer (`checkpoint_nodes`, `loss_scale`).
- `steps_done(optimizer)`: the step counter as an int.
"""
import math

import keras

from capsnet.precision import needs_loss_scaling


def learning_rate_schedule(learning_rate, decay_rate, decay_steps, staircase=False):
    """lr(step) = learning_rate · decay_rate^(step / decay_steps); a Keras schedule of
    the optimizer's step counter, so restoring the counter restores the LR."""
    return keras.optimizers.schedules.ExponentialDecay(
        initial_learning_rate=learning_rate, decay_steps=decay_steps, decay_rate=decay_rate,
        staircase=staircase)


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
    """The paper's optimizer for `model`: Adam on an exponentially decaying LR.

    Returns (optimizer, schedule). `train_cfg` is a config's `train` section;
    lr_decay_steps null decays once per `steps_per_epoch`. Adam's moments are created
    now (optimizer.build), so a checkpoint restore fills them in place instead of being
    deferred to the first step, and the first compiled step creates no variables.
    train.precision=mixed_float16 wraps Adam in Keras' LossScaleOptimizer (dynamic loss
    scaling: the train step multiplies the loss by optimizer.scale_loss, apply_gradients
    divides the gradients back and skips a step whose gradients overflowed, halving the
    scale; it doubles after 2000 finite steps).
    """
    decay_steps = train_cfg["lr_decay_steps"] or steps_per_epoch
    schedule = learning_rate_schedule(train_cfg["learning_rate"], train_cfg["lr_decay_rate"], decay_steps,
                                      train_cfg["lr_staircase"])
    optimizer = keras.optimizers.Adam(learning_rate=schedule)
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
