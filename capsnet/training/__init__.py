"""Training CapsNet: `train(cfg)` (capsnet.training.loop), the body of `python train.py`.

One module per concern; import each piece from its module (the config's checks, before
any of these: capsnet.config.check, which train() calls first):
    loop            train(cfg): set-up (devices, data, model, optimizer, checkpoints) and the
                    epoch loop
    epoch           CompiledSteps (the run's compiled steps, each epoch's input, its training
                    and test pass), train_epoch (one epoch's calls, fetched and timed)
    control         RunControl: Ctrl-C and SIGTERM, where the run stands, the resume line;
                    on_schedule (which epochs test and save)
    progress        the progress bar (keras' Progbar), the progress lines, the run's ETA
    health          non-finite steps (NonFiniteStep, diverged), collapsed test results
    xla_flags       TF_XLA_FLAGS and XLA_FLAGS, set once per process before TensorFlow starts
    run_dir         RunDir: the run dir's files, lock, checkpoints (latest, best, interrupted),
                    resume, history.jsonl, config.yaml and metrics.json
    run_lock        RunLock (one training per run dir), check_ours (a run dir of this app),
                    RunDirCallback (Hydra's run dir made first: a bad path is one line),
                    finished_run (a finished run started again, answered from its files);
                    free of TensorFlow, for train.py's checks before the import
    model_setup     build_capsnet, check_op_library (shared with evaluate())
    optimizer       build_optimizer (Adam on a decaying LR), scaled_learning_rate
    weight_average  WeightAverage (train.ema_decay)
    steps           make_train_step, make_train_loop (the non-finite guard), make_eval_step,
                    evaluate_model; XLA modes
    distribute      tf.distribute strategies, TF_CONFIG, input_iterator
    checkpoints     checkpoint contents, resume rules, the best checkpoint, resolve_checkpoint;
                    damaged checkpoints and lost state files (recover_latest, checkpoint_damage)
    summaries       TensorBoard scalars, images, histograms and HParams (RunSummaries)

scripts/benchmark_train.py times the same pieces train() is made of.
"""
__all__ = ["train"]


def __getattr__(name):
    if name == "train":
        # Imported on first use: loop imports TensorFlow, and `capsnet.training.run_lock` is
        # imported before TensorFlow is (train.py checks the run dir first).
        from capsnet.training.loop import train  # noqa: PLC0415

        return train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
