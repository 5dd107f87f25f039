"""Shared, session-scoped fixtures: a tiny French corpus, tokenizer and shards.

The corpus manifest is built here from `tests/assets/tiny_fr.txt` without the ingest
module (so tokenizer and shard tests do not depend on it): one document per blank-line
separated paragraph, every 10th paragraph (index 9, 19, ...) in the validation split.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mlm_pipeline.config import IngestConfig, ModelConfig, ShardConfig, TokenizerConfig
from mlm_pipeline.manifest import (
    CorpusManifest,
    ShardManifest,
    SourceEntry,
    TokenizerManifest,
    compute_digest,
    file_entry,
    sha256_file,
    write_manifest,
)

ASSETS = Path(__file__).parent / "assets"
TINY_FR = ASSETS / "tiny_fr.txt"


def read_tiny_paragraphs() -> list[str]:
    """The paragraphs of `tiny_fr.txt`, NFC-normalized, in file order."""
    text = TINY_FR.read_text(encoding="utf-8")
    return [unicodedata.normalize("NFC", p.strip()) for p in text.split("\n\n") if p.strip()]


def build_corpus_manifest(out_dir: Path, paragraphs: list[str]) -> CorpusManifest:
    """Write `paragraphs` as a two-split Parquet corpus in `out_dir` and its manifest.

    Every 10th paragraph (index % 10 == 9) goes to validation, the rest to train.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "validation": []}
    for i, text in enumerate(paragraphs):
        splits["validation" if i % 10 == 9 else "train"].append((f"tiny_fr.txt:{i}", text))
    entries = {}
    for name, docs in splits.items():
        path = out_dir / f"{name}-00000.parquet"
        table = pa.table(
            {
                "id": [d[0] for d in docs],
                "text": [d[1] for d in docs],
                "source": [str(TINY_FR)] * len(docs),
            }
        )
        pq.write_table(table, path)
        entries[name] = [file_entry(out_dir, path, rows=len(docs))]
    source_sha = sha256_file(TINY_FR)
    cfg = IngestConfig(sources=[str(TINY_FR)], validation_fraction=0.1)
    inputs = {str(TINY_FR): source_sha, "paragraphs": compute_digest("raw", paragraphs, {})}
    manifest = CorpusManifest(
        stage="ingest",
        digest=compute_digest("ingest", cfg, inputs),
        output_dir=str(out_dir.resolve()),
        config=cfg.model_dump(mode="json"),
        inputs=inputs,
        created_at=0.0,
        wall_time_s=0.0,
        sources=[
            SourceEntry(
                path=str(TINY_FR),
                sha256=source_sha,
                bytes=TINY_FR.stat().st_size,
                documents=len(paragraphs),
            )
        ],
        train=entries["train"],
        validation=entries["validation"],
        documents_read=len(paragraphs),
        documents_kept=len(paragraphs),
        documents_train=len(splits["train"]),
        documents_validation=len(splits["validation"]),
        characters=sum(len(p) for p in paragraphs),
        dropped={},
        repaired={},
    )
    write_manifest(manifest)
    return manifest


@pytest.fixture(scope="session")
def tiny_paragraphs() -> list[str]:
    """The documents of `tiny_fr.txt` (NFC paragraphs), in order."""
    return read_tiny_paragraphs()


@pytest.fixture(scope="session")
def make_corpus_manifest():
    """`build_corpus_manifest(out_dir, paragraphs)`: a corpus of your own paragraphs."""
    return build_corpus_manifest


@pytest.fixture(scope="session")
def tiny_work_dir(tmp_path_factory) -> Path:
    """A session-wide pipeline work directory for the tiny fixtures."""
    return tmp_path_factory.mktemp("work")


@pytest.fixture(scope="session")
def tiny_corpus_manifest(tmp_path_factory) -> CorpusManifest:
    """`tiny_fr.txt` as an ingested corpus (about 23 train and 2 validation documents)."""
    return build_corpus_manifest(tmp_path_factory.mktemp("corpus"), read_tiny_paragraphs())


@pytest.fixture(scope="session")
def tiny_tokenizer_config() -> TokenizerConfig:
    """Unigram, vocab_size 128."""
    return TokenizerConfig(vocab_size=128)


@pytest.fixture(scope="session")
def tiny_tokenizer_manifest(
    tiny_tokenizer_config, tiny_corpus_manifest, tiny_work_dir
) -> TokenizerManifest:
    """A SentencePiece unigram model with 128 pieces trained on the tiny corpus."""
    from mlm_pipeline.tokenizer.stage import train_tokenizer

    return train_tokenizer(tiny_tokenizer_config, tiny_corpus_manifest, tiny_work_dir)


@pytest.fixture(scope="session")
def tiny_shard_config() -> ShardConfig:
    """seq_len 16; small shards and encode batches so that both boundaries are crossed."""
    return ShardConfig(seq_len=16, rows_per_shard=64, encode_batch_size=4)


@pytest.fixture(scope="session")
def tiny_shard_manifest(
    tiny_shard_config, tiny_corpus_manifest, tiny_tokenizer_manifest, tiny_work_dir
) -> ShardManifest:
    """Packed rows of 16 tokens of the tiny corpus (several train shards, one validation)."""
    from mlm_pipeline.shards.stage import write_shards

    return write_shards(
        tiny_shard_config, tiny_corpus_manifest, tiny_tokenizer_manifest, tiny_work_dir
    )


@pytest.fixture(scope="session")
def tiny_model_config() -> ModelConfig:
    """hidden 32, 2 layers, 2 heads, feed-forward 64, no dropout."""
    return ModelConfig(
        hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, dropout=0.0
    )


def reference_reservoir_sample(items: list, k: int, seed: int) -> list:
    """Algorithm R (Vitter 1985) as `documents.write_training_text` documents it, one item
    at a time: item t >= k draws j = min(floor(u * (t + 1)), t), u = (x >> 11) * 2**-53,
    x the next raw output of numpy's PCG64(seed); the kept items in input order."""
    import math

    import numpy as np

    bits = np.random.PCG64(seed)
    slots = list(range(min(k, len(items))))
    for t in range(k, len(items)):
        u = (int(bits.random_raw()) >> 11) * 2.0**-53
        if (j := min(math.floor(u * (t + 1)), t)) < k:
            slots[j] = t
    return [items[i] for i in sorted(slots)]


@pytest.fixture(scope="session")
def reservoir_sample():
    """`reference_reservoir_sample(items, k, seed)`: the training-text sample, computed
    independently of the module."""
    return reference_reservoir_sample
