# capsnet for NVIDIA GPUs. A CUDA 12 *devel* base, so nvcc is there to build the op with
# its CUDA kernels inside the image (TensorFlow 2.21 is built with CUDA 12.5; its cuDNN 9
# comes with this base).
#   docker build -t capsnet .
#   docker run --gpus all -v $PWD/outputs:/capsnet/outputs capsnet custom_op=true
FROM nvidia/cuda:12.5.1-cudnn-devel-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev make g++ \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /capsnet
COPY . .
# `make install`'s steps (.venv, dependencies, the op library), plus TensorFlow's pinned
# CUDA runtime wheels (cuDNN, NCCL, ...) so it does not depend on the versions in the base
# image. `make ops-cuda`, not `make ops`: `docker build` sees no GPU driver, and `make ops`
# would leave the CUDA kernels out.
RUN make ops-cuda EXTRAS=test,cuda

ENTRYPOINT [".venv/bin/python", "train.py"]
