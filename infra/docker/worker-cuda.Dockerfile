# syntax=docker/dockerfile:1
# CUDA worker image: the local-gpu process worker in compose (profile `gpu`), and the image
# of every flow-run Job on the gpu-k8s Kubernetes pool (infra/k8s/). The project lives in
# /opt/mlm-pipeline, the working directory that the deployments' pull step sets. Build
# context: the repository root
#   docker build -f infra/docker/worker-cuda.Dockerfile -t mlm-pipeline/worker-cuda:0.1.0 .
#
# Base: plain Debian bookworm Python, not nvidia/cuda or pytorch/pytorch (Ubuntu):
# - PyPI's Linux x86_64 torch wheels are CUDA builds that bring the CUDA runtime, cuDNN and
#   NCCL as pip packages (torch 2.13.0: CUDA 13.0, cuDNN 9.20), so a CUDA base image would
#   only duplicate gigabytes;
# - the default corpus (debian:fr) is fetched with apt-get from Debian 12's archive.
# The host provides the driver (CUDA 13 needs NVIDIA driver >= 580) through the NVIDIA
# Container Toolkit or the Kubernetes device plugin. For an older driver, build with
# --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cuXYZ for a CUDA version it
# supports.
FROM python:3.11-slim-bookworm

# Every version (torch, prefect, mlflow, ...) comes from constraints.txt, the set CI tests;
# the servers in infra/compose.yaml run the prefect and mlflow versions pinned there.
ARG TORCH_INDEX_URL=https://pypi.org/simple

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The apt lists stay in the image: the corpus fetcher runs `apt-get download` as the
# unprivileged user, and only root may refresh the lists (rebuild the image to do so).
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && useradd --create-home --uid 10001 --user-group mlm

WORKDIR /opt/mlm-pipeline
COPY constraints.txt ./
# torch first (the big, rarely changing layer), at the version constraints.txt pins (a
# cuXYZ index's 2.13.0+cuXYZ satisfies ==2.13.0 and ranks above PyPI's build; the other
# dependencies come from PyPI at their pinned versions); `pip install .` then finds it
# satisfied.
RUN pip install --index-url "${TORCH_INDEX_URL}" --extra-index-url https://pypi.org/simple \
        -c constraints.txt torch

COPY pyproject.toml README.md prefect.yaml ./
COPY configs ./configs
COPY flows ./flows
COPY mlm_pipeline ./mlm_pipeline
# Extras: what the flows this worker runs may import (tests/infra/test_images.py checks
# it): `gpu` for GPU system metrics, `dask`, `near-dedup` and `s3` as on the CPU worker
# (the local-gpu pool may run the whole main flow, data preparation included).
RUN pip install -c constraints.txt ".[gpu,dask,near-dedup,s3,datasets]" \
 && rm -rf build ./*.egg-info \
 && mkdir -p /opt/mlm-pipeline/.mlm-pipeline /var/cache/mlm-pipeline \
 && chown 10001:10001 /opt/mlm-pipeline/.mlm-pipeline /var/cache/mlm-pipeline

# NVIDIA_DRIVER_CAPABILITIES: the driver parts the container runtime mounts (CUDA and
# nvidia-smi). NVIDIA_VISIBLE_DEVICES is deliberately unset: which GPUs a container gets is
# the runtime's decision (compose device reservation, Kubernetes nvidia.com/gpu limit).
# PWD: `docker exec` and the worker start without a shell, so nothing else sets it, and
# prefect.yaml's pull step is `set_working_directory: "{{ $PWD }}"`.
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PWD=/opt/mlm-pipeline \
    MLM_PIPELINE_CACHE=/var/cache/mlm-pipeline \
    PREFECT_LOGGING_EXTRA_LOGGERS=mlm_pipeline \
    PREFECT_LOGGING_LEVEL=INFO \
    MLFLOW_DISABLE_TELEMETRY=true \
    DO_NOT_TRACK=true

USER 10001:10001
CMD ["prefect", "worker", "start", "--pool", "local-gpu", "--type", "process"]
