"""Time an epoch's checkpoint writes for the paper model (latest/ alone, with best/ copied, with best/ linked).

On a new best epoch train() adds best/ as links to latest/'s files
(capsnet.training.checkpoints.BestCheckpoint); this times that against latest/ alone and
against best/ written as a second copy.

    python scripts/benchmark_checkpoint.py [--dir DIR] [--repeats 5]

The checkpoint holds what train() saves: the paper model's 8,215,568 weights, Adam's two
moments and the weight average (four float32 copies, ~125 MiB), in DIR (default: a
temporary directory; put it on the disk the runs use). Each timing starts after os.sync()
(the previous writes flushed, untimed) and ends when the files are written (in the page
cache, as in train()).
"""
import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PARAMETERS = 8_215_568


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--parameters", type=int, default=PARAMETERS, help="values per copy (default: the paper model's)")
    args = parser.parse_args(argv)
    import numpy as np
    import tensorflow as tf

    from capsnet.training.checkpoints import BestCheckpoint

    values = np.random.default_rng(0).random(args.parameters, dtype=np.float32)
    checkpoint = tf.train.Checkpoint(**{name: tf.Variable(values) for name in ("weights", "m", "v", "ema")})
    kinds = ("latest only", "latest + best written again", "latest + best as links")
    timings = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        # Each kind in a block of its own, the blocks twice (the first round is a warm-up:
        # the page cache and the file system settle), in fresh directories.
        for round_ in (0, 1):
            for number, kind in enumerate(kinds):
                where = Path(root) / f"{round_}-{number}"
                latest = tf.train.CheckpointManager(checkpoint, str(where / "latest"), max_to_keep=3)
                timings[kind] = []
                for n in range(1, args.repeats + 1):
                    os.sync()  # the writes before flushed, untimed: each timing starts from a clean page cache
                    start = time.perf_counter()
                    saved = latest.save(checkpoint_number=n)
                    if kind == "latest + best written again":
                        checkpoint.write(str(where / "best" / f"ckpt-{n}"))
                    elif kind == "latest + best as links":
                        BestCheckpoint(checkpoint, where / "best").adopt(n, saved)
                    timings[kind].append(time.perf_counter() - start)
    print(f"## An epoch's checkpoint writes, {args.parameters:,} parameters x 4, median of {args.repeats}\n")
    print("| writes | seconds (median) | all | vs latest only |\n|---|---:|---|---:|")
    base = statistics.median(timings["latest only"])
    for kind, seconds in timings.items():
        print(f"| {kind} | {statistics.median(seconds):.3f} | {' '.join(f'{s:.3f}' for s in seconds)} | "
              f"{statistics.median(seconds) / base:.2f}x |")


if __name__ == "__main__":
    main()
