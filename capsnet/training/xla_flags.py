"""The XLA process flags: TF_XLA_FLAGS and XLA_FLAGS, read once per process by TensorFlow
and XLA, so set before the first tensor (set_xla_flags, from train()'s set-up).

- `set_autoclustering`: train.xla=autocluster (the flag that lets it run on a CPU too);
- `set_xla_compile_threads`: XLA's GPU compiler on several threads (any XLA mode);
- `set_xla_gemm_backend`: XLA's GPU matrix products through cuBLAS, not autotuned Triton
  kernels (any XLA mode);
- `set_xla_cache`: train.xla_cache_dir, XLA's persistent compilation cache.
"""
import os
import re
from pathlib import Path

import tensorflow as tf

from capsnet.errors import ConfigError


def set_xla_flags(xla, cache_dir):
    """The flags a run of train.xla=`xla` with train.xla_cache_dir=`cache_dir` sets for
    this process, before TensorFlow sets up its devices (it reads them then: on a CPU-only
    machine autoclustering needs a TF_XLA_FLAGS flag, and the XLA cache is one; the cache
    only where XLA compiles: xla=jit or autocluster). Returns the notice to show if the
    cache flag replaced another directory or the default one cannot be made, else None."""
    set_autoclustering(xla == "autocluster")
    if xla == "none":
        return None  # nothing is compiled by XLA: no cache directory made
    set_xla_compile_threads()
    set_xla_gemm_backend()
    return set_xla_cache(cache_dir)


def set_autoclustering(enabled):
    """Turn XLA autoclustering on or off for this PROCESS: it applies to every tf.function
    run afterwards (the train step, the eval step, and anything else).

    TensorFlow autoclusters only GPU ops unless --tf_xla_cpu_global_jit is in
    TF_XLA_FLAGS; enabling adds it, so that `autocluster` also works on a CPU-only
    machine. TensorFlow reads TF_XLA_FLAGS once per process, when it first sets up its
    devices (the first tensor, variable or device query): call this before that for
    the flag to count. Once read, the flag stays; set_jit alone then decides whether
    functions instantiated later are clustered.
    """
    if enabled:
        set_tf_xla_flag("--tf_xla_cpu_global_jit")
    tf.config.optimizer.set_jit("autoclustering" if enabled else False)


def _flag_pattern(flag):
    """`flag` as a whole word of a flags variable, alone or as `flag=value`."""
    return re.compile(r"(?<!\S)" + re.escape(flag) + r"(=\S*)?(?=\s|$)")


def set_tf_xla_flag(flag, value=None):
    """Put `flag` (`flag=value` if a value is given) into TF_XLA_FLAGS once, in place of
    the flag's earlier setting if there is one. Returns that earlier setting as written
    ("--flag" or "--flag=value"), or None if the flag was absent. TensorFlow reads the
    variable once (see set_autoclustering)."""
    flags = os.environ.get("TF_XLA_FLAGS", "")
    pattern = _flag_pattern(flag)
    existing = pattern.search(flags)
    setting = flag if value is None else f"{flag}={value}"
    if existing is None:
        os.environ["TF_XLA_FLAGS"] = " ".join([*flags.split(), setting])
    elif existing.group(0) != setting:
        os.environ["TF_XLA_FLAGS"] = " ".join(pattern.sub(setting, flags, count=1).split())
    return None if existing is None else existing.group(0)


# XLA_FLAGS that let XLA's GPU compiler compile a program's kernels on several threads.
XLA_THREADS_FLAG = "--xla_gpu_force_compilation_parallelism"
XLA_SPLIT_FLAG = "--xla_gpu_enable_llvm_module_compilation_parallelism"


def set_xla_compile_threads(threads=None):
    """Let XLA's GPU compiler compile each program's kernels (LLVM, then ptxas) on `threads`
    threads (default: the cores this process may run on), for this PROCESS, unless XLA_FLAGS
    already names either flag (the user's choice stands). Returns the flags set ("" if none).

    Why: TensorFlow hands XLA no thread pool, so it compiles a program's kernels one after
    another. On an H200 (16 cores) the flags cut fast_mnist's first epoch of training, which
    is mostly compiling, from 27.3-30.4 s to 24.1-25.4 s (docs/benchmarks.md, "Start-up").
    XLA reads XLA_FLAGS once, at its first compilation: call this before it. A CPU-only run
    ignores both flags."""
    flags = os.environ.get("XLA_FLAGS", "")
    if any(_flag_pattern(flag).search(flags) for flag in (XLA_THREADS_FLAG, XLA_SPLIT_FLAG)):
        return ""
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    added = f"{XLA_THREADS_FLAG}={int(threads)} {XLA_SPLIT_FLAG}=true"
    os.environ["XLA_FLAGS"] = " ".join([*flags.split(), added])
    return added



XLA_TRITON_GEMM_FLAG = "--xla_gpu_enable_triton_gemm"
# Any XLA_FLAGS flag about Triton matrix products (--xla_gpu_enable_triton_gemm,
# --xla_gpu_triton_gemm_any, ...): a user who set one chose how XLA does them.
_USER_TRITON_GEMM = re.compile(r"(?<!\S)--xla_gpu_[^\s=]*triton_gemm")


def set_xla_gemm_backend():
    """XLA's GPU matrix products as cuBLAS calls instead of Triton kernels, for this PROCESS,
    unless XLA_FLAGS already names any --xla_gpu_*triton_gemm* flag (the user's choice stands,
    e.g. --xla_gpu_triton_gemm_any=true). Returns the flag set ("" if none).

    Why: with Triton on, XLA's compile of a step generates, compiles and times dozens of
    Triton configurations for each matrix product (the decoder's and the gradients'); the
    first train call of experiment=fast_mnist spent 22.6-24.4 s in epoch 1's training
    with them against 14.6-16.3 s without, epochs after it 0.39-0.41 s against 0.40-0.43 s
    (one H200, docs/benchmarks.md, "Start-up"). XLA reads XLA_FLAGS once, at its first
    compilation: call this before it. A CPU-only run ignores the flag."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _USER_TRITON_GEMM.search(flags):
        return ""
    added = f"{XLA_TRITON_GEMM_FLAG}=false"
    os.environ["XLA_FLAGS"] = " ".join([*flags.split(), added])
    return added


XLA_CACHE_FLAG = "--tf_xla_persistent_cache_directory"
# train.xla_cache_dir's default (configs/train/default.yaml): a home that cannot hold it (read-only,
# or no home at all) costs the cache, with a notice, not the run; a directory the user names must be made.
DEFAULT_CACHE_DIR = "~/.cache/capsnet/xla"


def set_xla_cache(directory):
    """XLA's persistent compilation cache (train.xla_cache_dir) for this PROCESS: every
    XLA computation compiled afterwards is written into `directory`, and one that is
    there already (the same computation, e.g. the same run config rerun) is loaded
    instead of compiled and autotuned. None: no cache. TensorFlow reads the flag with the
    others in TF_XLA_FLAGS, once (see set_autoclustering): call this before the first
    tensor. Returns the notice to show if the flag replaced another directory, else None.
    A directory that cannot be made is a ConfigError, but for the default (DEFAULT_CACHE_DIR):
    then no cache, and the notice says so."""
    if directory is None:
        return None
    path = Path(directory).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        if str(directory) == DEFAULT_CACHE_DIR:
            return (f"train.xla_cache_dir={directory} cannot be made ({error.strerror or error}): XLA compiles "
                    "without a cache (train.xla_cache_dir=PATH keeps one elsewhere, null says none)")
        raise ConfigError(f"train.xla_cache_dir={directory}: cannot make the directory "
                          f"({error.strerror or error})") from None
    earlier = set_tf_xla_flag(XLA_CACHE_FLAG, path)
    if earlier is not None and earlier != f"{XLA_CACHE_FLAG}={path}":
        return f"train.xla_cache_dir={path} replaces TF_XLA_FLAGS' {earlier}"
    return None

