"""MNIST digits on a larger canvas (Sabour et al. 2017, Sec. 5.2): expanded_mnist to train
on, affnist (an affine test set in affNIST's ranges) to score what it learnt on.

expanded_mnist follows the authors' generator (research/capsules/input_data/mnist/
mnist_shift.py in github.com/Sarasra/models, run with --shift=6 --pad=6, which their README
names for "expanded_mnist for affNIST generalizability"): each 28x28 digit zero-padded by
pad_pixels (6: a 40x40 canvas) and shifted by (dy, dx) in [-shift_pixels, shift_pixels]².
Their script writes every one of the 169 shifts of every digit of whichever split it is
given; here a training digit gets one shift uniform over those 169 per epoch (make_dataset's
shifts, keyed by (seed, epoch), on the canvas held in memory), and a test digit one fixed
shift drawn once under EXPANDED_TEST_KEY: the test split is shifted too (an unbiased one
per digit of what the script writes for --split=test), the same pixels in every run and
every evaluation. (The authors' reader of plain MNIST reads its test split unshifted,
test_0shifted_mnist.tfrecords; with data.shift_pixels=0 the test digits here are the
centred canvas, as in affNIST's "just centered" set, and training has no shifts either.)

Both hold their split in memory as uint8 canvases, so make_dataset, the device loop
(train.data_on_device) and evaluation treat them as any single-label dataset.
"""
import numpy as np

from capsnet.affine import AFFINE_TEST_SEED, affine_digits
from capsnet.augment import shift_batch, shift_corners
from capsnet.data.sources import load_split
from capsnet.datasets import test_set_refusal
from capsnet.errors import DataError
from capsnet.tasks.base import Split
from capsnet.tasks.single_label import SingleLabel

# The key of the expanded_mnist test split's shifts: fixed (not the run's seed), as
# MultiMNIST's test pairs are (capsnet.data.MULTIMNIST_TEST_KEY).
EXPANDED_TEST_KEY = (2017, 52)


class CanvasDigits(SingleLabel):
    """expanded_mnist: single-label digits on a canvas pad_pixels wider on every side
    (null: shift_pixels), shifted in training, at fixed shifts at test."""
    kind = "canvas"

    def pad_pixels(self):
        pad = self.cfg.get("pad_pixels")
        return self.cfg.get("shift_pixels", 2) if pad is None else pad

    def source(self, split, limit):
        """The split's MNIST digits, uint8 (N, 28, 28, 1), and labels (N,)."""
        return load_split(self.name, split, data_dir=self.cfg.get("dir"), limit=limit)

    def load(self, split, *, limit=None):
        images, labels = self.source(split, limit)
        p = self.pad_pixels()
        canvas = np.pad(images, ((0, 0), (p, p), (p, p), (0, 0)))           # (N, H + 2p, W + 2p, C)
        shift = self.cfg.get("shift_pixels", 2)
        if split == "test" and shift:
            canvas = fixed_shifts(canvas, shift)
        return Split(labels=labels, images=canvas, shape=tuple(canvas.shape[1:]))


def fixed_shifts(images, shift_pixels, key=EXPANDED_TEST_KEY):
    """Each of `images` (uint8 (N, H, W, C)) shifted by (dy, dx) uniform in
    [-shift_pixels, shift_pixels]², drawn as training draws its shifts (shift_corners,
    keyed by the example's index) under the fixed `key`: the first N of a longer split get
    the same shifts. Zero fill; nothing is lost where the canvas border is ≥ shift_pixels."""
    import tensorflow as tf

    with tf.device("/CPU:0"):  # the same kernels wherever a GPU is
        corners = shift_corners(tf.constant(key, tf.int64), tf.range(len(images), dtype=tf.int64), shift_pixels)
        return shift_batch(tf.constant(images), corners, shift_pixels).numpy()


class AffineDigits(CanvasDigits):
    """affnist: the MNIST test digits on the canvas, each under one affine map in affNIST's
    ranges (capsnet.affine.affine_digits, its fixed seed): a test set only."""
    kind = "affine"

    def load(self, split, *, limit=None):
        if self.spec.test_only and split != "test":
            raise DataError(test_set_refusal(self.name))
        images, labels = self.source("test", limit)
        canvas = affine_set(images, self.pad_pixels())
        return Split(labels=labels, images=canvas, shape=tuple(canvas.shape[1:]))


# (digest of the source digits, pad) -> their affine set: generating 10,000 takes seconds
# (capsnet.affine), and an evaluation of an ensemble or a test asks for the same set again.
_AFFINE_SETS = {}


def affine_set(images, pad_pixels):
    """capsnet.affine.affine_digits of `images` (uint8 (N, 28, 28, 1)) at its fixed seed on a
    canvas pad_pixels wider on every side, uint8 (N, H', W', 1), read-only: made once a
    process for the same digits and pad."""
    import hashlib

    key = (hashlib.sha256(np.ascontiguousarray(images).tobytes()).hexdigest(), int(pad_pixels))
    if key not in _AFFINE_SETS:
        canvas, _ = affine_digits(images, seed=AFFINE_TEST_SEED, pad_pixels=pad_pixels)
        canvas.setflags(write=False)
        _AFFINE_SETS.clear()  # one set kept: the full test set is 16 MB
        _AFFINE_SETS[key] = canvas
    return _AFFINE_SETS[key]
