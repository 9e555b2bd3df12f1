"""Training CapsNet: `train(cfg)` (capsnet.training.loop), the body of `python train.py`.

One module per concern; import each piece from its module (the config's checks, before
any of these: capsnet.config.check, which train() calls first):
    loop            train(cfg): config → setup → data → model/optimizer (new or resumed)
                    → compiled steps → epochs → final metrics; the run dir's layout
    model_setup     build_capsnet, check_op_library, check_labels (shared with evaluate())
    optimizer       build_optimizer (Adam on a decaying LR), scaled_learning_rate
    weight_average  WeightAverage (train.ema_decay)
    steps           make_train_step, make_train_loop (the non-finite guard), make_eval_step,
                    evaluate_model; XLA modes
    distribute      tf.distribute strategies, TF_CONFIG, input_iterator
    checkpoints     checkpoint contents, resume rules, the best checkpoint, resolve_checkpoint;
                    damaged checkpoints and lost state files (recover_latest, checkpoint_damage)
    run_lock        RunLock: one training per run dir
    summaries       TensorBoard scalars, images, histograms and HParams

scripts/benchmark_train.py times the same pieces train() is made of.
"""
from capsnet.training.loop import train

__all__ = ["train"]
