"""What holds the memory of the jit-compiled train step at its peak, from XLA's own buffer assignment.

    .venv/bin/python scripts/xla_memory_report.py --device gpu --batch-size 512 [--precision mixed_bfloat16]
        [--variant op+fused+jit] [key=value ...]
    .venv/bin/python scripts/xla_memory_report.py --dump DIR     # a dump made earlier (XLA_FLAGS=--xla_dump_to=DIR)
    .venv/bin/python scripts/xla_memory_report.py --keep DIR ...  # run, and keep the dump (HLO text too) in DIR

Runs one configuration of scripts/benchmark_train.py (two steps; its own process) with XLA
dumping its compiled modules, then reads the train step's module (the largest whose name
holds "train_step"): XLA's buffer assignment lists the values live at the point of peak
use, and the TensorFlow op each comes from. Prints the module's total and its temp buffer
(XLA places the step's values in one preallocated buffer; where their live ranges do not
let them share space it is larger than the peak), then the top rows of both lists as
Markdown tables:
- by op: bytes at the peak per TensorFlow op (`XLA_Args`: the step's inputs, i.e. the
  weights, Adam's moments and the batch);
- by value: the live XLA values, with their shapes.

Why: benchmark_train's "peak MiB" says how much, not what; on a GPU the step is one
allocation that XLA plans, so its plan is where memory can be won (issue [xla-op]: 1,120
MiB at batch 512 in float32 against PyTorch's 850). The plan of the CPU machine's XLA
differs from the GPU's (other fusions, no cuDNN workspaces): run it where the memory is.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_TOTAL = re.compile(r"^Total bytes used: (\d+)", re.M)
_TEMP = re.compile(r"^allocation \d+: size (\d+), preallocated-temp", re.M)
_PEAK_VALUES = re.compile(r"^  Live ranges at \d+ \(peak\):\n((?:    .*\n)*)", re.M)
_PEAK_VALUE = re.compile(r"^    (\S+?)(\{[^}]*\}): (\d+) bytes")  # name{tuple index}: bytes
_PEAK_OPS = re.compile(r"^  Stack trace breakdown for peak usage: .*\n((?:    .*\n)*)", re.M)
_PEAK_OP = re.compile(r"[├└]── (.+?) \([\d.]+%, total: ([\d ]+) bytes")


def read_report(text):
    """(total bytes, [(op, bytes)], [(value, bytes)]) of one buffer-assignment dump's text,
    the peak's rows largest first; empty lists where the dump has no peak section."""
    total = _TOTAL.search(text)
    values = _PEAK_VALUES.search(text)
    ops = _PEAK_OPS.search(text)
    peak_values = [(m.group(1) + ("" if m.group(2) == "{}" else m.group(2)), int(m.group(3))) for m in
                   (_PEAK_VALUE.match(line) for line in (values.group(1).splitlines() if values else []))
                   if m]
    peak_ops = [(m.group(1), int(m.group(2).replace(" ", ""))) for m in
                (_PEAK_OP.search(line) for line in (ops.group(1).splitlines() if ops else [])) if m]
    return (int(total.group(1)) if total else 0, sorted(peak_ops, key=lambda r: -r[1]),
            sorted(peak_values, key=lambda r: -r[1]))


def shapes_of(text):
    """{XLA value name: its shape} from a buffer-assignment dump's allocation list."""
    return {m.group(1): m.group(2) for m in re.finditer(r"value: <\d+ (\S+) @\d+> \([^)]*\): (\S+)", text)}


def train_step_dump(dump_dir):
    """The buffer-assignment file of the largest module whose name holds "train_step"."""
    files = [p for p in Path(dump_dir).glob("*buffer-assignment.txt") if "train_step" in p.name]
    if not files:
        raise SystemExit(f"error: no train step's buffer assignment in {dump_dir} (was XLA_FLAGS' --xla_dump_to set?)")
    return max(files, key=lambda p: read_report(p.read_text())[0])


def markdown(path, top):
    text = path.read_text()
    total, ops, values = read_report(text)
    shapes = shapes_of(text)
    mib = 1 << 20
    temp = _TEMP.search(text)
    temp_text = f", {int(temp.group(1)) / mib:,.1f} MiB of it the temp buffer" if temp else ""
    lines = [f"{path.name.split('.')[1] if '.' in path.name else path.name}: {total / mib:,.1f} MiB in all"
             f"{temp_text} (XLA's plan; the peak below)", "",
             "| TensorFlow op | MiB at the peak |", "|---|---:|"]
    lines += [f"| `{op}` | {size / mib:,.1f} |" for op, size in ops[:top]]
    lines += ["", f"peak: {sum(s for _, s in values) / mib:,.1f} MiB in {len(values)} live values", "",
              "| XLA value | shape | MiB |", "|---|---|---:|"]
    lines += [f"| `{name}` | `{shapes.get(name, '?')}` | {size / mib:,.1f} |" for name, size in values[:top]]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dump", type=Path, help="read this XLA dump dir instead of running a step")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="dump into DIR (made if missing) and keep it, with the step's HLO as text")
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--variant", default="op+fused+jit", help="a benchmark_train.py variant (default op+fused+jit)")
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--top", type=int, default=15, help="rows of each table (default 15)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="Hydra overrides of configs/train.yaml")
    args = parser.parse_args(argv)
    if args.dump is not None:
        print(markdown(train_step_dump(args.dump), args.top))
        return 0
    if "jit" not in args.variant:
        parser.error(f"--variant {args.variant}: only a jit variant is one XLA computation")
    with tempfile.TemporaryDirectory(prefix="xla-dump-") as scratch:
        dump = scratch if args.keep is None else args.keep
        env = dict(os.environ)
        # Only the train step, after optimization: no per-pass HLO, no LLVM IR.
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_pass_re=NONE "
                            "--xla_dump_hlo_module_re=.*train_step.*"
                            + (" --xla_dump_hlo_as_text" if args.keep is not None else "")).strip()
        command = [sys.executable, str(REPO / "scripts" / "benchmark_train.py"), "--device", args.device,
                   "--variants", args.variant, "--precision", args.precision, "--batch-sizes", str(args.batch_size),
                   "--steps", "1", "--warmup", "1", "--repeats", "1", "--steps-per-execution", "1",
                   *args.overrides]
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            sys.stderr.write(result.stdout[-3000:] + result.stderr[-3000:])
            raise SystemExit(f"error: benchmark_train.py failed (exit status {result.returncode})")
        print(markdown(train_step_dump(dump), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
