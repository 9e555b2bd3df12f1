"""Time the training input pipeline alone: images/s of capsnet.data's epochs, as train() builds them.

train() builds each epoch with make_split_dataset, shuffled and augmented by (seed, epoch);
this does the same, with no model.

    python scripts/benchmark_input.py --data-dir /data/mnist [--dataset mnist]
        [--batch-size 100] [--epochs 3] [--shift-pixels 2] [--flip] [--erase-probability 0.5] [--elastic-alpha 16]

Each epoch is timed from building its dataset to its last batch (on the host, nothing
else running), so the per-epoch tracing of the pipeline's functions counts; the first
epoch also builds the in-memory arrays. A training step that consumes batches faster
than this rate waits on its input. "ready" is the part before the first batch (the
epoch's draws, its pipeline and iterator): what train() builds on a thread during the
epoch before (capsnet.training.loop.built_ahead), since the GPU would wait for it.
"""
import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a clone without `pip install -e .` too


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, help="the dataset's IDX files")
    parser.add_argument("--dataset", default="mnist", help="mnist | fashion_mnist | multimnist (default mnist)")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--shift-pixels", type=int, default=2)
    parser.add_argument("--flip", action="store_true", help="also mirror left-right (as paper_fashion_mnist)")
    parser.add_argument("--erase-probability", type=float, default=0.0,
                        help="also random erasing with this probability (data.erase_probability; default 0: none)")
    parser.add_argument("--elastic-alpha", type=float, default=0.0,
                        help="also elastic distortion of this scale, sigma 4 (data.elastic_alpha; default 0: none)")
    args = parser.parse_args(argv)

    from capsnet.data import load_split, make_split_dataset

    images, labels = load_split(args.dataset, "train", data_dir=args.data_dir)
    print(f"{args.dataset}: {len(labels)} training images, batch {args.batch_size}, shift {args.shift_pixels}"
          f"{', flips' if args.flip else ''}"
          f"{f', erasing {args.erase_probability}' if args.erase_probability else ''}"
          f"{f', elastic alpha {args.elastic_alpha:g}' if args.elastic_alpha else ''}; {os.cpu_count()} cores visible")
    # Only the augmentations asked for, so the script also runs on a tree without the newer ones.
    extra = {key: value for key, value in (("erase_probability", args.erase_probability),
                                           ("elastic_alpha", args.elastic_alpha)) if value}
    for epoch in range(args.epochs):
        start = time.perf_counter()
        dataset = make_split_dataset(args.dataset, images, labels, batch_size=args.batch_size, training=True,
                                     seed=0, epoch=epoch, shift_pixels=args.shift_pixels, flip=args.flip, **extra)
        batches = iter(dataset)
        count = len(next(batches)[1])  # (images, labels[, digits])
        ready = time.perf_counter() - start
        count += sum(len(batch[1]) for batch in batches)
        seconds = time.perf_counter() - start
        print(f"epoch {epoch + 1}: {count} images in {seconds:.2f} s: {count / seconds:,.0f} images/s "
              f"(ready for its first batch after {ready:.3f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
