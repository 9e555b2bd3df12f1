"""Mixed precision (train.precision): 16-bit compute where it is safe, float32 where it must be.

References: the float32 model with the same weights (values), the graph of the traced
model (which ops run in which dtype), the NumPy float64 math of the ops on the rounded
16-bit inputs (values and gradients), and a float32 tiny run (training). Checkpoints
are the same in every precision: a run resumes from one precision into another.
"""
import shutil

import numpy as np
import pytest
import tensorflow as tf

from capsnet import ops
from capsnet.errors import ConfigError
from capsnet.evaluation import evaluate, format_report
from capsnet.layers import capsule_lengths
from capsnet.model import build_model
from capsnet.precision import bias_add
from capsnet.routing import dynamic_routing, squash
from capsnet.training import train
from conftest import assert_trained_as, np_capsule_prediction, read_events
from test_routing_op import inputs as routing_inputs
from test_routing_op import np_routing

MIXED = ["mixed_bfloat16", "mixed_float16"]
SIXTEEN_BIT = {"mixed_bfloat16": tf.bfloat16, "mixed_float16": tf.float16}
TINY = dict(conv1_filters=16, primary_caps_types=4, digit_caps_dim=8, decoder_units=(32, 64))


def twin_models(precision, routing="matmul"):
    """A tiny float32 CapsNet and one in `precision` holding the same (float32) weights."""
    reference = build_model(**TINY, routing=routing)
    mixed = build_model(**TINY, routing=routing, dtype=precision)
    mixed.set_weights(reference.get_weights())
    return reference, mixed


@pytest.mark.parametrize("routing", ["matmul", "op", "fused_op"])
@pytest.mark.parametrize("precision", MIXED)
def test_a_mixed_model_keeps_float32_weights_and_outputs_and_agrees_with_float32(precision, routing, seeded):
    reference, mixed = twin_models(precision, routing)
    assert {w.dtype for w in mixed.weights} == {"float32"}
    images = tf.random.uniform((8, 28, 28, 1), seed=1)
    labels = tf.constant([0, 1, 2, 3, 4, 5, 6, 7])
    want, got = reference(images, labels=labels), mixed(images, labels=labels)
    assert {k: v.dtype for k, v in got.items()} == {k: tf.float32 for k in want}
    # bfloat16 keeps 8 significant bits (float16 11): a 1296-term convolution sum and the
    # capsule prediction round to about 2^-8 (2^-11) of their size.
    atol = {"mixed_bfloat16": 2e-2, "mixed_float16": 3e-3}[precision]
    for key in ("lengths", "v_j", "c_ij", "reconstructions"):
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=atol, err_msg=key)


@pytest.mark.parametrize("precision", MIXED)
def test_mixed_policy_runs_convolutions_in_16_bits_and_routing_softmax_and_norms_in_float32(precision):
    """The traced model's ops: which run in 16 bits and which stay float32."""
    _, mixed = twin_models(precision)
    graph = tf.function(lambda x: mixed(x, training=False)).get_concrete_function(
        tf.TensorSpec((None, 28, 28, 1), tf.float32)).graph
    dtypes = {}
    for op in graph.get_operations():
        if op.node_def.attr["T"].WhichOneof("value") == "type":  # one dtype (not IdentityN's list)
            dtypes.setdefault(op.type, set()).add(tf.as_dtype(op.get_attr("T")))
    sixteen = SIXTEEN_BIT[precision]
    assert dtypes["Conv2D"] == {sixteen}                                # conv1, PrimaryCaps
    assert sixteen in dtypes["BatchMatMulV2"]                           # u_hat = W u
    assert dtypes["Softmax"] == {tf.float32}                            # c_ij = softmax(b_ij)
    assert dtypes["Sqrt"] == {tf.float32}                               # squash's and the lengths' norms
    assert dtypes["Sigmoid"] == {tf.float32}                            # the reconstruction's pixels


@pytest.mark.parametrize("sixteen", [tf.bfloat16, tf.float16])
def test_squash_routing_and_lengths_of_16_bit_inputs_compute_in_float32(sixteen):
    """The math on 16-bit inputs equals the float32 math on the same (rounded) values."""
    rng = np.random.default_rng(0)
    u_hat = tf.cast(rng.normal(0, 0.3, (4, 12, 5, 6)).astype(np.float32), sixteen)
    exact = tf.cast(u_hat, tf.float32)
    v16, c16 = dynamic_routing(u_hat, 3)
    v32, c32 = dynamic_routing(exact, 3)
    assert (v16.dtype, c16.dtype) == (tf.float32, tf.float32)
    np.testing.assert_array_equal(v16, v32)
    np.testing.assert_array_equal(c16, c32)
    np.testing.assert_array_equal(capsule_lengths(u_hat), capsule_lengths(exact))
    # squash keeps its input's dtype, computed in float32 and rounded once at the end: a
    # float16 |s|² of 300-long vectors would overflow (65504) and give NaN.
    s = tf.cast(rng.normal(0, 300, (3, 16)).astype(np.float32), sixteen)
    v = squash(s)
    assert v.dtype == sixteen
    np.testing.assert_array_equal(v, tf.cast(squash(tf.cast(s, tf.float32)), sixteen))


@pytest.mark.parametrize("sixteen", [tf.bfloat16, tf.float16])
def test_bias_add_of_16_bit_values_sums_its_gradient_like_numpy(sixteen):
    rng = np.random.default_rng(2)
    x = tf.cast(rng.normal(0, 1, (6, 5, 5, 7)).astype(np.float32), sixteen)
    bias = tf.constant(rng.normal(0, 1, 7).astype(np.float32))
    dy = tf.cast(rng.normal(0, 1, (6, 5, 5, 7)).astype(np.float32), sixteen)
    with tf.GradientTape() as tape:
        tape.watch([x, bias])
        y = bias_add(x, bias)
    grad_x, grad_bias = tape.gradient(y, [x, bias], output_gradients=dy)
    assert y.dtype == sixteen and grad_bias.dtype == tf.float32
    np.testing.assert_array_equal(y, tf.nn.bias_add(x, tf.cast(bias, sixteen)))
    np.testing.assert_array_equal(grad_x, dy)
    want = tf.cast(dy, tf.float64).numpy().sum(axis=(0, 1, 2))           # 150 terms each
    np.testing.assert_allclose(grad_bias, want, rtol=0, atol=ATOL[sixteen] * np.abs(want).max())


@pytest.mark.parametrize("precision", MIXED)
def test_a_mixed_train_step_has_no_16_bit_bias_add_grad(precision):
    """TensorFlow's BiasAddGrad in 16 bits took a quarter of a bfloat16 step on an H100
    (capsnet.precision.bias_add): none is left in the gradient of a mixed model."""
    _, mixed = twin_models(precision)

    @tf.function
    def gradients(images, labels):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(mixed(images, labels=labels)["lengths"])
        return tape.gradient(loss, mixed.trainable_variables)

    graph = gradients.get_concrete_function(tf.TensorSpec((None, 28, 28, 1), tf.float32),
                                            tf.TensorSpec((None,), tf.int32)).graph
    ops_by_type = {}
    for op in graph.get_operations():
        ops_by_type.setdefault(op.type, []).append(op)
    for op in ops_by_type.get("BiasAddGrad", []):
        assert tf.as_dtype(op.get_attr("T")) == tf.float32, op.name
    assert len(ops_by_type["BiasAdd"]) == 5  # conv1, PrimaryCaps, the decoder's three layers


# --------------------------------------------------------------------------- the ops in 16 bits: gradients

# |error| ≤ ATOL · max(1, max|reference|): a few roundings of the output to 8 (bfloat16)
# or 11 (float16) significant bits; sums run in float32.
ATOL = {tf.bfloat16: 2e-2, tf.float16: 3e-3}


def assert_near(got, want, dtype, what):
    got, want = tf.cast(got, tf.float64).numpy(), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL[dtype] * max(1.0, np.abs(want).max()), err_msg=what)


def rounded(array, dtype):
    """`array` as a `dtype` tensor and, for the reference, its rounded values in float64."""
    t = tf.cast(tf.constant(array, tf.float32), dtype)
    return t, tf.cast(t, tf.float64).numpy()


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
def test_prediction_op_gradients_in_16_bits_match_numpy(dtype):
    rng = np.random.default_rng(3)
    B, I, J, D, K = 5, 7, 10, 16, 8
    u, u64 = rounded(rng.uniform(-1, 1, (B, I, K)), dtype)
    W, W64 = rounded(rng.normal(0, 0.3, (I, J, D, K)), dtype)
    g, g64 = rounded(rng.normal(0, 1, (B, I, J, D)), dtype)
    with tf.GradientTape() as tape:
        tape.watch([u, W])
        u_hat = ops.capsule_prediction(u, W)
    grad_u, grad_W = tape.gradient(u_hat, [u, W], output_gradients=g)
    assert (u_hat.dtype, grad_u.dtype, grad_W.dtype) == (dtype, dtype, dtype)
    assert_near(u_hat, np_capsule_prediction(u64, W64), dtype, "u_hat")
    assert_near(grad_u, np.einsum("ijdk,bijd->bik", W64, g64), dtype, "grad_u")
    assert_near(grad_W, np.einsum("bijd,bik->ijdk", g64, u64), dtype, "grad_W")


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
def test_routing_op_gradients_in_16_bits_match_numpy(dtype):
    """The fused op's gradient is stop-gradient routing's: through the last s_j = Σ_i c_ij
    u_hat_j|i with c_ij constant, so dL/du_hat = c_ij · dL/ds_j."""
    u32, W32 = routing_inputs((3, 9, 10, 16, 8), np.float32, seed=5)
    u, u64 = rounded(u32, dtype)
    W, W64 = rounded(W32, dtype)
    g, g64 = rounded(np.random.default_rng(6).normal(0, 1, (3, 10, 16)), dtype)
    with tf.GradientTape() as tape:
        tape.watch([u, W])
        s_j, c_ij = ops.capsule_routing(u, W, 3)
    grad_u, grad_W = tape.gradient(s_j, [u, W], output_gradients=g)
    assert (grad_u.dtype, grad_W.dtype) == (dtype, dtype)
    s_ref, c_ref, _ = np_routing(u64, W64, 3)
    assert_near(s_j, s_ref, dtype, "s_j")
    d_u_hat = c_ref[..., None] * g64[:, None]                         # (B, I, J, D)
    assert_near(grad_u, np.einsum("ijdk,bijd->bik", W64, d_u_hat), dtype, "grad_u")
    assert_near(grad_W, np.einsum("bijd,bik->ijdk", d_u_hat, u64), dtype, "grad_W")


# --------------------------------------------------------------------------- training

@pytest.mark.slow
@pytest.mark.parametrize("precision, extra", [
    ("mixed_bfloat16", []),
    ("mixed_bfloat16", ["custom_op=true"]),            # the fused routing op in bfloat16
    ("mixed_float16", ["custom_op=true", "model.routing=tf"]),  # the prediction op, TF routing
    ("mixed_float16", ["train.xla=jit"]),
])
def test_each_precision_trains_like_float32(trained_run, tiny_config, spy_on_op, precision, extra):
    """Same seed, data and initial weights as the float32 run: the losses fall as its do."""
    calls = spy_on_op(op="capsule_routing" if extra == ["custom_op=true"] else "capsule_prediction")
    metrics = train(tiny_config(f"train.precision={precision}", "train.epochs=2", *extra))
    assert bool(calls) == ("custom_op=true" in extra)  # the path asked for ran
    ours, theirs = metrics["history"], trained_run[1]["history"][:2]
    # The first epoch's mean training loss is the float32 run's to rounding; after that the
    # trajectories part (16-bit rounding, amplified by lr 0.01 on 320 images), but the
    # training must fall as far.
    assert ours[0]["train_loss"] == pytest.approx(theirs[0]["train_loss"], rel=0.02)
    assert ours[1]["train_loss"] < 0.8 * ours[0]["train_loss"]
    assert ours[1]["test_loss"] < 1.25 * theirs[1]["test_loss"]
    assert metrics["test_accuracy"] >= theirs[1]["test_accuracy"] - 0.15


def test_the_ops_see_16_bit_inputs_under_a_mixed_policy(tiny_config, monkeypatch):
    """custom_op=true in mixed_bfloat16 hands the op bfloat16 u and W (no float32 round trip)."""
    seen = []
    real = ops.capsule_routing

    def spy(u, W, iterations, leaky=False):
        seen.append((u.dtype, W.dtype))
        return real(u, W, iterations, leaky=leaky)

    monkeypatch.setattr(ops, "capsule_routing", spy)
    train(tiny_config("train.precision=mixed_bfloat16", "custom_op=true", "train.epochs=1",
                      "data.limit_train=32", "data.limit_test=16"))
    assert seen and set(seen) == {(tf.bfloat16, tf.bfloat16)}


@pytest.mark.slow
def test_mixed_float16_logs_its_loss_scale(tiny_config, tmp_path):
    train(tiny_config("train.precision=mixed_float16", "train.epochs=1"))
    events = read_events(tmp_path / "run")
    scales = [float(tf.make_ndarray(value.tensor)) for _, value in events["train/loss_scale"]]
    assert scales and all(s >= 1.0 and np.log2(s).is_integer() for s in scales)  # powers of two
    assert "train/loss_scale" not in read_events_of_float32(tiny_config, tmp_path)


@pytest.mark.slow
def test_mixed_float16_logs_the_rate_of_the_next_update_after_skipped_steps(tiny_config, tmp_path, monkeypatch):
    """A step whose scaled gradients overflow float16 is skipped and does not advance Adam's
    counter, so the schedule runs behind the steps run: the learning rate logged (history and
    TensorBoard) is the schedule at Adam's counter, the rate the next update applies."""
    import keras

    import capsnet.training.optimizer as optimizer_module
    from capsnet.training.optimizer import exponential_decay

    # A loss scale of 2^40 overflows float16's gradients: the first steps are skipped, each
    # halving the scale, until it fits.
    class OverflowingAtFirst(keras.optimizers.LossScaleOptimizer):
        def __init__(self, inner_optimizer, **kwargs):
            super().__init__(inner_optimizer, initial_scale=2.0 ** 40, **kwargs)

    monkeypatch.setattr(optimizer_module.keras.optimizers, "LossScaleOptimizer", OverflowingAtFirst)
    metrics = train(tiny_config("train.precision=mixed_float16", "train.epochs=2", "train.lr_decay_steps=7"))
    steps_run, updates = metrics["global_step"], metrics["optimizer_updates"]
    assert steps_run == metrics["history"][-1]["global_step"] == 2 * 20
    assert 0 < updates < steps_run  # steps were skipped, and not all
    schedule = exponential_decay(0.01, 0.9, 7)  # the tiny run's train.learning_rate and lr_decay_rate
    assert metrics["history"][-1]["learning_rate"] == pytest.approx(float(schedule(updates)), rel=1e-6)
    events = read_events(tmp_path / "run")
    logged = {step: float(tf.make_ndarray(value.tensor)) for step, value in events["train/learning_rate"]}
    assert logged[steps_run] == pytest.approx(float(schedule(updates)), rel=1e-6)
    # Resumed, the run goes on numbering the steps run (not Adam's count of the applied ones).
    resumed = train(tiny_config("train.precision=mixed_float16", "train.epochs=3", "train.lr_decay_steps=7"))
    assert [line["global_step"] for line in resumed["history"]] == [20, 40, 60]
    assert updates < resumed["optimizer_updates"] <= updates + 20


def read_events_of_float32(tiny_config, tmp_path):
    run_dir = tmp_path / "float32"
    train(tiny_config("train.epochs=1", "data.limit_train=32", "data.limit_test=16", run_dir=run_dir))
    return read_events(run_dir)


@pytest.mark.slow
def test_a_checkpoint_resumes_across_precisions_and_back(trained_run, tiny_config, tmp_path):
    """float32 (4 epochs) → mixed_float16 (epoch 5, a loss scale saved) → mixed_bfloat16 (6) → float32 (7)."""
    original_dir, original = trained_run
    run_dir = tmp_path / "resumed"
    shutil.copytree(original_dir, run_dir)
    for epochs, precision in ((5, "mixed_float16"), (6, "mixed_bfloat16"), (7, "float32")):
        metrics = train(tiny_config(f"train.epochs={epochs}", f"train.precision={precision}", run_dir=run_dir))
        assert metrics["resumed_from"].endswith(f"ckpt-{epochs - 1}"), precision
        assert [h["epoch"] for h in metrics["history"]] == list(range(1, epochs + 1))
        assert metrics["history"][:4] == original["history"]
        # Resumed, not restarted: the loss goes on from where the float32 run left it.
        assert metrics["history"][-1]["train_loss"] < 1.2 * original["history"][-1]["train_loss"]
    saved = tf.train.load_checkpoint(str(run_dir / "checkpoints" / "latest" / "ckpt-5"))
    names = saved.get_variable_to_shape_map()
    assert any(name.startswith("loss_scale/") for name in names)
    assert any(name.startswith("optimizer/") for name in names)


def test_evaluate_uses_the_run_precision_or_the_one_asked_for(trained_run, tmp_path):
    run_dir, metrics = trained_run
    as_trained = evaluate(run_dir, which="latest", output=tmp_path / "a.json")
    bf16 = evaluate(run_dir, which="latest", precision="mixed_bfloat16", output=tmp_path / "b.json")
    assert (as_trained["precision"], bf16["precision"]) == ("float32", "mixed_bfloat16")
    assert as_trained["accuracy"] == metrics["test_accuracy"]
    assert abs(bf16["accuracy"] - as_trained["accuracy"]) <= 2 / as_trained["num_examples"]
    assert bf16["loss"] == pytest.approx(as_trained["loss"], rel=0.05)


@pytest.mark.slow
def test_evaluate_compiles_its_pass_as_the_run_did_and_so_reproduces_its_score(tiny_config, trained_run, tmp_path):
    """In bfloat16 the XLA-compiled test pass rounds differently from the plain one
    (MultiMNIST: up to 0.1 points, docs/results.md): evaluate.py's default (xla=null) is the
    run's own pass, which gives the run's last test loss to the bit."""
    run_dir = tmp_path / "jit-run"
    metrics = train(tiny_config("train.xla=jit", "train.precision=mixed_bfloat16", "train.epochs=1",
                                run_dir=run_dir))
    as_run = evaluate(run_dir, which="latest", output=tmp_path / "a.json")
    plain = evaluate(run_dir, which="latest", xla="none", output=tmp_path / "b.json")
    assert (as_run["xla"], plain["xla"]) == ("jit", "none")
    assert (as_run["accuracy"], as_run["loss"]) == (metrics["test_accuracy"], metrics["test_loss"])
    assert plain["loss"] == pytest.approx(as_run["loss"], rel=0.05)
    # A run trained without XLA is evaluated without it, or under jit where asked.
    float32_run = trained_run[0]
    assert evaluate(float32_run, which="latest", output=tmp_path / "c.json")["xla"] == "none"
    jit = evaluate(float32_run, which="latest", xla="jit", output=tmp_path / "d.json")
    assert jit["xla"] == "jit" and jit["loss"] == pytest.approx(trained_run[1]["test_loss"], rel=1e-4)


@pytest.mark.parametrize("override", ["train.precision=fp16", "train.precision=mixed_float32"])
def test_a_bad_precision_is_a_one_line_error_naming_the_choices(tiny_config, override):
    with pytest.raises(ConfigError) as error:
        tiny_config(override)
    message = str(error.value)
    assert "\n" not in message and "train.precision" in message
    assert all(choice in message for choice in ("float32", "mixed_bfloat16", "mixed_float16"))


def test_a_bad_eval_precision_is_a_one_line_error(trained_run, tmp_path):
    with pytest.raises(ConfigError, match=r"precision must be one of float32, mixed_bfloat16, mixed_float16"):
        evaluate(trained_run[0], precision="half", output=tmp_path / "x.json")


def test_the_train_config_defaults_to_float32(tiny_config):
    assert tiny_config()["train"]["precision"] == "float32"


def test_the_guard_norm_of_mixed_float16_is_unscaled_and_ignores_an_overflow_the_optimizer_skips():
    """An overflow of the scaled gradients is loss scaling at work, not a divergence."""
    import keras

    from capsnet.training.steps import gradient_norm

    variable = tf.Variable([1.0, 2.0])
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=1024.0)
    optimizer.build([variable])
    scaled = [tf.constant([3.0, 4.0]) * 1024.0]
    assert float(gradient_norm(scaled, optimizer)) == pytest.approx(5.0)
    assert float(gradient_norm([tf.constant([np.inf, 1.0])], optimizer)) == 0.0
    plain = keras.optimizers.Adam()
    assert float(gradient_norm([tf.constant([3.0, 4.0])], plain)) == pytest.approx(5.0)
    assert not np.isfinite(float(gradient_norm([tf.constant([np.nan, 1.0])], plain)))


@pytest.mark.parametrize("jit", [False, True])
def test_the_guard_norm_is_the_norm_of_all_gradients_together(jit):
    """gradient_norm (one reduction over the gradients end to end) against NumPy's norm of
    them all: variables of several shapes and dtypes, a missing gradient, sparse rows."""
    import keras

    from capsnet.training.steps import gradient_norm

    rng = np.random.default_rng(3)
    dense = [rng.normal(size=s).astype(np.float32) for s in [(9, 9, 1, 16), (16,), (1152, 10, 16, 8), (3, 5)]]
    rows = rng.normal(size=(2, 4)).astype(np.float32)
    grads = [tf.constant(dense[0]), None, tf.constant(dense[1]), tf.cast(dense[2], tf.bfloat16),
             tf.IndexedSlices(tf.constant(rows), tf.constant([0, 3]), tf.constant([5, 4])), tf.constant(dense[3])]
    values = [*dense[:2], tf.cast(tf.cast(dense[2], tf.bfloat16), tf.float32).numpy(), rows, dense[3]]
    want = np.sqrt(sum(np.sum(np.square(v.astype(np.float64))) for v in values))
    optimizer = keras.optimizers.Adam()  # no loss scale: the norm as it is

    def norm():
        return gradient_norm(grads, optimizer)
    if jit:
        norm = tf.function(norm, jit_compile=True)
    assert float(norm()) == pytest.approx(want, rel=1e-5)


# --------------------------------------------------------------------------- train.tf32

@pytest.fixture
def tf32_settings(monkeypatch):
    """The values the code under test sets TensorFloat-32 to, in order; TensorFlow's default
    (on) is put back afterwards, whatever a test left."""
    settings = []
    real = tf.config.experimental.enable_tensor_float_32_execution

    def spy(enabled):
        settings.append(enabled)
        real(enabled)

    monkeypatch.setattr(tf.config.experimental, "enable_tensor_float_32_execution", spy)
    yield settings
    real(True)


@pytest.mark.slow
def test_train_tf32_false_turns_tensorfloat32_off_and_true_back_on(tiny_config, trained_run, tf32_settings,
                                                                   tmp_path):
    """A sweep's jobs share a process: each run sets the switch to its own value. On this CPU
    there is no TF32, so the run trains as trained_run (TF32 on) did, loss for loss."""
    metrics = train(tiny_config("train.tf32=false"))
    assert tf32_settings == [False] and not tf.config.experimental.tensor_float_32_execution_enabled()
    assert_trained_as(metrics, trained_run[1])
    assert "tf32: false" in (tmp_path / "run" / "config.yaml").read_text()
    train(tiny_config("train.epochs=1", run_dir=tmp_path / "default"))
    assert tf32_settings == [False, True] and tf.config.experimental.tensor_float_32_execution_enabled()


def test_evaluate_sets_tf32_as_the_run_trained_or_as_asked(trained_run, tf32_settings, tmp_path):
    as_trained = evaluate(trained_run[0], which="latest", output=tmp_path / "a.json")
    strict = evaluate(trained_run[0], which="latest", tf32=False, output=tmp_path / "b.json")
    assert tf32_settings == [True, False]  # trained_run kept the default: on
    assert (as_trained["tf32"], strict["tf32"]) == (True, False)
    assert "tf32=False" in format_report(strict)
    # No TF32 on a CPU: the same scores either way.
    assert (strict["accuracy"], strict["loss"]) == (as_trained["accuracy"], as_trained["loss"])


def test_a_bad_tf32_value_is_a_one_line_error(tiny_config, trained_run, tmp_path):
    with pytest.raises(ConfigError, match=r"^train\.tf32 must be true or false, got 'sometimes'$"):
        tiny_config("train.tf32=sometimes")
    with pytest.raises(ConfigError, match=r"^tf32 must be true or false \(or null: as trained\), got 'off'$"):
        evaluate(trained_run[0], tf32="off", output=tmp_path / "x.json")
