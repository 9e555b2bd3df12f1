#!/usr/bin/env python3
"""Builds the capsnet op library capsnet/lib/_capsnet_ops.so (capsule prediction and fused routing).

    python scripts/build_ops.py                  CPU + CUDA kernels where nvcc and a GPU driver are found, else CPU only
    python scripts/build_ops.py --cpu-only       CPU kernels only
    python scripts/build_ops.py --require-cuda   CPU + CUDA kernels, GPU or not; fail unless nvcc is found
    python scripts/build_ops.py --driver         also build build/sanitize_driver (needs nvcc)
    python scripts/build_ops.py --driver-only    only the standalone driver

Sources are found, not named: every ops/*.cc except *.cu.cc goes to the C++ compiler,
every ops/*.cu.cc to nvcc (those are TensorFlow-free), and the headers (ops/*.h,
ops/*.cuh) go into the build key. The standalone driver is ops/sanitize_driver.cu
with all of ops/*.cu.cc.

The CUDA kernels take minutes of nvcc, so by default they are built only where they can
run: a GPU driver that sees a GPU (gpu_driver). A machine with the CUDA toolkit but no GPU
(a CI runner, a laptop) gets the CPU-only library; --require-cuda (`make ops-cuda`) builds
them anyway, e.g. in `docker build`, which sees no GPU. A current CPU+CUDA library is kept
either way: it runs on the CPU too.

Compiler flags for TensorFlow come only from tf.sysconfig (headers and ABI of the
installed pip TensorFlow). nvcc is looked up in $CUDA_HOME/bin, /usr/local/cuda/bin,
the pip wheel nvidia-cuda-nvcc (site-packages/nvidia/*/bin/nvcc) and PATH. The CUDA
runtime is not linked: libtensorflow_framework exports it.

A JSON stamp next to the library records the TensorFlow version, whether CUDA
kernels are in, the GPU architectures and a key of sources and flags; the build
is skipped when the key is unchanged (--force rebuilds). capsnet.ops reads the
stamp to refuse a library built for another TensorFlow.
"""
import argparse
import concurrent.futures
import datetime
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = os.path.join(ROOT, "ops")
BUILD = os.path.join(ROOT, "build")
DEFAULT_OUT = os.path.join(ROOT, "capsnet", "lib", "_capsnet_ops.so")
DRIVER_SOURCE = os.path.join(OPS, "sanitize_driver.cu")
DRIVER_OUT = os.path.join(BUILD, "sanitize_driver")

# sm_80 (A100) and sm_90 (H100/H200) machine code plus compute_90 PTX that newer
# GPUs JIT-compile. CUDA 13 cannot target sm_70 or older.
ARCHS = ["sm_80", "sm_90", "compute_90"]


def gencode(archs):
    """nvcc's -gencode flags for `archs` (names from ARCHS: sm_XY machine code, compute_XY PTX)."""
    return [flag for arch in archs
            for flag in ("-gencode", f"arch=compute_{arch.split('_')[1]},code={arch}")]


GENCODE = gencode(ARCHS)
NVCC_FLAGS = ["-x", "cu", "-std=c++17", "-DGOOGLE_CUDA=1", "--expt-relaxed-constexpr",
              "-Xcompiler", "-fPIC", "-O3", "--threads", "0"]
CXX_FLAGS = ["-std=c++17", "-O3", "-fPIC", "-DNDEBUG", "-Wno-deprecated-declarations"]




def xla_flags(tf):
    """Compile and link flags the XLA kernels (ops/xla_kernels.cc) need beyond tf.sysconfig's.

    The wheel ships the tf2xla and XLA headers, but two third-party headers they include
    sit under include/external/ rather than on the include path, and the tf2xla symbols
    (XlaOpKernel, XlaOpRegistrar) live in libtensorflow_cc, which TensorFlow's Python
    module has loaded before any op library.
    """
    include = tf.sysconfig.get_include()
    cflags = ["-isystem" + os.path.join(include, "external", "highwayhash"),
              "-isystem" + os.path.join(include, "external", "farmhash_archive", "src")]
    return cflags, ["-l:libtensorflow_cc.so.2"]


class BuildError(Exception):
    """A build step failed; the message says which and why."""


def cc_sources():
    """ops/*.cc for the C++ compiler: the TensorFlow side (ops, kernels, CPU code)."""
    return sorted(p for p in glob.glob(os.path.join(OPS, "*.cc")) if not p.endswith(".cu.cc"))


def cu_sources():
    """ops/*.cu.cc for nvcc: the CUDA kernels and their TensorFlow-free launchers."""
    return sorted(glob.glob(os.path.join(OPS, "*.cu.cc")))


def headers():
    """ops/*.h and ops/*.cuh: not compiled on their own, but part of every build key."""
    return sorted(glob.glob(os.path.join(OPS, "*.h")) + glob.glob(os.path.join(OPS, "*.cuh")))


def object_path(obj_dir, source):
    """build/ops/<cpu|cuda>/<name>.o for ops/<name>.cc (prediction.cu.cc -> prediction.cu.o)."""
    return os.path.join(obj_dir, os.path.splitext(os.path.basename(source))[0] + ".o")


def log(msg):
    print(f"build_ops: {msg}", flush=True)


def find_nvcc():
    """Path of a working nvcc, or None."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    # The CUDA 13 pip wheel nvidia-cuda-nvcc puts it under site-packages/nvidia/<pkg>/bin.
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "bin", "nvcc")))
    if shutil.which("nvcc"):
        candidates.append(shutil.which("nvcc"))
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            try:
                subprocess.run([path, "--version"], check=True, capture_output=True, timeout=60)
            except (OSError, subprocess.SubprocessError):
                continue
            return path
    return None


def gpu_driver():
    """(True, what was found) where an NVIDIA driver sees at least one GPU, else (False, why not).

    The test is the one TensorFlow's own GPU support passes: load the driver library
    libcuda.so.1 and call cuInit(0), then cuDeviceGetCount. Neither half alone would do:
    - nvidia-smi is missing from containers given only the compute libraries
      (NVIDIA_DRIVER_CAPABILITIES=compute) and can hang on a wedged driver;
    - libcuda.so.1 loads without a usable GPU: a driver package without its kernel module
      (a container started without --gpus, a host whose module is not loaded), or the
      CUDA toolkit's stub put on LD_LIBRARY_PATH. cuInit fails in all of these
      (CUDA_ERROR_NO_DEVICE, CUDA_ERROR_STUB_LIBRARY, ...).
    cuInit honours CUDA_VISIBLE_DEVICES as TensorFlow does (set empty, it sees no GPU).
    Nothing here needs the CUDA toolkit; cuInit runs in this process, which loads the same
    library again if it imports TensorFlow later.
    """
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False, "no NVIDIA driver library (libcuda.so.1)"
    try:
        status = cuda.cuInit(0)
        if status != 0:
            return False, f"the NVIDIA driver finds no usable GPU (cuInit: CUresult {status})"
        count = ctypes.c_int(0)
        status = cuda.cuDeviceGetCount(ctypes.byref(count))
    except AttributeError:  # a library of that name without the driver API
        return False, "libcuda.so.1 has no cuInit/cuDeviceGetCount"
    if status != 0 or count.value < 1:
        return False, "the NVIDIA driver sees no GPU"
    return True, f"an NVIDIA driver with {count.value} GPU{'s' if count.value > 1 else ''}"


def tool_version(cmd):
    try:
        out = subprocess.run(cmd + ["--version"], check=True, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    for line in lines:  # nvcc: "Cuda compilation tools, release 13.0, V13.0.88"
        if "release" in line:
            return line
    return lines[0] if lines else "unknown"  # g++: "g++ (Debian 12.2.0-14) 12.2.0"


def run_all(commands):
    """Runs (name, argv) commands in parallel, at most one per core but at least two at a
    time (a compile of TensorFlow's headers takes about a gigabyte, so not all at once);
    raises BuildError with the output of every failure. Returns {name: output}."""
    def run(argv):
        return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        done = [(name, argv, pool.submit(run, argv)) for name, argv in commands]
    failures = []
    outputs = {}
    for name, argv, future in done:
        proc = future.result()
        outputs[name] = proc.stdout
        if proc.returncode != 0:
            failures.append(f"{name} failed (exit {proc.returncode}):\n  {' '.join(argv)}\n{proc.stdout}")
    if failures:
        raise BuildError("\n".join(failures))
    return outputs


def digest(paths, extra):
    """Key of the files' names (relative to the repository) and contents, plus `extra`."""
    h = hashlib.sha256()
    for path in paths:
        h.update(os.path.relpath(path, ROOT).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(json.dumps(extra, sort_keys=True).encode())
    return h.hexdigest()


def without_paths(flags):
    """Flags with include/library paths dropped, so the key survives moving the venv."""
    return [f for f in flags if not f.startswith(("-I", "-L", "-isystem"))]


def ptxas_summary(output):
    """'kernel: N registers, S bytes spill' lines from nvcc -Xptxas -v output."""
    import re

    rows, name, spill = [], None, None
    for line in output.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line)
        if m:
            name, arch = m.groups()
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spill = m.groups()
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            demangled = name
            try:
                demangled = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip()
            except OSError:
                pass
            short = re.sub(r"\(anonymous namespace\)::|capsnet::|\(.*$", "", demangled)
            rows.append(f"{arch} {short}: {m.group(1)} registers, spill {spill[0]}/{spill[1]} bytes st/ld")
            name = None
    return rows


def installed_tensorflow():
    """(version, location) of the installed TensorFlow distribution without importing it, or
    None when no distribution of a known name is installed."""
    import importlib.metadata

    for name in ("tensorflow", "tensorflow-cpu", "tf-nightly"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return dist.version, str(dist.locate_file(""))
    return None


def quick_key(nvcc, archs=ARCHS):
    """The build key without TensorFlow's flags: sources, compilers and the installed TensorFlow
    (whose version and location fix its flags). A stamp with this key is up to date without
    importing TensorFlow, whose import prints its CUDA and oneDNN notices on every `make`."""
    tf_dist = installed_tensorflow()
    if tf_dist is None:
        return None
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    inputs = {"tensorflow": tf_dist, "cxx": tool_version([cxx]) if cxx else None, "cxx_flags": CXX_FLAGS,
              "nvcc": tool_version([nvcc]) if nvcc else None,
              "nvcc_flags": NVCC_FLAGS + gencode(archs) if nvcc else None}
    return digest(cc_sources() + cu_sources() + headers(), inputs)


def stamp_is_current(out, key):
    """Whether the library `out` exists and its stamp records `key` as its quick key."""
    stamp_path = os.path.splitext(out)[0] + ".json"
    if key is None or not os.path.isfile(out):
        return False
    try:
        with open(stamp_path) as f:
            return json.load(f).get("quick_key") == key
    except (OSError, ValueError):
        return False


def build_library(args, tf, nvcc):
    out = os.path.abspath(args.out)
    stamp_path = os.path.splitext(out)[0] + ".json"
    extra_cflags, extra_lflags = xla_flags(tf)
    cflags = tf.sysconfig.get_compile_flags() + extra_cflags
    lflags = tf.sysconfig.get_link_flags() + extra_lflags
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise BuildError("no C++ compiler found (install g++, or set CXX)")
    cuda = nvcc is not None
    key_inputs = {
        "tensorflow": tf.__version__,
        "cflags": without_paths(cflags),
        "lflags": without_paths(lflags),
        "cxx": tool_version([cxx]),
        "cxx_flags": CXX_FLAGS,
        "cuda": cuda,
        "nvcc": tool_version([nvcc]) if cuda else None,
        "nvcc_flags": NVCC_FLAGS + gencode(args.arch) if cuda else None,
    }
    cc_files, cu_files = cc_sources(), cu_sources() if cuda else []
    if not cc_files:
        raise BuildError(f"no C++ sources in {OPS} (ops/*.cc)")
    if cuda and not cu_files:
        raise BuildError(f"no CUDA sources in {OPS} (ops/*.cu.cc)")
    # All of ops/ (the CUDA sources too when building without them) so that a new,
    # renamed or removed file changes the key as an edit does.
    key = digest(cc_files + cu_sources() + headers(), key_inputs)
    if not args.force and os.path.isfile(out) and os.path.isfile(stamp_path):
        try:
            with open(stamp_path) as f:
                stamp = json.load(f)
            if stamp.get("key") == key:
                log(f"{os.path.relpath(out, ROOT)} is up to date (TensorFlow {tf.__version__}, "
                    f"{'CPU+CUDA' if cuda else 'CPU only'}); --force rebuilds")
                if stamp.get("quick_key") is None:  # a stamp from before quick keys: add one
                    stamp["quick_key"] = quick_key(nvcc, args.arch)
                    with open(stamp_path + ".tmp", "w") as f:
                        json.dump(stamp, f, indent=2)
                        f.write("\n")
                    os.replace(stamp_path + ".tmp", stamp_path)
                return
        except (OSError, ValueError, AttributeError):
            pass

    obj_dir = os.path.join(BUILD, "ops", "cuda" if cuda else "cpu")
    os.makedirs(obj_dir, exist_ok=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    abi = [f for f in cflags if f.startswith("-D_GLIBCXX_USE_CXX11_ABI")]
    commands, objects = [], []
    # nvcc first: its compiles take longest, so they start before the g++ ones wait for a slot.
    for src in cu_files:
        objects.append(object_path(obj_dir, src))
        commands.append((f"nvcc {os.path.basename(src)}",
                         [nvcc, *NVCC_FLAGS, *gencode(args.arch), *abi, *(["-Xptxas", "-v"] if args.ptxas_info else []),
                          "-I", OPS, "-c", src, "-o", objects[-1]]))
    for src in cc_files:
        objects.append(object_path(obj_dir, src))
        commands.append((f"g++ {os.path.basename(src)}",
                         [cxx, *CXX_FLAGS, *(["-DGOOGLE_CUDA=1"] if cuda else []), *cflags, "-c", src,
                          "-o", objects[-1]]))
    log(f"compiling {len(commands)} sources for TensorFlow {tf.__version__} "
        f"({'CPU + CUDA ' + ', '.join(args.arch) if cuda else 'CPU only'})")
    outputs = run_all(commands)
    if cuda and args.ptxas_info:
        for src in cu_files:
            for row in ptxas_summary(outputs[f"nvcc {os.path.basename(src)}"]):
                print("  " + row)
    tmp = out + ".tmp"
    run_all([("link", [cxx, "-shared", "-o", tmp, *objects, *lflags])])
    os.replace(tmp, out)  # atomic: a process that has the old library open keeps it
    stamp = {
        "tensorflow": tf.__version__,
        "cuda": cuda,
        "archs": list(args.arch) if cuda else [],
        "nvcc": key_inputs["nvcc"],
        "cxx": key_inputs["cxx"],
        "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "key": key,
        "quick_key": quick_key(nvcc, args.arch),
    }
    with open(stamp_path + ".tmp", "w") as f:
        json.dump(stamp, f, indent=2)
        f.write("\n")
    os.replace(stamp_path + ".tmp", stamp_path)
    # Loading it here catches unresolved symbols now rather than at first use.
    try:
        tf.load_op_library(out)
    except Exception as err:  # noqa: BLE001 - report whatever the loader raised
        raise BuildError(f"built {out} but TensorFlow cannot load it: {err}") from err
    log(f"built {os.path.relpath(out, ROOT)} ({'CPU + CUDA' if cuda else 'CPU only'}) and {os.path.relpath(stamp_path, ROOT)}")


def build_driver(nvcc, force):
    cu_files = cu_sources()
    key = digest([DRIVER_SOURCE, *cu_files, *headers()], {"nvcc": tool_version([nvcc]), "gencode": GENCODE})
    key_path = DRIVER_OUT + ".key"
    if not force and os.path.isfile(DRIVER_OUT) and os.path.isfile(key_path):
        with open(key_path) as f:
            if f.read().strip() == key:
                log(f"{os.path.relpath(DRIVER_OUT, ROOT)} is up to date")
                return
    os.makedirs(BUILD, exist_ok=True)
    log("compiling the standalone sanitizer driver")
    run_all([("nvcc sanitize_driver", [
        nvcc, "-std=c++17", "--expt-relaxed-constexpr", "-O3", "-lineinfo", *GENCODE, "--threads", "0",
        "-I", OPS, DRIVER_SOURCE, "-x", "cu", *cu_files, "-o", DRIVER_OUT])])
    with open(key_path, "w") as f:
        f.write(key + "\n")
    log(f"built {os.path.relpath(DRIVER_OUT, ROOT)}")


def library_nvcc(nvcc, out, *, require_cuda, force, archs=ARCHS):
    """The nvcc that builds the library at `out`, or None for the CPU-only library.

    With nvcc found and no --require-cuda: the CUDA kernels only where gpu_driver() finds a
    GPU, but a CPU+CUDA library at `out` that is up to date is kept (it runs on the CPU too,
    so `make ops-cuda` then `make test` does not rebuild it without them)."""
    if nvcc is None or require_cuda:
        return nvcc
    if not force and stamp_is_current(out, quick_key(nvcc, archs)):
        return nvcc
    found, what = gpu_driver()
    if found:
        log(f"{what}: building the CUDA kernels too")
        return nvcc
    log(f"{what}: building the CPU-only library (`make ops-cuda` adds the CUDA kernels anyway)")
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--cpu-only", action="store_true", help="build without CUDA kernels")
    mode.add_argument("--require-cuda", action="store_true",
                      help="build the CUDA kernels even without a GPU driver; fail if no nvcc is found")
    parser.add_argument("--out", default=DEFAULT_OUT, help="library path (default: capsnet/lib/_capsnet_ops.so)")
    parser.add_argument("--driver", action="store_true", help="also build build/sanitize_driver (needs nvcc)")
    parser.add_argument("--driver-only", action="store_true", help="only build build/sanitize_driver")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--ptxas-info", action="store_true", help="print registers/spills of every CUDA kernel")
    parser.add_argument("--arch", action="append", choices=ARCHS,
                        help="compile the CUDA kernels for this target only (repeatable; default: all of "
                             f"{', '.join(ARCHS)}); one target is enough to check that they compile")
    args = parser.parse_args(argv)
    args.arch = args.arch or ARCHS

    try:
        nvcc = None if args.cpu_only else find_nvcc()
        if nvcc is None and (args.require_cuda or args.driver or args.driver_only):
            raise BuildError("no CUDA compiler found (looked in $CUDA_HOME/bin, /usr/local/cuda/bin, "
                             "site-packages/nvidia/*/bin and PATH): install the CUDA toolkit or "
                             "`pip install nvidia-cuda-nvcc`, or set CUDA_HOME")
        if not args.driver_only:
            if nvcc is None and not args.cpu_only:
                log("no CUDA compiler found ($CUDA_HOME/bin, /usr/local/cuda/bin, site-packages/nvidia/*/bin, "
                    "PATH): building the CPU-only library")
            out = os.path.abspath(args.out)
            lib_nvcc = library_nvcc(nvcc, out, require_cuda=args.require_cuda, force=args.force, archs=args.arch)
            if not args.force and stamp_is_current(out, quick_key(lib_nvcc, args.arch)):
                log(f"{os.path.relpath(out, ROOT)} is up to date ({'CPU+CUDA' if lib_nvcc else 'CPU only'}); "
                    "--force rebuilds")
            else:
                import tensorflow as tf  # late: --driver-only and an up-to-date library need none

                build_library(args, tf, lib_nvcc)
        if args.driver or args.driver_only:
            build_driver(nvcc, args.force)
    except BuildError as err:
        print(f"build_ops: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
