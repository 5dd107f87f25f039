"""The parent of a run (`train.init_from`): which checkpoint it starts from, the tokenizer
that comes with it, and the retraining policy that picks the registered champion.

A local SOURCE is used where it is; an MLflow SOURCE (a run id, `models:/...`) is fetched
to this machine (`tracking.fetch.fetch_parent_checkpoint`) once, at a fresh start only (a
resumed run never reads its parent again: `models:/NAME@champion` may have moved on).
`train.train` then verifies and loads it (`train.warm_start`). mlflow and torch are
imported inside the functions.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.manifest import CorpusManifest, TokenizerManifest
from mlm_pipeline.progress import Progress
from mlm_pipeline.tracking.fetch import (champion_source, fetch_parent_checkpoint,
                                         registered_model_name)
from mlm_pipeline.tracking.registry import RUN_ID
from mlm_pipeline.tracking.tracker import MlflowTracker

if TYPE_CHECKING:  # pragma: no cover
    from mlm_pipeline.train.warm_start import InitSource

logger = logging.getLogger(__name__)

#: The tag a run of `retrain: continue` gets: `continued` (it started from the champion)
#: or `scratch_no_champion` (there was none yet).
RETRAIN_TAG = "mlm.retrain"


def is_mlflow_source(source: str) -> bool:
    """True when SOURCE names an MLflow run or model (and is not a local path)."""
    return not Path(source).expanduser().exists() and (
        source.startswith("models:/") or RUN_ID.fullmatch(source) is not None)


def fetch_init(cfg: PipelineConfig) -> Path | None:
    """The local checkpoint of an MLflow `train.init_from`, fetched now; None without one
    or for a local SOURCE (`train` resolves and verifies that itself).

    Raises:
        ValueError: the errors of `fetch_parent_checkpoint`.
    """
    source = cfg.train.init_from
    if source is None or not is_mlflow_source(source):
        return None
    return fetch_parent_checkpoint(MlflowTracker.from_config(cfg.tracking), source,
                                   cfg.work_dir)


def init_checkpoint(cfg: PipelineConfig, out_dir: str | Path) -> Path | None:
    """What `train.train` takes as `init_checkpoint` for the run directory `out_dir`: the
    MLflow parent fetched at a fresh start (`out_dir` holds no intact checkpoint yet);
    None when resuming, without `train.init_from`, or for a local SOURCE.

    Raises:
        ValueError: the errors of `fetch_parent_checkpoint`.
    """
    from mlm_pipeline.train.checkpoint import latest_intact_checkpoint

    if cfg.train.init_from is None or latest_intact_checkpoint(
            Path(out_dir) / "checkpoints", cfg.train.trust_unverified_checkpoint) is not None:
        return None
    return fetch_init(cfg)


def parent_of(cfg: PipelineConfig) -> InitSource | None:
    """The verified parent of `cfg` (`train.warm_start.resolve_init`), fetched first when
    it is an MLflow SOURCE; None without `train.init_from`.

    Raises:
        ValueError, FileNotFoundError: the errors of `fetch_parent_checkpoint` and
            `resolve_init`.
    """
    from mlm_pipeline.train.warm_start import resolve_init

    if cfg.train.init_from is None:
        return None
    return resolve_init(cfg.train.init_from, fetch_init(cfg),
                        cfg.train.trust_unverified_checkpoint)


def tokenizer_digest_for(cfg: PipelineConfig, corpus: CorpusManifest) -> str:
    """The digest of the tokenizer `prepare_tokenizer` gives `cfg`: the parent's with
    `tokenizer.from_init`, the adopted files' with `tokenizer.adopt_from`, else
    `tokenizer_digest(cfg.tokenizer, corpus)`.

    Raises:
        ValueError, FileNotFoundError: the errors of `parent_of` and
            `pretrained_tokenizer_digest`.
    """
    from mlm_pipeline.tokenizer import pretrained_tokenizer_digest, tokenizer_digest

    if cfg.tokenizer.adopt_from is not None:
        return pretrained_tokenizer_digest(cfg.tokenizer.adopt_from)
    if not cfg.tokenizer.from_init:
        return tokenizer_digest(cfg.tokenizer, corpus)
    return str(parent_of(cfg).state.get("tokenizer_digest"))


def prepare_tokenizer(cfg: PipelineConfig, corpus: CorpusManifest,
                      progress: Progress | None = None) -> TokenizerManifest:
    """The tokenizer stage of `cfg`: the Hugging Face tokenizer of `tokenizer.adopt_from`,
    the parent's tokenizer adopted into the work directory with `tokenizer.from_init`
    (nothing trained either way), else `train_tokenizer`.

    Raises:
        ValueError, FileNotFoundError, RuntimeError: the errors of `parent_of`,
            `warm_start.parent_tokenizer`, `adopt_tokenizer`,
            `adopt_pretrained_tokenizer` or `train_tokenizer`.
    """
    from mlm_pipeline.tokenizer import (adopt_pretrained_tokenizer, adopt_tokenizer,
                                        train_tokenizer)
    from mlm_pipeline.train.warm_start import parent_tokenizer

    if cfg.tokenizer.adopt_from is not None:
        return adopt_pretrained_tokenizer(cfg.tokenizer.adopt_from, cfg.work_dir)
    if not cfg.tokenizer.from_init:
        return train_tokenizer(cfg.tokenizer, corpus, cfg.work_dir, progress)
    return adopt_tokenizer(parent_tokenizer(parent_of(cfg)), cfg.work_dir)


def retrain_overrides(cfg: PipelineConfig, retrain_steps: int | None
                      ) -> tuple[list[str], dict[str, str]]:
    """The overrides and run tags of `retrain: continue` for `cfg`: with a registered
    champion (`tracking.fetch.champion_source`), `train.init_from=models:/<name>@champion`,
    `tokenizer.from_init=true` and `train.max_steps=<retrain_steps>` (when set), tag
    `continued`; with none yet, no overrides (a first run trains from scratch), tag
    `scratch_no_champion`. Both are logged.

    Raises:
        ValueError: `cfg` already sets `train.init_from` (two warm-start sources).
        mlflow.exceptions.MlflowException: the registry could not be asked.
    """
    if cfg.train.init_from is not None:
        raise ValueError(f"retrain=continue starts from the registered champion, but the "
                         f"config already sets train.init_from={cfg.train.init_from!r}: "
                         "set retrain=scratch to keep it, or drop it")
    source = champion_source(cfg)
    if source is None:
        logger.info("retrain=continue: no champion of %r registered yet at %s: training "
                    "from scratch", registered_model_name(cfg),
                    cfg.tracking.tracking_uri or "the default tracking URI")
        return [], {RETRAIN_TAG: "scratch_no_champion"}
    added = [f"train.init_from={source}", "tokenizer.from_init=true"]
    if retrain_steps is not None:
        added.append(f"train.max_steps={retrain_steps}")
    logger.info("retrain=continue: starting from %s (its weights and tokenizer), %d steps",
                source, retrain_steps or cfg.train.max_steps)
    return added, {RETRAIN_TAG: "continued"}
