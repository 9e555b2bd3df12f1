"""expanded_mnist (digits on a 40x40 canvas, shifted up to 6 px) and affnist (the test digits
under one affine map each, in affNIST's ranges; capsnet.affine): shapes, where each digit
lands (against the digit shifted by NumPy), the draws, the warp against independent
references (np.rot90, an analytic bilinear splat, TensorFlow's ImageProjectiveTransformV3),
the refusal to train on affnist, and evaluate.py scoring an expanded_mnist run on affnist."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import checkpoint_lengths, compose_config, numpy_shift, run_entry_point, tiny_overrides

from capsnet.affine import (ROTATE_DEGREES, SCALE, SHEAR, affine_digits, affine_parameters, inverse_maps, linear_part,
                            warp_bilinear)
from capsnet.config import AUGMENTATION_OFF
from capsnet.errors import ConfigError, DataError
from capsnet.idx import read_idx
from capsnet.tasks import task_for

REAL_MNIST = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"
needs_mnist = pytest.mark.skipif(not REAL_MNIST.is_dir(), reason="needs the real MNIST test files")


def expanded(data_dir, **keys):
    return task_for({**AUGMENTATION_OFF, "name": "expanded_mnist", "dir": str(data_dir), "shift_pixels": 6,
                     "pad_pixels": 6, **keys})


def found_shifts(canvases, sources):
    """For each 40x40 canvas, the (dy, dx) in [-6, 6]² at which it is its 28x28 source zero-padded
    by 6 and shifted by (dy, dx): the 28x28 window at (6 + dy, 6 + dx) equals the source and
    holds all of the canvas' ink; None where no shift or several fit."""
    found = []
    for canvas, source in zip(canvases[..., 0], sources[..., 0]):
        windows = np.lib.stride_tricks.sliding_window_view(canvas, source.shape)    # (13, 13, 28, 28)
        fits = (windows == source).all(axis=(2, 3)) & (windows.sum(axis=(2, 3), dtype=np.int64) ==
                                                       canvas.sum(dtype=np.int64))
        hits = np.argwhere(fits) - 6
        found.append(tuple(hits[0].tolist()) if len(hits) == 1 else None)
    return found


def test_expanded_mnist_training_digits_shifted_whole_within_6_px(tiny_idx_dir):
    from capsnet.data import epoch_draws

    task = expanded(tiny_idx_dir)
    train = task.load("train")
    sources = read_idx(tiny_idx_dir / "train-images-idx3-ubyte.gz")[..., None]     # (320, 28, 28, 1)
    assert train.images.shape == (320, 40, 40, 1) and task.example_shape(train.shape) == (40, 40, 1)
    shifts = {}
    for epoch in (0, 1):
        images, labels = (np.concatenate(part) for part in zip(*[
            (x.numpy(), y.numpy()) for x, y in task.dataset(train, batch_size=64, training=True, seed=3, epoch=epoch)]))
        order = epoch_draws(train.images.shape, training=True, seed=3, epoch=epoch, shift_pixels=6)["index"].numpy()
        pixels = np.rint(images * 255).astype(np.uint8)
        np.testing.assert_array_equal(labels, read_idx(tiny_idx_dir / "train-labels-idx1-ubyte.gz")[order])
        # Every digit whole (its pixel mass kept) at one shift within ±6 px of the canvas centre.
        np.testing.assert_array_equal(pixels.sum(axis=(1, 2, 3), dtype=np.int64),
                                      sources[order].sum(axis=(1, 2, 3), dtype=np.int64))
        found = found_shifts(pixels, sources[order])
        assert None not in found
        assert all(np.array_equal(canvas[..., 0], numpy_shift(np.pad(source[..., 0], 6), *shift))
                   for canvas, source, shift in zip(pixels, sources[order], found))
        shifts[epoch] = dict(zip(order.tolist(), found))
    drawn = np.array(list(shifts[0].values()))
    # Spread over the whole range: both extremes on both axes, most of the 169 shifts used.
    assert drawn.min(axis=0).tolist() == [-6, -6] and drawn.max(axis=0).tolist() == [6, 6]
    assert len(set(map(tuple, drawn))) > 100 and abs(drawn.mean()) < 1.0
    # A new draw each epoch (the same shift for a digit by chance: 1 in 169).
    assert sum(shifts[0][i] == shifts[1][i] for i in range(320)) < 16


def test_expanded_mnist_test_split_fixed_and_shifted(tiny_idx_dir):
    first, again = expanded(tiny_idx_dir).load("test"), expanded(tiny_idx_dir, limit_test=None).load("test")
    np.testing.assert_array_equal(first.images, again.images)
    np.testing.assert_array_equal(expanded(tiny_idx_dir).load("test", limit=40).images, first.images[:40])
    batches = list(expanded(tiny_idx_dir).dataset(first, batch_size=32, training=False))
    np.testing.assert_array_equal(np.rint(np.concatenate([x.numpy() for x, _ in batches]) * 255), first.images)
    found = found_shifts(first.images, read_idx(tiny_idx_dir / "t10k-images-idx3-ubyte.gz")[..., None])
    assert None not in found and len(set(found)) > 40  # 100 digits: shifted, at many shifts
    # shift_pixels 0: the digits centred on the canvas (mnist_shift.py --shift=0 --pad=6).
    centred = expanded(tiny_idx_dir, shift_pixels=0).load("test").images
    assert set(found_shifts(centred, read_idx(tiny_idx_dir / "t10k-images-idx3-ubyte.gz")[..., None])) == {(0, 0)}


def test_expanded_mnist_batches_on_the_device_equal_tf_data(tiny_idx_dir):
    from capsnet.training.device_input import DeviceTrainingSet

    task = expanded(tiny_idx_dir)
    train = task.load("train", limit=64)
    device = DeviceTrainingSet(train.images, train.labels, batch_size=32, seed=5, device="/CPU:0",
                               **task.augmentation())
    on_device = device.batch(device.epoch(2).draws, 1, 32)
    x, y = list(task.dataset(train, batch_size=32, training=True, seed=5, epoch=2))[1]
    np.testing.assert_array_equal(on_device[0].numpy(), x.numpy())
    np.testing.assert_array_equal(on_device[1].numpy(), y.numpy())


def test_config_shapes_and_the_refusal_to_train_on_affnist():
    from capsnet import config

    cfg = compose_config("train", ["data=expanded_mnist", "run_dir=/unused"])
    assert cfg["model"]["input_shape"] == [40, 40, 1] and config.check(cfg)["data"]["pad_pixels"] == 6
    for override in ("data=affnist", "data.name=affnist"):
        with pytest.raises(ConfigError, match=r"^data\.name=affnist is a test set only .*data\.name=affnist$"):
            config.check(compose_config("train", [override, "run_dir=/unused"]))
    with pytest.raises(DataError, match="affnist is a test set only"):
        task_for({"name": "affnist", "dir": None, "shift_pixels": 0, "pad_pixels": 6}).load("train")


def test_affine_draws_deterministic_and_within_affnists_ranges():
    rng = np.random.default_rng(0)
    digits = np.zeros((30, 28, 28), np.uint8)
    digits[:, 8:20, 10:18] = rng.integers(0, 256, (30, 12, 8))
    first, params = affine_digits(digits, seed=11)
    again, _ = affine_digits(digits, seed=11)
    other, _ = affine_digits(digits, seed=12)
    assert first.shape == (30, 40, 40, 1) and first.dtype == np.uint8
    assert first.tobytes() == again.tobytes() and first.tobytes() != other.tobytes()
    np.testing.assert_array_equal(affine_digits(digits[:7], seed=11)[0], first[:7])  # keyed by index
    drawn = affine_parameters(5000, seed=11)
    for key, (low, high) in {"rotate_degrees": (-ROTATE_DEGREES, ROTATE_DEGREES), "shear": (-SHEAR, SHEAR),
                             "scale_y": SCALE, "scale_x": SCALE}.items():
        values = drawn[key]
        assert low <= values.min() < low + 0.02 * (high - low) and high - 0.02 * (high - low) < values.max() <= high
    assert (ROTATE_DEGREES, SHEAR, SCALE) == (20.0, 0.2, (0.8, 1.2))  # affNIST's documented ranges


def test_identity_and_90_degrees_against_numpy():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (3, 40, 40)).astype(np.float64)
    identity = inverse_maps(linear_part(np.zeros(3), np.zeros(3), np.ones(3), np.ones(3)), (np.zeros(3),) * 2, 40)
    np.testing.assert_array_equal(warp_bilinear(images, identity), images)  # exactly, every pixel
    quarter = inverse_maps(linear_part(np.full(3, 90.0), np.zeros(3), np.ones(3), np.ones(3)), (np.zeros(3),) * 2, 40)
    np.testing.assert_allclose(warp_bilinear(images, quarter), np.rot90(images, axes=(1, 2)), atol=1e-9)


def test_a_bright_pixel_rotated_lands_where_the_rotation_puts_it():
    """One pixel at p, rotated by 30 degrees about the centre c: the output is the bilinear
    tent of that pixel centred at c + R (p - c), R computed here with NumPy's cos and sin."""
    image = np.zeros((1, 40, 40))
    p = np.array([12.0, 27.0])
    image[0, int(p[0]), int(p[1])] = 255.0
    angle = np.deg2rad(30.0)
    rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])  # (y, x), counterclockwise
    out = warp_bilinear(image, inverse_maps(linear_part(np.array([30.0]), np.zeros(1), np.ones(1), np.ones(1)),
                                            (np.zeros(1),) * 2, 40))[0]
    c = np.full(2, 19.5)
    grid = np.stack(np.meshgrid(np.arange(40.0), np.arange(40.0), indexing="ij"), -1)       # (40, 40, 2)
    back = (grid - c) @ np.linalg.inv(rotation).T + c - p                                   # each output's offset from p
    np.testing.assert_allclose(out, 255.0 * np.prod(np.maximum(0.0, 1.0 - np.abs(back)), -1), atol=1e-9)
    centre = (grid * out[..., None]).sum((0, 1)) / out.sum()
    np.testing.assert_allclose(centre, c + rotation @ (p - c), atol=0.35)
    # Rotated counterclockwise as seen: a pixel right of the centre moves up.
    assert centre[0] < 19.5 - 5


def test_warp_equals_tensorflows_projective_transform():
    import tensorflow as tf

    rng = np.random.default_rng(2)
    images = rng.uniform(0, 255, (4, 40, 40))
    matrix = linear_part(np.array([17.0, -8.0, 20.0, -20.0]), np.array([0.15, -0.2, 0.0, 0.1]),
                         np.array([0.9, 1.2, 0.8, 1.0]), np.array([1.1, 0.85, 1.2, 0.8]))
    inverse = inverse_maps(matrix, (np.array([3.2, -5.0, 0.0, 7.5]), np.array([-2.4, 6.1, 0.0, -7.0])), 40)
    # TensorFlow maps an output (x, y) to the input point (a0 x + a1 y + a2, b0 x + b1 y + b2).
    transforms = np.stack([inverse[:, 1, 1], inverse[:, 1, 0], inverse[:, 1, 2],
                           inverse[:, 0, 1], inverse[:, 0, 0], inverse[:, 0, 2], np.zeros(4), np.zeros(4)], 1)
    theirs = tf.raw_ops.ImageProjectiveTransformV3(
        images=tf.constant(images[..., None], tf.float32), transforms=tf.constant(transforms, tf.float32),
        output_shape=[40, 40], fill_value=0.0, interpolation="BILINEAR", fill_mode="CONSTANT")
    np.testing.assert_allclose(warp_bilinear(images, inverse), theirs.numpy()[..., 0], atol=0.02)


@needs_mnist
def test_affnist_test_split_keeps_each_digit_inside_the_canvas():
    task = task_for({"name": "affnist", "dir": str(REAL_MNIST), "shift_pixels": 0, "pad_pixels": 6})
    split = task.load("test", limit=300)
    digits = read_idx(REAL_MNIST / "t10k-images-idx3-ubyte.gz")[:300]
    canvas, params = affine_digits(digits)
    assert split.images.shape == (300, 40, 40, 1) and task.example_shape(split.shape) == (40, 40, 1)
    np.testing.assert_array_equal(split.images, canvas)
    np.testing.assert_array_equal(task.load("test", limit=300).images, canvas)  # the same pixels again
    ring = np.concatenate([canvas[:, 0], canvas[:, -1], canvas[:, :, 0], canvas[:, :, -1]], axis=1)
    assert not ring.any()  # no ink reaches the edge: nothing left the 40x40 box
    # The ink scales with the map's area (sy · sx), none lost: within what bilinear resampling adds or drops
    # (up to ~6% at the smallest scales).
    mass = canvas.sum(axis=(1, 2, 3), dtype=np.float64) / digits.sum(axis=(1, 2), dtype=np.float64)
    np.testing.assert_allclose(mass, params["scale_y"] * params["scale_x"], rtol=0.08)
    # The translations use the room the canvas leaves (affNIST's "significant translations").
    assert min(params["translate_y"].min(), params["translate_x"].min()) < -8
    assert max(params["translate_y"].max(), params["translate_x"].max()) > 8


@pytest.mark.slow
def test_evaluate_py_scores_an_expanded_mnist_run_on_affnist(tiny_idx_dir, tmp_path):
    import tensorflow as tf

    from capsnet.training import train

    run_dir = tmp_path / "run"
    train(compose_config("train", tiny_overrides(tiny_idx_dir, run_dir, "data=expanded_mnist", "train.epochs=1")))
    result = run_entry_point("evaluate.py", f"checkpoint={run_dir}", "data.name=affnist", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["dataset"] == "affnist" and report["num_examples"] == 100
    assert report["output"] == str(run_dir.resolve() / "evaluations" / "latest-ckpt-1.affnist.json")
    assert not (run_dir / "evaluations" / "latest-ckpt-1.json").exists()  # the run's own report is not overwritten
    # The accuracy is the model's on the affine set made directly from the test digits.
    canvas, _ = affine_digits(read_idx(tiny_idx_dir / "t10k-images-idx3-ubyte.gz"))
    labels = read_idx(tiny_idx_dir / "t10k-labels-idx1-ubyte.gz")
    dataset = tf.data.Dataset.from_tensor_slices((canvas.astype(np.float32) / 255.0, labels)).batch(50)
    lengths = checkpoint_lengths(report["checkpoint"], run_dir, dataset)
    assert report["accuracy"] == pytest.approx(np.mean(lengths.argmax(1) == labels), abs=1e-9)
    assert math.isfinite(report["loss"])
