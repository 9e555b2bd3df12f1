"""scripts/build_ops.py's choice of variant: the GPU driver test (libcuda.so.1 and cuInit,
mocked) and the library it builds from it: CPU-only where nvcc is found but no GPU driver,
CUDA where both are, CUDA with --require-cuda whatever the driver. Nothing is compiled:
build_library is replaced by a recorder."""
import ctypes
import json

import pytest

from conftest import load_script

build_ops = load_script("build_ops")


class FakeDriver:
    """libcuda.so.1's cuInit and cuDeviceGetCount, returning the given CUresults and count."""

    def __init__(self, init=0, count=1, count_status=0):
        self.init, self.count, self.count_status = init, count, count_status

    def cuInit(self, flags):  # noqa: N802 - the driver API's name
        assert flags == 0
        return self.init

    def cuDeviceGetCount(self, pointer):  # noqa: N802
        ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int))[0] = self.count
        return self.count_status


def driver_library(monkeypatch, library):
    """ctypes.CDLL("libcuda.so.1") gives `library` (an exception instance: raises it)."""
    def cdll(name, *args, **kwargs):
        assert name == "libcuda.so.1"
        if isinstance(library, Exception):
            raise library
        return library

    monkeypatch.setattr(ctypes, "CDLL", cdll)


@pytest.mark.parametrize("library, found, words", [
    (OSError("libcuda.so.1: cannot open shared object file"), False, "no NVIDIA driver library"),
    (FakeDriver(init=100), False, "CUresult 100"),       # CUDA_ERROR_NO_DEVICE: driver, no GPU
    (FakeDriver(init=34), False, "CUresult 34"),         # CUDA_ERROR_STUB_LIBRARY: the toolkit's stub
    (FakeDriver(count=0), False, "sees no GPU"),
    (FakeDriver(count=1, count_status=3), False, "sees no GPU"),
    (object(), False, "no cuInit"),                      # a libcuda.so.1 without the driver API
    (FakeDriver(count=1), True, "with 1 GPU"),
    (FakeDriver(count=8), True, "with 8 GPUs"),
])
def test_gpu_driver_needs_the_library_and_a_gpu_it_sees(monkeypatch, library, found, words):
    driver_library(monkeypatch, library)
    got, what = build_ops.gpu_driver()
    assert got is found and words in what


@pytest.fixture
def builds(monkeypatch, tmp_path):
    """main()'s library builds as (nvcc) calls, with nvcc 'found' and nothing compiled."""
    calls = []

    def build_library(args, tf, nvcc):
        calls.append(nvcc)

    monkeypatch.setattr(build_ops, "find_nvcc", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.setattr(build_ops, "tool_version", lambda cmd: f"{cmd[0]} 1.0")
    monkeypatch.setattr(build_ops, "build_library", build_library)
    return calls


def run_main(tmp_path, *flags):
    assert build_ops.main(["--out", str(tmp_path / "_capsnet_ops.so"), *flags]) == 0


def test_nvcc_without_a_gpu_driver_builds_the_cpu_only_library(builds, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(build_ops, "gpu_driver", lambda: (False, "no NVIDIA driver library (libcuda.so.1)"))
    run_main(tmp_path)
    assert builds == [None]
    assert ("no NVIDIA driver library (libcuda.so.1): building the CPU-only library (`make ops-cuda` adds the "
            "CUDA kernels anyway)") in capsys.readouterr().out


def test_nvcc_and_a_gpu_driver_build_the_cuda_kernels(builds, monkeypatch, tmp_path):
    monkeypatch.setattr(build_ops, "gpu_driver", lambda: (True, "an NVIDIA driver with 1 GPU"))
    run_main(tmp_path)
    assert builds == ["/opt/cuda/bin/nvcc"]


def test_require_cuda_builds_them_without_a_driver_and_cpu_only_never(builds, monkeypatch, tmp_path):
    def no_probe():
        raise AssertionError("the driver is not asked about when the variant is forced")

    monkeypatch.setattr(build_ops, "gpu_driver", no_probe)
    run_main(tmp_path, "--require-cuda")
    run_main(tmp_path, "--cpu-only")
    assert builds == ["/opt/cuda/bin/nvcc", None]


def test_a_current_cuda_library_is_kept_without_a_driver(builds, monkeypatch, tmp_path, capsys):
    """`make ops-cuda` then `make install`: the CPU+CUDA build stays (it runs on the CPU too)."""
    monkeypatch.setattr(build_ops, "gpu_driver", lambda: (False, "no NVIDIA driver library (libcuda.so.1)"))
    (tmp_path / "_capsnet_ops.so").write_bytes(b"")
    stamp = {"cuda": True, "quick_key": build_ops.quick_key("/opt/cuda/bin/nvcc")}
    (tmp_path / "_capsnet_ops.json").write_text(json.dumps(stamp))
    run_main(tmp_path)
    assert builds == [] and "is up to date (CPU+CUDA)" in capsys.readouterr().out
    run_main(tmp_path, "--force")  # a forced rebuild follows the driver again
    assert builds == [None]


def test_a_current_cpu_only_library_is_up_to_date_without_a_driver(builds, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(build_ops, "gpu_driver", lambda: (False, "no NVIDIA driver library (libcuda.so.1)"))
    (tmp_path / "_capsnet_ops.so").write_bytes(b"")
    (tmp_path / "_capsnet_ops.json").write_text(json.dumps({"cuda": False, "quick_key": build_ops.quick_key(None)}))
    run_main(tmp_path)
    assert builds == [] and "is up to date (CPU only)" in capsys.readouterr().out
    # ... and where a driver appears (the same tree in a GPU container), the CUDA kernels are built.
    monkeypatch.setattr(build_ops, "gpu_driver", lambda: (True, "an NVIDIA driver with 1 GPU"))
    run_main(tmp_path)
    assert builds == ["/opt/cuda/bin/nvcc"]


def test_arch_picks_the_gencode_targets_and_a_one_target_library_is_not_the_full_one(builds, monkeypatch,
                                                                                     tmp_path, capsys):
    assert build_ops.gencode(build_ops.ARCHS) == [
        "-gencode", "arch=compute_80,code=sm_80",
        "-gencode", "arch=compute_90,code=sm_90",
        "-gencode", "arch=compute_90,code=compute_90"]
    assert build_ops.gencode(["sm_90"]) == ["-gencode", "arch=compute_90,code=sm_90"]
    # A library built for sm_90 only (CI's compile check) is current for --arch sm_90 ...
    (tmp_path / "_capsnet_ops.so").write_bytes(b"")
    stamp = {"cuda": True, "quick_key": build_ops.quick_key("/opt/cuda/bin/nvcc", ["sm_90"])}
    (tmp_path / "_capsnet_ops.json").write_text(json.dumps(stamp))
    run_main(tmp_path, "--require-cuda", "--arch", "sm_90")
    assert builds == [] and "is up to date (CPU+CUDA)" in capsys.readouterr().out
    # ... but not for the default targets, which an A100 needs.
    run_main(tmp_path, "--require-cuda")
    assert builds == ["/opt/cuda/bin/nvcc"]
    with pytest.raises(SystemExit):
        build_ops.main(["--arch", "sm_70"])
