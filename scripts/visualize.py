"""PNG figures of what a trained run learned (capsnet.figures draws them, `run_figures` reads the run).

    .venv/bin/python scripts/visualize.py RUN_DIR [--out DIR] [--which best|latest] [--examples N]

RUN_DIR: a run dir or a checkpoint path, as evaluate.py takes it (a run dir's default checkpoint
too: best/ where the run held out a validation split, else latest/; named on stderr); the
model is rebuilt from the run's config.yaml and its test split read from the run's data.dir. The first N test
examples (default 200: the paper's CapsNet forward on them is most of the run's ~20 s on a
2-core CPU) go through the model. Writes into --out (default RUN_DIR/figures,
created if missing), and prints each path written:
- `perturbation_<class>.png` (a CapsNet with a decoder): the paper's Fig. 4 for the class's
  first test example: a row per digit-capsule dimension, a column per amount added to it
  (-0.25 to 0.25 by 0.05), each the decoder's image (16 x 11 tiles of H x W pixels);
- `reconstructions.png`: one test example per class over its reconstruction;
- `routing.png` (a CapsNet): the final coupling coefficients c_ij of four of those examples,
  per class, on the primary-capsule grid (the mean over capsule types at a position);
- `lengths.png`: each class example's capsule lengths (the CNN baseline: class probabilities);
- `confusion.png`: the confusion matrix of the N examples.
A figure a model cannot have (no decoder, the CNN baseline) is left out with a note on stderr.
A bad run dir or checkpoint is `error: ...` on one line, exit status 2.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a clone without `pip install -e .` too

from capsnet.cli import fail, import_tensorflow_quietly  # noqa: E402  (as train.py does)
from capsnet.errors import CapsnetError, ConfigError  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run dir or checkpoint path (as evaluate.py's checkpoint=)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: RUN_DIR/figures)")
    parser.add_argument("--which", choices=("best", "latest"), default=None,
                        help="in a run dir: its best or latest checkpoint (default: evaluate.py's, best where the "
                             "run held out a validation split, else latest)")
    parser.add_argument("--examples", type=int, default=200, help="test examples through the model (default 200)")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error(f"--examples must be at least 1, got {args.examples}")
    if args.out is None:
        args.out = (args.run_dir if args.run_dir.is_dir() else args.run_dir.parent) / "figures"
    return args


def file_name(name):
    """A figure's name as a file name: perturbation/3 → perturbation_3.png (class names made plain)."""
    return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name) + ".png"


def run_figures(checkpoint, *, which=None, examples=200, batch_size=100):
    """model_figures of a trained run: `checkpoint` a run dir or checkpoint path, resolved and
    its model rebuilt from its config.yaml as evaluate.py does (the run's weights: its
    average where it kept one), over the first `examples` examples of its test split.
    Returns (FigureSet, the checkpoint prefix read)."""
    # TensorFlow's modules: imported once main() has checked the path (a bad one answers at once).
    from capsnet.evaluation import load_run_test_split, resolve_member
    from capsnet.figures import model_figures
    from capsnet.tasks import task_for
    from capsnet.training.checkpoints import restore_model
    from capsnet.training.model_setup import build_capsnet

    member = resolve_member(str(checkpoint), which=which, custom_op=False, weights=None, xla="none")
    data_cfg = dict(member["cfg"]["data"])
    data_cfg["limit_test"] = min(data_cfg.get("limit_test") or examples, examples)
    task = task_for(data_cfg)
    if task.label_format.targets:
        raise ConfigError(f"the run {member['run_dir']} trained on two-digit images ({task.name}): the figures "
                          "need one label per example")
    model = build_capsnet(member["cfg"]["model"], False)
    restore_model(model, member["prefix"], member["weights"])
    split = load_run_test_split(task, from_run=True, run_dir=member["run_dir"])
    batches = [(x.numpy(), y.numpy()) for x, y, *_ in task.dataset(split, batch_size=batch_size, training=False)]
    images, labels = (np.concatenate(part) for part in zip(*batches))
    figures = model_figures(model, images, labels, class_names=task.class_names(model.num_classes),
                            batch_size=batch_size)
    return figures, member["prefix"]


def main(argv=None):
    args = parse_args(argv)
    if not args.run_dir.exists():  # before the seconds-long TensorFlow import
        fail(f"run dir or checkpoint {args.run_dir} does not exist")
    import_tensorflow_quietly()
    from capsnet.figures import encode_png  # TensorFlow's: imported above, quietly

    try:
        figures, prefix = run_figures(args.run_dir, which=args.which, examples=args.examples)
    except CapsnetError as exc:
        fail(exc)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot create output dir {args.out}: {exc.strerror}")
    print(f"figures of {prefix} on the first {args.examples} test examples (all where there are fewer)",
          file=sys.stderr)
    for note in figures.notes:
        print(f"note: {note}", file=sys.stderr)
    written = []
    for name, image in figures.images.items():
        path = args.out / file_name(name)
        try:
            path.write_bytes(encode_png(image))
        except OSError as exc:
            fail(f"cannot write {path}: {exc.strerror}")
        written.append(path)
        print(path)
    return written


if __name__ == "__main__":
    main()
