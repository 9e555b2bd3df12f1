"""Digits to try predict.py on: test images of the MNIST sample in the package
(capsnet/sample_data/mnist_sample.npz) written as 28x28 grey PNG files.

    .venv/bin/python scripts/sample_digits.py my_digits [--per-digit 1]
    .venv/bin/python predict.py checkpoint=exported/demo images='my_digits/*.png'

Writes DIR/<label>_<index>.png for the first --per-digit test images of each digit 0-9 (index:
the image's place in the sample's test split), white on black as MNIST is, so the name says
the class predict.py should answer. A file of that name already there is left as it is (a
rerun writes nothing new). An unwritable DIR is one `error: ...` line, exit status 2.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a clone without `pip install -e .` too

from capsnet.cli import fail, import_tensorflow_quietly  # noqa: E402  (as train.py does)


def sample_digits(per_digit):
    """[(file name, uint8 image (28, 28, 1))]: the first `per_digit` test images of each digit
    in the bundled sample, by digit, then by index."""
    # capsnet.data imports TensorFlow, which main() imports first, quietly: imported at the top,
    # TensorFlow's native start-up lines (cuInit errors and all) would reach the user's terminal.
    from capsnet.data.sources import load_sample  # noqa: PLC0415

    images, labels, _ = load_sample("mnist", "test")
    chosen = []
    for digit in range(10):
        for index in np.flatnonzero(labels == digit)[:per_digit]:
            chosen.append((f"{digit}_{index:04d}.png", images[index][..., None]))  # (28, 28, 1)
    return chosen


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write the PNGs into (created)")
    parser.add_argument("--per-digit", type=int, default=1, help="test images of each digit (default 1)")
    args = parser.parse_args(argv)
    if args.per_digit < 1:
        fail(f"--per-digit {args.per_digit}: at least 1")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot create {args.out}: {exc.strerror}")
    import_tensorflow_quietly()
    from capsnet.prediction import write_png  # noqa: PLC0415  (TensorFlow's PNG encoder)

    written = []
    for name, image in sample_digits(args.per_digit):
        path = args.out / name
        if path.exists():
            continue
        try:
            write_png(path, image / 255.0)
        except OSError as exc:
            fail(f"cannot write {path}: {exc.strerror}")
        written.append(path)
    kept = 10 * args.per_digit - len(written)
    print(f"{10 * args.per_digit} digits in {args.out} ({len(written)} written, {kept} already there; the name's first "
          f"character is the digit): python predict.py checkpoint=... images='{args.out}/*.png'")
    return written


if __name__ == "__main__":
    main()
