#!/usr/bin/env bash
# The NCCL that TensorFlow 2.21 was built against (nvidia-nccl-cu12, CUDA 12), for the lent
# GPU machines, whose only NCCL is PyTorch's CUDA 13 build (nvidia-nccl-cu13) and whose
# gpu-kit leaves NCCL out. Packed into parts that travel one per command, as the kit's do:
#   bash scripts/pack_nccl.sh                      # here: .ncclkit/part.NN + MANIFEST (~4 × 60 MiB)
#   command: mkdir -p /tmp/ncclkit && cp .ncclkit/part.* .ncclkit/MANIFEST /tmp/ncclkit/
#   carry:   [".ncclkit/part.NN", ".ncclkit/MANIFEST"]      (one part a call, back to back)
# `bash scripts/gpu_session.sh scale` then unpacks /tmp/ncclkit and puts it first on
# LD_LIBRARY_PATH (else it falls back on PyTorch's NCCL and says so).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"  # the parts go into the repository's root, as the kit's
version="${NCCL_VERSION:-2.27.7}"  # tensorflow[and-cuda] 2.21: nvidia-nccl-cu12>=2.27.7,<3
out="$PWD/.ncclkit"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/ncclkit/$version"
if [ ! -f "$cache/libnccl.so.2.xz" ]; then
  work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work" "nvidia-nccl-cu12==$version"
  (cd "$work" && python3 -m zipfile -e nvidia_nccl_cu12-*.whl x)
  echo "pack_nccl: compressing libnccl.so.2 ($(du -h "$work/x/nvidia/nccl/lib/libnccl.so.2" | cut -f1)), a few minutes"
  mkdir -p "$cache"
  xz -T0 -6 -c "$work/x/nvidia/nccl/lib/libnccl.so.2" > "$cache/libnccl.so.2.xz.tmp"
  mv "$cache/libnccl.so.2.xz.tmp" "$cache/libnccl.so.2.xz"
fi
rm -rf "$out"; mkdir -p "$out"
split -b 60M -d -a 2 "$cache/libnccl.so.2.xz" "$out/part."
(cd "$out" && sha256sum part.* > MANIFEST && echo "nvidia-nccl-cu12==$version" > VERSION)
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.ncclkit/' "$exclude" 2>/dev/null || echo '/.ncclkit/' >> "$exclude"
echo "pack_nccl: $(ls "$out"/part.* | wc -l) parts in .ncclkit/ (nvidia-nccl-cu12==$version)"
