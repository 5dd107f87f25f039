"""Pack encoded documents into fixed-length rows and write them as Arrow IPC shards.

Packing ("full sentences", RoBERTa, Liu et al. 2019, §4.2, with BERT's [CLS] / [SEP]
convention, Devlin et al. 2019, §3). Each split is read as one token stream

    doc1 [SEP] doc2 [SEP] doc3 [SEP] ...

in document order, and cut into rows of `seq_len` tokens: every row is [CLS] followed by the
next `seq_len - 1` stream tokens. Rows therefore cross document boundaries (a [SEP] marks each
boundary), every row is full, and there is no padding inside the corpus. The stream tokens
left after the last full row (fewer than `seq_len - 1`) are the split's single remainder: they
are counted (`remainder_tokens`) and not written. For each split

    tokens_in = pieces + documents = rows * (seq_len - 1) + remainder_tokens
    remainder_tokens = remainder_content_tokens + remainder_separators

so the document pieces in the rows plus `remainder_content_tokens` are the pieces of every
document, exactly (the remainder's [SEP] tokens are counted apart).

Storage. One Arrow IPC file format (Feather v2, uncompressed) file per `rows_per_shard` rows,
named `train-00000.arrow`, `validation-00000.arrow`, ...; one column `input_ids` of type
`fixed_size_list<uint16>[seq_len]` (uint32 when `vocab_size > 65536`). Each shard is written
as a single record batch: record batches in an IPC file are separated by metadata, and only
one contiguous buffer lets `open_shard` return a zero-copy memory-mapped `(rows, seq_len)`
array.

Speed and memory. Documents are read from Parquet in batches of at most
`encode_batch_size` documents and `encode_batch_bytes` bytes of text (a longer document
alone) and encoded on `num_threads` worker threads, one batch per task with a
single-threaded SentencePiece call (it releases the GIL), ids returned as numpy arrays;
packing and writing run in the calling thread, in batch order, so the shards are
byte-identical for any thread count (or on partitions elsewhere, `write_shards(encode=...)`,
`mlm_pipeline.shards.parallel`). Each shard's sha256 is computed while it is written. Rows
are appended to the shard's temporary body file as they are packed, and the shard is
written around it when full (`packing.ShardWriter`), so memory is a few batches in flight,
never a whole shard or split; Arrow allocates from a pool that returns freed memory
meanwhile (`_returning_memory_pool`).

Precomputed masking (`masking.mode: precomputed`). The unmasked shards above are written
as always (evaluation baselines and the reference for the copies read them); in addition,
the training split gets `dupe_factor` masked copies, copy `c` of shard `i` named
`train-copy{c}-{i:05d}.arrow`, with the same rows, in the same order, as
`train-{i:05d}.arrow`. Each holds two columns: `input_ids`,
`fixed_size_list<uint16|uint32>[seq_len]` (the corrupted ids, storage dtype of the split),
and `labels`, `fixed_size_list<int32>[seq_len]` (the original id where the position is
predicted, -100 elsewhere). They are made by `mlm_pipeline.masking.KeyedMasking` keyed by
`(masking.seed, epoch=c, row_index=global train row)`, so a copy equals what dynamic
masking gives in epoch `c`. The copies' entries follow the unmasked ones in
`ShardManifest.train.shards` (`ShardSplit.rows` stays the rows of one copy;
`ShardSplit.masked_copies` = `dupe_factor`, `ShardManifest.masking` = the masking config
and seed); `format.masked_copies` and `format.split_shards` tell them apart by that count
(by name for manifests written before it). `masked_copies.write_masked_copies` writes them,
with the config's `selection` and `whole_word` (word starts from `Tokenizer.word_starts`).
The validation split is never masked here: evaluation masks it with its own fixed seed.

This module may import numpy and pyarrow; it imports torch only inside the precomputed
path (never at import time).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa

from mlm_pipeline.config import MaskingConfig, ShardConfig, SpecialIds
from mlm_pipeline.ingest.hashing import HashMemo
from mlm_pipeline.locks import remove_stale_temporaries, reuse_or_build
from mlm_pipeline.manifest import (
    CorpusManifest, ShardManifest, ShardSplit, Stopwatch, TokenizerManifest, compute_digest,
    load_if_complete, stage_dir, write_manifest,
)
from mlm_pipeline.progress import NullProgress, Progress
from mlm_pipeline.shards.packing import Encoder, write_split
from mlm_pipeline.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

STAGE = "shards"
#: Value of `ShardManifest.packing` for the scheme in the module docstring.
PACKING = "full-sentences: [CLS] + (seq_len-1) tokens of the doc[SEP] stream, remainder dropped"
#: Largest vocabulary whose ids fit in uint16.
UINT16_VOCAB = 1 << 16
#: ShardConfig fields that do not change the shards (see `shards_digest`).
_SCHEDULING_FIELDS = {"num_threads", "encode_batch_size", "encode_batch_bytes"}


def _precomputed(masking: MaskingConfig | None) -> bool:
    return masking is not None and masking.mode == "precomputed"


def _inputs(corpus: CorpusManifest, tokenizer: TokenizerManifest) -> dict[str, str]:
    return {"corpus": corpus.digest, "tokenizer": tokenizer.digest,
            "tokenizer_model": tokenizer.model.sha256}


def shards_digest(cfg: ShardConfig, corpus: CorpusManifest, tokenizer: TokenizerManifest,
                  masking: MaskingConfig | None = None) -> str:
    """Identity of the shards `write_shards(cfg, corpus, tokenizer, work_dir, masking)`
    writes. Without precomputed masking it does not depend on `masking`; with it, on all
    of it (seed included; hashed as before the seed moved into `MaskingConfig`, so
    digests are unchanged). It never depends on `num_threads`, `encode_batch_size` or
    `encode_batch_bytes`: they schedule the work and do not change the shards, so changing
    them reuses the cached shards. The tokenizer enters by its digest and its model file's
    sha256: shards are never reused with a model other than the one that encoded them."""
    inputs = _inputs(corpus, tokenizer)
    shard_cfg = cfg.model_dump(mode="json", exclude=_SCHEDULING_FIELDS)
    if not _precomputed(masking):
        return compute_digest(STAGE, shard_cfg, inputs)
    # The masking algorithm's version is part of the identity: copies made by an earlier
    # hash must never be mistaken for what dynamic masking gives today.
    from mlm_pipeline.masking.keyed import MASKING_ALGORITHM  # torch, only on this path

    return compute_digest(STAGE, {"shards": shard_cfg, "masking": masking.masks_record(),
                                  "seed": masking.seed, "masking_algorithm": MASKING_ALGORITHM},
                          inputs)


def shard_special_ids(shards: ShardManifest, tokenizer: TokenizerManifest) -> SpecialIds:
    """The special ids the shards were written with, which training and evaluation mask
    and pack with: `shards.special_ids`, once they equal the tokenizer's.

    Raises:
        ValueError: the shards were written with other ids than the tokenizer's (both
            manifests named): a run would mix two vocabularies' ids.
    """
    if shards.special_ids != tokenizer.special_ids:
        raise ValueError(
            f"shards {shards.path} were written with special ids "
            f"{shards.special_ids.roles()}, but tokenizer {tokenizer.path} has "
            f"{tokenizer.special_ids.roles()}: write the shards with this tokenizer")
    return shards.special_ids


@contextmanager
def _returning_memory_pool() -> Iterator[None]:
    """Make Arrow allocate from a pool that returns freed memory at once while the block
    runs: jemalloc with purging decay 0, or malloc where pyarrow lacks jemalloc.

    pyarrow's default pool (mimalloc here) keeps freed pages for reuse: reading the 16x
    benchmark corpus (benchmarks/bench_data.py) kept ~100 MiB resident against ~50 MiB at
    1x. malloc returns them but fragments: peak RSS of the stage at 1x / 16x was
    156 / 207 MiB with mimalloc, 137 / 205 with malloc, 138 / 183 with jemalloc, decay 0
    (https://arrow.apache.org/docs/python/memory.html#memory-pools). The pool is
    process-wide, so the previous one is restored afterwards; the decay setting applies to
    Arrow's own jemalloc only.
    """
    previous = pa.default_memory_pool()
    try:
        pool = pa.jemalloc_memory_pool()
        pa.jemalloc_set_decay_ms(0)
    except NotImplementedError:  # a pyarrow built without jemalloc
        pool = pa.system_memory_pool()
    pa.set_memory_pool(pool)
    try:
        yield
    finally:
        pa.set_memory_pool(previous)


def write_shards(cfg: ShardConfig, corpus: CorpusManifest, tokenizer: TokenizerManifest,
                 work_dir: str | os.PathLike[str], masking: MaskingConfig | None = None,
                 progress: Progress | None = None, encode: Encoder | None = None
                 ) -> ShardManifest:
    """Encode both splits, pack them into rows and write Arrow shards (or reuse cached ones).

    Args:
        cfg: `seq_len` (tokens per row, [CLS] included), `rows_per_shard`,
            `encode_batch_size` and `encode_batch_bytes` (most documents and bytes of text
            per encode task), `num_threads` (encode worker threads, 0 = one per core this
            process may use; the output does not depend on it).
        corpus: the ingested corpus (`train` and `validation` Parquet files).
        tokenizer: the trained tokenizer.
        work_dir: pipeline work directory; output goes to `<work_dir>/shards/<digest[:16]>`.
        masking: with `mode="precomputed"`, also write `dupe_factor` masked copies of the
            training split, keyed by `masking.seed` (module docstring); None or
            `dynamic` writes only token rows.
        progress: where to report stages `shards train` and `shards validation`
            (`mlm_pipeline.progress`): documents encoded of the split's, with `rows`
            written so far (the rows' total is known only at the end: the split's `rows`).
        encode: `(documents, doc[SEP] stream)` of a split's Parquet files, in order; None
            encodes on threads here (`shards.parallel`: on partitions elsewhere, same bytes).

    Returns:
        The manifest: per split the shard files (rows, tokens = rows * seq_len, sha256),
        rows (of one copy), documents, `tokens_in`, `remainder_tokens` (split into
        `remainder_content_tokens` and `remainder_separators`) and `masked_copies`;
        `masking` (config and seed) when copies were written.

    Raises:
        ValueError: the training split yields no full row (the corpus is smaller than one
            row of `seq_len` tokens), the tokenizer model differs from its manifest, a
            Parquet file is malformed (the file is named), or a path in a manifest is
            outside its stage directory (`ManifestPathError`, the manifest named).
    """
    digest = shards_digest(cfg, corpus, tokenizer, masking)
    out_dir = stage_dir(work_dir, STAGE, digest)
    # Reused only when every shard still has its sha256 (else the changed one is named in
    # a warning and the shards written again).
    cached, reused = reuse_or_build(
        out_dir, STAGE,
        lambda: load_if_complete(out_dir, ShardManifest, digest, HashMemo(work_dir).file_sha256),
        lambda: _build(cfg, corpus, tokenizer, masking, digest, out_dir,
                       progress or NullProgress(), encode))
    if reused:
        logger.info("shards: reusing %s", out_dir)
    return cached


def _build(cfg: ShardConfig, corpus: CorpusManifest, tokenizer: TokenizerManifest,
           masking: MaskingConfig | None, digest: str, out_dir: Path,
           progress: Progress, encode: Encoder | None = None) -> ShardManifest:
    """Write `out_dir` (the caller holds its `stage_lock`); errors: `write_shards`'s."""
    watch = Stopwatch()
    tok = Tokenizer.load(tokenizer)  # checks the special-token ids and the model's sha256
    # Tokenizer.encode returns Python int lists; the batch encoder's numpy output avoids an
    # int object per token. Texts are ingested documents, already normalized.
    encoder, special_ids = tok.batch_encoder(), tok.special_ids
    dtype = "uint16" if tokenizer.vocab_size <= UINT16_VOCAB else "uint32"
    out_dir.mkdir(parents=True, exist_ok=True)
    # Temporary files of a killed earlier attempt: never shards, always rewritten.
    remove_stale_temporaries(out_dir)
    splits: dict[str, ShardSplit] = {}
    for name, files in (("train", corpus.train), ("validation", corpus.validation)):
        paths = [corpus.file(e.path) for e in files]
        with _returning_memory_pool():
            progress.start(f"shards {name}", float(sum(e.rows or 0 for e in files)),
                           "documents", f"seq_len {cfg.seq_len}")
            split = write_split(name, paths, encoder, cfg, dtype, out_dir, progress, encode,
                                special_ids)
            progress.finish(f"shards {name}", rows=split.rows)
        if split.rows == 0:
            if name == "train":
                raise ValueError(
                    f"shards: the corpus is smaller than one row of seq_len={cfg.seq_len} "
                    f"tokens: the training split has {split.tokens_in} tokens "
                    f"({split.documents} documents) and a row needs {cfg.seq_len - 1} "
                    "after [CLS]; lower shards.seq_len or add text")
            logger.warning("shards: the %s split (%d documents, %d tokens) is shorter than one "
                           "row of seq_len=%d; it has no shards", name, split.documents,
                           split.tokens_in, cfg.seq_len)
        splits[name] = split
    config = cfg.model_dump(mode="json")
    masking_record = None
    if _precomputed(masking):
        train = splits["train"]
        from mlm_pipeline.shards.masked_copies import write_masked_copies  # torch: only here

        copies = write_masked_copies(train.shards, out_dir, masking, tok, cfg.seq_len)
        splits["train"] = train.model_copy(update={"shards": train.shards + copies,
                                                   "masked_copies": masking.dupe_factor})
        from mlm_pipeline.masking.keyed import MASKING_ALGORITHM

        masking_record = masking.masks_record() | {
            "seed": masking.seed, "algorithm": MASKING_ALGORITHM}
        # Also beside the shard config, where `maskers.build_masker` checks that a trainer's
        # masking matches the copies.
        config |= {"masking": masking.masks_record(), "masking_seed": masking.seed,
                   "masking_algorithm": MASKING_ALGORITHM}
    manifest = ShardManifest(
        stage=STAGE, digest=digest, output_dir=str(out_dir), config=config,
        inputs=_inputs(corpus, tokenizer), created_at=watch.created_at,
        wall_time_s=watch.elapsed, seq_len=cfg.seq_len, dtype=dtype,
        vocab_size=tokenizer.vocab_size, packing=PACKING, train=splits["train"],
        validation=splits["validation"], masking=masking_record, special_ids=special_ids)
    write_manifest(manifest)
    return manifest
