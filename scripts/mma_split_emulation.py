"""NumPy emulation of the 16-bit tensor-core routing's numerics (ops/routing_mma.cuh), to
size what tests/test_routing_op.py::test_gpu_16bit_tensor_cores_keep_float32_sums may
expect: the forward of r = 3 routing iterations with v_j and c_ij u split into hi + lo
16-bit parts (as the kernel feeds its mma), and without the split (16-bit products),
each against float32 routing on the same 16-bit u and W, both rounded once to 16 bits.

    .venv/bin/python scripts/mma_split_emulation.py [--batch 32] [--seed 11]

Prints, per type, variant and output, whether the test's criterion holds (at most one
unit in the last place apart) and the share of elements whose bits differ (the test
allows < 2%). Sums are float32 (NumPy's einsum order, not the kernel's).
"""
import argparse

import ml_dtypes
import numpy as np


def rounded(x, dtype):
    return x.astype(dtype).astype(np.float32)


def squash(s):
    n2 = (s * s).sum(-1, keepdims=True)
    return s * (n2 / (1 + n2) / np.sqrt(n2 + 1e-7))


def route(u, W, iterations, operand=None):
    """(s_j, c_ij) of the last iteration. operand: None = float32 routing; "split" or
    "plain" with a 16-bit dtype = v_j and c_ij u as the mma's operands, split or not."""
    mode, dtype = operand or (None, None)
    u_hat = np.einsum("ijdk,bik->bijd", W, u).astype(np.float32)
    b = np.zeros(u_hat.shape[:3], np.float32)

    def as_operand(x):  # what the mma multiplies for a float32 value x
        hi = rounded(x, dtype)
        return hi + rounded(x - hi, dtype) if mode == "split" else hi

    for t in range(iterations):
        e = np.exp(b - b.max(-1, keepdims=True))
        c = (e / e.sum(-1, keepdims=True)).astype(np.float32)
        if mode is None:
            s = np.einsum("bij,bijd->bjd", c, u_hat)
        else:
            s = np.einsum("bijk,ijdk->bjd", as_operand(c[..., None] * u[:, :, None, :]), W)
        if t == iterations - 1:
            return s.astype(np.float32), c
        v = squash(s).astype(np.float32)
        if mode is None:
            b = b + np.einsum("bijd,bjd->bij", u_hat, v)
        else:
            b = b + np.einsum("bik,bijk->bij", u, np.einsum("bjd,ijdk->bijk", as_operand(v), W))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    for name, dtype, unit in (("bfloat16", ml_dtypes.bfloat16, 2.0 ** -7), ("float16", np.float16, 2.0 ** -10)):
        u = rounded(rng.uniform(-1, 1, (args.batch, 1152, 8)).astype(np.float32) / np.sqrt(8), dtype)
        W = rounded(0.3 * rng.uniform(-1, 1, (1152, 10, 16, 8)).astype(np.float32), dtype)
        want = route(u, W, 3)
        for mode in ("split", "plain"):
            got = route(u, W, 3, (mode, dtype))
            for output, a, b in zip(("s_j", "c_ij"), got, want):
                a, b_rounded = rounded(a, dtype), rounded(b, dtype)
                scale = np.abs(b).max()
                within = np.all(np.abs(a - b_rounded) <= unit * np.abs(b_rounded) + unit * 1e-3 * scale)
                print(f"{name} {mode:5s} {output:4s}: within one unit {bool(within)}, "
                      f"bits differ in {np.mean(a != b_rounded):.2%}")


if __name__ == "__main__":
    main()
