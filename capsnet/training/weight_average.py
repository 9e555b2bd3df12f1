"""The weight average (train.ema_decay > 0): `WeightAverage`.

An exponential moving average of the weights is updated after every step and saved in
every checkpoint (node "ema", restored on resume). The per-epoch test pass,
TensorBoard's test/ curves, the best checkpoint and evaluate.py (weights=null) use the
averaged weights; the trained ones' test loss and accuracy are logged beside them
(test/raw_*, history's test_raw_*).
"""
import contextlib

import tensorflow as tf

from capsnet.training.checkpoints import checkpoint_weights


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
