# syntax=docker/dockerfile:1
# CPU worker image: `prefect worker start --pool local-cpu --type process` (the default
# command); flow runs execute in this container, with the project in /opt/mlm-pipeline, the
# working directory that the deployments' pull step sets. Build context: the repository
# root (compose does this; by hand:
#   docker build -f infra/docker/worker-cpu.Dockerfile -t mlm-pipeline/worker-cpu:0.1.0 .)
# Debian bookworm, because the default corpus (debian:fr) is fetched with apt-get from
# Debian 12's archive.
FROM python:3.11-slim-bookworm

# Every version (torch, prefect, mlflow, ...) comes from constraints.txt, the set CI tests;
# the servers in infra/compose.yaml run the prefect and mlflow versions pinned there.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

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
# torch first, at the version constraints.txt pins, from the CPU-only index (its build
# 2.13.0+cpu ranks above PyPI's CUDA 2.13.0, and satisfies ==2.13.0: PEP 440 ignores the
# local label; its dependencies, at their pinned versions, come from PyPI): `pip install .`
# then finds it satisfied instead of pulling the CUDA build (several GB). This layer stays
# cached across code edits.
RUN pip install --index-url "${TORCH_INDEX_URL}" --extra-index-url https://pypi.org/simple \
        -c constraints.txt torch

COPY pyproject.toml README.md prefect.yaml ./
COPY configs ./configs
COPY flows ./flows
COPY mlm_pipeline ./mlm_pipeline
# The installed CPU torch satisfies the constraint, so pip keeps it. Extras: what the
# flows this worker runs may import (tests/infra/test_images.py checks it): `dask` for
# prepare-data with data.executor: dask, `near-dedup` for ingest.near_dedup_threshold, `s3`
# for s3:// work directories and sources (s3fs) and direct S3 artifact access when a
# deployment points MLflow at an object store instead of the tracking server's proxy (boto3).
RUN pip install -c constraints.txt ".[dask,near-dedup,s3,datasets]" \
 && rm -rf build ./*.egg-info \
 && mkdir -p /opt/mlm-pipeline/.mlm-pipeline /var/cache/mlm-pipeline \
 && chown 10001:10001 /opt/mlm-pipeline/.mlm-pipeline /var/cache/mlm-pipeline

# PWD: `docker exec` and the worker start without a shell, so nothing else sets it, and
# prefect.yaml's pull step is `set_working_directory: "{{ $PWD }}"`.
ENV PWD=/opt/mlm-pipeline \
    MLM_PIPELINE_CACHE=/var/cache/mlm-pipeline \
    PREFECT_LOGGING_EXTRA_LOGGERS=mlm_pipeline \
    PREFECT_LOGGING_LEVEL=INFO \
    MLFLOW_DISABLE_TELEMETRY=true \
    DO_NOT_TRACK=true

USER 10001:10001
CMD ["prefect", "worker", "start", "--pool", "local-cpu", "--type", "process"]
