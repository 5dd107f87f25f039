# syntax=docker/dockerfile:1
# MLflow tracking server with what the stack's stores and login need: the PostgreSQL driver
# (psycopg2), the S3 client (boto3) and Flask-WTF (the basic-auth app); the command comes from
# infra/compose.yaml. Copies only constraints.txt from the build context (the repository
# root): every package at the version pinned there, the mlflow CI tests.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MLFLOW_DISABLE_TELEMETRY=true \
    DO_NOT_TRACK=true

COPY constraints.txt /tmp/constraints.txt
# Flask-WTF: the basic-auth app (`--app-name basic-auth`, mlflow's `auth` extra) needs it.
# /var/lib/mlflow-auth: the login database; a new named volume copies this owner.
RUN pip install -c /tmp/constraints.txt mlflow Flask-WTF psycopg2-binary boto3 \
 && rm /tmp/constraints.txt \
 && useradd --create-home --uid 10001 --user-group mlflow \
 && mkdir -p /var/lib/mlflow-auth \
 && chown 10001:10001 /var/lib/mlflow-auth

USER 10001:10001
WORKDIR /home/mlflow
EXPOSE 5000
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
