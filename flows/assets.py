"""The stage outputs as Prefect assets: corpus -> tokenizer -> shards -> model.

Each output is an asset keyed by its digest (`mlm_pipeline.tracking.version_lineage.
asset_key`: `mlm://corpus/<digest[:16]>`, ..., `.../model/<checkpoint state_sha256[:16]>`).
A stage's key is known only once it has computed its digest, while `materialize` fixes a
task's assets when the task is built; so a small task built per output reports it right
after the stage (`prefect.asset.materialization.succeeded`, its inputs as related assets),
and the UI's asset graph draws the edges. A reused stage is reported too (metadata
`reused`); the reporting task is not cached (a `Cached` task run emits no asset event).

Dependencies: tokenizer <- corpus (with `tokenizer.from_init` too: the corpus it served),
shards <- corpus + tokenizer, model <- shards + tokenizer (+ the parent model when
warm-started: its checkpoint digest, `TrainManifest.init`).
"""

from __future__ import annotations

from typing import Any

from prefect.assets import Asset, AssetProperties, materialize

from mlm_pipeline.manifest import CorpusManifest, ShardManifest, TokenizerManifest, TrainManifest
from mlm_pipeline.tracking.version_lineage import asset_key, model_digest

from mlm_pipeline_flows.task_support import NOT_CACHED


def stage_asset(stage: str, digest: str, description: str) -> Asset:
    """The asset of a `stage` output with content `digest` (named `<stage> <digest[:12]>`)."""
    return Asset(key=asset_key(stage, digest), properties=AssetProperties(
        name=f"{stage} {digest[:12]}", description=description))


def _report(asset: Asset, deps: list[Asset], metadata: dict[str, Any]) -> None:
    """Run a task that materializes `asset` from `deps` with `metadata` in this flow run."""

    def report() -> None:
        """Nothing to compute: the event reports the stage's output."""
        asset.add_metadata(metadata)

    materialize(asset, asset_deps=deps, name=f"asset-{asset.key.split('/')[2]}",
                **NOT_CACHED)(report)()


def _metadata(manifest, started_at: float | None, **extra: Any) -> dict[str, Any]:
    return {"digest": manifest.digest, "path": str(manifest.path),
            "reused": started_at is not None and manifest.created_at < started_at, **extra}


def report_data_assets(corpus: CorpusManifest, tokenizer: TokenizerManifest,
                       shards: ShardManifest, started_at: float | None = None
                       ) -> dict[str, Asset]:
    """Report the three data outputs as assets (see the module docstring); returns them
    by stage. `started_at` (Unix time, s): outputs made before it are marked reused."""
    assets = {"corpus": stage_asset("corpus", corpus.digest, "cleaned, deduplicated "
                                    "documents split into train and validation (ingest)"),
              "tokenizer": stage_asset("tokenizer", tokenizer.digest, "SentencePiece model"),
              "shards": stage_asset("shards", shards.digest, "packed Arrow token shards")}
    _report(assets["corpus"], [], _metadata(
        corpus, started_at, documents_train=corpus.documents_train,
        documents_validation=corpus.documents_validation))
    _report(assets["tokenizer"], [assets["corpus"]], _metadata(
        tokenizer, started_at, vocab_size=tokenizer.vocab_size))
    _report(assets["shards"], [assets["corpus"], assets["tokenizer"]], _metadata(
        shards, started_at, train_rows=shards.train.rows, seq_len=shards.seq_len))
    return assets


def report_model_asset(trained: TrainManifest, tokenizer: TokenizerManifest,
                       shards: ShardManifest, registered: dict[str, Any] | None = None
                       ) -> Asset:
    """Report the trained model (its final checkpoint) as an asset depending on `shards`,
    `tokenizer` and the parent model of a warm start (when the parent checkpoint has a
    digest: an unverified one has none); `registered` (`app.publish.publish`'s record) adds
    the model URI, registered version and decision to the metadata."""
    digest = model_digest(trained)
    asset = stage_asset("model", digest, "trained checkpoint (final step)")
    deps = [stage_asset("shards", shards.digest, "packed Arrow token shards"),
            stage_asset("tokenizer", tokenizer.digest, "SentencePiece model")]
    if trained.init and trained.init.get("digest"):  # "" for an unverified parent
        deps.append(stage_asset("model", str(trained.init["digest"]),
                                "trained checkpoint (final step)"))
    metadata: dict[str, Any] = {"digest": digest, "steps": trained.steps,
                                "checkpoint": str(trained.file(trained.checkpoint_dir))}
    if registered:
        metadata.update({k: registered.get(k)
                         for k in ("model_uri", "name", "version", "decision")})
    _report(asset, deps, metadata)
    return asset
