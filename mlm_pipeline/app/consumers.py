"""Using a trained model from any SOURCE: `mlm-pipeline fill-mask` and `export`; and its
tokenizer: `mlm-pipeline tokenize`.

A SOURCE is a checkpoint directory, a training run directory (its newest checkpoint), an
MLflow run id (the run's logged model) or a `models:/NAME@ALIAS` URI (also
`models:/NAME/VERSION`, `models:/m-...`). A local SOURCE is used through our checkpoint
(`train.checkpoint`, `train.export`); an MLflow one through the `transformers` directory
it holds (`tracking.registry.download_model`, `evaluate.hf_fill_mask`), which gives the
same predictions. torch, transformers and mlflow are imported inside the functions.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from mlm_pipeline.tracking.registry import RUN_ID, download_model
from mlm_pipeline.tracking.tracker import MlflowTracker

#: What a SOURCE may be (for error messages).
SOURCE_KINDS = ("a checkpoint directory (…/checkpoints/step-XXXXXXXX), a training run "
                "directory holding one, an MLflow run id (32 hex digits) or a "
                "models:/NAME@ALIAS URI")


def is_mlflow_source(source: str) -> bool:
    """True for an MLflow SOURCE (run id or `models:/` URI), False for an existing path.

    Raises:
        ValueError: SOURCE is neither (the message says what is expected).
    """
    if Path(source).exists():
        return False
    if source.startswith("models:/") or RUN_ID.fullmatch(source):
        return True
    raise ValueError(f"SOURCE {source!r} is not {SOURCE_KINDS}: no such checkpoint or run "
                     "directory")


def resolve_checkpoint(path: Path, trust_unverified: bool = False) -> Path:
    """A checkpoint directory, or the newest intact one under a training run directory
    (`train.verified.find_checkpoint`).

    Raises:
        FileNotFoundError: `path` does not exist, or holds no complete checkpoint.
        CheckpointError: the checkpoint is damaged, or every one of the run is; or it
            cannot be verified and `trust_unverified` is false (`UnverifiedCheckpointError`,
            naming `--trust-unverified`).
    """
    from mlm_pipeline.train.verified import find_checkpoint

    return find_checkpoint(path, trust_unverified)


def fill_mask_source(source: str, args: list[str], *, top_k: int,
                     tracker: MlflowTracker, trust_unverified: bool = False
                     ) -> list[dict[str, Any]]:
    """Fill-mask predictions of SOURCE (see `evaluate.fill_mask`).

    Args:
        source: the SOURCE (see the module docstring).
        args: for a local SOURCE, the SentencePiece `.model` file then the texts; for an
            MLflow SOURCE, the texts.
        top_k: candidates per mask.
        tracker: the MLflow backend of an MLflow SOURCE.
        trust_unverified: use a local checkpoint that cannot be verified (no digest).

    Raises:
        ValueError: a bad SOURCE, a local SOURCE without TOKENIZER_MODEL and TEXT, or a
            text without `[MASK]`; a damaged, unverifiable (not trusted) or oversized
            checkpoint (`CheckpointError`, the file named).
        FileNotFoundError: a local SOURCE holds no complete checkpoint.
    """
    if is_mlflow_source(source):
        from mlm_pipeline.evaluate.hf_fill_mask import fill_mask_hf

        with tempfile.TemporaryDirectory(prefix="mlm-fill-mask-") as tmp:
            return fill_mask_hf(download_model(tracker, source, Path(tmp) / "model"), args,
                                top_k=top_k)
    from mlm_pipeline.evaluate.stage import fill_mask
    from mlm_pipeline.tokenizer import Tokenizer
    from mlm_pipeline.train.verified import load_verified

    if len(args) < 2:
        raise ValueError(f"fill-mask {source}: a checkpoint needs TOKENIZER_MODEL and at "
                         "least one TEXT")
    checkpoint = resolve_checkpoint(Path(source), trust_unverified)
    model, state = load_verified(checkpoint, trust_unverified=trust_unverified)
    return fill_mask(model, Tokenizer.load(args[0]), args[1:], seq_len=state["seq_len"],
                     top_k=top_k)


def export_source(source: str, out_dir: str | Path, *, tokenizer: str | None,
                  overwrite: bool, tracker: MlflowTracker,
                  trust_unverified: bool = False) -> dict[str, Any]:
    """Write SOURCE as a `transformers` model directory; returns what was written
    (`checkpoint` or `source`, `out_dir`, `files`: name -> bytes).

    Raises:
        ValueError: a bad SOURCE (one line: what was given, what is expected), a model
            that cannot be exported, or a damaged, unverifiable (unless
            `trust_unverified`) or oversized checkpoint (`CheckpointError`, the file named).
        FileExistsError: `out_dir` is not empty and `overwrite` is false.
        FileNotFoundError: the checkpoint's tokenizer is not found.
    """
    from mlm_pipeline.train.export import export_checkpoint

    if is_mlflow_source(source):
        out = download_model(tracker, source, out_dir, overwrite=overwrite)
        origin = {"source": source}
    else:
        try:
            checkpoint = resolve_checkpoint(Path(source), trust_unverified)
        except FileNotFoundError as exc:
            raise ValueError(f"export: SOURCE {source!r} is not {SOURCE_KINDS}: "
                             f"{exc}") from exc
        out = export_checkpoint(checkpoint, out_dir, tokenizer=tokenizer, overwrite=overwrite,
                                trust_unverified=trust_unverified)
        origin = {"checkpoint": str(checkpoint)}
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    return {**origin, "out_dir": str(out), "files": files}


def tokenize(texts: list[str], config: str | None = None, overrides: list[str] | None = None,
             tokenizer: str | None = None) -> dict[str, Any]:
    """`mlm-pipeline tokenize`: the pieces and ids of `texts` with the trained tokenizer of
    `config` (its stage directory found by digest, `prepared.find_tokenizer`) or the one at
    `tokenizer` (a SentencePiece `.model` file or a tokenizer stage directory).

    Returns:
        `tokenizer` (its path), `vocab_size`, and `results`: per text, `text`, `pieces`
        and `ids`.

    Raises:
        ConfigError: neither or both of `config` and `tokenizer` are given.
        StageMissingError, FileNotFoundError: the tokenizer cannot be found.
    """
    from mlm_pipeline.app.prepared import find_tokenizer
    from mlm_pipeline.config_files import ConfigError, load_config
    from mlm_pipeline.tokenizer import Tokenizer

    if (config is None) == (tokenizer is None):
        raise ConfigError("tokenize: give either CONFIG or --tokenizer")
    tok = Tokenizer.load(tokenizer or find_tokenizer(load_config(config, overrides or [])))
    return {"tokenizer": str(tok.path), "vocab_size": tok.vocab_size, "results": [
        {"text": text, "pieces": [tok.id_to_piece(i) for i in ids], "ids": ids}
        for text, ids in zip(texts, tok.encode(texts))]}
