"""Stage 4, the shards: documents encoded, packed into fixed-length rows and written as
Arrow IPC shards (`stage`, the verb; `packing`, encoding and packing one split; `parallel`,
the encoder threads), the shard format itself (`format`: write, memory-map, verify)
and, with precomputed masking, the masked copies of the training split (`masked_copies`,
the only module here that imports torch).
"""

from mlm_pipeline.shards.format import open_shard, split_shards, verify_shards
from mlm_pipeline.shards.stage import shard_special_ids, shards_digest, write_shards

__all__ = ["open_shard", "shard_special_ids", "shards_digest", "split_shards",
           "verify_shards", "write_shards"]
