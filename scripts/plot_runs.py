"""PNG plots of training runs, made from the TensorBoard event files that train() writes.

    .venv/bin/python scripts/plot_runs.py RUN_DIR [RUN_DIR ...] --out DIR [--names a,b]
    .venv/bin/python scripts/plot_runs.py /tmp/acc/mnist /tmp/acc/fashion \\
        --names paper_mnist,paper_fashion_mnist --out docs/img

Writes into --out (created if missing), and prints each path written:
- `curves.png`: test accuracy per tested epoch, every epoch on the axis (left), train (solid) /
  test (dashed) total loss (middle, log scale) and training speed in images/s (right: the
  logged windows, train/images_per_sec, and the run's mean in the legend), every run overlaid,
  one colour per run, every point marked; one legend under the panels, a line per run: its name
  (shortened: short_names), last and best accuracy, mean images/s. The run's mean is train/mean_images_per_sec's last
  value (metrics.json's images_per_sec: the mean of its epochs' speeds), or for a run that
  did not write it, the mean of its windows.
  A run that kept a moving average of its weights (train.ema_decay) tests the average;
  its trained weights' test accuracy (test/raw_accuracy) is the dotted line of its colour.
- `<name>_reconstructions.png` per run: the last tested epoch's
  `reconstructions/inputs_over_reconstructions` image (test inputs over their
  reconstructions), as TensorBoard shows it. Skipped, with a note on stderr, for a run
  trained without the decoder (it has no such image).

Run names default to the run directories' names; `--names` gives one per run dir, in
order. They become file names, so they must be unique and plain (letters, digits, `._-`).

Only the event files are read (not history.jsonl), so the plots show what TensorBoard
shows. A resumed run has one event file per process, read in the order they were
started; where a resumed run wrote a step again (the epoch a killed process did not
finish), the later value replaces the earlier ones from that step on, as TensorBoard does.
A run dir without event files, or whose events hold no test accuracy, is a user error:
`error: ...` on one line, exit status 2.
"""
import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a clone without `pip install -e .` too

from capsnet.cli import fail, import_tensorflow_quietly  # noqa: E402  (as train.py does)

ACCURACY_TAG = "test/accuracy"
EPOCH_TAG = "time/train_seconds"  # written at the end of every epoch, tested or not
RAW_ACCURACY_TAG = "test/raw_accuracy"  # the trained weights' of a run with train.ema_decay > 0
LOSS_TAGS = {"train": "train/loss", "test": "test/loss"}
SPEED_TAG = "train/images_per_sec"           # one log window's training speed
RUN_SPEED_TAG = "train/mean_images_per_sec"  # the run's mean so far, after every epoch
IMAGE_TAG = "reconstructions/inputs_over_reconstructions"
EVENT_GLOB = "events.out.tfevents.*"
DPI = 100
NAME_PATTERN = re.compile(r"^[A-Za-z0-9._+-]+$")  # run dir names join their overrides with "+"


# --------------------------------------------------------------------------- reading

def event_files(run_dir):
    """run_dir's event files in the order their writers started.

    The name holds the writer's start time (`events.out.tfevents.<unix time>.<host>.<pid>...`);
    sorting on it, not on mtime, keeps the order when a run dir was copied (which resets mtimes).
    """
    def start_time(path):
        parts = path.name.split(".")
        return (int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else 0, path.name)

    return sorted((p for p in Path(run_dir).glob(EVENT_GLOB) if p.is_file()), key=start_time)


def check_run_dir(run_dir):
    """run_dir's event files; FileNotFoundError naming the path if it has none or is no dir."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run dir {run_dir} does not exist or is not a directory")
    files = event_files(run_dir)
    if not files:
        raise FileNotFoundError(f"no TensorBoard event files ({EVENT_GLOB}) in {run_dir}")
    return files


def _summary_values(path):
    """(step, Summary.Value) of one event file, up to a record cut short.

    A file whose writer was killed mid-record ends in a partial record, on which
    tf.data raises DataLossError: everything before it is still good.
    """
    import tensorflow as tf

    try:
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                yield event.step, value
    except tf.errors.DataLossError:
        return


def purge_rewritten_steps(points):
    """[(step, x), ...] in write order → the points TensorBoard would show, sorted by step.

    A point whose step is not beyond the previous one starts a rewrite (a resumed run
    repeating the epoch its predecessor did not finish): the earlier points from that
    step on are dropped, so each step keeps its latest value and the curve stays continuous.
    """
    kept = []
    for step, x in points:
        while kept and kept[-1][0] >= step:
            kept.pop()
        kept.append((step, x))
    return kept


def read_run(run_dir):
    """{tag: [(step, Summary.Value), ...]} of run_dir's event files, rewritten steps purged.

    Raises FileNotFoundError (with the path) for a missing dir or one without event files.
    """
    files = check_run_dir(run_dir)
    events = {}
    for path in files:
        for step, value in _summary_values(path):
            events.setdefault(value.tag, []).append((step, value))
    return {tag: purge_rewritten_steps(points) for tag, points in events.items()}


def scalar_series(events, tag):
    """(steps, values) of a scalar tag as float lists; empty lists if the tag is absent."""
    import tensorflow as tf

    points = events.get(tag, [])
    # TF2 summaries store scalars as tensors; TF1-style ones in simple_value.
    values = [float(tf.make_ndarray(v.tensor)) if v.HasField("tensor") else float(v.simple_value)
              for _, v in points]
    return [step for step, _ in points], values


def last_image(events, tag=IMAGE_TAG):
    """(step, uint8 array (height, width, channels)) of the last image written under tag, or None."""
    import tensorflow as tf

    points = events.get(tag)
    if not points:
        return None
    step, value = points[-1]
    # An image summary's tensor is [width, height, png_1, ...]; train() writes one image.
    encoded = tf.make_ndarray(value.tensor)  # (2 + images,) bytes
    if encoded.shape[0] < 3:
        return None
    return step, tf.io.decode_png(encoded[2]).numpy()  # (height, width, channels)


def load_run(run_dir):
    """What the plots need from one run: epochs and accuracy, losses on an epoch axis, the image.

    The x axis is epochs: an epoch's scalars are written at step epoch * steps_per_epoch, the
    time/ ones every epoch and the test/ ones every train.test_every_epochs-th and the last, so
    a test point at step s is epoch s / steps_per_epoch, and so are the train losses, logged by
    global step.
    """
    events = read_run(run_dir)
    acc_steps, accuracy = scalar_series(events, ACCURACY_TAG)
    if not acc_steps:
        raise ValueError(f"the event files in {run_dir} hold no '{ACCURACY_TAG}' scalars "
                         f"(tags found: {', '.join(sorted(events)) or 'none'})")
    # Runs written before the time/ scalars existed tested every epoch: their test steps are the epochs'.
    epoch_steps = scalar_series(events, EPOCH_TAG)[0] or acc_steps
    # The spacing, not the count: a run begun before those scalars and resumed after has them late.
    gaps = [b - a for a, b in zip(epoch_steps, epoch_steps[1:])]
    steps_per_epoch = min(gaps) if gaps else epoch_steps[0]
    losses = {}
    for split, tag in LOSS_TAGS.items():
        steps, values = scalar_series(events, tag)
        losses[split] = ([s / steps_per_epoch for s in steps], values)
    speed_steps, speeds = scalar_series(events, SPEED_TAG)
    run_speed = scalar_series(events, RUN_SPEED_TAG)[1]
    image = last_image(events)
    return {
        "epochs": [round(step / steps_per_epoch) for step in acc_steps],
        "accuracy": accuracy,
        "raw_accuracy": scalar_series(events, RAW_ACCURACY_TAG)[1],  # [] without a weight average
        "losses": losses,
        "images_per_sec": ([s / steps_per_epoch for s in speed_steps], speeds),
        # The run's mean: as written by train(), else (older runs) the windows' mean; None without either.
        "mean_images_per_sec": run_speed[-1] if run_speed else (sum(speeds) / len(speeds) if speeds else None),
        "image": image,  # (step, array) or None
        "image_epoch": None if image is None else round(image[0] / steps_per_epoch),
    }


# --------------------------------------------------------------------------- plotting

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def accuracy_limits(runs):
    """The accuracy axis's (low, high) in %: every tested epoch of every run inside it, the
    first ones too (a low first epoch stretches the axis, but a dropped point would hide
    a run that starts slowly or collapses)."""
    all_acc = [100 * a for run in runs.values() for a in run["accuracy"] + run["raw_accuracy"]]
    low, high = min(all_acc), max(all_acc)
    pad = max(0.1, 0.05 * (high - low))
    return low - pad, min(100.0, high + pad) + pad / 2


LABEL_CHARS = 48  # a run's name in the legend, at most: longer auto-generated names are shortened


def short_names(names):
    """Run names for the legend: the run dir's time prefix (`10-00-00_`) and the overrides all
    runs share (`custom_op-true` of `10-00-00_custom_op-true+seed-1` beside `..._custom_op-true+seed-2`)
    left out, and what is still longer than LABEL_CHARS cut in the middle ("…"). Names left
    equal (or empty) by that are kept whole."""
    parts = [re.sub(r"^\d\d-\d\d-\d\d_", "", name).split("+") for name in names]
    shared = set.intersection(*map(set, parts)) if len(parts) > 1 else set()
    short = ["+".join(p for p in part if p not in shared) or "+".join(part) for part in parts]
    short = [s if len(s) <= LABEL_CHARS else s[:LABEL_CHARS // 2 - 1] + "…" + s[-(LABEL_CHARS // 2):]
             for s in short]
    return short if len(set(short)) == len(short) and all(short) else list(names)


def curves_figure(runs):
    """runs: {name: load_run(...)} → (the curves' figure, the accuracy axis's limits). One
    legend for the three panels, under them and inside the figure (a run's colour, name, last
    and best accuracy, mean images/s: one line each), so that long run names neither cover the
    curves nor run off the image; every point has a marker, so a run of one epoch shows."""
    plt = _pyplot()
    rows = len(runs) + sum(1 for run in runs.values() if run["raw_accuracy"])
    fig, (ax_acc, ax_loss, ax_speed) = plt.subplots(1, 3, figsize=(12, 4 + 0.18 * rows), dpi=DPI,
                                                    layout="constrained")
    for k, (name, run) in enumerate(zip(short_names(list(runs)), runs.values())):
        color = f"C{k % 10}"
        accuracy = [100 * a for a in run["accuracy"]]
        speed = "" if run["mean_images_per_sec"] is None else f", mean {run['mean_images_per_sec']:,.1f} images/s"
        ax_acc.plot(run["epochs"], accuracy, "o-", color=color, lw=1.2, ms=3,
                    label=f"{name} (last {accuracy[-1]:.2f}%, best {max(accuracy):.2f}%{speed})")
        if run["raw_accuracy"]:
            raw = [100 * a for a in run["raw_accuracy"]]
            ax_acc.plot(run["epochs"][:len(raw)], raw, "o:", color=color, lw=1.0, ms=2,
                        label=f"{name}, trained weights (last {raw[-1]:.2f}%)")
        for split, style in (("train", "-"), ("test", "o--")):
            x, y = run["losses"][split]
            if x:
                ax_loss.plot(x, y, style, color=color, lw=1.0, ms=3)
        x, y = run["images_per_sec"]
        if x:
            ax_speed.plot(x, y, ".-", color=color, lw=1.0, ms=3)
    ax_acc.set(title="test accuracy", xlabel="epoch", ylabel="accuracy (%)")
    ax_acc.xaxis.get_major_locator().set_params(integer=True)  # tested epochs: whole numbers
    limits = accuracy_limits(runs)
    ax_acc.set_ylim(*limits)
    ax_loss.set(title="total loss (train solid, test dashed)", xlabel="epoch", ylabel="loss", yscale="log")
    ax_speed.set(title="training speed", xlabel="epoch", ylabel="images/s")
    ax_speed.set_ylim(bottom=0)  # speeds compared as ratios: from zero
    for ax in (ax_acc, ax_loss, ax_speed):
        ax.grid(True, alpha=0.3)
    fig.legend(*ax_acc.get_legend_handles_labels(), loc="outside lower center", fontsize=8, frameon=False)
    return fig, limits


def plot_curves(runs, path):
    """runs: {name: load_run(...)} → curves.png at path; returns the accuracy axis's limits."""
    fig, limits = curves_figure(runs)
    fig.savefig(path, dpi=DPI)
    _pyplot().close(fig)
    return limits


def plot_reconstructions(name, run, path):
    """The run's last reconstruction grid → path, upscaled without smoothing, titled."""
    plt = _pyplot()
    _, image = run["image"]
    height, width = image.shape[:2]
    # ~8 inches wide at most; the grid's own aspect plus room for the title.
    scale = min(8.0 / width, 4.0 / height) * DPI
    fig = plt.figure(figsize=(width * scale / DPI, height * scale / DPI + 0.3), dpi=DPI)
    ax = fig.add_axes((0, 0, 1, height * scale / DPI / (height * scale / DPI + 0.3)))
    shown = image[..., 0] if image.shape[-1] == 1 else image
    ax.imshow(shown, cmap="gray", vmin=0, vmax=255, interpolation="nearest")
    ax.axis("off")
    fig.suptitle(f"{name}, epoch {run['image_epoch']}: test inputs (top) over reconstructions (bottom)",
                 fontsize=9, y=0.97)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


# --------------------------------------------------------------------------- main

def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", type=Path)
    parser.add_argument("--out", required=True, type=Path, help="directory for the PNGs (created)")
    parser.add_argument("--names", help="comma-separated run names, one per RUN_DIR (default: dir names)")
    args = parser.parse_args(argv)
    names = args.names.split(",") if args.names else [p.resolve().name for p in args.run_dirs]
    if len(names) != len(args.run_dirs):
        fail(f"--names has {len(names)} names for {len(args.run_dirs)} run dirs")
    for name in names:
        if not NAME_PATTERN.match(name):
            fail(f"run name {name!r} is not a plain file name (letters, digits, '._+-')")
    if len(set(names)) != len(names):
        fail(f"run names must be unique (got {', '.join(names)}); pass --names")
    args.names = names
    return args


def main(argv=None):
    # Argument and path errors before the seconds-long TensorFlow import.
    args = parse_args(argv)
    for run_dir in args.run_dirs:
        try:
            check_run_dir(run_dir)
        except FileNotFoundError as exc:
            fail(exc)
    import_tensorflow_quietly()
    runs = {}
    for name, run_dir in zip(args.names, args.run_dirs):
        try:
            runs[name] = load_run(run_dir)
        except (FileNotFoundError, ValueError) as exc:
            fail(exc)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot create output dir {args.out}: {exc.strerror}")

    written = [args.out / "curves.png"]
    plot_curves(runs, written[0])
    for name, run in runs.items():
        if run["image"] is None:
            print(f"note: {name} has no '{IMAGE_TAG}' image (trained without the decoder?)", file=sys.stderr)
            continue
        written.append(args.out / f"{name}_reconstructions.png")
        plot_reconstructions(name, run, written[-1])
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
