"""capsnet.training.device_input (train.data_on_device): the training split in device
memory, each call's steps one XLA program.

References: make_dataset's batches (the tf.data pipeline, tests/test_data.py's subject),
a plain train() run on the same data, hand-counted steps of a stand-in train step.
"""
import numpy as np
import pytest
import tensorflow as tf

from capsnet import config
from capsnet.data import make_dataset, make_multimnist_dataset
from capsnet.errors import ConfigError
from capsnet.training import epoch, train
from capsnet.training.device_input import DevicePairSet, DeviceTrainingSet, make_device_train_loop
from conftest import assert_checkpoint_tensors_close, compose_config, read_events, tiny_overrides

AUGMENTATION = {"shift_pixels": 2, "flip": True, "shift_fill": "edge", "erase_probability": 0.5,
                "erase_max_area": 0.3}
ELASTIC = {"elastic_alpha": 8.0, "elastic_sigma": 2.0}


def some_split(n=30):
    rng = np.random.default_rng(3)
    return rng.integers(1, 256, (n, 12, 12, 1), dtype=np.uint8), rng.integers(0, 10, n).astype(np.int64)


@pytest.mark.slow
@pytest.mark.parametrize("elastic", [False, True], ids=["batched", "elastic"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "xla"])
def test_device_batches_are_make_datasets_batches(compiled, elastic):
    """Every batch of an epoch (the last one short: 30 = 4 × 7 + 2), gathered and augmented
    as the device loop does it (eagerly, and inside an XLA computation), equals
    make_dataset's batch of the same (seed, epoch): flips, edge-filled shifts, erasing, and
    elastic distortions (their noise drawn in the step). Bit for bit, but for the elastic
    distortion's float arithmetic under XLA (its convolutions and sums rounded apart from
    TensorFlow's kernels: ~1e-6 seen)."""
    augmentation = {**AUGMENTATION, **(ELASTIC if elastic else {})}
    images, labels = some_split()
    training_set = DeviceTrainingSet(images, labels, batch_size=7, seed=11, **augmentation)
    batch = tf.function(training_set.batch, jit_compile=True, autograph=False) if compiled else training_set.batch
    for epoch in (0, 3):
        draws = training_set.epoch(epoch).draws
        assert {k: tf.TensorSpec.from_tensor(v) for k, v in draws.items()} == training_set.draws_signature()
        expected = list(make_dataset(images, labels, batch_size=7, training=True, seed=11, epoch=epoch,
                                     **augmentation))
        assert [len(y) for _, y in expected] == [7, 7, 7, 7, 2]
        for step, (want_images, want_labels) in enumerate(expected):
            got_images, got_labels = batch(draws, tf.constant(step, tf.int64), len(want_labels))
            if compiled and elastic:
                np.testing.assert_allclose(got_images.numpy(), want_images.numpy(), rtol=0, atol=1e-5)
            else:
                np.testing.assert_array_equal(got_images.numpy(), want_images.numpy())
            np.testing.assert_array_equal(got_labels.numpy(), want_labels.numpy())
            assert got_labels.dtype == tf.int32


@pytest.mark.slow
@pytest.mark.parametrize("shift, pad, elastic", [(2, 3, 0), (0, None, 0), (2, 3, 8)],
                         ids=["shift2_pad3", "unshifted", "shift2_pad3_elastic"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "xla"])
def test_device_pairs_are_make_multimnist_datasets_pairs(compiled, shift, pad, elastic):
    """MultiMNIST on the device: every batch of an epoch (the last one short), paired,
    shifted and overlaid as the device loop does it (eagerly and inside an XLA
    computation), equals make_multimnist_dataset's batch of the same (seed, epoch): the
    overlaid images, both labels and each digit's target, bit for bit (integer sums, then
    the host's p / 255); with each digit elastically distorted, to float tolerance inside
    XLA (its convolutions and bilinear sums round as XLA's do)."""
    images, labels = some_split()
    pairs = DevicePairSet(images, labels, batch_size=7, seed=11, shift_pixels=shift, pad_pixels=pad,
                          elastic_alpha=elastic)
    batch = tf.function(pairs.batch, jit_compile=True, autograph=False) if compiled else pairs.batch
    for epoch in (0, 3):
        draws = pairs.epoch(epoch).draws
        assert {k: tf.TensorSpec.from_tensor(v) for k, v in draws.items()} == pairs.draws_signature()
        expected = list(make_multimnist_dataset(images, labels, batch_size=7, training=True, seed=11, epoch=epoch,
                                                shift_pixels=shift, pad_pixels=pad, elastic_alpha=elastic))
        assert [len(y) for _, y, _ in expected] == [7, 7, 7, 7, 2]
        for step, want in enumerate(expected):
            got = batch(draws, tf.constant(step, tf.int64), len(want[1]))
            assert got[1].dtype == tf.int32 and got[0].shape[1] == 12 + 2 * (shift if pad is None else pad)
            for got_part, want_part in zip(got, want, strict=True):
                if compiled and elastic:
                    np.testing.assert_allclose(got_part.numpy(), want_part.numpy(), rtol=0, atol=1e-5)
                else:
                    np.testing.assert_array_equal(got_part.numpy(), want_part.numpy())
            if elastic:
                assert np.abs(got[2].numpy() - np.round(got[2].numpy() * 255) / 255).max() > 1e-3  # distorted
    # A new pairing every epoch (the partners' classes differ from the base's).
    first, later = pairs.epoch(0).draws, pairs.epoch(1).draws
    assert not np.array_equal(first["partner"].numpy(), later["partner"].numpy())
    assert (labels[first["partner"].numpy()] != labels[first["index"].numpy()]).all()


@pytest.mark.slow
@pytest.mark.parametrize("augmentation", [[], ["data.elastic_alpha=8"]], ids=["shifts", "elastic"])
def test_multimnist_on_device_trains_the_same_steps_as_the_pipeline(tiny_idx_dir, tmp_path, augmentation):
    """data=multimnist with train.data_on_device=true against false (custom_op=true
    train.xla=jit; 60 pairs an epoch in batches of 16, the last one 12), with each digit
    elastically distorted too: the same pairs, so the same per-step losses, test accuracy
    and final weights (float tolerance: a loop of steps in one program is compiled apart
    from the single step)."""
    from capsnet.training import train

    common = ["data=multimnist", "model.input_shape=[36,36,1]", "train.epochs=2", "data.limit_train=60",
              "data.limit_test=40", "custom_op=true", "train.xla=jit", "train.log_every_steps=2",
              "train.steps_per_execution=2", *augmentation]
    runs = {}
    for on_device in (False, True):
        run_dir = tmp_path / f"on_device_{on_device}"
        cfg = compose_config("train", tiny_overrides(tiny_idx_dir, run_dir, *common,
                                                     f"train.data_on_device={str(on_device).lower()}"))
        metrics = train(cfg)
        assert metrics["global_step"] == 8  # 60 pairs: 3 batches of 16 and one of 12, twice
        runs[on_device] = (run_dir, metrics, [(step, float(tf.make_ndarray(v.tensor)))
                                              for step, v in read_events(run_dir)["train/loss"]])
    (pipe_dir, pipe, pipe_losses), (dev_dir, dev, dev_losses) = runs[False], runs[True]
    assert [s for s, _ in dev_losses] == [s for s, _ in pipe_losses]
    np.testing.assert_allclose([v for _, v in dev_losses], [v for _, v in pipe_losses], rtol=1e-5)
    assert dev["test_accuracy"] == pytest.approx(pipe["test_accuracy"], abs=0.05)  # 40 test pairs: 2 at most
    assert_checkpoint_tensors_close(dev_dir / "checkpoints" / "latest" / "ckpt-2",
                                    pipe_dir / "checkpoints" / "latest" / "ckpt-2", rtol=1e-3, atol=1e-4, prefix="model/")


def test_device_loop_runs_the_steps_asked_and_stops_at_the_first_non_finite_one():
    """A stand-in step that counts its calls (a variable) and reports its batch's size and
    first label: a call of sizes [7, 7, 7, 2] runs four steps on the epoch's next batches
    (the short one a program apart), a full call (4 steps of 7) runs the program whose trip
    count is a constant, all three traced when the loop is made; the values stop at the step
    whose loss is not finite."""
    images, labels = some_split()
    training_set = DeviceTrainingSet(images, labels, batch_size=7, seed=0, shift_pixels=0)
    calls = tf.Variable(0.0)
    bad_call = tf.Variable(-1.0)
    traced = []  # the batch size of each trace (a Python side effect: it runs when the step is traced)

    def step(images, labels):
        traced.append(images.shape[0])
        calls.assign_add(1.0)
        loss = tf.where(tf.equal(calls, bad_call), float("nan"), calls)
        return {"loss": loss, "margin_loss": tf.cast(tf.shape(labels)[0], tf.float32),
                "reconstruction_loss": tf.cast(labels[0], tf.float32), "accuracy": tf.reduce_mean(images),
                "grad_norm": tf.constant(1.0)}

    # The programs traced before any call (their names then depend on nothing after: the
    # docstring's why): sizes 7 and 2 with a tensor trip count, size 7 with 4 steps.
    train_steps = make_device_train_loop(step, training_set, steps_per_execution=4, trace_sizes=(7, 2, 7))
    assert sorted(traced) == [2, 7, 7]
    assert sorted(train_steps.programs, key=str) == [(2, None), (7, 4), (7, None)]
    called = record_calls(train_steps)
    epoch = training_set.epoch(0)
    expected = list(make_dataset(images, labels, batch_size=7, training=True, seed=0, epoch=0, shift_pixels=0))
    first = train_steps(epoch, tf.constant([7, 0, 0, 0], tf.int32))
    rest = train_steps(epoch, tf.constant([7, 7, 7, 2], tf.int32))
    np.testing.assert_array_equal(first["loss"].numpy(), [1.0])
    np.testing.assert_array_equal(rest["loss"].numpy(), [2.0, 3.0, 4.0, 5.0])
    np.testing.assert_array_equal(rest["margin_loss"].numpy(), [7, 7, 7, 2])
    np.testing.assert_array_equal(np.concatenate([first["reconstruction_loss"], rest["reconstruction_loss"]]),
                                  [float(y[0]) for _, y in expected])
    np.testing.assert_allclose(rest["accuracy"].numpy(), [float(tf.reduce_mean(x)) for x, _ in expected[1:]],
                               rtol=1e-6)
    assert epoch.steps_run == 5

    bad_call.assign(7.0)  # the second step of the next call: it and nothing after it comes back
    cut = train_steps(training_set.epoch(1), tf.constant([7, 7, 7, 0], tf.int32))
    assert cut["loss"].shape == (2,) and cut["loss"][0] == 6.0 and np.isnan(cut["loss"][1])
    assert float(calls.numpy()) == 8.0  # the step after the bad one ran all the same
    assert sorted(traced) == [2, 7, 7]  # no call traced again

    # A call of no steps runs none; one past the epoch's examples is refused (XLA's gather
    # would clamp the positions: wrong batches, no error).
    assert {k: v.shape for k, v in train_steps(epoch, tf.constant([0, 0, 0, 0])).items()} == {}.fromkeys(first, (0,))
    with pytest.raises(ValueError, match=r"steps 6-6 of sizes \[7\] need examples up to 42, past the epoch's 30"):
        train_steps(epoch, tf.constant([7, 0, 0, 0], tf.int32))
    assert float(calls.numpy()) == 8.0 and epoch.steps_run == 5

    # A full call: the constant trip count's program, the epoch's batches in turn as before.
    bad_call.assign(-1.0)
    epoch = training_set.epoch(2)
    expected = list(make_dataset(images, labels, batch_size=7, training=True, seed=0, epoch=2, shift_pixels=0))
    full = train_steps(epoch, tf.constant([7, 7, 7, 7], tf.int32))
    np.testing.assert_array_equal(full["loss"].numpy(), [9.0, 10.0, 11.0, 12.0])
    np.testing.assert_array_equal(full["reconstruction_loss"].numpy(), [float(y[0]) for _, y in expected[:4]])
    assert epoch.steps_run == 4
    assert sorted(traced) == [2, 7, 7]  # no call traced again
    # Only the full call ran the constant-length program ([7], [7, 7, 7, 2] and the cut [7, 7, 7] did not).
    assert called == [(7, None), (7, None), (2, None), (7, None), (7, 4)]

    # Without the constant trip count: one program a size serves every call.
    traced.clear()
    one_program = make_device_train_loop(step, training_set, steps_per_execution=4, trace_sizes=(7, 2),
                                         static_steps=None)
    assert sorted(traced) == [2, 7] and sorted(one_program.programs) == [(2, None), (7, None)]
    full = one_program(training_set.epoch(2), tf.constant([7, 7, 7, 7], tf.int32))
    np.testing.assert_array_equal(full["reconstruction_loss"].numpy(), [float(y[0]) for _, y in expected[:4]])
    assert sorted(traced) == [2, 7]

    # Calls of one step at most (static_steps=1, as train() passes for such epochs): the
    # constant-length programs only, the short batch's too.
    traced.clear()
    single = make_device_train_loop(step, training_set, steps_per_execution=4, trace_sizes=(7, 2), static_steps=1)
    assert sorted(traced) == [2, 7] and sorted(single.programs) == [(2, 1), (7, 1)]
    called = record_calls(single)
    epoch = training_set.epoch(2)
    for sizes in ([7, 0, 0, 0],) * 4 + ([2, 0, 0, 0],):
        single(epoch, tf.constant(sizes, tf.int32))
    assert called == [(7, 1)] * 4 + [(2, 1)] and sorted(traced) == [2, 7]


def record_calls(train_steps):
    """The keys of make_device_train_loop's programs in the order they are called (each
    program wrapped in train_steps.programs, where train_steps looks it up at each call)."""
    called = []
    for key, run in list(train_steps.programs.items()):
        def counted(*args, key=key, run=run):
            called.append(key)
            return run(*args)
        train_steps.programs[key] = counted
    return called


def test_device_training_set_refuses_per_example_augmentation_and_unknown_arguments():
    images, labels = some_split()
    with pytest.raises(ConfigError,
                       match=r"\(flip, shift, elastic, erase\); data\.zoom=0\.1 runs per example in tf\.data$"):
        DeviceTrainingSet(images, labels, batch_size=7, seed=0, shift_pixels=2, rotate_degrees=0.0, zoom=0.1)
    with pytest.raises(TypeError, match="unknown augmentation argument"):
        DeviceTrainingSet(images, labels, batch_size=7, seed=0, shift_pixels=2, sharpen=1.0)
    with pytest.raises(ConfigError, match=r"data\.shift_pixels"):
        DeviceTrainingSet(images, labels, batch_size=7, seed=0, shift_pixels=12)


@pytest.mark.slow
def test_data_on_device_trains_the_same_steps_as_the_pipeline(tiny_config, tmp_path, monkeypatch, capsys):
    """custom_op=true train.xla=jit with train.data_on_device=true against false: the same
    batches (flips, elastic distortions and erasing on; the epoch's last batch short: 69 =
    4 × 16 + 5), so the
    same per-step losses, test accuracy and final weights (float tolerance: a loop of
    steps in one program is compiled apart from the single step). Calls of 1 and 2 steps:
    full calls (2 × 16) run the constant-length loop, the others the tensor-count one.
    The finished run rerun trains nothing, and copies no training set to do so."""
    common = ["custom_op=true", "train.xla=jit", "data.limit_train=69", "train.epochs=2", "train.log_every_steps=2",
              "train.steps_per_execution=2", "data.flip=true", "data.erase_probability=0.5", "data.elastic_alpha=8"]
    made = []  # (static_steps, the programs called) of each device loop train() makes

    def recording(*args, **kwargs):
        train_steps = make_device_train_loop(*args, **kwargs)
        made.append((kwargs["static_steps"], record_calls(train_steps)))
        return train_steps

    monkeypatch.setattr(epoch, "make_device_train_loop", recording)
    runs = {}
    for on_device in (False, True):
        run_dir = tmp_path / f"on_device_{on_device}"
        metrics = train(tiny_config(*common, f"train.data_on_device={str(on_device).lower()}", run_dir=run_dir))
        assert metrics["global_step"] == 10
        runs[on_device] = (run_dir, metrics, [(step, float(tf.make_ndarray(v.tensor)))
                                              for step, v in read_events(run_dir)["train/loss"]])
    (pipe_dir, pipe, pipe_losses), (dev_dir, dev, dev_losses) = runs[False], runs[True]
    # On a CPU, each run prints one notice: the pipeline's run the jit one, the device loop's run
    # its own instead (the paper model's steps take minutes there, not 1.06-1.19x).
    printed = capsys.readouterr().out
    on_cpu = 0 if tf.config.list_physical_devices("GPU") else 1
    assert printed.count("notice: train.data_on_device=true on a CPU") == on_cpu
    assert printed.count("notice: train.xla=jit on a CPU") == on_cpu
    assert [s for s, _ in dev_losses] == [s for s, _ in pipe_losses] == [2, 4, 5, 6, 8, 10]  # log steps, epoch ends
    # Calls of 1, 1, 2, 1 | 1, 2, 2 steps (the first of an epoch one step, none past a log
    # step); the two calls of 2 full batches ran the constant-length loop.
    assert made == [(2, [(16, None), (16, None), (16, 2), (5, None), (16, None), (16, 2), (16, None), (5, None)])]
    np.testing.assert_allclose([v for _, v in dev_losses], [v for _, v in pipe_losses], rtol=1e-5)
    assert dev["test_accuracy"] == pytest.approx(pipe["test_accuracy"], abs=0.02)  # 100 test images: 2 at most
    # atol 1e-4 (weights ~1e-2): on an H100 the two programs' TF32 convolutions left 5 of
    # conv1's 1,296 weights 2-4e-5 apart after the 8 steps.
    assert_checkpoint_tensors_close(dev_dir / "checkpoints" / "latest" / "ckpt-2",
                                    pipe_dir / "checkpoints" / "latest" / "ckpt-2", rtol=1e-3, atol=1e-4, prefix="model/")

    def refused(*args, **kwargs):
        raise AssertionError("a finished run copied its training set to the device")

    monkeypatch.setattr(epoch, "DeviceTrainingSet", refused)
    rerun = train(tiny_config(*common, "train.data_on_device=true", run_dir=dev_dir))
    assert rerun["global_step"] == 10 and rerun["test_accuracy"] == dev["test_accuracy"]


@pytest.mark.parametrize("overrides, message", [
    (["train.xla=none"], r"^train\.data_on_device=true runs each call's steps as one XLA program: set train\.xla=jit"),
    (["distribute=multi_worker"], r"^train\.data_on_device=true trains on the devices of one machine: set "
                                  r"distribute=none or distribute=mirrored \(got multi_worker\)"),
    (["data.rotate_degrees=5", "data.zoom=0.1", "data.elastic_alpha=30"],
     r"data\.rotate_degrees=5, data\.zoom=0\.1 runs per example in tf\.data"),
])
def test_data_on_device_refuses_what_it_cannot_do_in_one_line(tiny_config, overrides, message):
    cfg = tiny_config("train.data_on_device=true", "train.xla=jit", *overrides)
    with pytest.raises(ConfigError, match=message) as error:
        config.check(cfg)
    assert "\n" not in str(error.value)


def test_data_on_device_is_accepted_under_distribute_mirrored(tiny_config):
    """distribute=mirrored keeps the device loop (each replica's slice gathered on its device:
    tests/test_distribute.py); the global batch's split over the replicas is checked where the
    replicas are known (check_global_batch, at the start of train())."""
    checked = config.check(tiny_config("train.data_on_device=true", "train.xla=jit", "distribute=mirrored"))
    assert checked["train"]["data_on_device"] and checked["distribute"]["strategy"] == "mirrored"
