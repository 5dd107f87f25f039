"""The champion scored on a new version's data, for the registry's decision
(`mlm_pipeline.app.decide`): each scorer is one kind of `Evidence`.

- `ChampionRescorer`: a champion with the same tokenizer evaluated on other data (another
  `eval_data_digest`). Its checkpoint is found as warm start finds a parent
  (`tracking.fetch.fetch_parent_checkpoint`), verified (`train.verified.load_verified`) and
  evaluated by `evaluate.stage.masked_lm_metrics` on the new version's validation rows with
  its fixed masks, row cap, precision and device: `eval/loss` exactly as the new version's
  (document attention as the champion trained).
- `BpcComparison`: a champion with another tokenizer and the new version, both scored in
  `eval/bits_per_char` (`evaluate.bpc`) on the new version's validation text.
- `HoldoutRescorer`: the champion scored on the new version's holdout text
  (`holdout/bits_per_char`), when its own holdout score is on another text or seed.

torch is imported inside the functions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlm_pipeline.app.decide import BPC_METRIC, HOLDOUT_METRIC, METRIC
from mlm_pipeline.errors import OtherTokenizer, RescoreUnavailable
from mlm_pipeline.manifest import CorpusManifest, EvalManifest, ShardManifest, TrainManifest
from mlm_pipeline.tracking.fetch import fetch_parent_checkpoint
from mlm_pipeline.tracking.tracker import MlflowTracker

logger = logging.getLogger(__name__)

#: The share of words `eval/bits_per_char` scores (`evaluate.bpc.DEFAULT_RATE`).
BPC_RATE = 0.15


def champion_checkpoint(tracker: MlflowTracker, champion: dict[str, Any],
                        download_dir: str | Path) -> Path:
    """The champion version's training checkpoint on this machine: where its run's train
    manifest says, else the one its run uploaded, downloaded under `download_dir`.

    Raises:
        RescoreUnavailable: the version records no run, or the run has no train manifest
            or checkpoint to be found (the reason of `fetch_parent_checkpoint`).
    """
    if not champion.get("run_id"):
        raise RescoreUnavailable(f"champion version {champion['version']} records no run")
    try:
        return fetch_parent_checkpoint(tracker, champion["run_id"], download_dir)
    except ValueError as exc:
        raise RescoreUnavailable(
            str(exc).replace("train.init_from ", "champion run ", 1)) from exc


@dataclass(frozen=True)
class ChampionRescorer:
    """Evaluates a champion on a challenger's evaluation data (see the module docstring).

    Attributes:
        tracker: the MLflow backend the champion's run is read from.
        trained: the challenger's training manifest (its device and precision).
        evaluated: the challenger's evaluation (its eval config, masking record, inputs).
        shards: the challenger's shards (their validation rows are evaluated).
        tokenizer_dir: the challenger's tokenizer stage directory (whole-word starts).
    """

    tracker: MlflowTracker
    trained: TrainManifest
    evaluated: EvalManifest
    shards: ShardManifest
    tokenizer_dir: str | Path

    def __call__(self, champion: dict[str, Any]) -> float:
        """The champion version's `eval/loss` (token-weighted mean cross-entropy, nats per
        masked token) on the challenger's validation rows and masks.

        Args:
            champion: the champion's version record (`tracking.registry.champion`).

        Raises:
            OtherTokenizer: its checkpoint was trained with another tokenizer.
            RescoreUnavailable: its checkpoint cannot be found or verified, or has another
                vocabulary or a shorter `seq_len` than the challenger's rows.
        """
        from mlm_pipeline.train.verified import CheckpointError, load_verified

        with tempfile.TemporaryDirectory(prefix="mlm-champion-") as tmp:
            checkpoint = champion_checkpoint(self.tracker, champion, tmp)
            try:
                model, state = load_verified(checkpoint, self.trained.device)
            except (CheckpointError, FileNotFoundError) as exc:
                raise RescoreUnavailable(f"its checkpoint {checkpoint}: {exc}") from exc
        self._check_fits(state)
        loss = self._loss(model, state)
        logger.info("registry: champion version %s re-scored on eval data of shards %s: "
                    "%s %.4f (its own: %s)", champion["version"], self.shards.digest[:12],
                    METRIC, loss, champion.get("eval_loss"))
        return loss

    def _check_fits(self, state: dict[str, Any]) -> None:
        """Refuse a champion whose ids or positions do not fit the challenger's rows.

        Raises:
            OtherTokenizer: it was trained with another tokenizer.
            RescoreUnavailable: naming every other mismatch.
        """
        if state.get("tokenizer_digest") != self.evaluated.inputs.get("tokenizer"):
            raise OtherTokenizer(str(state.get("tokenizer_digest")))
        problems = []
        if state.get("vocab_size") != self.shards.vocab_size:
            problems.append(f"vocab_size {state.get('vocab_size')} vs {self.shards.vocab_size}")
        if int(state.get("seq_len") or 0) < self.shards.seq_len:
            problems.append(f"seq_len {state.get('seq_len')} < the rows' {self.shards.seq_len}")
        if problems:
            raise RescoreUnavailable("its checkpoint does not fit the challenger's data: "
                                     + "; ".join(problems))

    def _loss(self, model: Any, state: dict[str, Any]) -> float:
        """`masked_lm_metrics(...)["eval/loss"]` of `model` on the challenger's data."""
        from mlm_pipeline.config import EvalConfig, MaskingConfig
        from mlm_pipeline.evaluate.stage import eval_masking, masked_lm_metrics
        from mlm_pipeline.tokenizer import Tokenizer
        from mlm_pipeline.train.data import ShardDataset

        cfg = EvalConfig.model_validate(self.evaluated.config["eval"])
        masking = MaskingConfig.model_validate(self.evaluated.config["masking"])
        tok = Tokenizer.load(self.tokenizer_dir)
        train_cfg = (state.get("config") or {}).get("train") or {}
        metrics = masked_lm_metrics(
            model, ShardDataset(self.shards, "validation"),
            masking=eval_masking(cfg, masking, self.shards, tok),
            batch_size=cfg.batch_size, max_rows=cfg.max_rows, device=self.trained.device,
            precision=self.trained.precision,
            document_attention=bool(train_cfg.get("document_attention", False)))
        return float(metrics[METRIC])


@dataclass(frozen=True)
class BpcComparison:
    """Scores a champion trained with another tokenizer and the challenger in
    `eval/bits_per_char` (`evaluate.bpc`) on the challenger's validation text: the
    ingest stage's validation documents, at most `eval.bpc_max_chars` characters, words
    chosen with the challenger's `eval.seed`. Each model is loaded from its training
    checkpoint and runs with its own tokenizer, on the challenger's device, in fp32.

    Attributes:
        tracker: the MLflow backend the champion's run is read from.
        trained: the challenger's training manifest (its checkpoint and device).
        evaluated: the challenger's evaluation (its eval config).
        corpus: the challenger's corpus (its validation documents are the text).
        tokenizer_dir: the challenger's tokenizer stage directory.
    """

    tracker: MlflowTracker
    trained: TrainManifest
    evaluated: EvalManifest
    corpus: CorpusManifest
    tokenizer_dir: str | Path

    def text_digest(self) -> str:
        """What the scores are computed on, as a sha256 (hex): the corpus digest (its
        validation documents), the choosing seed, the character budget and the rate."""
        from mlm_pipeline.config import EvalConfig

        cfg = EvalConfig.model_validate(self.evaluated.config["eval"])
        data = {"corpus": self.corpus.digest, "seed": cfg.seed,
                "max_chars": cfg.bpc_max_chars, "rate": BPC_RATE}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def __call__(self, champion: dict[str, Any]) -> tuple[float, float]:
        """(the challenger's, the champion's) `eval/bits_per_char` on the challenger's
        validation text.

        Args:
            champion: the champion's version record (`tracking.registry.champion`).

        Raises:
            RescoreUnavailable: the champion's checkpoint or its tokenizer cannot be
                found or verified, or a model cannot score the text.
        """
        from mlm_pipeline.config import EvalConfig
        from mlm_pipeline.evaluate.bpc import bits_per_char
        from mlm_pipeline.ingest.stage import read_documents
        from mlm_pipeline.tokenizer import Tokenizer
        from mlm_pipeline.train.verified import CheckpointError, load_verified

        cfg = EvalConfig.model_validate(self.evaluated.config["eval"])
        texts = [t for _, t in read_documents(
            [self.corpus.file(e.path) for e in self.corpus.validation])]
        device = self.trained.device

        def score(model: Any, tok: Tokenizer) -> float:
            return bits_per_char(model, tok, texts, seed=cfg.seed, rate=BPC_RATE,
                                 max_chars=cfg.bpc_max_chars, batch_size=cfg.batch_size,
                                 device=device).bits_per_char

        model, tok = load_champion(self.tracker, champion, device)
        try:
            theirs = score(model, tok)
            del model
            own = self.trained.file(self.trained.checkpoint_dir)
            mine, _ = load_verified(own, device)
            ours = score(mine, Tokenizer.load(self.tokenizer_dir))
        except (CheckpointError, FileNotFoundError, ValueError) as exc:
            raise RescoreUnavailable(f"bits per character: {exc}") from exc
        logger.info("registry: %s on %s validation characters: challenger %.4f, champion "
                    "version %s %.4f", BPC_METRIC, cfg.bpc_max_chars, ours,
                    champion["version"], theirs)
        return ours, theirs


def load_champion(tracker: MlflowTracker, champion: dict[str, Any], device: str) -> tuple:
    """The champion version's model (from its training checkpoint, verified, on `device`)
    and its own tokenizer (found by digest in a `tokenizer/` directory of its work
    directory), to score it on text.

    Raises:
        RescoreUnavailable: its checkpoint or its tokenizer cannot be found or verified.
    """
    from mlm_pipeline.manifest import TokenizerManifest
    from mlm_pipeline.tokenizer import Tokenizer
    from mlm_pipeline.train.export import find_stage_manifest
    from mlm_pipeline.train.verified import CheckpointError, load_verified

    with tempfile.TemporaryDirectory(prefix="mlm-champion-") as tmp:
        checkpoint = champion_checkpoint(tracker, champion, tmp)
        try:
            model, state = load_verified(checkpoint, device)
            digest = str(state.get("tokenizer_digest"))
            found = find_stage_manifest(checkpoint, "tokenizer", digest, TokenizerManifest)
            if found is None:
                raise FileNotFoundError(f"its tokenizer (digest {digest[:12]}) is not in "
                                        "a tokenizer/ directory of its work directory")
            return model, Tokenizer.load(found)
        except (CheckpointError, FileNotFoundError, ValueError) as exc:
            raise RescoreUnavailable(f"its checkpoint {checkpoint}: {exc}") from exc


@dataclass(frozen=True)
class HoldoutRescorer:
    """Scores the champion on this run's holdout text (`holdout.json` of its evaluation,
    checked against its digest), with this run's seed, cap and device: its checkpoint and
    its own tokenizer (`load_champion`).

    Attributes:
        tracker: the MLflow backend the champion's run is read from.
        trained: this run's training manifest (its device).
        evaluated: this run's evaluation, scored on a holdout.
    """

    tracker: MlflowTracker
    trained: TrainManifest
    evaluated: EvalManifest

    def __call__(self, champion: dict[str, Any]) -> float:
        """The champion's `holdout/bits_per_char` on this run's holdout text.

        Raises:
            RescoreUnavailable: its checkpoint, its tokenizer or this run's holdout text
                cannot be found, or its model cannot score it.
        """
        from mlm_pipeline.config import EvalConfig
        from mlm_pipeline.evaluate.bpc import holdout_metrics, read_holdout_text

        cfg = EvalConfig.model_validate(self.evaluated.config["eval"])
        digest = self.evaluated.config["holdout"]["digest"]
        try:
            documents = read_holdout_text(self.evaluated.output_dir, digest)
        except (OSError, ValueError, KeyError) as exc:
            raise RescoreUnavailable(f"this run's holdout text: {exc}") from exc
        model, tok = load_champion(self.tracker, champion, self.trained.device)
        try:
            theirs = holdout_metrics(model, tok, documents, cfg, self.trained.device)
        except ValueError as exc:
            raise RescoreUnavailable(f"{HOLDOUT_METRIC}: {exc}") from exc
        logger.info("registry: champion version %s re-scored on holdout %s: %s %.4f (its "
                    "own tag: %s on %s)", champion["version"], digest[:12], HOLDOUT_METRIC,
                    theirs[HOLDOUT_METRIC], champion.get("holdout_bits_per_char"),
                    (champion.get("holdout_digest") or "none")[:12])
        return float(theirs[HOLDOUT_METRIC])
