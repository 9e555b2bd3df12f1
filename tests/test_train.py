"""capsnet.training: helpers against NumPy, a tiny end-to-end run, resume, config errors,
the XLA modes of the train step, the compiled op in training."""
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
import yaml

from capsnet.errors import CheckpointError, ConfigError, DataError, OpLibraryError
from capsnet.training import train
from capsnet.training.optimizer import cosine_decay, exponential_decay
from capsnet.figures import image_grid
from conftest import (REPO, assert_checkpoint_tensors_close, compose_config, entry_point_env, load_script, read_events,
                      run_entry_point, tiny_overrides)

STEPS_PER_EPOCH = 20  # 320 tiny training images / batch 16


# --------------------------------------------------------------------------- pure helpers

def test_image_grid_puts_inputs_over_reconstructions():
    rng = np.random.default_rng(0)
    inputs, recons = rng.random((3, 4, 5, 2)), rng.random((3, 4, 5, 2))
    grid = image_grid(inputs, recons)
    assert grid.shape == (1, 2 * 4, 3 * 5, 2)
    for n in range(3):
        np.testing.assert_array_equal(grid[0, :4, 5 * n:5 * n + 5], inputs[n].astype(np.float32))
        np.testing.assert_array_equal(grid[0, 4:, 5 * n:5 * n + 5], recons[n].astype(np.float32))


def test_image_grid_clips_and_rejects_mismatched_shapes():
    grid = image_grid(np.full((1, 2, 2, 1), 2.0), np.full((1, 2, 2, 1), -1.0))
    assert grid.max() == 1.0 and grid.min() == 0.0
    with pytest.raises(ValueError, match=r"\(2, 4, 4, 1\) and \(2, 4, 5, 1\)"):
        image_grid(np.zeros((2, 4, 4, 1)), np.zeros((2, 4, 5, 1)))


@pytest.mark.parametrize("staircase", [False, True])
def test_exponential_decay_matches_the_formula(staircase):
    schedule = exponential_decay(0.001, 0.9, 50, staircase)
    for step in (0, 1, 49, 50, 51, 777):
        exponent = step // 50 if staircase else step / 50
        assert float(schedule(step)) == pytest.approx(0.001 * 0.9 ** exponent, rel=1e-6)


def cosine_reference(step, peak, total, warmup):
    """The warm-up and cosine decay, written out: linear 0 → peak, then half a cosine to 0."""
    if step < warmup:
        return peak * step / warmup
    progress = min(step - warmup, total - warmup) / (total - warmup)
    return 0.5 * peak * (1 + np.cos(np.pi * progress))


@pytest.mark.parametrize("warmup", [0, 30])
def test_cosine_decay_matches_the_formula(warmup):
    schedule = cosine_decay(0.002, 300, warmup)
    for step in (0, 1, 15, 29, 30, 31, 100, 165, 299, 300, 301, 1000):
        assert float(schedule(step)) == pytest.approx(cosine_reference(step, 0.002, 300, warmup), rel=1e-5, abs=1e-10)
    assert float(schedule(300)) == pytest.approx(0.0, abs=1e-10)  # the run ends at a rate of 0
    with pytest.raises(ValueError, match="0 <= warmup_steps < total_steps, got 300 and 300"):
        cosine_decay(0.002, 300, 300)


def test_exponential_decay_stops_at_its_floor():
    """train.lr_decay_floor (the authors' 1e-6): max(0.001 · 0.96^(step / 2000), floor),
    smooth; the floor is kept through Keras' serialisation of the schedule."""
    import keras

    from capsnet.training.optimizer import exponential_decay, learning_rate_schedule

    schedule = exponential_decay(0.001, 0.96, 2000, floor=1e-6)
    for step in (0, 1000, 2000, 300_000, 338_000, 600_000):
        assert float(schedule(step)) == pytest.approx(max(0.001 * 0.96 ** (step / 2000), 1e-6), rel=1e-5)
    assert float(schedule(600_000)) == pytest.approx(1e-6)  # 0.001 · 0.96^300 = 4.9e-9 without it
    clone = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(schedule))
    assert float(clone(600_000)) == pytest.approx(1e-6)
    unfloored = learning_rate_schedule({"lr_schedule": "exponential", "learning_rate": 0.001, "lr_decay_rate": 0.96,
                                        "lr_decay_steps": 2000, "lr_staircase": False}, 391)
    assert float(unfloored(600_000)) == pytest.approx(0.001 * 0.96 ** 300, rel=1e-4)


@pytest.mark.slow
def test_a_cosine_run_follows_its_schedule_and_cannot_be_extended(tiny_config, tmp_path):
    """train.lr_schedule=cosine: the learning rate each epoch's line records is the
    formula's at that step (after half an epoch of warm-up, down to 0 at the last step),
    and a resume that moves the end (train.epochs) is refused: the LR would jump."""
    run_dir = tmp_path / "cosine"
    cfg = tiny_config("train.lr_schedule=cosine", "train.warmup_epochs=0.5", "train.epochs=3", run_dir=run_dir)
    train(cfg)
    lines = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    steps_per_epoch = lines[0]["global_step"]
    assert [line["global_step"] for line in lines] == [steps_per_epoch * e for e in (1, 2, 3)]
    peak = cfg["train"]["learning_rate"]
    for line in lines:
        assert line["learning_rate"] == pytest.approx(
            cosine_reference(line["global_step"], peak, 3 * steps_per_epoch, steps_per_epoch // 2),
            rel=1e-5, abs=1e-10)
    assert lines[-1]["learning_rate"] == pytest.approx(0.0, abs=1e-10)
    with pytest.raises(CheckpointError, match=r"\(train\.epochs: 3 -> 4\)") as err:
        train(tiny_config("train.lr_schedule=cosine", "train.warmup_epochs=0.5", "train.epochs=4", run_dir=run_dir))
    assert "train.epochs may grow" not in str(err.value)  # not for this run
    # What the cosine schedule does not read may change: the finished run is measured as it is.
    again = train(tiny_config("train.lr_schedule=cosine", "train.warmup_epochs=0.5", "train.epochs=3",
                              "train.lr_decay_rate=0.5", run_dir=run_dir))
    assert again["resumed_from"].endswith("ckpt-3") and again["epochs"] == 3


@pytest.mark.slow
def test_drop_remainder_trains_full_batches_only(tiny_config, tmp_path, monkeypatch):
    """train.drop_remainder=true: every step of an epoch gets a full batch (50 examples at
    16 a batch: 3 steps, not 4 with a last one of 2), the step counter and the images
    counted follow, and the epoch's batches are the first 48 of the same shuffled order."""
    from capsnet.tasks.single_label import SingleLabel
    seen = []
    make = SingleLabel.dataset

    def recording(self, data, *, training, drop_remainder=False, **kwargs):
        dataset = make(self, data, training=training, drop_remainder=drop_remainder, **kwargs)
        if training:
            full = make(self, data, training=training, **kwargs)  # the same epoch, its last batch kept
            seen.append(([labels.numpy() for _, labels in dataset], np.concatenate([y for _, y in full])))
        return dataset

    monkeypatch.setattr(SingleLabel, "dataset", recording)
    run_dir = tmp_path / "dropped"
    metrics = train(tiny_config("data.limit_train=50", "train.drop_remainder=true", "train.epochs=2", run_dir=run_dir))
    assert metrics["global_step"] == 6
    assert [h["global_step"] for h in metrics["history"]] == [3, 6]
    assert len(seen) == 2
    for batches, full in seen:
        assert [len(b) for b in batches] == [16, 16, 16] and len(full) == 50
        np.testing.assert_array_equal(np.concatenate(batches), full[:48])
    assert not np.array_equal(seen[0][1], seen[1][1])  # each epoch its own order, so its own 2 left out
    with pytest.raises(ConfigError, match=r"train\.batch_size=64 with train\.drop_remainder=true leaves no batch "
                                          r"of the 50 training examples of mnist") as err:
        train(tiny_config("data.limit_train=50", "train.drop_remainder=true", "train.batch_size=64",
                          run_dir=tmp_path / "too_big"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["train.warmup_epochs=1"], "train.warmup_epochs=1 needs train.lr_schedule=cosine"),
    (["train.lr_schedule=cosine", "train.warmup_epochs=4", "train.epochs=4"],
     "train.warmup_epochs=4 must be fewer than train.epochs=4"),
    (["train.lr_schedule=linear"], "train.lr_schedule must be one of exponential, cosine, got 'linear'"),
    (["train.warmup_epochs=-1"], r"train.warmup_epochs must be a number in \[0, 1000\], got -1"),
    (["train.weight_decay=-0.01"], r"train.weight_decay must be >= 0, got -0.01"),
])
def test_bad_schedule_values_are_one_line_config_errors(tiny_config, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        train(tiny_config(*overrides))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


def test_weight_decay_shrinks_kernels_and_W_by_lr_times_decay_and_leaves_biases(tiny_config):
    """One update with train.weight_decay=wd against the same update without: every kernel
    and DigitCaps' W ends lower by lr · wd · w (decoupled: Adam's step is the same in both),
    every bias (the layers' and DigitCaps' b_j) exactly where Adam alone puts it."""
    from capsnet.training.model_setup import build_capsnet
    from capsnet.training.optimizer import build_optimizer

    wd, lr = 0.5, 0.01
    cfg = tiny_config("model.digit_caps_bias=0.1", f"train.learning_rate={lr}")
    models, optimizers = [], []
    for decay in (0.0, wd):
        keras.utils.set_random_seed(3)
        model = build_capsnet(cfg["model"], custom_op=False)
        optimizer, _ = build_optimizer({**cfg["train"], "weight_decay": decay}, 10, model)
        models.append(model)
        optimizers.append(optimizer)
    before = [v.numpy() for v in models[0].trainable_variables]
    grads = [np.random.default_rng(i).normal(size=v.shape).astype(np.float32) for i, v in enumerate(before)]
    for model, optimizer in zip(models, optimizers):
        optimizer.apply_gradients(zip([tf.constant(g) for g in grads], model.trainable_variables))
    decayed = 0
    for w0, plain, with_decay in zip(before, models[0].trainable_variables, models[1].trainable_variables):
        assert plain.path.split("/")[-1] == with_decay.path.split("/")[-1]
        if plain.name in ("bias", "b_j"):
            np.testing.assert_array_equal(with_decay.numpy(), plain.numpy())
        else:
            np.testing.assert_allclose(with_decay.numpy(), plain.numpy() - lr * wd * w0, rtol=0, atol=2e-7)
            decayed += 1
    assert decayed == 6  # conv1, PrimaryCaps' conv, W and the decoder's three kernels
    assert optimizers[0].weight_decay is None  # 0: the paper's Adam, no decay term at all


def test_sgd_is_nesterov_momentum_on_the_schedule_with_decoupled_decay_against_numpy(tiny_config):
    """train.optimizer=sgd: three updates against the Nesterov update written out in NumPy
    (v = m·v - lr·g; w += m·v - lr·g, Sutskever et al. 2013 in Keras' form), each at the
    schedule's rate for its step, after the decoupled decay w -= lr · wd · w; biases undecayed."""
    from capsnet.training.model_setup import build_capsnet
    from capsnet.training.optimizer import build_optimizer

    momentum, wd = 0.8, 0.05
    cfg = tiny_config("train.optimizer=sgd", f"train.momentum={momentum}", "train.learning_rate=0.1",
                      "train.lr_decay_rate=0.5", f"train.weight_decay={wd}")
    model = build_capsnet(cfg["model"], custom_op=False)
    optimizer, schedule = build_optimizer(cfg["train"], 2, model)
    assert isinstance(optimizer, keras.optimizers.SGD) and optimizer.nesterov
    weights = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    velocity = [np.zeros_like(w) for w in weights]
    rng = np.random.default_rng(5)
    for step in range(3):
        grads = [rng.normal(size=w.shape).astype(np.float32) for w in weights]
        optimizer.apply_gradients(zip([tf.constant(g) for g in grads], model.trainable_variables))
        lr = float(schedule(step))
        for i, (variable, g) in enumerate(zip(model.trainable_variables, grads)):
            if variable.name not in ("bias", "b_j"):
                weights[i] = weights[i] - lr * wd * weights[i]
            velocity[i] = momentum * velocity[i] - lr * g
            weights[i] = weights[i] + momentum * velocity[i] - lr * g
    assert float(schedule(2)) == pytest.approx(0.1 * 0.5)  # the rate did change over the steps
    for variable, expected in zip(model.trainable_variables, weights):
        np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-5, atol=1e-6, err_msg=variable.path)


def test_set_xla_flags_makes_the_cache_only_where_xla_compiles(tmp_path, monkeypatch):
    """train.xla_cache_dir is on by default: train.xla=none compiles nothing with XLA, so
    its run neither makes the directory nor sets the flag; jit does both."""
    from capsnet.training.xla_flags import XLA_CACHE_FLAG, set_xla_flags

    monkeypatch.setenv("TF_XLA_FLAGS", "")
    monkeypatch.setenv("XLA_FLAGS", "")
    set_xla_flags("none", tmp_path / "none")
    assert not (tmp_path / "none").exists() and XLA_CACHE_FLAG not in os.environ["TF_XLA_FLAGS"]
    set_xla_flags("jit", tmp_path / "jit")
    assert (tmp_path / "jit").is_dir()
    assert f"{XLA_CACHE_FLAG}={tmp_path / 'jit'}" in os.environ["TF_XLA_FLAGS"].split()


def test_the_tests_tiny_runs_keep_no_xla_cache_in_the_home(tiny_config):
    """The default train.xla_cache_dir is in the home (~/.cache/capsnet/xla): the tests' jit
    runs (tiny_config, trained the same way in subprocesses) keep none there, and one test's
    compiled steps are never another's."""
    from capsnet.training.xla_flags import DEFAULT_CACHE_DIR

    assert compose_config("train", ["run_dir=/r"])["train"]["xla_cache_dir"] == DEFAULT_CACHE_DIR
    assert tiny_config("train.xla=jit")["train"]["xla_cache_dir"] is None


# --------------------------------------------------------------------------- configs

def test_model_config_covers_every_capsnet_argument_with_the_paper_values():
    from capsnet.model import CapsNet
    from capsnet.training.model_setup import BASELINE_KEYS, build_capsnet

    cfg = compose_config("train", ["run_dir=/unused"])
    arguments = set(inspect.signature(CapsNet.__init__).parameters) - {"self", "kwargs", "custom_op"}
    # The router is built from model.routing, routing_iterations and stop_gradient_routing
    # (capsnet.config.router_spec) and custom_op, the top-level key.
    router_keys = {"routing", "routing_iterations", "stop_gradient_routing"}
    # model.kind picks the class; the cnn_* keys are the CNN baseline's (BASELINE_KEYS), deep_widths
    # the deep network's stem (DEEP_KEYS).
    baseline_keys = {"kind", "deep_widths", *(key for key in BASELINE_KEYS if key.startswith("cnn_"))}
    assert set(cfg["model"]) - router_keys - baseline_keys == arguments - {"router"}
    assert build_capsnet(cfg["model"], custom_op=False).count_params() == 8_215_568
    assert build_capsnet({**cfg["model"], "decoder": False}, custom_op=False).count_params() == 6_804_224


def test_config_groups_compose():
    from hydra.errors import ConfigCompositionException

    fashion = compose_config("train", ["data=fashion_mnist", "run_dir=/unused"])
    assert fashion["data"]["name"] == "fashion_mnist"
    assert set(fashion["data"]) == set(compose_config("train", ["run_dir=/unused"])["data"])
    assert fashion["train"]["reconstruction_weight"] == 0.0005
    evaluation = compose_config("eval", ["checkpoint=/some/run"])
    assert evaluation["checkpoint"] == "/some/run" and evaluation["which"] is None
    with pytest.raises(ConfigCompositionException, match="no_such_key"):
        compose_config("train", ["train.no_such_key=1"])


@pytest.mark.parametrize("override, key", [
    ("train.epochs=0", "train.epochs"),
    ("train.batch_size=-4", "train.batch_size"),
    ("train.learning_rate=0", "train.learning_rate"),
    ("train.lr_decay_steps=1.5", "train.lr_decay_steps"),
    ("seed=abc", "seed"),
    ("train.xla=fast", "train.xla"),
    ("train.steps_per_execution=0", "train.steps_per_execution"),
])
def test_bad_train_values_raise_config_error(tiny_config, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        train(tiny_config(override))


@pytest.mark.parametrize("override, message", [
    # Only real booleans: Hydra passes `no`, `off`, `0` and `1` as they are, and bool('no') is True.
    ("custom_op=no", "custom_op must be true or false, got 'no'"),
    ("deterministic=yes", "deterministic must be true or false, got 'yes'"),
    ("debug=0", "debug must be true or false, got 0"),
    ("train.lr_staircase=1", "train.lr_staircase must be true or false, got 1"),
    ("train.progress_bar=off", "train.progress_bar must be true or false, got 'off'"),
    ("model.decoder=no", "model.decoder must be true or false, got 'no'"),
    ("model.stop_gradient_routing=none", "model.stop_gradient_routing must be true or false"),
    ("model.routing=no", "model.routing must be one of auto, tf, xla, got 'no'"),  # replaces model.jit_routing
    # The loss values, checked before anything is built.
    ("train.m_plus=abc", "train.m_plus must be a finite number, got 'abc'"),
    ("train.m_minus=0.95", r"need 0 <= m_minus < m_plus <= 1 .*got m_plus=0.9, m_minus=0.95"),
    ("train.m_plus=1.5", r"m_minus < m_plus <= 1"),
    ("train.lambda_=-1", "lambda_ must be >= 0"),
    ("train.reconstruction_weight=-0.1", r"train\.reconstruction_weight must be >= 0, got -0\.1"),
    ("train.reconstruction_weight=nan", "train.reconstruction_weight must be a finite number"),
    ("train.ema_decay=1.0", r"train.ema_decay must be a number in \[0, 1\) .*got 1.0"),
    ("train.ema_decay=-0.1", r"train.ema_decay must be a number in \[0, 1\) .*got -0.1"),
    ("train.ema_decay=abc", r"train.ema_decay must be a number in \[0, 1\) .*got 'abc'"),
    # The model section, checked before the labels are compared with it.
    ("model.num_classes=abc", "num_classes must be a positive integer, got 'abc'"),
    ("model.num_classes=2.5", "num_classes must be a positive integer, got 2.5"),
    ("model.input_shape=5", r"input_shape \(5, 5, 5\) is too small"),
    ("model.input_shape=[28,28]", "input_shape must be 3 positive integers"),
    ("model.decoder_units=[32,abc]", "decoder_units must be a non-empty sequence of positive integers"),
    ("model.w_init_stddev=-0.1", "w_init_stddev must be a positive number, got -0.1"),
    ("model.primary_caps_scale=0", "primary_caps_scale must be a positive number, got 0"),
    ("model.primary_caps_bias=inf", "primary_caps_bias must be a finite number, got inf"),
    # The augmentation options, named as config keys.
    ("data.shift_fill=reflect", "data.shift_fill must be one of zero, edge, got 'reflect'"),
    ("data.elastic_alpha=-3", r"data\.elastic_alpha must be a number in \[0, 100\], got -3"),
    ("data.rotate_degrees=200", r"data\.rotate_degrees must be a number in \[0, 180\]"),
    ("data.erase_max_area=0", r"data\.erase_max_area must be a number in \[0\.02, 1\], got 0"),
])
def test_bad_values_raise_one_line_config_errors_before_any_work(tiny_config, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message) as err:
        train(tiny_config(override))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()  # refused before the run dir was made


def test_labels_beyond_num_classes_raise_config_error(tiny_config):
    with pytest.raises(ConfigError, match=r"labels lie in \[0, 9\] but model\.num_classes is 5"):
        train(tiny_config("model.num_classes=5"))


# --------------------------------------------------------------------------- end to end

def test_tiny_run_learns(trained_run):
    _, metrics = trained_run
    history = metrics["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    assert history[-1]["train_loss"] < 0.8 * history[0]["train_loss"]
    assert history[-1]["test_loss"] < 0.8 * history[0]["test_loss"]
    assert metrics["test_accuracy"] >= 0.5  # chance is 0.1
    assert metrics["global_step"] == 4 * STEPS_PER_EPOCH
    assert metrics["best_test_accuracy"] == max(h["test_accuracy"] for h in history)
    assert metrics["images_per_sec"] > 0


def test_run_dir_holds_config_checkpoints_and_metrics(trained_run, tiny_idx_dir):
    run_dir, metrics = trained_run
    saved = json.loads((run_dir / "metrics.json").read_text())
    assert saved["test_accuracy"] == metrics["test_accuracy"]
    assert saved["history"] == json.loads(json.dumps(metrics["history"]))
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["model"]["conv1_filters"] == 16
    assert config["data"]["dir"] == str(Path(tiny_idx_dir).resolve())
    history_lines = (run_dir / "history.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in history_lines] == [1, 2, 3, 4]

    # keep_checkpoints=3 latest, and the best epoch apart.
    latest = sorted(p.name for p in (run_dir / "checkpoints" / "latest").glob("ckpt-*.index"))
    assert latest == ["ckpt-2.index", "ckpt-3.index", "ckpt-4.index"]
    best = [p.name for p in (run_dir / "checkpoints" / "best").glob("ckpt-*.index")]
    assert best == [f"ckpt-{metrics['best_epoch']}.index"]
    variables = dict(tf.train.list_variables(str(run_dir / "checkpoints" / "latest" / "ckpt-4")))
    # The weights go by readable model paths (all of them: also the decoder's hidden layers).
    for name in ("conv1.Skernel", "primary_caps.Sconv.Skernel", "digit_caps.SW", "decoder.Sfc1.Skernel",
                 "decoder.Sfc2.Skernel", "decoder.Sfc3.Skernel"):
        assert f"model/{name}/.ATTRIBUTES/VARIABLE_VALUE" in variables
    assert variables["model/digit_caps.SW/.ATTRIBUTES/VARIABLE_VALUE"] == [144, 10, 8, 8]


def test_tensorboard_logs(trained_run):
    run_dir, metrics = trained_run
    events = read_events(run_dir)
    plugins = {tag: values[0][1].metadata.plugin_data.plugin_name for tag, values in events.items()}
    for split in ("train", "test"):
        for name in ("loss", "margin_loss", "reconstruction_loss", "accuracy", "images_per_sec"):
            assert plugins[f"{split}/{name}"] == "scalars"
    assert plugins["train/step_time_ms"] == plugins["train/learning_rate"] == "scalars"
    assert plugins["routing/c_ij"] == plugins["capsules/lengths"] == "histograms"
    assert plugins["reconstructions/inputs_over_reconstructions"] == "images"

    # Global step as the TB step: test metrics once per epoch, equal to the run's history.
    test_accuracy = events["test/accuracy"]
    assert [step for step, _ in test_accuracy] == [STEPS_PER_EPOCH * e for e in (1, 2, 3, 4)]
    np.testing.assert_allclose([tf.make_ndarray(v.tensor) for _, v in test_accuracy],
                               [h["test_accuracy"] for h in metrics["history"]], rtol=1e-6)
    train_steps = [step for step, _ in events["train/loss"]]
    assert train_steps == sorted(set(train_steps)) and train_steps[-1] == 4 * STEPS_PER_EPOCH
    last_lr = tf.make_ndarray(events["train/learning_rate"][-1][1].tensor)
    assert last_lr == pytest.approx(0.01 * 0.9 ** 4, rel=1e-5)  # decays once per epoch

    # Where each epoch's wall time went: one value per epoch and phase, each positive.
    for phase in ("train", "test", "save"):
        values = events[f"time/{phase}_seconds"]
        assert [step for step, _ in values] == [STEPS_PER_EPOCH * e for e in (1, 2, 3, 4)]
        assert all(tf.make_ndarray(v.tensor) > 0 for _, v in values), phase

    # The grid: 4 test images over their reconstructions, 28x28 each.
    _, grid = events["reconstructions/inputs_over_reconstructions"][-1]
    width, height = (int(x) for x in grid.tensor.string_val[:2])
    assert (height, width) == (2 * 28, 4 * 28)
    # c_ij of the 16 histogram examples: 144 primary x 10 digit capsules each, rows of a softmax.
    _, c_ij = events["routing/c_ij"][-1]
    buckets = tf.make_ndarray(c_ij.tensor)  # (k, 3): left edge, right edge, count
    assert buckets[:, 2].sum() == 16 * 144 * 10
    assert buckets[:, 0].min() >= 0.0 and buckets[:, 1].max() <= 1.0 + 1e-6

    # HParams: the run's values, for side-by-side comparison.
    from tensorboard.plugins.hparams import plugin_data_pb2

    start = plugin_data_pb2.HParamsPluginData.FromString(
        events["_hparams_/session_start_info"][0][1].metadata.plugin_data.content).session_start_info
    assert start.hparams["custom_op"].bool_value is False
    assert start.hparams["batch_size"].number_value == 16
    assert start.hparams["routing_iterations"].number_value == 3
    assert start.hparams["dataset"].string_value == "mnist"
    assert start.hparams["lr_schedule"].string_value == "exponential"
    assert start.hparams["seed"].number_value == 0
    assert start.hparams["precision"].string_value == "float32"
    assert start.hparams["tf32"].bool_value is True and start.hparams["weight_decay"].number_value == 0.0
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        events["_hparams_/experiment"][0][1].metadata.plugin_data.content).experiment
    assert {m.name.tag for m in experiment.metric_infos} == {"test/accuracy", "validation/accuracy",
                                                             "train/mean_images_per_sec"}


@pytest.mark.slow
def test_resume_continues_where_the_checkpoint_left_off(trained_run, tiny_config, tmp_path):
    original_dir, original = trained_run
    run_dir = tmp_path / "resumed"
    shutil.copytree(original_dir, run_dir)

    metrics = train(tiny_config("train.epochs=5", run_dir=run_dir))
    assert metrics["resumed_from"].endswith("ckpt-4")
    assert metrics["global_step"] == 5 * STEPS_PER_EPOCH
    assert [h["epoch"] for h in metrics["history"]] == [1, 2, 3, 4, 5]
    assert metrics["history"][:4] == original["history"]
    events = read_events(run_dir)
    assert [step for step, _ in events["test/accuracy"]] == [STEPS_PER_EPOCH * e for e in range(1, 6)]
    assert len(events["_hparams_/session_start_info"]) == 1  # one trial, continued

    # Rerunning a finished run trains nothing and reports the same checkpoint; keys that do not
    # change the run's trajectory may differ from the run's config.
    again = train(tiny_config("train.epochs=5", "train.log_every_steps=7", "train.keep_checkpoints=5",
                              "train.progress_bar=true", "train.num_images=2", run_dir=run_dir))
    assert again["history"] == metrics["history"] and again["global_step"] == metrics["global_step"]
    assert again["test_accuracy"] == metrics["test_accuracy"]


def test_test_batch_size_sets_the_test_pass_batches_not_its_scores(trained_run, tiny_config, tmp_path, monkeypatch):
    """train.test_batch_size batches the per-epoch test pass differently (a finished run,
    rerun, measures its checkpoint again) and scores it the same: each example on its own."""
    from capsnet.tasks.single_label import SingleLabel

    original_dir, original = trained_run
    run_dir = tmp_path / "rerun"
    shutil.copytree(original_dir, run_dir)
    test_batches = []
    make = SingleLabel.dataset

    def recording(self, data, *, batch_size, training, **kwargs):
        if not training:
            test_batches.append(batch_size)
        return make(self, data, batch_size=batch_size, training=training, **kwargs)

    monkeypatch.setattr(SingleLabel, "dataset", recording)
    again = train(tiny_config("train.test_batch_size=7", run_dir=run_dir))
    assert test_batches == [7]
    assert again["test_accuracy"] == original["test_accuracy"]
    np.testing.assert_allclose(again["test_loss"], original["test_loss"], rtol=1e-4)


@pytest.mark.parametrize("overrides, differences", [
    (["seed=1"], ["seed: 0 -> 1"]),
    (["model.conv1_filters=8"], ["model.conv1_filters: 16 -> 8"]),
    (["data.limit_train=100", "train.m_plus=0.8"], ["data.limit_train: None -> 100", "train.m_plus: 0.9 -> 0.8"]),
    (["train.batch_size=32", "train.lr_staircase=true", "data.shift_pixels=0"],
     ["data.shift_pixels: 2 -> 0", "train.batch_size: 16 -> 32", "train.lr_staircase: False -> True"]),
    (["data.rotate_degrees=5", "data.flip=true"], ["data.flip: False -> True", "data.rotate_degrees: 0 -> 5"]),
    (["train.ema_decay=0.99"], ["train.ema_decay: 0.0 -> 0.99"]),  # the run kept no average to continue
    (["train.weight_decay=0.01"], ["train.weight_decay: 0.0 -> 0.01"]),
    # A cosine schedule's end is part of the run: train.epochs is compared only then.
    (["train.lr_schedule=cosine"], ["train.lr_schedule: 'exponential' -> 'cosine'"]),
])
def test_resume_with_a_config_that_changes_the_run_says_what_differs(trained_run, tiny_config, tmp_path,
                                                                     overrides, differences):
    run_dir = tmp_path / "other"
    shutil.copytree(trained_run[0], run_dir)
    with pytest.raises(CheckpointError) as err:
        train(tiny_config(*overrides, "train.epochs=5", run_dir=run_dir))
    message = str(err.value)
    assert f"run dir {run_dir} was trained with a different config ({'; '.join(differences)})" in message
    assert "\n" not in message
    assert (run_dir / "history.jsonl").read_text() == (trained_run[0] / "history.jsonl").read_text()  # untouched


def test_the_refusal_and_the_readme_name_the_keys_a_resume_may_change(trained_run, tiny_config, tmp_path):
    """What the refusal says may change is what the README's Resume paragraph says, and so it is:
    a larger train.epochs and another train.learning_rate (a notice) continue the run."""
    import re

    from capsnet.training.checkpoints import check_resumable

    run_dir = tmp_path / "other"
    shutil.copytree(trained_run[0], run_dir)
    with pytest.raises(CheckpointError) as err:
        train(tiny_config("seed=1", run_dir=run_dir))
    said = re.findall(r"([\w.]+) may (?:grow|change)", str(err.value))
    readme = (REPO / "README.md").read_text()
    resume = readme[readme.index("**Resume.**"):].split("\n\n")[0]
    assert said == re.findall(r"`([\w.]+)` may (?:grow|change)", resume) == ["train.epochs", "train.learning_rate"]
    changed = tiny_config("train.epochs=9", "train.learning_rate=0.005", run_dir=run_dir)
    assert check_resumable(run_dir, changed) == ["train.learning_rate: 0.01 -> 0.005"]


@pytest.mark.parametrize("saved, current, differences", [
    # The exponential schedule: its decay keys are kept, train.epochs may grow.
    ({}, {"epochs": 9}, []),
    ({}, {"lr_decay_rate": 0.5}, ["train.lr_decay_rate"]),
    # The cosine one: its end and warm-up are kept, the decay keys it does not read may change.
    ({"lr_schedule": "cosine"}, {"lr_schedule": "cosine", "lr_decay_rate": 0.5}, []),
    ({"lr_schedule": "cosine"}, {"lr_schedule": "cosine", "epochs": 9}, ["train.epochs"]),
    ({"lr_schedule": "cosine", "warmup_epochs": 1}, {"lr_schedule": "cosine"}, ["train.warmup_epochs"]),
    # A change of schedule, and what the saved run's schedule read.
    ({}, {"lr_schedule": "cosine", "epochs": 9}, ["train.lr_schedule"]),
    ({"lr_schedule": "cosine"}, {"epochs": 9}, ["train.epochs", "train.lr_schedule"]),
])
def test_resume_keeps_the_keys_of_the_runs_learning_rate_schedule(tiny_config, saved, current, differences):
    from capsnet.training.checkpoints import _config_differences

    base = tiny_config()
    with_train = lambda changes: {**base, "train": {**base["train"], **changes}}  # noqa: E731
    assert sorted(_config_differences(with_train(saved), with_train(current))) == differences


@pytest.mark.slow
@pytest.mark.parametrize("changed", ["data.zoom=0.1", "data.elastic_alpha=30", "data.shift_fill=edge",
                                     "data.erase_probability=0.5", "model.w_init_stddev=0.01", "train.ema_decay=0.9",
                                     "train.drop_remainder=True", "model.primary_caps_scale=0.5"])
def test_resume_of_a_run_saved_before_the_later_options(trained_run, tiny_config, tmp_path, changed):
    """A config.yaml without the options added later (data.flip / rotate_degrees / zoom /
    elastic_* / shift_fill / erase_*, model.w_init_stddev / primary_caps_scale / primary_caps_bias,
    train.ema_decay / lr_schedule / warmup_epochs / drop_remainder) was trained with their
    defaults: resuming with the defaults continues, changing one is refused."""
    run_dir = tmp_path / "old"
    shutil.copytree(trained_run[0], run_dir)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    for key in ("flip", "rotate_degrees", "zoom", "elastic_alpha", "elastic_sigma", "shift_fill", "erase_probability",
                "erase_max_area"):
        del saved["data"][key]
    del saved["model"]["w_init_stddev"], saved["model"]["primary_caps_scale"], saved["model"]["primary_caps_bias"]
    del saved["train"]["ema_decay"]
    del saved["train"]["lr_schedule"], saved["train"]["warmup_epochs"], saved["train"]["drop_remainder"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    (run_dir / ".capsnet-run").unlink()  # a run dir of before the marker (a marked one is read strictly)
    key, value = changed.split("=")
    with pytest.raises(CheckpointError, match=rf"\({key}: \S+ -> '?{value}'?\)"):
        train(tiny_config(changed, "train.epochs=5", run_dir=run_dir))
    metrics = train(tiny_config("train.epochs=5", run_dir=run_dir))
    assert metrics["resumed_from"].endswith("ckpt-4")


def test_resume_with_a_corrupt_config_yaml_is_a_checkpoint_error(trained_run, tiny_config, tmp_path):
    run_dir = tmp_path / "corrupt"
    shutil.copytree(trained_run[0], run_dir)
    (run_dir / "config.yaml").write_text("model: [unclosed\n")
    with pytest.raises(CheckpointError, match=f"cannot parse the run config {run_dir}/config.yaml") as err:
        train(tiny_config("train.epochs=5", run_dir=run_dir))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_crash_before_the_epoch_checkpoint_redoes_the_epoch(tiny_config, tmp_path, monkeypatch):
    """The epoch's checkpoint is its commit point: the history line comes first, the best
    checkpoint after it, and a restart discards what an uncommitted epoch left."""
    run_dir = tmp_path / "run"
    real_save = tf.train.CheckpointManager.save

    def crash(self, *args, **kwargs):
        raise RuntimeError("simulated crash at the commit point")

    monkeypatch.setattr(tf.train.CheckpointManager, "save", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_config("train.epochs=1"))
    # Written before the commit point: the history line; best/ comes after it.
    assert [json.loads(line)["epoch"] for line in (run_dir / "history.jsonl").read_text().splitlines()] == [1]
    assert not list(run_dir.glob("checkpoints/best/ckpt-*"))
    assert tf.train.latest_checkpoint(str(run_dir / "checkpoints" / "best")) is None
    assert tf.train.latest_checkpoint(str(run_dir / "checkpoints" / "latest")) is None

    monkeypatch.setattr(tf.train.CheckpointManager, "save", real_save)
    metrics = train(tiny_config("train.epochs=1"))
    assert metrics["resumed_from"] is None  # nothing was committed: the epoch is redone
    assert metrics["epochs"] == 1 and [h["epoch"] for h in metrics["history"]] == [1]
    best = tf.train.latest_checkpoint(str(run_dir / "checkpoints" / "best"))
    assert best is not None and best.endswith("best/ckpt-1")
    assert sorted(p.name for p in (run_dir / "checkpoints" / "best").glob("ckpt-*.index")) == ["ckpt-1.index"]
    # The best checkpoint holds the committed epoch 1, the same state as latest/ckpt-1.
    ours = tf.train.load_checkpoint(best)
    committed = tf.train.load_checkpoint(str(run_dir / "checkpoints" / "latest" / "ckpt-1"))
    for name in ("model/digit_caps.SW/.ATTRIBUTES/VARIABLE_VALUE", "epoch/.ATTRIBUTES/VARIABLE_VALUE"):
        np.testing.assert_array_equal(ours.get_tensor(name), committed.get_tensor(name), err_msg=name)


@pytest.mark.slow
def test_a_crash_after_the_commit_point_adopts_the_best_epoch_on_restart(tiny_config, tmp_path, monkeypatch):
    """Epoch 1 committed (latest/ckpt-1), the crash before best/ took it: the restart (nothing
    left to train) puts it into best/ from latest's files (the same files: hard links)."""
    from capsnet.training.checkpoints import BestCheckpoint

    run_dir = tmp_path / "run"

    def crash(self, *args, **kwargs):
        raise RuntimeError("simulated crash after the commit point")

    with monkeypatch.context() as patch:
        patch.setattr(BestCheckpoint, "adopt", crash)
        with pytest.raises(RuntimeError, match="simulated crash"):
            train(tiny_config("train.epochs=1"))
    latest = run_dir / "checkpoints" / "latest" / "ckpt-1"
    assert tf.train.latest_checkpoint(str(latest.parent)) == str(latest)
    assert tf.train.latest_checkpoint(str(run_dir / "checkpoints" / "best")) is None
    metrics = train(tiny_config("train.epochs=1"))
    assert metrics["resumed_from"] == str(latest) and metrics["best_epoch"] == 1
    best = run_dir / "checkpoints" / "best" / "ckpt-1"
    assert tf.train.latest_checkpoint(str(best.parent)) == str(best)
    assert Path(f"{best}.index").stat().st_ino == Path(f"{latest}.index").stat().st_ino


def test_resume_drops_best_checkpoints_of_epochs_not_done(trained_run, tiny_config, tmp_path):
    """best/ holding a checkpoint numbered above the restored epoch (a crash before the commit
    point, or a run dir written before the best checkpoint waited for it) and an older one (a
    crash between the commit and the deletion of the previous best): only the best as of the
    restored epoch remains."""
    original_dir, original = trained_run
    run_dir = tmp_path / "run"
    shutil.copytree(original_dir, run_dir)
    best_dir = run_dir / "checkpoints" / "best"
    best_epoch = original["best_epoch"]
    for number in (0, 7):
        for path in best_dir.glob(f"ckpt-{best_epoch}.*"):
            shutil.copy(path, best_dir / path.name.replace(f"ckpt-{best_epoch}.", f"ckpt-{number}."))
    (best_dir / "checkpoint").write_text('model_checkpoint_path: "ckpt-7"\n')

    metrics = train(tiny_config(run_dir=run_dir))  # all 4 epochs done: nothing to train
    assert metrics["epochs"] == 4
    assert sorted(p.name for p in best_dir.glob("ckpt-*.index")) == [f"ckpt-{best_epoch}.index"]
    assert tf.train.latest_checkpoint(str(best_dir)) == str(best_dir / f"ckpt-{best_epoch}")


def test_deterministic_false_after_a_true_run_in_one_process_turns_determinism_off(tiny_config, tmp_path):
    """A sweep (-m) runs its jobs in one process; op determinism is a process-wide switch."""
    from tensorflow.python.framework import config as tf_config

    missing = tmp_path / "no_data"
    try:
        for deterministic in (True, False, True, False):
            cfg = tiny_config(f"deterministic={str(deterministic).lower()}")
            cfg["data"]["dir"] = str(missing)  # stops the job once the switch is set, before any training
            with pytest.raises(DataError, match="no_data"):
                train(cfg)
            assert tf_config.is_op_determinism_enabled() is deterministic
    finally:
        tf_config.disable_op_determinism()


def test_without_decoder(tiny_config, tmp_path):
    metrics = train(tiny_config("model.decoder=false", "train.epochs=1"))
    assert metrics["test_reconstruction_loss"] == 0.0
    assert metrics["test_loss"] == pytest.approx(metrics["test_margin_loss"])
    tags = set(read_events(tmp_path / "run"))
    assert "routing/c_ij" in tags and "reconstructions/inputs_over_reconstructions" not in tags


# --------------------------------------------------------------------------- XLA

# Runs in a fresh process (XLA settings are process-wide, and on a CPU the flag that lets
# autoclustering act is read once, when TensorFlow sets up its devices): the same tiny
# model and batch, 6 train steps with xla=none, then 6 from the same initial weights with
# xla=<mode>. Prints the losses as JSON; "MARKER <mode>" on stderr separates the phases.
XLA_SCRIPT = r"""
import json, sys
import keras, tensorflow as tf
from capsnet.losses import loss_params
from capsnet.training.model_setup import build_capsnet
from capsnet.training.optimizer import build_optimizer
from capsnet.training.steps import make_train_step
from capsnet.training.xla_flags import set_autoclustering
from conftest import synthetic_digits

mode, cfg = sys.argv[1], json.loads(sys.argv[2])
set_autoclustering(mode == "autocluster")  # before any tensor: see set_autoclustering
images, labels = synthetic_digits(32, seed=0)
images = tf.constant(images[..., None] / 255.0, tf.float32)  # (32, 28, 28, 1)
labels = tf.constant(labels, tf.int32)                         # (32,)
keras.utils.set_random_seed(0)
losses, initial = {}, None
for xla in ("none", mode):
    model = build_capsnet(cfg["model"], custom_op=False)
    if initial is None:
        initial = model.get_weights()
    model.set_weights(initial)
    optimizer, _ = build_optimizer(cfg["train"], 20, model)
    step = make_train_step(model, optimizer, input_shape=cfg["model"]["input_shape"],
                           losses=loss_params(cfg["train"]), xla=xla)
    print("MARKER", xla, file=sys.stderr, flush=True)
    losses[xla] = [float(step(images, labels)["loss"]) for _ in range(6)]
print(json.dumps(losses))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["jit", "autocluster"])
def test_xla_train_step_compiles_and_trains_like_none(tiny_idx_dir, tmp_path, mode):
    cfg = compose_config("train", tiny_overrides(tiny_idx_dir, tmp_path / "unused"))
    env = entry_point_env(REPO / "tests")  # the script imports conftest
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"  # XLA's "Compiled cluster" line is an INFO log
    env.pop("TF_XLA_FLAGS", None)
    result = subprocess.run([sys.executable, "-c", XLA_SCRIPT, mode, json.dumps(cfg)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    losses = json.loads(result.stdout.strip().splitlines()[-1])

    # XLA compiled something, and only in the <mode> phase (TF logs this once per process).
    before, marker, after = result.stderr.partition(f"MARKER {mode}")
    assert marker and "Compiled cluster using XLA" not in before
    assert "Compiled cluster using XLA" in after, result.stderr[-2000:]
    # Same first-step loss as without XLA; then it trains, along the same path.
    assert losses[mode][0] == pytest.approx(losses["none"][0], rel=1e-5)
    assert losses[mode][-1] < 0.9 * losses[mode][0]
    np.testing.assert_allclose(losses[mode], losses["none"], rtol=1e-3)


def test_set_tf_xla_flag_sets_each_flag_once_and_returns_the_earlier_setting(monkeypatch):
    from capsnet.training.xla_flags import set_tf_xla_flag

    monkeypatch.setenv("TF_XLA_FLAGS", "--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit_x")
    assert set_tf_xla_flag("--tf_xla_cpu_global_jit") is None  # a longer flag is another flag
    assert os.environ["TF_XLA_FLAGS"] == "--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit_x --tf_xla_cpu_global_jit"
    assert set_tf_xla_flag("--tf_xla_cpu_global_jit") == "--tf_xla_cpu_global_jit"
    assert os.environ["TF_XLA_FLAGS"].split().count("--tf_xla_cpu_global_jit") == 1
    assert set_tf_xla_flag("--tf_xla_auto_jit", 1) == "--tf_xla_auto_jit=2"  # replaced where it was
    assert os.environ["TF_XLA_FLAGS"] == "--tf_xla_auto_jit=1 --tf_xla_cpu_global_jit_x --tf_xla_cpu_global_jit"


def test_set_xla_cache_adds_the_flag_and_replaces_another_directory_with_a_notice(tmp_path, monkeypatch):
    from capsnet.training.xla_flags import DEFAULT_CACHE_DIR, set_xla_cache

    monkeypatch.setenv("TF_XLA_FLAGS", "--tf_xla_cpu_global_jit")
    assert set_xla_cache(None) is None
    assert os.environ["TF_XLA_FLAGS"] == "--tf_xla_cpu_global_jit"  # None: left alone
    assert set_xla_cache(tmp_path / "a" / "b") is None
    assert os.environ["TF_XLA_FLAGS"] == f"--tf_xla_cpu_global_jit --tf_xla_persistent_cache_directory={tmp_path}/a/b"
    assert (tmp_path / "a" / "b").is_dir()  # made up front: TensorFlow would only log its failure
    assert set_xla_cache(tmp_path / "a" / "b") is None  # the same again: no notice, one flag
    assert os.environ["TF_XLA_FLAGS"].count("--tf_xla_persistent_cache_directory") == 1
    notice = set_xla_cache(tmp_path / "c")
    assert notice == (f"train.xla_cache_dir={tmp_path}/c replaces TF_XLA_FLAGS' "
                      f"--tf_xla_persistent_cache_directory={tmp_path}/a/b")
    assert os.environ["TF_XLA_FLAGS"] == f"--tf_xla_cpu_global_jit --tf_xla_persistent_cache_directory={tmp_path}/c"
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^train.xla_cache_dir=.*file/d: cannot make the directory"):
        set_xla_cache(tmp_path / "file" / "d")
    # The default in a home that cannot hold it (read-only, a file): the run goes on uncached, said.
    monkeypatch.setenv("HOME", str(tmp_path / "file"))
    monkeypatch.setenv("TF_XLA_FLAGS", "")
    assert set_xla_cache(DEFAULT_CACHE_DIR) == (
        f"train.xla_cache_dir={DEFAULT_CACHE_DIR} cannot be made (Not a directory): XLA compiles without a cache "
        "(train.xla_cache_dir=PATH keeps one elsewhere, null says none)")
    assert os.environ["TF_XLA_FLAGS"] == ""


@pytest.mark.slow
def test_set_xla_compile_threads_adds_flags_this_xla_knows_unless_the_user_set_them(monkeypatch):
    """Both flags go into XLA_FLAGS, after the user's others; a user's setting of either is
    left as it is. XLA aborts the process on a flag it does not know (at its first
    compilation): a subprocess compiles a function with the flags set."""
    from capsnet.training.xla_flags import set_xla_compile_threads

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert set_xla_compile_threads(3) == ("--xla_gpu_force_compilation_parallelism=3 "
                                          "--xla_gpu_enable_llvm_module_compilation_parallelism=true")
    assert os.environ["XLA_FLAGS"] == ("--xla_dump_to=/tmp/x --xla_gpu_force_compilation_parallelism=3 "
                                       "--xla_gpu_enable_llvm_module_compilation_parallelism=true")
    for user in ("--xla_gpu_force_compilation_parallelism=1",
                 "--xla_gpu_enable_llvm_module_compilation_parallelism=false"):
        monkeypatch.setenv("XLA_FLAGS", user)
        assert set_xla_compile_threads() == "" and os.environ["XLA_FLAGS"] == user
    monkeypatch.delenv("XLA_FLAGS")
    code = ("import os, tensorflow as tf\n"
            "from capsnet.training.xla_flags import set_xla_compile_threads, set_xla_gemm_backend\n"
            "print(set_xla_compile_threads())\n"
            "print(set_xla_gemm_backend())\n"
            "print(float(tf.function(lambda x: x * 2, jit_compile=True)(tf.ones(3))[0]))")
    result = subprocess.run([sys.executable, "-c", code], env=entry_point_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    threads = len(os.sched_getaffinity(0))
    assert result.stdout.split("\n")[:3] == [
        f"--xla_gpu_force_compilation_parallelism={threads} --xla_gpu_enable_llvm_module_compilation_parallelism=true",
        "--xla_gpu_enable_triton_gemm=false", "2.0"]


def test_set_xla_gemm_backend_turns_triton_gemms_off_unless_the_user_set_it(monkeypatch):
    """The flag goes into XLA_FLAGS once, after the user's others; a user's own setting of
    it (either value), or of any other --xla_gpu_*triton_gemm* flag, is left as it is. (That
    this XLA knows the flag: the compile-threads test above compiles a function with it set.)"""
    from capsnet.training.xla_flags import set_xla_gemm_backend

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert set_xla_gemm_backend() == "--xla_gpu_enable_triton_gemm=false"
    assert set_xla_gemm_backend() == ""  # set already: not twice
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_enable_triton_gemm=false"
    for user in ("--xla_gpu_enable_triton_gemm=true", "--xla_gpu_enable_triton_gemm",
                 "--xla_gpu_triton_gemm_any=true",
                 "--xla_dump_to=/tmp/x --xla_gpu_unsupported_enable_triton_gemm=false"):
        monkeypatch.setenv("XLA_FLAGS", user)
        assert set_xla_gemm_backend() == "" and os.environ["XLA_FLAGS"] == user
    # a flag that only mentions triton_gemm in its value is not the user's choice of backend
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_dump_autotune_results_to=/tmp/triton_gemm")
    assert set_xla_gemm_backend() == "--xla_gpu_enable_triton_gemm=false"


@pytest.mark.parametrize("steps_per_epoch, start, per_call, log_every, lengths", [
    (10, 0, 1, 50, [1] * 10),        # one step a call: as before the option
    (10, 0, 4, 50, [1, 4, 4, 1]),    # the first call of an epoch is one step; the epoch's end
    (10, 0, 4, 3, [1, 2, 3, 3, 1]),  # calls end at log steps 3, 6, 9
    (10, 7, 4, 3, [1, 1, 3, 3, 2]),  # the global step goes on from 7: log steps 9, 12, 15
    (3, 0, 50, 50, [1, 2]),
])
def test_execution_lengths_end_at_log_steps_and_at_the_epoch_end(steps_per_epoch, start, per_call, log_every,
                                                                  lengths):
    from capsnet.training.steps import execution_lengths

    assert execution_lengths(steps_per_epoch, start, per_call, log_every) == lengths


@pytest.mark.parametrize("tty", [True, False], ids=["terminal", "log_file"])
def test_progress_bar_moves_at_any_steps_per_execution(monkeypatch, capsys, tty):
    """On a terminal the bar moves ~20 times an epoch even with 50 steps per call (calls of
    at most 1/20 of the epoch) and never shows images/s as nan; in a log file the calls stay
    as long as steps_per_execution allows (the bar prints one line per epoch there)."""
    from capsnet.training.epoch import EpochShape, TrainScalars, train_epoch

    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty)
    calls = []

    def train_steps(iterator, batch_sizes):
        ran = int(tf.math.count_nonzero(batch_sizes))
        calls.append(ran)
        time.sleep(0.002 * ran)  # a clock for images/s
        return {"loss": tf.fill([ran], 0.5), "margin_loss": tf.fill([ran], 0.4),
                "reconstruction_loss": tf.fill([ran], 0.1), "accuracy": tf.fill([ran], 1.0),
                "grad_norm": tf.ones([ran])}

    shape = EpochShape(num_examples=100, batch_size=1, steps_per_execution=50, log_every_steps=1000)
    means, step, stopped_at = train_epoch(train_steps, None, shape, global_step=0,
                                          scalars=TrainScalars(tf.summary.create_noop_writer(), lambda: 0.001))
    assert step == 100 and sum(calls) == 100 and means["loss"] == pytest.approx(0.5) and stopped_at is None
    assert calls == ([1] + [5] * 19 + [4] if tty else [1, 50, 49])
    assert "nan" not in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["custom_op=true"], ["train.xla=jit"], ["custom_op=true", "train.xla=jit"]],
                         ids=["matmul", "op", "jit", "op_jit"])
def test_several_steps_per_call_run_the_same_steps(tiny_config, tmp_path, extra):
    """steps_per_execution=3 loops over the dataset inside one call: the same steps as one
    call each, so the same per-step losses (logged every 2 steps; the epoch's last batch is
    short: 53 = 3 × 16 + 5) and the same final weights and Adam moments."""
    common = ["data.limit_train=53", "train.epochs=2", "train.log_every_steps=2", *extra]
    runs = {}
    for per_call in (1, 3):
        run_dir = tmp_path / f"per_call_{per_call}"
        metrics = train(tiny_config(*common, f"train.steps_per_execution={per_call}", run_dir=run_dir))
        assert metrics["global_step"] == 8
        runs[per_call] = (run_dir, [(step, float(tf.make_ndarray(v.tensor)))
                                    for step, v in read_events(run_dir)["train/loss"]])
    (one_dir, one), (loop_dir, loop) = runs[1], runs[3]
    assert [s for s, _ in loop] == [s for s, _ in one] == [2, 4, 6, 8]
    np.testing.assert_allclose([v for _, v in loop], [v for _, v in one], rtol=1e-5)
    names = assert_checkpoint_tensors_close(loop_dir / "checkpoints" / "latest" / "ckpt-2",
                                            one_dir / "checkpoints" / "latest" / "ckpt-2", rtol=1e-4, atol=1e-6)
    assert any(name.startswith("optimizer/") for name in names)


@pytest.mark.slow
def test_train_with_xla_jit_matches_the_plain_run(trained_run, tiny_config, capsys):
    """train() wires xla=jit into both compiled steps: its first epoch measures what the
    plain run's did (same seed, data order and initial weights). On a CPU it says that
    jit is slower there, once."""
    _, plain = trained_run
    capsys.readouterr()
    jit = train(tiny_config("train.xla=jit", "train.epochs=1"))
    notices = capsys.readouterr().out.count("notice: train.xla=jit on a CPU")
    assert notices == (0 if tf.config.list_logical_devices("GPU") else 1)
    ours, theirs = jit["history"][0], plain["history"][0]
    for key in ("train_loss", "test_loss", "test_margin_loss"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-3), key
    assert abs(ours["test_accuracy"] - theirs["test_accuracy"]) <= 0.02  # 100 test images: 2 at most


@pytest.mark.slow
def test_the_compiled_test_step_is_compiled_beside_the_first_epoch(tiny_config, monkeypatch):
    """train.xla=jit: the test step is called on zeros of each test batch shape (32, and the
    last batch's 100 % 32 = 4) in a thread of its own once the first training call has
    returned, before the first test pass, which waits for it; the run's test scores are the
    test split's through the trained weights (the zeros' outputs are kept nowhere)."""
    from capsnet.evaluation import evaluate
    from capsnet.training import epoch

    calls, real, returned, real_epoch = [], epoch.compile_eval_step, [], epoch.train_epoch

    def counting_epoch(train_steps, *args, **kwargs):
        def counted(*inputs):
            out = train_steps(*inputs)
            returned.append(1)
            return out
        return real_epoch(counted, *args, **kwargs)

    def spy(eval_step, element_spec, sizes):
        assert returned, "the test step's compilation started before the first training call returned"
        shapes = []

        def recording(*inputs):
            shapes.append([(tuple(x.shape), x.dtype, float(tf.reduce_max(tf.abs(tf.cast(x, tf.float32)))))
                           for x in inputs])
            return eval_step(*inputs)

        calls.append((sizes, shapes, real(recording, element_spec, sizes)))
        return calls[-1][2]

    monkeypatch.setattr(epoch, "compile_eval_step", spy)
    monkeypatch.setattr(epoch, "train_epoch", counting_epoch)
    cfg = tiny_config("data.limit_train=40", "train.epochs=1", "train.xla=jit", "train.test_batch_size=32")
    metrics = train(cfg)
    [(sizes, shapes, future)] = calls
    assert sizes == [4, 32] and future.done() and future.result() is None
    assert shapes == [[((n, 28, 28, 1), tf.float32, 0.0), ((n,), tf.int32, 0.0)] for n in (4, 32)]
    report = evaluate(cfg["run_dir"], which="latest")
    assert metrics["test_accuracy"] == report["accuracy"]


@pytest.mark.slow
def test_the_validation_pass_waits_for_the_test_steps_compilation(tiny_config, monkeypatch):
    """train.xla=jit with data.validation_fraction: the validation split's last batch shape is
    compiled beside the first epoch with the test split's, and the validation pass, the
    epoch's first over held-out data, waits for that compilation as the test pass does
    (calling the step beside it compiled the same shapes twice at once); the run's estimate
    counts the validation split's examples with the test split's."""
    from capsnet.training import epoch, loop
    from capsnet.training.progress import Progress

    futures, passes, real_compile, real_evaluate = [], [], epoch.compile_eval_step, epoch.evaluate_model

    def slow_compile(eval_step, element_spec, sizes):
        def slowly(*inputs):
            time.sleep(2.0)  # longer than the epoch's steps left after the compiling call
            return eval_step(*inputs)

        futures.append((sizes, real_compile(slowly, element_spec, sizes)))
        return futures[-1][1]

    def evaluating(eval_step, dataset, *args, **kwargs):
        passes.append(futures[0][1].done())
        return real_evaluate(eval_step, dataset, *args, **kwargs)

    monkeypatch.setattr(epoch, "compile_eval_step", slow_compile)
    monkeypatch.setattr(epoch, "evaluate_model", evaluating)
    estimates = []  # the run's estimate counts the validation pass beside the test pass
    monkeypatch.setattr(loop, "Progress", lambda **kwargs: estimates.append(kwargs) or Progress(**kwargs))
    metrics = train(tiny_config("data.limit_train=40", "data.validation_fraction=0.2", "train.epochs=1",
                                "train.xla=jit", "train.test_batch_size=32"))
    [(sizes, _)] = futures
    assert len(sizes) == 3 and {4, 32} < set(sizes)  # the test split's 100 = 3 x 32 + 4, the validation's
    assert passes == [True, True] and "validation_accuracy" in metrics["history"][0]
    [estimate], [held_out] = estimates, set(sizes) - {4, 32}  # (fewer than 32 held out: one batch)
    assert estimate["test_examples"] == 100 + held_out


def test_compiling_the_test_step_leaves_its_errors_to_the_test_pass():
    """compile_eval_step: an op's error (the call ran out of memory beside the training, say)
    is dropped, the test pass making the same call alone; anything else is a bug, raised."""
    from capsnet.training.steps import compile_eval_step

    spec = (tf.TensorSpec([None, 2], tf.float32),)

    def out_of_memory(x):
        raise tf.errors.ResourceExhaustedError(None, None, "OOM")

    def broken(x):
        raise TypeError("not a step")

    assert compile_eval_step(out_of_memory, spec, [3]).result(timeout=60) is None
    with pytest.raises(TypeError, match="not a step"):
        compile_eval_step(broken, spec, [3]).result(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["auto", "tf"], ids=["fused_op", "op"])
def test_custom_op_under_xla_jit_trains_as_the_matmul_path(tiny_config, tmp_path, routing):
    """custom_op=true train.xla=jit compiles the whole step with our kernels in it (XLA
    custom calls): the same per-step losses and final weights as custom_op=false under
    jit (same seed, data and initial weights; float tolerance: different summation orders)."""
    from capsnet.model import build_model
    from capsnet.training.optimizer import build_optimizer
    from capsnet.losses import loss_params
    from capsnet.training.steps import make_train_step

    common = ["data.limit_train=40", "train.epochs=2", "train.log_every_steps=1", "train.xla=jit"]
    runs = {}
    for name, extra in (("op", ["custom_op=true", f"model.routing={routing}"]), ("matmul", ["custom_op=false"])):
        run_dir = tmp_path / name
        metrics = train(tiny_config(*common, *extra, run_dir=run_dir))
        assert metrics["global_step"] == 6
        runs[name] = (run_dir, [float(tf.make_ndarray(v.tensor)) for _, v in read_events(run_dir)["train/loss"]])
    (op_dir, op_losses), (matmul_dir, matmul_losses) = runs["op"], runs["matmul"]
    assert len(op_losses) == 6
    np.testing.assert_allclose(op_losses, matmul_losses, rtol=2e-4)
    assert_checkpoint_tensors_close(op_dir / "checkpoints" / "latest" / "ckpt-2",
                                    matmul_dir / "checkpoints" / "latest" / "ckpt-2", rtol=1e-3, atol=1e-5,
                                    prefix="model/")

    # make_train_step builds the jit step for an op model made outside a config too.
    model = build_model(routing="fused_op", conv1_filters=16, primary_caps_types=4, digit_caps_dim=8)
    cfg = tiny_config()
    optimizer, _ = build_optimizer(cfg["train"], 20, model)
    step = make_train_step(model, optimizer, input_shape=(28, 28, 1), losses=loss_params(cfg["train"]), xla="jit")
    values = step(tf.zeros((2, 28, 28, 1)), tf.constant([1, 2]))
    assert np.isfinite(float(values["loss"]))


def test_jit_routing_inside_xla_jit_is_a_config_error(tiny_config):
    # model.routing=xla is what model.jit_routing=true was.
    with pytest.raises(ConfigError, match=r"model\.routing=xla is redundant under train\.xla=jit"):
        train(tiny_config("model.routing=xla", "train.xla=jit"))


# --------------------------------------------------------------------------- the compiled op

@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False], ids=["fused_routing", "prediction_op"])
def test_custom_op_trains_like_the_matmul_path_and_evaluates_the_same_on_both(
        trained_run, tiny_config, tmp_path, spy_on_op, fused):
    """custom_op=true (by default the fused routing op; with model.routing=tf the
    prediction op + TF routing). Needs the op library: `make test` builds it first."""
    from capsnet.evaluation import evaluate

    calls = spy_on_op(op="capsule_routing" if fused else "capsule_prediction")
    metrics = train(tiny_config("custom_op=true", "train.epochs=1",
                                *([] if fused else ["model.routing=tf"])))
    assert (144, 10, 8, 8) in {W for _, W in calls}  # DigitCaps ran that op, not the matmul path
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["custom_op"] is True
    # Same seed, data and initial weights as the matmul-path run: the same first epoch.
    ours, theirs = metrics["history"][0], trained_run[1]["history"][0]
    for key in ("train_loss", "test_loss"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-3), key

    # One checkpoint, evaluated through the op and through the matmul path.
    calls.clear()
    op = evaluate(tmp_path / "run", which="latest", custom_op=True, output=tmp_path / "op.json")
    assert calls, "evaluate(custom_op=True) did not use the op"
    calls.clear()
    matmul = evaluate(tmp_path / "run", which="latest", custom_op=False, output=tmp_path / "matmul.json")
    assert not calls
    assert (op["custom_op"], matmul["custom_op"]) == (True, False)
    assert op["accuracy"] == metrics["test_accuracy"]  # what training's own test pass measured
    assert abs(matmul["accuracy"] - op["accuracy"]) <= 1 / op["num_examples"]  # at most one borderline image
    assert matmul["loss"] == pytest.approx(op["loss"], rel=1e-4)


@pytest.mark.slow
def test_a_capsule_bias_trains_through_the_op_and_evaluates_the_same_on_both_paths(tiny_config, tmp_path, spy_on_op):
    """model.digit_caps_bias (the authors' code's bias on s_j): custom_op=true then runs
    the prediction op and TF routing (auto skips the fused op, which has no bias); the
    bias learns and is checkpointed; one checkpoint evaluates the same on both paths."""
    from capsnet.evaluation import evaluate

    calls = spy_on_op(op="capsule_prediction")
    metrics = train(tiny_config("custom_op=true", "train.epochs=1", "model.digit_caps_bias=0.1"))
    assert calls and np.isfinite(metrics["history"][0]["train_loss"])
    reader = tf.train.load_checkpoint(str(tmp_path / "run" / "checkpoints" / "latest"))
    (b_j,) = [reader.get_tensor(name) for name in reader.get_variable_to_shape_map() if "b_j" in name]
    assert b_j.shape == (10, 8) and not np.allclose(b_j, 0.1)  # it trained
    op = evaluate(tmp_path / "run", which="latest", custom_op=True, output=tmp_path / "op.json")
    matmul = evaluate(tmp_path / "run", which="latest", custom_op=False, output=tmp_path / "matmul.json")
    assert op["accuracy"] == metrics["test_accuracy"]
    assert abs(matmul["accuracy"] - op["accuracy"]) <= 1 / op["num_examples"]
    assert matmul["loss"] == pytest.approx(op["loss"], rel=1e-4)


def test_custom_op_library_without_cuda_while_tf_sees_a_gpu_is_refused(tiny_config, tmp_path, monkeypatch):
    """It would run the op on the CPU beside a GPU, silently; the stamp says how it was built."""
    from capsnet import ops
    from capsnet.training.model_setup import check_op_library

    real_devices = tf.config.list_physical_devices
    stamps = []
    monkeypatch.setattr(ops, "build_stamp", lambda path: stamps.append(path) or {"cuda": False})
    check_op_library()  # no GPU here: the CPU build is what is needed

    def with_a_gpu(device_type=None):
        if device_type == "GPU":
            return [tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")]
        return real_devices(device_type)

    monkeypatch.setattr(tf.config, "list_physical_devices", with_a_gpu)
    with pytest.raises(OpLibraryError) as err:
        train(tiny_config("custom_op=true"))
    message = str(err.value)
    assert "\n" not in message and "built without CUDA" in message and "make ops-cuda" in message
    assert ops.library_path() in message and stamps[-1] == ops.library_path()
    assert not (tmp_path / "run").exists()

    monkeypatch.setattr(ops, "build_stamp", lambda path: {"cuda": True})
    check_op_library()  # a CUDA build passes (the op itself runs on the CPU here)


def test_custom_op_without_the_library_is_one_line_error(tiny_config, tmp_path, fresh_op_loader):
    missing = fresh_op_loader
    with pytest.raises(OpLibraryError) as err:
        train(tiny_config("custom_op=true"))
    message = str(err.value)
    assert "\n" not in message and str(missing) in message and "make ops" in message
    assert not (tmp_path / "run").exists()  # refused before the run dir was made


# --------------------------------------------------------------------------- scripts/benchmark_train.py

def test_benchmark_train_variants_change_only_the_routing_backend():
    """A variant sets model.routing.backend and keeps the section's other keys: the CIFAR-10
    preset's leaky routing is timed as leaky routing, on the fused op and off it."""
    from capsnet import config

    bt = load_script("benchmark_train")
    model_cfg = compose_config("train", ["run_dir=unused", "experiment=paper_cifar10"])["model"]
    assert model_cfg["routing"]["leaky"] is True
    for variant, custom_op, backend, mode in (("op+fused", True, "auto", "fused_op"), ("op", True, "tf", "op"),
                                             ("matmul", False, "tf", "matmul")):
        cfg = bt.variant_model_cfg(variant, model_cfg)
        assert cfg["routing"] == {**model_cfg["routing"], "backend": backend}, variant
        assert config.router_spec(custom_op, cfg)["leaky"] is True and config.router_spec(custom_op, cfg)["backend"] == mode
    assert bt.variant_model_cfg("op", {**model_cfg, "routing": "auto"})["routing"] == {"backend": "tf"}


@pytest.mark.slow
def test_benchmark_train_script_times_both_paths_on_the_same_model(tmp_path):
    """A CPU smoke run of the benchmark on the tiny model (the op library must be built)."""
    from conftest import TINY_MODEL

    output = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "benchmark_train.py"), "--device", "cpu", "--batch-sizes", "4,6",
         "--steps", "2", "--repeats", "3", "--warmup", "1", "--variants", "op,matmul", "--json", str(output),
         "--precision", "float32,mixed_bfloat16", *TINY_MODEL],
        env=entry_point_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(output.read_text())
    # conv1 9·9·1·16, PrimaryCaps 9·9·16·(4·8), W 144·10·8·8, decoder 80-32-64-784
    assert report["parameters"] == ((81 * 16 + 16) + (81 * 16 * 32 + 32) + 144 * 10 * 8 * 8
                                    + (80 * 32 + 32) + (32 * 64 + 64) + (64 * 784 + 784))
    # bfloat16: the same steps in another precision, its ratio against its own baseline.
    bf16 = {(row["variant"], row["batch_size"]): row for row in report["results"]
            if row["precision"] == "mixed_bfloat16"}
    assert sorted(bf16) == [("matmul", 4), ("matmul", 6), ("op", 4), ("op", 6)]
    for (variant, batch), row in bf16.items():
        assert row["ratio"] == pytest.approx(row["images_per_sec"] / bf16[("matmul", batch)]["images_per_sec"])
        # The CPU allocator's peak (a BFC allocator in the workers) is measured. Not compared
        # across batches: the tiny model's batches of 4 and 6 differ by well under a MiB, less
        # than the allocator's run-to-run spread (CI once saw 55.8 MiB at 4 against 43.1 at 6).
        assert 0 < row["peak_memory_mib"] < 4096
    rows = {(row["variant"], row["batch_size"]): row for row in report["results"] if row["precision"] == "float32"}
    assert sorted(rows) == [("matmul", 4), ("matmul", 6), ("op", 4), ("op", 6)]
    assert report["errors"] == []
    for (variant, batch), row in rows.items():
        assert row["first_loss"] == pytest.approx(bf16[(variant, batch)]["first_loss"], rel=2e-2)
        median = float(np.median(row["repeat_seconds"]))
        assert len(row["repeat_seconds"]) == 3
        assert row["images_per_sec"] == pytest.approx(2 * batch / median)
        assert row["ms_per_step"] == pytest.approx(1000 * median / 2)
        assert row["ratio"] == pytest.approx(row["images_per_sec"] / rows[("matmul", batch)]["images_per_sec"])
        # Same seed in every variant's process: the same weights and data, so the same first loss.
        assert row["first_loss"] == pytest.approx(rows[("matmul", batch)]["first_loss"], rel=1e-5)
        assert np.isfinite(row["last_loss"])
    table = result.stdout
    assert "| custom_op=true xla=none | float32 | 6 |" in table
    assert "| custom_op=false xla=none | mixed_bfloat16 | 4 |" in table


@pytest.mark.slow
def test_benchmark_train_times_the_data_on_device_loop(tmp_path):
    """--input on_device: the steps of train.data_on_device=true (a call's steps one XLA
    program over a synthetic uint8 training set on the device) for both jit variants: the
    same seed gives both the same weights and batches, so the same first loss."""
    from conftest import TINY_MODEL

    output = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "benchmark_train.py"), "--device", "cpu", "--batch-sizes", "8",
         "--steps", "4", "--repeats", "1", "--warmup", "1", "--steps-per-execution", "2",
         "--variants", "op+fused+jit,matmul+jit", "--input", "on_device", "--json", str(output), *TINY_MODEL],
        env=entry_point_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(output.read_text())
    assert report["input"] == "on_device" and report["errors"] == []
    rows = {row["variant"]: row for row in report["results"]}
    assert sorted(rows) == ["matmul+jit", "op+fused+jit"]
    assert rows["op+fused+jit"]["first_loss"] == pytest.approx(rows["matmul+jit"]["first_loss"], rel=1e-4)
    assert all(np.isfinite(row["last_loss"]) and row["last_loss"] != row["first_loss"] for row in rows.values())
    assert "train.data_on_device=true" in result.stdout and report["augmentation"] == []

    # An augmentation override reaches the device's batches: the same weights see elastically
    # distorted images, so the first loss moves; the inputs that repeat one batch refuse it.
    command = [sys.executable, str(REPO / "scripts" / "benchmark_train.py"), "--device", "cpu", "--batch-sizes", "8",
               "--steps", "4", "--repeats", "1", "--warmup", "1", "--steps-per-execution", "2",
               "--variants", "matmul+jit", "--json", str(output), *TINY_MODEL, "data.elastic_alpha=16"]
    result = subprocess.run([*command, "--input", "on_device"], env=entry_point_env(), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    elastic = json.loads(output.read_text())
    assert elastic["augmentation"] == ["data.elastic_alpha=16"]
    first = elastic["results"][0]["first_loss"]
    assert np.isfinite(first) and first != pytest.approx(rows["matmul+jit"]["first_loss"], rel=1e-4)
    refused = subprocess.run([*command, "--input", "device"], env=entry_point_env(), capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and "error: data.elastic_alpha=16: only benchmark_train's --input on_device" \
        in refused.stderr
    for script in (["benchmark_scale.py", "--device", "cpu"], ["profile_train.py"]):  # one batch repeated too
        refused = subprocess.run([sys.executable, str(REPO / "scripts" / script[0]), *script[1:],
                                  "data.erase_probability=0.5"], env=entry_point_env(), capture_output=True,
                                 text=True, timeout=120)
        assert refused.returncode == 2 and "error: data.erase_probability=0.5: only" in refused.stderr, script


@pytest.mark.slow
def test_benchmark_conv_times_the_true_gradients(tmp_path):
    """scripts/benchmark_conv.py's parts are the convolution and its two gradients (against
    GradientTape's), and a CPU smoke run writes a row per conv, part and XLA setting."""
    bench = load_script("benchmark_conv")
    for _, in_shape, filter_shape, stride in bench.CONVS:
        full = bench.conv_parts(tf, 2, in_shape, filter_shape, stride, tf.float32)
        x, w, dy = full["forward"][1]
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x, w])
            y = tf.nn.conv2d(x, w, stride, "VALID")
        assert y.shape == dy.shape
        for form in bench.FORMS if stride > 1 else ["strided"]:
            parts = bench.conv_parts(tf, 2, in_shape, filter_shape, stride, tf.float32, form)
            # float32 sums of 20,736 products in another order: ~1e-5 apart on values of ~1
            np.testing.assert_allclose(parts["forward"][0](*parts["forward"][1]).numpy(), y.numpy(),
                                       rtol=1e-5, atol=5e-5, err_msg=form)
            for part, wrt in (("filter_grad", w), ("input_grad", x)):
                want = tape.gradient(y, wrt, output_gradients=dy).numpy()
                got = parts[part][0](*parts[part][1]).numpy()
                if form == "cropped" and part == "input_grad":  # of the used rows; the others' is 0
                    assert not want[:, got.shape[1]:].any() and not want[:, :, got.shape[2]:].any()
                    want = want[:, :got.shape[1], :got.shape[2]]
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{form} {part}")
    output = tmp_path / "conv.json"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_conv.py"), "--device", "cpu",
                             "--batch-size", "2", "--repeats", "1", "--xla", "none,jit",
                             "--form", "strided,space_to_depth", "--json", str(output)],
                            env=entry_point_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(output.read_text())["rows"]
    assert [(r["conv"], r["form"], r["part"]) for r in rows] == [
        (c[0], f, p) for c in bench.CONVS for f in (["strided", "space_to_depth"] if c[3] > 1 else ["strided"])
        for p in bench.PARTS]
    assert all(r["ms_none"] > 0 and r["ms_jit"] > 0 for r in rows)
    assert "| primary_caps | space_to_depth | input_grad | float32 |" in result.stdout
    refused = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_conv.py"), "--device", "cpu",
                              "--framework", "torch"], env=entry_point_env(), capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and "--framework torch times PyTorch's GPU kernels" in refused.stderr


@pytest.mark.slow
def test_benchmark_train_times_the_step_with_and_without_the_guard(tmp_path):
    """--guard on,off: each configuration with train()'s step and without the non-finite
    guard, the same model and data (the same first loss), the rows told apart."""
    from conftest import TINY_MODEL

    output = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "benchmark_train.py"), "--device", "cpu", "--batch-sizes", "4",
         "--steps", "2", "--repeats", "1", "--warmup", "1", "--variants", "matmul", "--guard", "on,off",
         "--json", str(output), *TINY_MODEL],
        env=entry_point_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = {row["guard"]: row for row in json.loads(output.read_text())["results"]}
    assert sorted(rows) == [False, True]
    assert rows[False]["first_loss"] == pytest.approx(rows[True]["first_loss"], rel=1e-6)
    assert rows[False]["ratio"] == pytest.approx(1.0)  # each against the baseline of its own guard setting
    assert "| custom_op=false xla=none no_guard | float32 | 4 |" in result.stdout
    assert "| custom_op=false xla=none | float32 | 4 |" in result.stdout


def test_benchmark_out_of_device_memory_is_one_line_naming_the_batch(monkeypatch):
    """time_training (benchmark_train and benchmark_scale) turns an OOM into a CapsnetError
    with the batch size and the first line of TensorFlow's message, not its allocator dump."""
    from conftest import TINY_MODEL

    from capsnet.errors import CapsnetError

    bt = load_script("benchmark_train")

    def out_of_memory(*args, **kwargs):
        raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[4,1152]\n"
                                                           "allocator dump ...")

    monkeypatch.setattr(bt, "time_steps", out_of_memory)
    run_spec = {"variant": "matmul", "custom_op": False, "xla": "none", "steps": 1, "warmup": 0, "repeats": 1,
                "input": "pipeline", **bt.compose_config(list(TINY_MODEL))}
    with pytest.raises(CapsnetError, match=r"^out of device memory at batch 4: OOM when allocating tensor "
                                           r"with shape\[4,1152\]$"):
        bt.time_training(run_spec, 4, "/CPU:0")


@pytest.mark.slow
def test_benchmark_train_script_rejects_bad_arguments(tmp_path):
    for args, message in ((["--variants", "op,fast"], "unknown variant(s) fast"),
                          (["--batch-sizes", "128,0"], "positive integers"),
                          (["custom_op=true"], "custom_op is set by each variant"),
                          (["--precision", "float32,fp8"], "unknown precision(s) fp8"),
                          (["--guard", "maybe"], "--guard takes on, off or on,off"),
                          (["train.precision=mixed_bfloat16"], "train.precision is set by"),
                          (["model.no_such_key=1"], "error: bad override"),
                          (["--input", "on_device", "--variants", "op+fused+jit,matmul"],
                           "--input on_device (train.data_on_device=true) needs train.xla=jit")):
        result = run_entry_point("scripts/benchmark_train.py", *args, cwd=tmp_path, timeout=120)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- weight average (train.ema_decay)

def test_weight_average_follows_the_formula_and_swaps_in_and_out(tiny_config):
    """WeightAverage inside the train step against NumPy: from the initial weights, after
    step t, shadow = d_t * shadow + (1 - d_t) * w_t with d_t = min(decay, (1 + t) / (10 + t)).
    decay 0.3 is reached at t = 3, so both the ramp and the cap are exercised. in_model()
    shows the averages and puts the trained weights back, also when the block raises."""
    from capsnet.losses import loss_params
    from capsnet.training.checkpoints import checkpoint_weights
    from capsnet.training.model_setup import build_capsnet
    from capsnet.training.optimizer import build_optimizer
    from capsnet.training.steps import make_train_step
    from capsnet.training.weight_average import WeightAverage
    from conftest import synthetic_digits

    cfg = tiny_config()
    tf.keras.utils.set_random_seed(0)
    model = build_capsnet(cfg["model"], custom_op=False)
    optimizer, _ = build_optimizer(cfg["train"], 20, model)
    average = WeightAverage(model, 0.3, optimizer.iterations)
    step = make_train_step(model, optimizer, input_shape=model.image_shape, losses=loss_params(cfg["train"]),
                           weight_average=average)
    names = [name for name, v in checkpoint_weights(model).items() if v.trainable]
    assert len(names) == len(model.trainable_variables) > 0
    shadow = {name: checkpoint_weights(model)[name].numpy().astype(np.float64) for name in names}
    images, labels = synthetic_digits(16 * 6, seed=1)
    images = tf.constant(images[..., None] / 255.0, tf.float32)
    for t in range(1, 7):
        step(images[16 * (t - 1):16 * t], tf.constant(labels[16 * (t - 1):16 * t], tf.int32))
        d = min(0.3, (1 + t) / (10 + t))
        for name in names:
            shadow[name] = d * shadow[name] + (1 - d) * checkpoint_weights(model)[name].numpy()
    averaged = average.weights()
    trained = {name: checkpoint_weights(model)[name].numpy() for name in names}
    for name in names:
        np.testing.assert_allclose(averaged[name].numpy(), shadow[name], rtol=1e-5, atol=1e-7, err_msg=name)
        assert not np.allclose(averaged[name].numpy(), trained[name]), name  # an average, not a copy
    with average.in_model():
        for name in names:
            np.testing.assert_allclose(checkpoint_weights(model)[name].numpy(), shadow[name], rtol=1e-5, atol=1e-7)
    with pytest.raises(RuntimeError, match="a failing test pass"):  # an error inside the block
        with average.in_model():
            raise RuntimeError("a failing test pass")
    for name in names:  # after both blocks: the trained weights and the averages, each in its place
        np.testing.assert_array_equal(checkpoint_weights(model)[name].numpy(), trained[name])
        np.testing.assert_allclose(averaged[name].numpy(), shadow[name], rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def ema_runs(tiny_idx_dir, tmp_path_factory):
    """Two deterministic runs with train.ema_decay=0.9: 3 epochs straight, and 2 epochs
    resumed for a third; (straight run dir, its metrics, resumed run dir)."""
    root = tmp_path_factory.mktemp("ema")

    def run(run_dir, epochs):
        return train(compose_config("train", tiny_overrides(tiny_idx_dir, root / run_dir, "train.ema_decay=0.9",
                                                            "deterministic=true", f"train.epochs={epochs}")))

    metrics = run("straight", 3)
    run("resumed", 2)
    assert run("resumed", 3)["resumed_from"].endswith("ckpt-2")
    return root / "straight", metrics, root / "resumed"


@pytest.mark.slow
def test_an_ema_run_tests_and_evaluates_its_average_and_logs_its_trained_weights(ema_runs, tmp_path):
    from capsnet.evaluation import evaluate, format_report

    run_dir, metrics, _ = ema_runs
    last = metrics["history"][-1]
    assert metrics["test_accuracy"] == last["test_accuracy"] and metrics["test_raw_accuracy"] == last["test_raw_accuracy"]
    assert last["test_loss"] != last["test_raw_loss"]  # two sets of weights
    # evaluate.py restores the average by default, the trained weights on request: each
    # gives the loss the run measured for it at that epoch.
    averaged = evaluate(run_dir, which="latest", output=tmp_path / "ema.json")
    trained = evaluate(run_dir, which="latest", weights="raw", output=tmp_path / "raw.json")
    assert (averaged["weights"], trained["weights"]) == ("ema", "raw")
    assert "(epoch 3, moving average of the weights)" in format_report(averaged).splitlines()[0]
    assert averaged["loss"] == pytest.approx(last["test_loss"], rel=1e-5)
    assert trained["loss"] == pytest.approx(last["test_raw_loss"], rel=1e-5)
    assert trained["accuracy"] == pytest.approx(last["test_raw_accuracy"])
    # TensorBoard: test/ is the average's, test/raw_* the trained weights', every epoch.
    events = read_events(run_dir)
    for tag, key in (("test/loss", "test_loss"), ("test/raw_loss", "test_raw_loss"),
                     ("test/raw_accuracy", "test_raw_accuracy")):
        np.testing.assert_allclose([tf.make_ndarray(v.tensor) for _, v in events[tag]],
                                   [h[key] for h in metrics["history"]], rtol=1e-6, err_msg=tag)


@pytest.mark.slow
def test_an_ema_run_resumes_its_average(ema_runs):
    """A run resumed after epoch 2 ends with the same weights, Adam state AND averages as the
    uninterrupted run (deterministic=true): the checkpoint carries the average across."""
    straight, _, resumed = ema_runs
    ours = tf.train.load_checkpoint(str(resumed / "checkpoints" / "latest" / "ckpt-3"))
    theirs = tf.train.load_checkpoint(str(straight / "checkpoints" / "latest" / "ckpt-3"))
    names = set(theirs.get_variable_to_shape_map()) - {"_CHECKPOINTABLE_OBJECT_GRAPH"}
    assert set(ours.get_variable_to_shape_map()) - {"_CHECKPOINTABLE_OBJECT_GRAPH"} == names
    averages = sorted(name for name in names if name.startswith("ema/"))
    weights = sorted(name for name in names if name.startswith("model/"))
    assert [n[len("ema/"):] for n in averages] == [n[len("model/"):] for n in weights]  # the same keys
    assert_checkpoint_tensors_close(resumed / "checkpoints" / "latest" / "ckpt-3",
                                    straight / "checkpoints" / "latest" / "ckpt-3", rtol=0, atol=0)


@pytest.mark.parametrize("weights, message", [
    ("ema", r"weights=ema: the run .* kept no average of its weights \(train.ema_decay was 0\)"),
    ("best", "weights must be one of raw, ema"),
])
def test_evaluate_weights_that_the_run_does_not_have_are_one_line_config_errors(trained_run, tmp_path,
                                                                                weights, message):
    from capsnet.evaluation import evaluate

    with pytest.raises(ConfigError, match=message) as err:
        evaluate(trained_run[0], weights=weights, output=tmp_path / "never.json")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "never.json").exists()


def test_built_ahead_builds_the_next_item_while_the_caller_works_on_this_one():
    import threading

    from capsnet.training.loop import built_ahead
    started = {item: threading.Event() for item in range(5)}
    threads = {}

    def build(item):
        threads[item] = threading.current_thread().name
        started[item].set()
        if item == 3:
            raise ValueError("bad item 3")
        return item * 10

    seen = []
    with pytest.raises(ValueError, match="bad item 3"):
        for item, built in built_ahead(build, range(5)):
            # The next item's build starts while the caller still holds this one.
            assert started[item + 1].wait(timeout=30)
            seen.append((item, built))
    assert seen == [(0, 0), (1, 10), (2, 20)]  # in order; the failed build surfaces at its own item
    assert not started[4].is_set()  # nothing is built past the failure
    assert all(name.startswith("capsnet-next-epoch") for name in threads.values())
    assert list(built_ahead(build, [])) == []

    # The caller failing mid-way: the generator closes and waits for the build under way.
    with pytest.raises(RuntimeError, match="caller failed"):
        for item, _ in built_ahead(lambda i: i, range(5)):
            raise RuntimeError("caller failed")
