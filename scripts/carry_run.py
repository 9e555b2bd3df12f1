"""Move a training run from one lent GPU machine to the next, in parts.

A lent machine is held for 30 minutes at most, so a longer run has to continue on the next
machine, and its run dir has to travel through this one. A call brings back at most 8
files of 16 MiB, and it carries at most 64 MiB, the working tree included. Checkpoints are
far larger than that: the MultiMNIST preset's is ~270 MB (its weights, Adam's two moments
and the weight average, float32).

`out` packs what a resume needs into one tar: the run's config, history, logs, event
files and its newest checkpoint. Older checkpoints stay behind, and best/ goes along only
where it is that same checkpoint. The tar is split into parts of 15 MiB, listed in a
MANIFEST with their sha256. `in` checks each part as it arrives, and unpacks the run dir
once all have come. train.py then resumes it as it resumes any run (same config, same
trajectory; capsnet.training.checkpoints).

    # old machine, one call after another (each call returns what `out` puts in $OUT):
    python3 scripts/carry_run.py out /tmp/runs/NAME --first 0      # packs once; parts 0-3
    python3 scripts/carry_run.py out /tmp/runs/NAME --first 4      # parts 4-7, and so on
    # here: copy each call's returned files into .gpucarry/NAME/ (ignored by git)
    # new machine, three parts a call (carry .gpucarry/NAME/MANIFEST and the parts):
    python3 scripts/carry_run.py in /tmp/runs/NAME --parts .gpucarry/NAME

Standard library only: it runs on the lent machine before TensorFlow's kit is there.
"""
import argparse
import hashlib
import io
import os
import re
import shutil
import sys
import tarfile
from pathlib import Path

PART_BYTES = 15 * 2**20  # a call brings back files of at most 16 MiB
PARTS_PER_CALL = 4       # and 64 MiB in all: four parts and the MANIFEST
MANIFEST = "MANIFEST"
# What stays behind: the lock of the training that wrote the run, a save a crash cut short.
LEFT_BEHIND = re.compile(r"(^|/)(train\.lock|[^/]*_temp(/.*)?|[^/]*\.tmp)$")


class CarryError(Exception):
    """A one-line reason why the run cannot be packed or put together."""


def checkpoint_state(directory):
    """(the newest ckpt-N's name, its timestamp line or None) from the `checkpoint` state file
    of a CheckpointManager directory; (None, None) when there is none."""
    state = Path(directory) / "checkpoint"
    if not state.is_file():
        return None, None
    text = state.read_text()
    newest = re.search(r'^model_checkpoint_path: "([^"]+)"', text, re.M)
    if newest is None:
        return None, None
    paths = re.findall(r'^all_model_checkpoint_paths: "([^"]+)"', text, re.M)
    stamps = re.findall(r"^all_model_checkpoint_timestamps: (\S+)", text, re.M)
    stamp = dict(zip(paths, stamps)).get(newest.group(1))
    return newest.group(1), stamp


def state_text(name, stamp):
    """A `checkpoint` state file naming `name` alone, so the next machine's CheckpointManager
    neither looks for the checkpoints left behind nor keeps `name` past its own limit."""
    lines = [f'model_checkpoint_path: "{name}"', f'all_model_checkpoint_paths: "{name}"']
    if stamp is not None:
        lines += [f"all_model_checkpoint_timestamps: {stamp}", f"last_preserved_timestamp: {stamp}"]
    return "\n".join(lines) + "\n"


def payload(run_dir):
    """(relative paths to pack, {relative path of a state file: its new text}, the newest
    checkpoint's name) of a run dir."""
    run_dir = Path(run_dir)
    latest = run_dir / "checkpoints" / "latest"
    name, stamp = checkpoint_state(latest)
    if name is None or not (latest / f"{name}.index").is_file():
        raise CarryError(f"{run_dir}: no checkpoint to carry (no {latest}/checkpoint naming a saved ckpt-N)")
    best = run_dir / "checkpoints" / "best"
    best_name, best_stamp = checkpoint_state(best)
    keep = {"checkpoints/latest": name, "checkpoints/best": best_name if best_name == name else None}
    files, states = [], {}
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        relative = path.relative_to(run_dir).as_posix()
        folder, _, file_name = relative.rpartition("/")
        if LEFT_BEHIND.search(relative):
            continue
        if folder in keep:
            if file_name == "checkpoint":
                if keep[folder] is not None:
                    states[relative] = state_text(keep[folder], stamp if folder.endswith("latest") else best_stamp)
                continue
            if keep[folder] is None or not file_name.startswith(keep[folder] + "."):
                continue
        files.append(relative)
    return files, states, name


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(directory):
    """[(part name, sha256, bytes)] and the checkpoint's name from `directory`/MANIFEST."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CarryError(f"no {MANIFEST} in {directory}: carry the one `out` wrote with the parts")
    parts, checkpoint = [], None
    for line in path.read_text().splitlines():
        if line.startswith("# checkpoint "):
            checkpoint = line.split()[2]
        elif line and not line.startswith("#"):
            digest, size, name = line.split()
            parts.append((name, digest, int(size)))
    if not parts:
        raise CarryError(f"{path} lists no parts")
    return parts, checkpoint


def pack(run_dir, staging, part_bytes=PART_BYTES):
    """The run's tar, split into `staging`/part.NNN, and their MANIFEST; returns the parts'
    names. A MANIFEST already there for the same newest checkpoint is kept (each `out` call
    after the first only hands out more of its parts)."""
    run_dir, staging = Path(run_dir), Path(staging)
    files, states, name = payload(run_dir)
    if (staging / MANIFEST).is_file():
        parts, checkpoint = read_manifest(staging)
        if checkpoint == name and all((staging / part).is_file() for part, _, _ in parts):
            return [part for part, _, _ in parts]
        print(f"carry_run: {run_dir} has saved {name} since it was packed ({checkpoint}): packing again")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tar_path = staging / "run.tar"
    with tarfile.open(tar_path, "w") as tar:
        for relative in files:
            tar.add(run_dir / relative, arcname=relative, recursive=False)
        for relative, text in states.items():
            data = text.encode()
            info = tarfile.TarInfo(relative)
            info.size, info.mtime, info.mode = len(data), int((run_dir / relative).stat().st_mtime), 0o644
            tar.addfile(info, io.BytesIO(data))
    lines = [f"# checkpoint {name} of {run_dir.name}", f"# tar {sha256(tar_path)} {tar_path.stat().st_size}"]
    parts = []
    with open(tar_path, "rb") as tar:
        for index, block in enumerate(iter(lambda: tar.read(part_bytes), b"")):
            part = f"part.{index:03d}"
            (staging / part).write_bytes(block)
            lines.append(f"{hashlib.sha256(block).hexdigest()} {len(block)} {part}")
            parts.append(part)
    tar_path.unlink()
    (staging / MANIFEST).write_text("\n".join(lines) + "\n")
    return parts


def emit(staging, out, first, count=PARTS_PER_CALL):
    """Copy the MANIFEST and parts first .. first+count-1 into `out`; returns their names."""
    parts, _ = read_manifest(staging)
    if not 0 <= first < len(parts):
        raise CarryError(f"--first {first}: the run has parts 0-{len(parts) - 1}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(staging) / MANIFEST, out / MANIFEST)
    chosen = [part for part, _, _ in parts[first:first + count]]
    for part in chosen:
        shutil.copyfile(Path(staging) / part, out / part)
    return chosen


def receive(parts_dir, staging):
    """Check the parts in `parts_dir` against their MANIFEST and keep them in `staging`;
    returns (parts kept so far, parts the MANIFEST lists)."""
    parts_dir, staging = Path(parts_dir), Path(staging)
    parts, checkpoint = read_manifest(parts_dir)
    if (staging / MANIFEST).is_file() and read_manifest(staging) != (parts, checkpoint):
        raise CarryError(f"{parts_dir}/{MANIFEST} is not the one the parts in {staging} came with: "
                         f"remove {staging} to start this run's parts again")
    staging.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(parts_dir / MANIFEST, staging / MANIFEST)
    for part, digest, size in parts:
        source = parts_dir / part
        if not source.is_file() or (staging / part).is_file():
            continue
        if source.stat().st_size != size or sha256(source) != digest:
            raise CarryError(f"{source}: not the part {MANIFEST} lists (sha256 or size differs): send it again")
        shutil.copyfile(source, staging / part)
    have = [part for part, _, _ in parts if (staging / part).is_file()]
    return have, [part for part, _, _ in parts]


def unpack(staging, run_dir):
    """The run dir from the parts in `staging` (every part must be there)."""
    staging, run_dir = Path(staging), Path(run_dir)
    parts, _ = read_manifest(staging)
    whole = re.search(r"^# tar (\S+) (\d+)$", (staging / MANIFEST).read_text(), re.M)
    if run_dir.exists() and any(run_dir.iterdir()):
        raise CarryError(f"{run_dir} exists and is not empty: unpack into a new run dir")
    tar_path = staging / "run.tar"
    with open(tar_path, "wb") as tar:
        for part, _, _ in parts:
            with open(staging / part, "rb") as f:
                shutil.copyfileobj(f, tar)
    if whole and (sha256(tar_path) != whole.group(1) or tar_path.stat().st_size != int(whole.group(2))):
        raise CarryError(f"{tar_path}: the parts put together are not the tar {MANIFEST} names")
    run_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar_path) as tar:
        tar.extractall(run_dir, filter="data")
    tar_path.unlink()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("direction", choices=["out", "in"])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--first", type=int, default=0, help="out: the first part to put in $OUT")
    parser.add_argument("--parts", type=Path, help="in: the folder the carried MANIFEST and parts are in")
    parser.add_argument("--staging", type=Path, help="where parts wait (default /tmp/carry/<out|in>/<run dir name>)")
    parser.add_argument("--part-mib", type=float, default=PART_BYTES / 2**20, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    staging = args.staging or Path("/tmp/carry") / args.direction / args.run_dir.name
    try:
        if args.direction == "out":
            every = pack(args.run_dir, staging, int(args.part_mib * 2**20))
            sent = emit(staging, os.environ.get("OUT", "gpu-out"), args.first)
            rest = len(every) - (args.first + len(sent))
            print(f"carry_run: {', '.join(sent)} of {len(every)} parts in $OUT"
                  + (f"; next: --first {args.first + len(sent)}" if rest > 0 else "; that was the last"))
        else:
            if args.parts is None:
                raise CarryError("in: --parts <folder with the carried MANIFEST and parts> is needed")
            have, every = receive(args.parts, staging)
            if len(have) < len(every):
                missing = [part for part in every if part not in have]
                print(f"carry_run: {len(have)} of {len(every)} parts here; still to send: {' '.join(missing)}")
                return 0
            unpack(staging, args.run_dir)
            shutil.rmtree(staging)
            print(f"carry_run: {args.run_dir} unpacked from {len(every)} parts; train.py on it resumes the run")
    except CarryError as err:
        print(f"carry_run: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
