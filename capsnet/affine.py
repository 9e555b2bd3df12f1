"""An affine test set in affNIST's ranges, made from MNIST digits in NumPy (no TensorFlow).

affNIST (Tijmen Tieleman, https://www.cs.toronto.edu/~tijmen/affNIST/) puts MNIST digits
on a 40x40 canvas (the 28x28 digit centred by an edge of 6 background pixels) and applies
one random affine transformation per image: rotation within ±20 degrees, shearing within
±0.2, vertical and horizontal scaling each in [0.8, 1.2], and a translation that keeps the
digit inside the 40x40 box. Its files cannot be read here, so `affine_digits` draws
transformations in those ranges: a set *in affNIST's ranges*, not affNIST's images (its
draws, its composition order and its resampling are its own).

The draws come from one seed (NumPy's PCG64, one row of six uniforms per digit, so the
first N digits get the same transformations whatever the limit), and the warp is
elementwise float64 arithmetic (no BLAS, no vectorised sin/cos: the only transcendental
calls are Python's math.sin/cos, once per digit), so a seed gives the same uint8 pixels
bit for bit on every run.
"""
import math

import numpy as np

from capsnet.errors import DataError

# affNIST's documented ranges (its page, above).
ROTATE_DEGREES = 20.0   # rotation uniform in [-20, 20] degrees
SHEAR = 0.2             # horizontal shear factor uniform in [-0.2, 0.2]
SCALE = (0.8, 1.2)      # vertical and horizontal scale, each uniform in [0.8, 1.2]
# The seed of the test set data.name=affnist scores: fixed, so every run and every
# evaluation sees the same images.
AFFINE_TEST_SEED = 20171026  # the date the capsules paper (Sabour et al. 2017) was posted

__all__ = ["ROTATE_DEGREES", "SHEAR", "SCALE", "AFFINE_TEST_SEED", "affine_parameters", "linear_part",
           "inverse_maps", "warp_bilinear", "affine_digits"]


def affine_parameters(n, seed):
    """n transformations' parameters in affNIST's ranges: {"rotate_degrees", "shear",
    "scale_y", "scale_x": float64 (n,), "place_y", "place_x": float64 (n,) uniform in
    [0, 1), where between its lowest and highest allowed translation each digit goes
    (affine_digits)}. Row i depends only on (seed, i): a prefix of n is the draw of fewer."""
    draws = np.random.Generator(np.random.PCG64(seed)).random((n, 6))  # (n, 6) in [0, 1)
    low, high = SCALE
    return {"rotate_degrees": ROTATE_DEGREES * (2.0 * draws[:, 0] - 1.0),
            "shear": SHEAR * (2.0 * draws[:, 1] - 1.0),
            "scale_y": low + (high - low) * draws[:, 2],
            "scale_x": low + (high - low) * draws[:, 3],
            "place_y": draws[:, 4], "place_x": draws[:, 5]}


def linear_part(rotate_degrees, shear, scale_y, scale_x):
    """The 2x2 matrix acting on (y, x) offsets from the centre, row down, column right:
    scale, then shear (x += shear · y), then rotate counterclockwise as the image is seen
    (rows grow downwards), M = R · Sh · S. Returns its entries (m_yy, m_yx, m_xy, m_xx),
    float64 arrays like the arguments."""
    angles = np.asarray(rotate_degrees, np.float64) * (math.pi / 180.0)
    cos = np.array([math.cos(a) for a in np.ravel(angles)]).reshape(np.shape(angles))
    sin = np.array([math.sin(a) for a in np.ravel(angles)]).reshape(np.shape(angles))
    # On (y, x) with rows downwards, a counterclockwise rotation is R = [[cos, -sin], [sin, cos]]
    # (np.rot90's direction at 90 degrees); Sh · S = [[sy, 0], [shear · sy, sx]].
    scale_y, scale_x, shear = (np.asarray(v, np.float64) for v in (scale_y, scale_x, shear))
    return (cos * scale_y - sin * shear * scale_y, -sin * scale_x,
            sin * scale_y + cos * shear * scale_y, cos * scale_x)


def inverse_maps(matrix, translation, size):
    """Each output pixel's source point: for forward maps p' = c + t + M (p - c) about the
    centre c = (size - 1) / 2 of a size x size canvas, the inverse p = c + M⁻¹ (p' - c - t)
    as (n, 2, 3) float64 rows [[i_yy, i_yx, o_y], [i_xy, i_xx, o_x]] with p = I p' + o.
    `matrix`: linear_part's entries, `translation`: (t_y, t_x), arrays of n."""
    m_yy, m_yx, m_xy, m_xx = (np.asarray(m, np.float64) for m in matrix)
    det = m_yy * m_xx - m_yx * m_xy
    i_yy, i_yx, i_xy, i_xx = m_xx / det, -m_yx / det, -m_xy / det, m_yy / det
    c = (size - 1) / 2.0
    t_y, t_x = (np.asarray(t, np.float64) for t in translation)
    # p = c + I (p' - c - t) = I p' + (c - I (c + t))
    o_y = c - (i_yy * (c + t_y) + i_yx * (c + t_x))
    o_x = c - (i_xy * (c + t_y) + i_xx * (c + t_x))
    return np.stack([np.stack([i_yy, i_yx, o_y], -1), np.stack([i_xy, i_xx, o_x], -1)], -2)  # (n, 2, 3)


def warp_bilinear(images, inverse, chunk=500):
    """Inverse-mapping bilinear warp: out[k, y, x] = images[k] sampled at inverse[k] · (y, x, 1)
    (pixel centres at integer coordinates, zero outside), float64. `images`: (n, H, W)
    numbers, `inverse`: (n, 2, 3) (inverse_maps'). An integer source point (the identity)
    reads its pixel exactly. `chunk` images at a time (the same values; ~1.5x faster than
    all at once, their temporaries staying in cache)."""
    images = np.asarray(images, np.float64)
    n, h, w = images.shape
    ys, xs = np.meshgrid(np.arange(h, dtype=np.float64), np.arange(w, dtype=np.float64), indexing="ij")
    # A zero border of two pixels: a sample's corners outside the image are clipped into it,
    # so they read zeros (both corners of a sample beyond the image's edge row).
    padded = np.pad(images, ((0, 0), (2, 2), (2, 2))).reshape(n, -1)     # (n, (H + 4) · (W + 4))
    out = np.empty((n, h, w))
    for start in range(0, n, chunk):
        inv = inverse[start:start + chunk, :, :, None, None]                # (b, 2, 3, 1, 1)
        flat = padded[start:start + chunk]
        sy = inv[:, 0, 0] * ys + inv[:, 0, 1] * xs + inv[:, 0, 2]            # (b, H, W) source rows
        sx = inv[:, 1, 0] * ys + inv[:, 1, 1] * xs + inv[:, 1, 2]            # (b, H, W) source columns
        y0, x0 = np.floor(sy), np.floor(sx)
        fy, fx = sy - y0, sx - x0
        # Rows and columns in the padded image, clipped into its zero border.
        y0 = np.clip(y0, -2, h).astype(np.int64) + 2
        x0 = np.clip(x0, -2, w).astype(np.int64) + 2
        y1, x1 = y0 + 1, x0 + 1
        rows = np.arange(len(flat))[:, None, None]

        def at(yy, xx):
            return flat[rows, yy * (w + 4) + xx]

        out[start:start + chunk] = ((1.0 - fy) * ((1.0 - fx) * at(y0, x0) + fx * at(y0, x1))
                                    + fy * ((1.0 - fx) * at(y1, x0) + fx * at(y1, x1)))
    return out


def _digit_boxes(images):
    """Each image's box of non-zero pixels, widened by one pixel on every side (how far a
    bilinear sample still reads them): (top, bottom, left, right) float64 (n,); an empty
    image: its centre."""
    n, h, w = images.shape
    rows, cols = images.any(axis=2), images.any(axis=1)                  # (n, H), (n, W)
    empty = ~rows.any(axis=1)
    top = np.where(empty, (h - 1) / 2, rows.argmax(axis=1) - 1.0)
    bottom = np.where(empty, (h - 1) / 2, h - rows[:, ::-1].argmax(axis=1))
    left = np.where(empty, (w - 1) / 2, cols.argmax(axis=1) - 1.0)
    right = np.where(empty, (w - 1) / 2, w - cols[:, ::-1].argmax(axis=1))
    return top, bottom, left, right


def _translation_range(matrix, boxes, size):
    """For each digit, the translations (t_y, t_x) that keep its transformed box (boxes, on
    the canvas, about its centre c) within the canvas' pixel centres [0, size - 1]:
    ((low_y, high_y), (low_x, high_x)); where the box is wider than the canvas, both ends
    are the translation that centres it."""
    m_yy, m_yx, m_xy, m_xx = matrix
    c = (size - 1) / 2.0
    top, bottom, left, right = (b - c for b in boxes)
    corners = [(y, x) for y in (top, bottom) for x in (left, right)]
    ys = np.stack([m_yy * y + m_yx * x for y, x in corners])             # (4, n) offsets from c
    xs = np.stack([m_xy * y + m_xx * x for y, x in corners])
    ranges = []
    for offsets in (ys, xs):
        low, high = -c - offsets.min(axis=0), c - offsets.max(axis=0)
        middle = (low + high) / 2.0
        fits = low <= high
        ranges.append((np.where(fits, low, middle), np.where(fits, high, middle)))
    return ranges


def affine_digits(images, seed=AFFINE_TEST_SEED, pad_pixels=6):
    """Each digit of `images` (uint8 (n, H, W) or (n, H, W, 1)) centred on a canvas of
    H + 2 · pad_pixels (affNIST: 28 + 12 = 40) and transformed by one affine map in affNIST's
    ranges (affine_parameters of `seed`), translated to a uniform place among those that
    keep its box of ink inside the canvas. Returns (uint8 (n, H', W', 1), parameters: the
    draws plus "translate_y", "translate_x", the translation used)."""
    images = np.asarray(images)
    if images.ndim == 4 and images.shape[-1] == 1:
        images = images[..., 0]
    if images.ndim != 3 or images.dtype != np.uint8 or images.shape[1] != images.shape[2]:
        raise DataError(f"affine_digits takes square uint8 digits (n, H, H[, 1]), got {images.dtype} {images.shape}")
    p = int(pad_pixels)
    canvas = np.pad(images, ((0, 0), (p, p), (p, p)))                    # (n, H', H'), the digit centred
    size = canvas.shape[1]
    params = affine_parameters(len(canvas), seed)
    matrix = linear_part(params["rotate_degrees"], params["shear"], params["scale_y"], params["scale_x"])
    (low_y, high_y), (low_x, high_x) = _translation_range(matrix, _digit_boxes(canvas), size)
    params["translate_y"] = low_y + (high_y - low_y) * params["place_y"]
    params["translate_x"] = low_x + (high_x - low_x) * params["place_x"]
    warped = warp_bilinear(canvas, inverse_maps(matrix, (params["translate_y"], params["translate_x"]), size))
    return np.clip(np.rint(warped), 0, 255).astype(np.uint8)[..., None], params
