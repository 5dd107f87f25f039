# syntax=docker/dockerfile:1
# MLflow tracking server with the PostgreSQL driver (psycopg2) and the S3 client (boto3)
# that the stack's backend store and artifact store need; the command comes from
# infra/compose.yaml. Copies only constraints.txt from the build context (the repository
# root): mlflow, boto3 and psycopg2-binary at the versions pinned there, the mlflow CI tests.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MLFLOW_DISABLE_TELEMETRY=true \
    DO_NOT_TRACK=true

COPY constraints.txt /tmp/constraints.txt
RUN pip install -c /tmp/constraints.txt mlflow psycopg2-binary boto3 \
 && rm /tmp/constraints.txt \
 && useradd --create-home --uid 10001 --user-group mlflow

USER 10001:10001
WORKDIR /home/mlflow
EXPOSE 5000
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
