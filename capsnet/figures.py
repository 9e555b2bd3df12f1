"""What a trained model learned, as pictures: scripts/visualize.py writes them as PNG files,
RunSummaries.figures puts them into TensorBoard at the end of training.

- `perturbation_images`: the paper's Fig. 4 (Sabour et al. 2017, sec. 5.1): each of a
  digit capsule's dimensions moved by PERTURBATIONS (-0.25 to 0.25 by 0.05), the others
  kept, reconstructed through the decoder; `tile` lays them out, a row per dimension.
- `image_grid`: inputs over their reconstructions (TensorBoard's test/reconstructions, every epoch).
- `routing_maps`: the final coupling coefficients c_ij of an example laid out on the
  primary-capsule grid, one map per class (the mean over the capsule types at a position).
- `model_figures`: all of them for a model and a batch of labelled test examples, each an
  image array ready for a PNG (matplotlib draws the charts: routing, lengths, confusion).

The model and examples are the caller's; nothing here reads a config or a run dir.
"""
import io

import numpy as np
import tensorflow as tf

from capsnet.scoring import score

__all__ = ["PERTURBATIONS", "FigureSet", "model_figures", "perturbed_capsules", "perturbation_images", "displayable", "tile",
           "routing_maps", "class_examples", "confusion_counts", "encode_png", "image_grid"]

# The added amounts, one column each: -0.25, -0.20, ..., 0.25 (11 steps; the paper's range and interval).
PERTURBATIONS = np.round(np.arange(-5, 6) * 0.05, 2)


def class_examples(labels, num_classes):
    """The index of the first example of each class in `labels` (N,), or None where a class has none."""
    labels = np.asarray(labels)
    return [int(np.argmax(labels == k)) if np.any(labels == k) else None for k in range(num_classes)]


def image_grid(images, reconstructions):
    """Inputs over reconstructions: two rows of N tiles, (N, H, W, C) x 2 → (1, 2H, N·W, C)."""
    images = np.asarray(images, np.float32)
    reconstructions = np.asarray(reconstructions, np.float32)
    if images.ndim != 4 or images.shape != reconstructions.shape:
        raise ValueError(f"image_grid: need two (N, H, W, C) arrays of one shape, got "
                         f"{images.shape} and {reconstructions.shape}")
    n, h, w, c = images.shape
    rows = np.stack([images, reconstructions])                        # (2, N, H, W, C)
    grid = rows.transpose(0, 2, 1, 3, 4).reshape(2 * h, n * w, c)     # (2H, N·W, C)
    return np.clip(grid, 0.0, 1.0)[None]                              # (1, 2H, N·W, C)


def confusion_counts(labels, predictions, num_classes):
    """(num_classes, num_classes) int64 counts: rows the true class, columns the predicted one
    (capsnet.scoring.score's matrix)."""
    return np.asarray(score(labels, predictions, num_classes)["confusion_matrix"], np.int64)


def perturbed_capsules(v_j, label, steps=PERTURBATIONS):
    """One example's digit capsules v_j (classes, dim) copied once per (dimension d, step s),
    with steps[s] added to v_j[label, d]: (dim · len(steps), classes, dim), row-major in (d, s)."""
    v_j = np.asarray(v_j, np.float32)
    classes, dim = v_j.shape
    steps = np.asarray(steps, np.float32)
    out = np.repeat(v_j[None], dim * len(steps), axis=0).reshape(dim, len(steps), classes, dim)
    out[np.arange(dim), :, label, np.arange(dim)] += steps[None, :]          # (dim, S) moved entries
    return out.reshape(dim * len(steps), classes, dim)


def perturbation_images(model, v_j, label, steps=PERTURBATIONS):
    """The decoder's image of each perturbed_capsules copy (masked by `label`, as in training):
    (dim, len(steps), H, W, C) in [0, 1]."""
    capsules = perturbed_capsules(v_j, label, steps)                          # (dim·S, classes, dim)
    labels = tf.fill([len(capsules)], tf.constant(int(label), tf.int32))
    images = model.decoder(tf.constant(capsules), labels).numpy()             # (dim·S, H, W, C)
    return images.reshape(v_j.shape[-1], len(steps), *images.shape[1:])


def displayable(image):
    """`image` in [0, 1] for drawing: as it is when it already lies there, else stretched from
    its own minimum and maximum (inputs under data.standardize are per-image standardised,
    about -3 to 3, which a [0, 1] drawing would clip to black and white)."""
    image = np.asarray(image, np.float32)
    low, high = float(image.min()), float(image.max())
    if low >= 0.0 and high <= 1.0:
        return image
    return (image - low) / (high - low) if high > low else np.zeros_like(image)


def tile(images):
    """(R, S, H, W, C) → one (R·H, S·W, C) picture, row r holding images[r]."""
    rows, cols, h, w, c = images.shape
    return images.transpose(0, 2, 1, 3, 4).reshape(rows * h, cols * w, c)


def primary_grid(model):
    """(H', W', types): where each of the model's primary capsules sits (PrimaryCaps' order:
    i = (h·W' + w)·types + t)."""
    if hasattr(model, "primary_grid"):  # capsnet.deep.DeepCapsNet: its stem's map, a 'same' PrimaryCaps
        return model.primary_grid()
    conv1_shape = model.conv1.compute_output_shape((None, *model.image_shape))   # (B, H1, W1, filters)
    # The capsules' grid is PrimaryCaps' 'valid' conv output: (H1 - k) // s + 1 per side.
    k, s = model.primary_caps_kernel_size, model.primary_caps_strides
    grid_h, grid_w = ((d - k) // s + 1 for d in conv1_shape[1:3])
    return grid_h, grid_w, model.primary_caps_types


def routing_maps(c_ij, grid):
    """One example's c_ij (in_caps, classes) → (classes, H', W'): the mean coupling to each
    class over the capsule types at each grid position."""
    h, w, types = grid
    c_ij = np.asarray(c_ij).reshape(h, w, types, -1)                          # (H', W', types, classes)
    return c_ij.mean(axis=2).transpose(2, 0, 1)                               # (classes, H', W')


def encode_png(image):
    """A (H, W, C) float image in [0, 1] (C 1, 3 or 4) or uint8 as PNG bytes."""
    image = np.asarray(image)
    if image.dtype != np.uint8:
        image = np.round(np.clip(image, 0.0, 1.0) * 255).astype(np.uint8)
    return tf.io.encode_png(image).numpy()


class FigureSet:
    """model_figures' result: `images` {name: (H, W, C) uint8 or float in [0, 1]} in the
    order drawn, and `notes`, one line for each figure left out and why."""

    def __init__(self):
        self.images, self.notes = {}, []


def _outputs(model, images, batch_size):
    """The model's test-time outputs (no labels: the decoder reconstructs the prediction) of
    `images` in batches, as NumPy arrays concatenated."""
    call = tf.function(lambda x: model(x, training=False), reduce_retracing=True)
    parts = [call(tf.constant(images[i:i + batch_size])) for i in range(0, len(images), batch_size)]
    return {key: np.concatenate([p[key].numpy() for p in parts]) for key in parts[0]}


def model_figures(model, images, labels, *, class_names=None, batch_size=100, routing_examples=4):
    """The figures of `model` (a CapsNet or the CNN baseline, weights loaded) on test examples
    `images` (N, H, W, C) float and `labels` (N,) int: a FigureSet.

    perturbation/<class> (CapsNet with a decoder): the Fig. 4 grid of the class's first example
    (16 rows of dimensions × 11 steps); reconstructions: inputs over reconstructions, one per
    class; routing: c_ij maps of the first `routing_examples` classes' examples; lengths: each
    class example's capsule lengths (the CNN: its class probabilities); confusion: the
    confusion matrix of all N.
    """
    images, labels = np.asarray(images, np.float32), np.asarray(labels).astype(np.int64)
    num_classes = int(model.num_classes)
    names = [str(k) for k in range(num_classes)] if class_names is None else [str(n) for n in class_names]
    figures = FigureSet()
    outputs = _outputs(model, images, batch_size)
    predictions = outputs["lengths"].argmax(axis=-1)
    chosen = [(k, i) for k, i in enumerate(class_examples(labels, num_classes)) if i is not None]
    capsules = "v_j" in outputs
    if not capsules:
        figures.notes.append("perturbation, reconstructions, routing: left out, the model (a CNN) has no capsules, "
                             "decoder or routing (its lengths figure shows class probabilities)")
    elif getattr(model, "decoder", None) is None:
        figures.notes.append("perturbation, reconstructions: left out, the model has no decoder (model.decoder=false)")
    else:
        for k, i in chosen:
            figures.images[f"perturbation/{names[k]}"] = tile(perturbation_images(model, outputs["v_j"][i], k))
        shown = np.stack([displayable(images[i]) for _, i in chosen])
        figures.images["reconstructions"] = image_grid(shown, np.stack([outputs["reconstructions"][i]
                                                                        for _, i in chosen]))[0]
    if capsules:
        grid = primary_grid(model)
        picks = chosen[:routing_examples]
        figures.images["routing"] = _render(_routing_chart, [images[i] for _, i in picks],
                                            [routing_maps(outputs["c_ij"][i], grid) for _, i in picks],
                                            [(names[k], names[predictions[i]]) for k, i in picks], names)
    figures.images["lengths"] = _render(_lengths_chart, [outputs["lengths"][i] for _, i in chosen],
                                        [names[k] for k, _ in chosen], names, capsules)
    figures.images["confusion"] = _render(_confusion_chart, confusion_counts(labels, predictions, num_classes),
                                          names)
    return figures


# --------------------------------------------------------------------------- charts (matplotlib)

def _render(draw, *args):
    """draw(figure, *args) on a new matplotlib figure → (H, W, 4) uint8 RGBA (a PNG's pixels)."""
    import matplotlib  # noqa: PLC0415  (a charting dependency only the figures need)

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure  # noqa: PLC0415

    figure = Figure(dpi=80)
    draw(figure, *args)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return tf.io.decode_png(buffer.getvalue(), channels=4).numpy()


def _routing_chart(figure, images, maps, titles, names):
    """A row per example: the input, then its c_ij maps side by side, one per class."""
    rows, classes = len(images), len(names)
    figure.set_size_inches(2 + 1.1 * classes, 1.4 * rows + 0.6)
    axes = figure.subplots(rows, 2, squeeze=False, gridspec_kw={"width_ratios": [1, classes]})
    for r in range(rows):
        axes[r, 0].imshow(np.squeeze(displayable(images[r])), cmap="gray", vmin=0, vmax=1)
        axes[r, 0].set_title(f"label {titles[r][0]}, pred {titles[r][1]}", fontsize=7)
        h, w = maps[r].shape[1:]
        # The class maps side by side, a one-pixel gap (NaN: blank) between them.
        strip = np.full((h, classes * (w + 1) - 1), np.nan)
        for k in range(classes):
            strip[:, k * (w + 1):k * (w + 1) + w] = maps[r][k]
        # The example's own range: near-uniform couplings (1/classes) would all look one colour on [0, 1].
        shown = axes[r, 1].imshow(strip, cmap="viridis", vmin=np.nanmin(strip), vmax=np.nanmax(strip))
        axes[r, 1].set_xticks([k * (w + 1) + (w - 1) / 2 for k in range(classes)], names, fontsize=7)
        axes[r, 1].set_yticks([])
        figure.colorbar(shown, ax=axes[r, 1], fraction=0.02)
        axes[r, 0].axis("off")
    figure.suptitle("c_ij: coupling of the primary capsules at each grid position to each class "
                    "(mean over capsule types)", fontsize=8)


def _lengths_chart(figure, lengths, titles, names, capsules):
    """One axes (ten would take seconds of matplotlib's text layout): a group of bars per
    example, its length (or probability) for each class, the labelled class's bar orange."""
    count, classes = len(lengths), len(names)
    figure.set_size_inches(1.0 + 0.12 * count * (classes + 2), 3.0)
    ax = figure.subplots()
    width = 1.0 / (classes + 2)
    for n in range(count):
        x = n + width * (np.arange(classes) - (classes - 1) / 2)
        ax.bar(x, lengths[n], width=width, color=["C1" if name == titles[n] else "C0" for name in names])
    ax.set_ylim(0, 1)
    ax.set_xticks(range(count), [f"label {t}" for t in titles], fontsize=7)
    ax.set_xlim(-0.6, count - 0.4)
    what = "capsule lengths |v_j|" if capsules else "class probabilities (softmax)"
    ax.set_title(f"{what} of each class's first test example: one bar per class in class order, the label's orange",
                 fontsize=8)


# The confusion matrix's axes: a cell's side, about the width of a character of the 7-point
# class names, and how many characters of a name are written (a folder's classes can be long).
_CELL_INCHES = 0.45
_CHAR_INCHES = 0.06
_TICK_CHARS = 24


def _short_name(name, limit=_TICK_CHARS):
    """`name` cut in the middle to `limit` characters (… marks the cut): classes that differ
    only at the end ("..._017", "... number 12") stay apart."""
    if len(name) <= limit:
        return name
    head = (limit - 1) // 2
    return name[:head] + "…" + name[len(name) - (limit - 1 - head):]


def _confusion_chart(figure, confusion, names):
    """The confusion matrix with its counts written in. The class names are cut to _TICK_CHARS,
    the figure grows by the longest one's width, and the predicted ones are written upright
    where one is wider than a cell (side by side they would run into each other)."""
    k = len(names)
    labels = [_short_name(name) for name in names]
    label_inches = _CHAR_INCHES * max(map(len, labels))
    upright = label_inches > _CELL_INCHES
    figure.set_size_inches(1.2 + _CELL_INCHES * k + label_inches,
                           1.0 + _CELL_INCHES * k + (label_inches if upright else 0))
    ax = figure.subplots()
    ax.imshow(confusion, cmap="Blues")
    for (r, c), count in np.ndenumerate(confusion):
        if count:
            ax.text(c, r, str(count), ha="center", va="center", fontsize=6,
                    color="white" if count > confusion.max() / 2 else "black")
    ax.set_xticks(range(k), labels, fontsize=7, rotation=90 if upright else 0)
    ax.set_yticks(range(k), labels, fontsize=7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"confusion ({int(confusion.sum())} test examples)", fontsize=9)
    figure.tight_layout()
