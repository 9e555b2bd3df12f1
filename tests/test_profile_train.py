"""scripts/profile_train.py's reading of a trace: a GPU's busy time is the union of its
kernels' intervals (streams overlap), and each idle gap is charged to the kernel that
ended it, against sums worked out by hand."""
import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def profile_train():
    return load_script("profile_train")


# Two streams: conv on one, an elementwise kernel overlapping it on the other; then a gap of
# 5 before the all-reduce, a gap of 2 before the next step's conv, and a kernel inside it.
KERNELS = [(0, 10, "conv"), (4, 12, "add"), (17, 20, "nccl_all_reduce"), (22, 30, "conv"),
           (23, 25, "add")]


def test_busy_time_counts_overlapping_streams_once(profile_train):
    # [0, 12] + [17, 20] + [22, 30] = 12 + 3 + 8
    assert profile_train.union_length([(s, e) for s, e, _ in KERNELS]) == 23


def test_each_gap_is_charged_to_the_kernel_that_ends_it(profile_train):
    assert profile_train.idle_gaps(KERNELS) == {"nccl_all_reduce": [5, 1], "conv": [2, 1]}
    # Unsorted input and a kernel ending inside another's interval leave no false gap.
    shuffled = [KERNELS[4], KERNELS[2], KERNELS[0], KERNELS[3], KERNELS[1], (1, 3, "copy")]
    assert profile_train.idle_gaps(shuffled) == {"nccl_all_reduce": [5, 1], "conv": [2, 1]}
    assert profile_train.idle_gaps([(0, 5, "conv")]) == {}


def test_busy_plus_idle_is_the_span_of_the_kernels(profile_train):
    idle = sum(ps for ps, _ in profile_train.idle_gaps(KERNELS).values())
    assert profile_train.union_length([(s, e) for s, e, _ in KERNELS]) + idle == 30 - 0


@pytest.mark.parametrize("argv", [["--input", "on_device", "--variant", "op+fused"],
                                  ["--input", "on_device", "--variant", "op+fused+jit", "--replicas", "2"]],
                         ids=["not_jit", "two_gpus"])
def test_on_device_input_takes_one_gpu_and_a_jit_variant(profile_train, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        profile_train.main(argv)
    assert exit_info.value.code == 2
    assert "--input on_device (train.data_on_device=true) profiles one GPU and a +jit variant" in capsys.readouterr().err
