# syntax=docker/dockerfile:1
# MLflow tracking server with the PostgreSQL driver (psycopg2) and the S3 client (boto3)
# that the stack's backend store and artifact store need; the command comes from
# infra/compose.yaml. Copies nothing from the build context.
FROM python:3.11-slim-bookworm

ARG MLFLOW_VERSION=3.17.2

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MLFLOW_DISABLE_TELEMETRY=true \
    DO_NOT_TRACK=true

RUN pip install "mlflow==${MLFLOW_VERSION}" "psycopg2-binary>=2.9.9,<3" "boto3>=1.34,<2" \
 && useradd --create-home --uid 10001 --user-group mlflow

USER 10001:10001
WORKDIR /home/mlflow
EXPOSE 5000
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
