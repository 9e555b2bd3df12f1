"""scripts/xla_memory_report.py: XLA's peak of a known computation, read from a real dump;
the whole script on the tiny model (CPU); a dump without a train step is a one-line error."""
import subprocess
import sys

import pytest

from conftest import TINY_MODEL, entry_point_env, load_script, run_entry_point

# A jit-compiled "train_step" whose peak is known: a (512, 512) float32 product (1 MiB) is
# alive while its square is computed; both are outputs, so both are live at the end.
KNOWN = r"""
import tensorflow as tf

@tf.function(jit_compile=True)
def train_step(x):
    y = tf.matmul(x, x, name="first_product")
    return y, tf.matmul(y, y, name="second_product")

train_step(tf.ones((512, 512)))
"""


@pytest.fixture(scope="module")
def report():
    return load_script("xla_memory_report")


def test_the_peak_of_a_known_computation(report, tmp_path):
    env = entry_point_env()
    env["XLA_FLAGS"] = f"--xla_dump_to={tmp_path} --xla_dump_hlo_pass_re=NONE"
    result = subprocess.run([sys.executable, "-c", KNOWN], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    dump = report.train_step_dump(tmp_path)
    total, ops, values = report.read_report(dump.read_text())
    mib = 1 << 20
    # The input and the two products, 1 MiB each, are the computation's memory.
    assert 3 * mib <= total < 4 * mib
    assert {op: size for op, size in ops}["first_product"] == mib
    assert {op: size for op, size in ops}["second_product"] == mib
    assert sorted(size for _, size in values)[-3:] == [mib] * 3
    table = report.markdown(dump, top=5)
    assert "| `first_product` | 1.0 |" in table and "`f32[512,512]{1,0}`" in table


def test_the_script_on_the_tiny_model(tmp_path):
    result = run_entry_point("scripts/xla_memory_report.py", "--device", "cpu", "--batch-size", "16",
                             "--keep", str(tmp_path / "dump"), *TINY_MODEL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # --keep: the train step's buffer assignment and its HLO text stay, and the report gives
    # the temp buffer XLA places the step's values in.
    kept = [p.name for p in (tmp_path / "dump").iterdir() if "train_step" in p.name]
    assert any(name.endswith("after_optimizations-buffer-assignment.txt") for name in kept), kept
    assert any(name.endswith("after_optimizations.txt") for name in kept), kept
    assert "MiB of it the temp buffer (XLA's plan" in result.stdout.splitlines()[0], result.stdout
    # conv1's output (B, 10, 10, 4·16) on blocks is among what is live at the peak, and the
    # step's inputs (weights, Adam's moments, the batch) are.
    assert "| `caps_net_1/conv1_1/Conv2D` |" in result.stdout, result.stdout
    assert "| `XLA_Args` |" in result.stdout
    assert "`f32[16,10,10,64]" in result.stdout


def test_a_dump_without_a_train_step_is_a_one_line_error(tmp_path):
    result = run_entry_point("scripts/xla_memory_report.py", "--dump", str(tmp_path), cwd=tmp_path)
    assert result.returncode != 0
    assert result.stderr.strip() == f"error: no train step's buffer assignment in {tmp_path} " \
                                    "(was XLA_FLAGS' --xla_dump_to set?)"
