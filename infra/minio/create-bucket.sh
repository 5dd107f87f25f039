#!/bin/sh
# One-shot MinIO setup, safe to rerun: the private bucket $BUCKET and the user
# $MLFLOW_S3_ACCESS_KEY that may read and write only that bucket (policy `mlflow-artifacts`).
# Shell built-ins and `mc` only: the mc image has little else.
set -eu
: "${MINIO_ROOT_USER:?}" "${MINIO_ROOT_PASSWORD:?}" "${MLFLOW_S3_ACCESS_KEY:?}" "${MLFLOW_S3_SECRET_KEY:?}" "${BUCKET:?}"

mc alias set store http://minio:9000 "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD"
mc mb --ignore-existing "store/$BUCKET"
mc anonymous set none "store/$BUCKET"

policy=/tmp/mlflow-artifacts-policy.json
printf '%s\n' \
  '{"Version": "2012-10-17", "Statement": [' \
  "  {\"Effect\": \"Allow\", \"Action\": [\"s3:GetBucketLocation\", \"s3:ListBucket\", \"s3:ListBucketMultipartUploads\"], \"Resource\": [\"arn:aws:s3:::$BUCKET\"]}," \
  "  {\"Effect\": \"Allow\", \"Action\": [\"s3:GetObject\", \"s3:PutObject\", \"s3:DeleteObject\", \"s3:AbortMultipartUpload\", \"s3:ListMultipartUploadParts\"], \"Resource\": [\"arn:aws:s3:::$BUCKET/*\"]}" \
  ']}' > "$policy"
mc admin policy create store mlflow-artifacts "$policy"
mc admin user add store "$MLFLOW_S3_ACCESS_KEY" "$MLFLOW_S3_SECRET_KEY"
# `policy attach` fails when the policy is attached already (a rerun).
case "$(mc admin user info store "$MLFLOW_S3_ACCESS_KEY")" in
  *mlflow-artifacts*) ;;
  *) mc admin policy attach store mlflow-artifacts --user "$MLFLOW_S3_ACCESS_KEY" ;;
esac
echo "minio-init: bucket $BUCKET ready"
