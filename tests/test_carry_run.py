"""scripts/carry_run.py: a real tiny run packed into parts, handed out and carried a few
parts a call as between two lent machines, put together and resumed; against the run
trained without the move. Damaged or foreign parts and a non-empty target are refused in one
line."""
import json
import tarfile

import pytest

from capsnet.training import train
from conftest import assert_trained_as, load_script


@pytest.fixture(scope="module")
def carry_run():
    return load_script("carry_run")


@pytest.fixture
def run_of_two_epochs(tiny_config, tmp_path):
    """trained_run's first two epochs, saved every epoch (latest/ holds ckpt-1 and ckpt-2)."""
    run_dir = tmp_path / "old"
    train(tiny_config("train.epochs=2", run_dir=run_dir))
    (run_dir / "train.lock").touch()  # as a training still holding the run would leave it
    return run_dir


def packed(carry_run, run_dir, staging, parts=5):
    """The run packed into about `parts` parts (the tiny checkpoint is far below 15 MiB)."""
    files, _, _ = carry_run.payload(run_dir)
    sizes = {(run_dir / f).stat().st_ino: (run_dir / f).stat().st_size for f in files}  # best/'s links once
    total = sum(sizes.values())
    return carry_run.pack(run_dir, staging, part_bytes=total // (parts - 1))


def test_a_run_carried_in_parts_resumes_as_the_uninterrupted_run(carry_run, run_of_two_epochs, trained_run,
                                                                   tiny_config, tmp_path):
    parts = packed(carry_run, run_of_two_epochs, tmp_path / "staging-out")
    assert len(parts) >= 4
    stamp = (tmp_path / "staging-out" / parts[0]).stat().st_mtime_ns
    assert carry_run.pack(run_of_two_epochs, tmp_path / "staging-out") == parts  # a second `out` call: not repacked
    assert (tmp_path / "staging-out" / parts[0]).stat().st_mtime_ns == stamp

    # Two parts a call back from the old machine, then one call per two parts to the new one.
    calls = [carry_run.emit(tmp_path / "staging-out", tmp_path / f"out{first}", first, count=2)
             for first in range(0, len(parts), 2)]
    assert [part for call in calls for part in call] == parts
    for index, first in enumerate(range(0, len(parts), 2)):
        have, every = carry_run.receive(tmp_path / f"out{first}", tmp_path / "staging-in")
        assert every == parts and have == parts[:first + len(calls[index])]
    new = tmp_path / "new"
    carry_run.unpack(tmp_path / "staging-in", new)

    latest = new / "checkpoints" / "latest"
    assert sorted(p.name for p in latest.iterdir()) == ["checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index"]
    assert carry_run.checkpoint_state(latest)[0] == "ckpt-2"
    assert "ckpt-1" not in (latest / "checkpoint").read_text()
    assert not (new / "train.lock").exists()
    for name in ("config.yaml", "history.jsonl"):
        assert (new / name).read_bytes() == (run_of_two_epochs / name).read_bytes(), name
    # best/ went along only if epoch 2 was the best; its files are latest's bytes.
    best = new / "checkpoints" / "best" / "ckpt-2.index"
    assert not best.exists() or best.read_bytes() == (latest / "ckpt-2.index").read_bytes()

    metrics = train(tiny_config(run_dir=new))  # trained_run's 4 epochs: 2 more
    assert [line["epoch"] for line in metrics["history"]] == [1, 2, 3, 4]
    assert_trained_as(metrics, trained_run[1])


def test_a_damaged_part_is_refused_naming_it_and_a_foreign_manifest_too(carry_run, run_of_two_epochs, tmp_path):
    parts = packed(carry_run, run_of_two_epochs, tmp_path / "staging-out")
    carry_run.emit(tmp_path / "staging-out", tmp_path / "out", 0, count=len(parts))
    damaged = tmp_path / "out" / parts[1]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(carry_run.CarryError, match=rf"out/{parts[1]}: not the part MANIFEST lists .*send it again"):
        carry_run.receive(tmp_path / "out", tmp_path / "staging-in")

    # Parts of another packing (a later checkpoint) do not mix with the ones already received.
    other = tmp_path / "other"
    packed(carry_run, run_of_two_epochs, other, parts=3)
    with pytest.raises(carry_run.CarryError, match="is not the one the parts in .* came with"):
        carry_run.receive(other, tmp_path / "staging-in")


def test_the_cli_lists_missing_parts_and_refuses_a_non_empty_run_dir(carry_run, run_of_two_epochs, tmp_path,
                                                                      monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    staging = ["--staging", str(tmp_path / "staging-out"), "--part-mib", "0.5"]
    assert carry_run.main(["out", str(run_of_two_epochs), *staging]) == 0
    names = [part for part, _, _ in carry_run.read_manifest(tmp_path / "out").parts]
    first = capsys.readouterr().out
    assert first.startswith(f"carry_run: {', '.join(names[:4])} of {len(names)} parts in $OUT")
    assert len(names) > 4 and first.rstrip().endswith("next: --first 4")

    receive = ["--parts", str(tmp_path / "out"), "--staging", str(tmp_path / "staging-in")]
    assert carry_run.main(["in", str(tmp_path / "new"), *receive]) == 0
    assert capsys.readouterr().out == (f"carry_run: 4 of {len(names)} parts here; still to send: "
                                       f"{' '.join(names[4:])}\n")
    assert not (tmp_path / "new").exists()

    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "history.jsonl").write_text(json.dumps({"epoch": 1}) + "\n")
    assert carry_run.main(["out", str(run_of_two_epochs), *staging, "--first", "4"]) == 0
    capsys.readouterr()
    assert carry_run.main(["in", str(tmp_path / "new"), *receive]) == 1
    err = capsys.readouterr().err
    assert err == f"carry_run: {tmp_path / 'new'} exists and is not empty: unpack into a new run dir\n"

    assert carry_run.main(["out", str(tmp_path / "nothing-here")]) == 1
    assert "no checkpoint to carry" in capsys.readouterr().err


def test_the_tar_holds_no_path_outside_the_run(carry_run, run_of_two_epochs, tmp_path):
    """Every member is relative and below the run dir (unpack extracts with the 'data' filter)."""
    files, states, name = carry_run.payload(run_of_two_epochs)
    assert name == "ckpt-2" and set(states) >= {"checkpoints/latest/checkpoint"}
    carry_run.pack(run_of_two_epochs, tmp_path / "s", part_bytes=2**26)  # one part: the tar itself
    with tarfile.open(tmp_path / "s" / "part.000") as tar:
        members = tar.getnames()
    assert sorted(members) == sorted([*files, *states])
    assert all(not m.startswith(("/", "..")) and "/../" not in m for m in members)
