"""mlm-pipeline: pretrain BERT-style masked language models end to end.

Stages (one module each): `ingest` -> `tokenizer` -> `shards` -> `train` -> `evaluate`,
with `masking` shared by shards and training and `tracking` the only MLflow user.
Importing this package imports neither torch nor prefect.
"""

__version__ = "0.1.0"
