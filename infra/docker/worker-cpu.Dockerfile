# syntax=docker/dockerfile:1
# CPU worker image: `prefect worker start --pool local-cpu --type process` (the default
# command); flow runs execute in this container, with the project in /opt/mlm-pipeline, the
# working directory that the deployments' pull step sets. Build context: the repository
# root (compose does this; by hand:
#   docker build -f infra/docker/worker-cpu.Dockerfile -t mlm-pipeline/worker-cpu:0.1.0 .)
# Debian bookworm, because the default corpus (debian:fr) is fetched with apt-get from
# Debian 12's archive.
FROM python:3.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The versions the stack's servers run (infra/compose.yaml); clients should not be newer.
ARG PREFECT_VERSION=3.9.1
ARG MLFLOW_VERSION=3.17.2

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The apt lists stay in the image: the corpus fetcher runs `apt-get download` as the
# unprivileged user, and only root may refresh the lists (rebuild the image to do so).
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && useradd --create-home --uid 10001 --user-group mlm

# torch first, from the CPU-only index: `pip install .` then finds it satisfied instead of
# pulling the CUDA build (several GB) from PyPI. This layer stays cached across code edits.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /opt/mlm-pipeline
COPY pyproject.toml README.md prefect.yaml ./
COPY configs ./configs
COPY flows ./flows
COPY mlm_pipeline ./mlm_pipeline
# torch is named again only to pin it: 2.13.0+cpu satisfies ==2.13.0 (PEP 440 ignores the
# local label), so pip keeps the CPU build. boto3: direct S3 artifact access when a
# deployment points MLflow at an object store instead of the tracking server's proxy.
RUN pip install . "torch==${TORCH_VERSION}" "prefect==${PREFECT_VERSION}" \
        "mlflow==${MLFLOW_VERSION}" "boto3>=1.34,<2" \
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
