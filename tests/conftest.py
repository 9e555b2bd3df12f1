"""Shared fixtures: a tiny learnable IDX dataset, the real Hydra config shrunk to a tiny
model, a tiny trained run, helpers to run the entry points as a user would, and the
shared pieces of the op and model tests (NumPy reference of the capsule prediction,
seeding, TF32 off, a spy on the compiled op, an op loader with no library)."""
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from absl import logging as absl_logging

REPO = Path(__file__).resolve().parents[1]

# absl's logging handler (made when absl.logging is first imported, by TensorFlow) writes to the
# sys.stderr of that moment, under pytest the capture's file, and closes that stream whenever
# logging is configured again (logging.config.dictConfig: Hydra, run in the test process) while
# sys.stderr is another stream: pytest-xdist's worker then fails every later test on "I/O
# operation on closed file". sys.__stderr__ is a stream it never closes.
absl_logging.get_absl_handler().python_handler.stream = sys.__stderr__
CONFIG_DIR = REPO / "configs"

# A CapsNet small enough to train in seconds on 2 CPU cores: 144 primary capsules
# (6x6 grid x 4 types) of 8D, ten 8D digit capsules, a 32-64 decoder.
TINY_MODEL = [
    "model.conv1_filters=16",
    "model.primary_caps_types=4",
    "model.digit_caps_dim=8",
    "model.decoder_units=[32,64]",
]
TINY_TRAIN = [
    "train.epochs=4",
    "train.batch_size=16",
    "train.learning_rate=0.01",
    "train.log_every_steps=4",
    "train.num_images=4",
    "train.histogram_examples=16",
    "train.progress_bar=false",
    "train.figures=false",  # the end-of-training figures cost seconds a run: trained_run and the tests of them draw them
    "train.xla_cache_dir=null",  # the default is in the home: a test's jit run writes nothing there
]


# --------------------------------------------------------------------------- data

def synthetic_digits(n, seed, size=28, num_classes=10):
    """n uint8 images (n, size, size) and labels: each class is a fixed pattern of four
    bright bars at class-specific places, randomly shifted by up to 2 px, with noise.

    Learnable in a couple of epochs by a tiny CapsNet, unlike random noise, and needs
    no files outside the repository.
    """
    templates = np.zeros((num_classes, size, size), np.float32)
    layout = np.random.default_rng(1234)  # the same class patterns for every split
    for k in range(num_classes):
        for _ in range(4):
            y, x = layout.integers(6, size - 10, size=2)
            if layout.random() < 0.5:
                templates[k, y:y + 2, x:x + 8] = 1.0   # horizontal bar
            else:
                templates[k, y:y + 8, x:x + 2] = 1.0   # vertical bar
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, size=n)
    shifts = rng.integers(-2, 3, size=(n, 2))
    images = np.stack([np.roll(templates[k], tuple(s), axis=(0, 1)) for k, s in zip(labels, shifts)])
    images = np.clip(images * rng.uniform(0.7, 1.0, size=(n, 1, 1)) + rng.uniform(0, 0.15, images.shape), 0, 1)
    return (images * 255).astype(np.uint8), labels.astype(np.uint8)


def write_idx_dataset(directory, n_train, n_test, gz=True):
    """An MNIST-format IDX directory (train-*, t10k-*) of synthetic_digits."""
    from capsnet.idx import write_idx

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    for prefix, n, seed in (("train", n_train, 0), ("t10k", n_test, 1)):
        images, labels = synthetic_digits(n, seed)
        write_idx(directory / f"{prefix}-images-idx3-ubyte{suffix}", images)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte{suffix}", labels)
    return directory


@pytest.fixture(scope="package")  # once for the whole tests/ folder
def tiny_idx_dir(tmp_path_factory):
    """A small learnable MNIST-format dataset: 320 train / 100 test images, gzip IDX."""
    return write_idx_dataset(tmp_path_factory.mktemp("tiny_idx"), n_train=320, n_test=100)


def numpy_shift(image, dy, dx):
    """The NumPy reference of a shift: out[y, x] = image[y - dy, x - dx] where that is
    inside, else 0."""
    h, w = image.shape[:2]
    out = np.zeros_like(image)
    out[max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
        image[max(-dy, 0):h + min(-dy, 0), max(-dx, 0):w + min(-dx, 0)]
    return out


# The per-example augmentation draws, as the input pipeline made them before it drew
# whole epochs at once (capsnet.augment.flip_mask, shift_corners): the references its
# batches are checked against.
def random_shift(image, shift_pixels, key, fill="zero"):
    """Shifts one (H, W, C) image by (dy, dx), each uniform in [-shift_pixels, shift_pixels],
    drawn from the stateless RNG `key` (int64 (2,)); the uncovered border is zero
    (fill="zero") or repeats the nearest border pixel (fill="edge"). Both fills draw the
    same shift from the same key."""
    import tensorflow as tf

    h, w, c = image.shape
    s = shift_pixels
    # A crop at corner (oy, ox) of the image padded by s is the image shifted by (s - oy, s - ox).
    corner = tf.random.stateless_uniform([2], seed=key, minval=0, maxval=2 * s + 1,
                                         dtype=tf.int32, alg="philox")
    if fill == "edge":
        # out[y, x] = image[clip(y - dy), clip(x - dx)] with (dy, dx) = s - corner.
        rows = tf.clip_by_value(tf.range(h) + corner[0] - s, 0, h - 1)
        cols = tf.clip_by_value(tf.range(w) + corner[1] - s, 0, w - 1)
        return tf.gather(tf.gather(image, rows, axis=0), cols, axis=1)  # (H, W, C)
    padded = tf.pad(image, [[s, s], [s, s], [0, 0]])  # (H + 2s, W + 2s, C), zero border
    return tf.slice(padded, [corner[0], corner[1], 0], [h, w, c])  # (H, W, C)



def random_flip(image, key):
    """Mirrors one (H, W, C) image left-right with probability 1/2 (stateless RNG `key`)."""
    import tensorflow as tf

    mirror = tf.random.stateless_uniform([], seed=key, alg="philox") < 0.5
    return tf.cond(mirror, lambda: tf.reverse(image, axis=[1]), lambda: image)


def collect(dataset):
    """A finite tf.data dataset of tuples as one NumPy array per tuple element, the
    batches concatenated."""
    parts = zip(*[tuple(t.numpy() for t in element) for element in dataset])
    return tuple(np.concatenate(part) for part in parts)


def np_margin_loss(labels, lengths, m_plus=0.9, m_minus=0.1, lambda_=0.5):
    """Eq. 4, class by class: labels (B,) one class per example, or (B, n) the classes
    present (MultiMNIST: two)."""
    loss = np.zeros(len(labels))
    for b, label in enumerate(labels):
        present = set(np.atleast_1d(label).tolist())
        for k, length in enumerate(lengths[b]):
            if k in present:
                loss[b] += max(0.0, m_plus - length) ** 2
            else:
                loss[b] += lambda_ * max(0.0, length - m_minus) ** 2
    return loss


# --------------------------------------------------------------------------- config

def compose_config(config_name="train", overrides=()):
    """The real config (configs/), composed by Hydra with `overrides`, as a plain dict
    (capsnet.config.compose: the schemas registered, a wrong type → ConfigError)."""
    from capsnet import config

    return config.compose(config_name, overrides)


def tiny_overrides(data_dir, run_dir, *extra):
    """Overrides shrinking the real config to the tiny model and dataset, writing to run_dir."""
    return [*TINY_MODEL, *TINY_TRAIN, f"data.dir={data_dir}", f"run_dir={run_dir}", *extra]


@pytest.fixture
def tiny_config(tiny_idx_dir, tmp_path):
    """compose_config(tiny) with its run dir in tmp_path; call with extra overrides."""

    def make(*extra, run_dir=None):
        return compose_config("train", tiny_overrides(tiny_idx_dir, run_dir or tmp_path / "run", *extra))

    return make


@pytest.fixture(scope="package")  # once for the whole tests/ folder
def trained_run(tiny_idx_dir, tmp_path_factory):
    """A tiny run trained in-process for 4 epochs (20 steps each): (run_dir, returned metrics)."""
    from capsnet.training import train

    run_dir = tmp_path_factory.mktemp("trained") / "run"
    metrics = train(compose_config("train", tiny_overrides(tiny_idx_dir, run_dir, "train.figures=true")))
    return run_dir, metrics


def assert_trained_as(metrics, reference):
    """A run's losses match the reference run's (trained_run's metrics) epoch for epoch."""
    for mine, theirs in zip(metrics["history"], reference["history"], strict=True):
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-3)
    assert metrics["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-3)


# --------------------------------------------------------------------------- subprocesses

def repo_env(*paths):
    """This process's environment for a subprocess that imports capsnet: `paths`, then the
    repository, then any PYTHONPATH already set, on its PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(REPO), env.get("PYTHONPATH", "")])
    return env


def entry_point_env(*paths):
    """repo_env(*paths) as a user's shell would have it: without the variables that change
    what the entry points print (full Hydra tracebacks, TensorFlow's log level)."""
    env = repo_env(*paths)
    env.pop("HYDRA_FULL_ERROR", None)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    return env


def sigint_as_in_a_terminal():
    """Popen preexec_fn: SIGINT at its default, as a terminal's foreground job has it. A suite started in
    the background by a shell without job control inherits SIGINT ignored, and Python then installs no
    KeyboardInterrupt handler: a Ctrl-C test would send a signal that train.py never sees."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def load_script(name):
    """scripts/<name>.py as a module, to test its functions in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_entry_point(script, *args, cwd, timeout=300):
    """Run a script of the repository (train.py, evaluate.py, scripts/...; path relative to
    the repository) as a user would; returns the CompletedProcess (text)."""
    return subprocess.run([sys.executable, str(REPO / script), *map(str, args)], cwd=cwd,
                          env=entry_point_env(), capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------- TensorBoard

def tfrecords(path):
    """The records of a TFRecord file, up to the first one cut short: the file may still be
    being written, or its writer killed mid-record (tf.data would raise DataLossError).

    Framing: uint64 length, uint32 CRC of the length, the data, uint32 CRC of the data
    (little-endian; the CRCs are not checked).
    """
    data = Path(path).read_bytes()
    offset = 0
    while offset + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        end = offset + 12 + length + 4
        if end > len(data):
            return
        yield data[offset + 12:offset + 12 + length]
        offset = end


def read_events(run_dir):
    """All summaries in run_dir's event files: {tag: [(step, Summary.Value), ...]} in file order."""
    import tensorflow as tf

    events = {}
    # A resumed run adds a file: read them in the order they were written.
    for path in sorted(Path(run_dir).glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        for record in tfrecords(path):
            event = tf.compat.v1.Event.FromString(record)
            for value in event.summary.value:
                events.setdefault(value.tag, []).append((event.step, value))
    return events


def checkpoint_lengths(prefix, run_dir, dataset):
    """A checkpoint's capsule lengths (N, classes) over `dataset`'s batches, computed by
    the model directly (not through evaluate()): the reference for ensemble tests."""
    from capsnet.training.checkpoints import read_run_config, restore_model
    from capsnet.training.model_setup import build_capsnet

    model = build_capsnet(read_run_config(run_dir)["model"], False)
    restore_model(model, str(prefix))
    return np.concatenate([model(x, training=False)["lengths"].numpy() for x, *_ in dataset])


# --------------------------------------------------------------------------- op and model tests

def np_capsule_prediction(u, W):
    """NumPy reference of the capsule prediction in float64:
    u_hat[b, i, j, d] = sum_k W[i, j, d, k] u[b, i, k]."""
    return np.einsum("bik,ijdk->bijd", np.asarray(u, np.float64), np.asarray(W, np.float64))


@pytest.fixture
def seeded():
    """Same initial weights every run: failures reproduce. Modules that build layers use it
    for every test: pytestmark = pytest.mark.usefixtures("seeded")."""
    import keras

    keras.utils.set_random_seed(0)


@pytest.fixture
def no_tf32():
    """Full float32 matmuls: on a GPU the matmul path would otherwise use TF32 (10-bit
    mantissa) while the op computes in float32, and differ by ~1e-3 relative."""
    import tensorflow as tf

    was = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    yield
    tf.config.experimental.enable_tensor_float_32_execution(was)


@pytest.fixture
def spy_on_op(monkeypatch):
    """spy_on_op(through=None, op="capsule_prediction") replaces ops.<op> (a compiled op's
    wrapper: capsule_prediction or capsule_routing) with a spy that records each call as
    (u.shape, W.shape) (at trace time inside a tf.function) and passes it on to
    `through`, by default the real op; returns the list of calls."""
    from capsnet import ops

    def spy_on(through=None, op="capsule_prediction"):
        through = through or getattr(ops, op)
        calls = []

        def spy(u, W, *args, **kwargs):
            calls.append((tuple(u.shape), tuple(W.shape)))
            return through(u, W, *args, **kwargs)

        monkeypatch.setattr(ops, op, spy)
        return calls

    return spy_on


@pytest.fixture
def fresh_op_loader(monkeypatch, tmp_path):
    """The op loader pointed at tmp_path/_capsnet_ops.so, which does not exist (yet), with
    nothing loaded, as in a fresh process; returns that path."""
    from capsnet import ops

    path = tmp_path / "_capsnet_ops.so"
    monkeypatch.setattr(ops, "_LIBRARY_PATH", str(path))
    monkeypatch.setattr(ops, "_lib", None)
    return path


def assert_checkpoint_tensors_close(ours, theirs, *, rtol, atol, prefix=""):
    """Every tensor of checkpoint `theirs` whose name starts with `prefix` (a string or a
    tuple of them) is in `ours` and within (rtol, atol) of it (0 and 0: equal; checkpoint
    prefixes, e.g. <run>/checkpoints/latest/ckpt-2). Returns the names compared, sorted."""
    import tensorflow as tf

    ours, theirs = tf.train.load_checkpoint(str(ours)), tf.train.load_checkpoint(str(theirs))
    names = sorted(name for name in theirs.get_variable_to_shape_map()
                   if name != "_CHECKPOINTABLE_OBJECT_GRAPH" and name.startswith(prefix))
    for name in names:
        mine, ref = ours.get_tensor(name), theirs.get_tensor(name)
        if np.asarray(ref).dtype.kind in "SUO":  # a string of the training state: the same
            np.testing.assert_array_equal(mine, ref, err_msg=name)
        else:
            np.testing.assert_allclose(mine, ref, rtol=rtol, atol=atol, err_msg=name)
    return names
