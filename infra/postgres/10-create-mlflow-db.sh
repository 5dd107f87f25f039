#!/bin/bash
# Creates the `mlflow` role and database beside the `prefect` ones that the postgres image
# makes from POSTGRES_USER / POSTGRES_DB. The image runs this once, when the data volume is
# empty (/docker-entrypoint-initdb.d); later password changes need ALTER ROLE.
# `mlflow` is no superuser and can reach only its own database.
# No `set -u`: the entrypoint sources this file when it is not executable.
set -eo pipefail

if [ -z "${MLFLOW_DB_PASSWORD:-}" ]; then
    echo "10-create-mlflow-db.sh: MLFLOW_DB_PASSWORD is not set" >&2
    exit 1
fi

# The password travels as a psql variable (:'name' quotes it), never through the shell.
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
     --set=mlflow_password="$MLFLOW_DB_PASSWORD" <<'SQL'
CREATE ROLE mlflow LOGIN PASSWORD :'mlflow_password';
CREATE DATABASE mlflow OWNER mlflow;
REVOKE ALL ON DATABASE mlflow FROM PUBLIC;
REVOKE ALL ON DATABASE prefect FROM PUBLIC;
SQL
