"""Configs of the data and training stages: ingest, tokenizer, shards, masking, model, train."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from mlm_pipeline.config.base import NUM_SPECIAL, StrictModel
from mlm_pipeline.config.masking_schedule import (
    LinearRate, MlmProbability, StepwiseRate, rate_at)


class IngestConfig(StrictModel):
    """Corpus ingestion: which inputs to read and how documents are cleaned and split."""

    sources: list[str] = Field(default_factory=lambda: ["debian:fr"], min_length=1)
    """Inputs, in order. `debian:NAME` fetches a built-in French corpus from Debian packages
    (names: see `mlm_pipeline.ingest.corpora.DEBIAN_CORPORA`: `debian:fr` = the default set,
    software documentation; `debian:fr-general` = it plus the Littré dictionary's
    definitions and quotations, general-domain French); any
    other entry is a path, directory, glob or fsspec URL (`s3://`, `https://`, `file://`)
    of `.txt`, `.jsonl`, `.json`, `.parquet` or `.csv` files, optionally compressed
    (`.gz`, `.zst`, `.bz2`, `.xz`)."""
    text_field: str = "text"
    """JSON field or Parquet/CSV column that holds the document text."""
    txt_document: Literal["paragraph", "file"] = "paragraph"
    """`.txt` files: one document per blank-line-separated block (`paragraph`) or per file."""
    normalization: Literal["NFC", "NFKC"] = "NFC"
    """Unicode normalization form applied to every document."""
    min_chars: int = Field(default=1, ge=1)
    """Documents shorter than this many characters (after cleaning) are dropped and counted."""
    max_documents: int | None = Field(default=None, ge=1)
    """Stop after this many documents read (a slice for quick runs); None reads everything."""
    max_document_chars: int = Field(default=1_000_000, ge=1000)
    """Documents longer than this many characters are split (at paragraph, then sentence,
    then whitespace boundaries, never dropped or truncated) into parts of at most this size."""
    min_letter_share: float = Field(default=0.0, ge=0.0, le=1.0)
    """Documents whose share of letters (Unicode category L*) among non-space characters is
    below this are dropped (`few_letters`); 0 disables the filter."""
    languages: list[str] | None = None
    """Keep only records whose `lang` field (JSONL/Parquet/CSV) is in this list (dropped:
    `language`); records without a `lang` field are kept. None disables the filter."""
    near_dedup_threshold: float | None = Field(default=None, gt=0.0, le=1.0)
    """Drop near-duplicates whose estimated Jaccard similarity of word 5-gram shingles with
    a kept document is at least this (MinHash LSH, Broder 1997); None disables it."""
    validation_fraction: float = Field(default=0.02, ge=0.0, lt=1.0)
    """Share of documents (by hash of the normalized text) held out for evaluation."""
    validation_dedup: Literal["none", "lines"] = "none"
    """`lines`: remove from each validation document every line that occurs, case-folded
    and with its whitespace collapsed, in a training document (CCNet's line-level
    deduplication, Wenzek et al. 2020, across the split: shared boilerplate stays on the
    training side); a validation document left shorter than `min_chars` is dropped
    (`validation_overlap`). `none`: the split by hash alone. The shipped configs use
    `lines` (`mlm_pipeline.ingest.overlap`)."""
    overlap_ngram: int | None = Field(default=13, ge=1)
    """Measure the validation<->training overlap after deduplication: the share of the
    validation split's word n-gram windows of this length that occur in training (GPT-3's
    13-grams, Brown et al. 2020, appendix C), in the manifest's `validation_overlap`;
    None: not measured."""
    cache_dir: str | None = None
    """Where fetched Debian packages and extracted corpora are cached; None uses
    the project's cache (`$MLM_PIPELINE_CACHE`, else `~/.cache/mlm-pipeline`)."""
    on_bad_file: Literal["skip", "fail"] = "skip"
    """An input file unreadable in its format (truncated or not-compressed `.gz`, `.json`
    not one array, Parquet or CSV without `text_field`, CSV quote never closed, ...):
    `skip` names it with its reason in the manifest and reads the others; `fail` stops the
    run with one error naming every bad file."""
    allowed_sources: list[str] | None = None
    """Sources a deployment run may take from an event (the `corpus.updated` trigger's
    `event_sources`): absolute directory roots (a source must resolve inside one), URL
    prefixes (`s3://bucket/corpus/`) or exact `debian:NAME` names; any other event source is
    refused before a file is read. None: events may name no source. Sources of the config
    itself are not checked, but every file a source inside an allowed root expands to must
    resolve inside one (a file symlink leading out is skipped, `outside_allowed_sources`)."""

    @field_validator("allowed_sources")
    @classmethod
    def _allowed_sources_are_roots(cls, value: list[str] | None) -> list[str] | None:
        """Each entry is an absolute path, a URL prefix (`scheme://...`) or `debian:NAME`."""
        bad = [v for v in value or [] if not ("://" in v or v.startswith(("debian:", "/", "~")))]
        if bad:
            raise ValueError(f"allowed_sources: {bad} are not absolute directory roots, URL "
                             "prefixes (scheme://...) or debian:NAME names")
        return value


class TokenizerConfig(StrictModel):
    """SentencePiece training on the training split, or the adoption of a published
    model's Hugging Face tokenizer (`adopt_from`)."""

    model_type: Literal["unigram", "bpe"] = "unigram"
    """SentencePiece algorithm (Kudo 2018 unigram LM, or BPE)."""
    vocab_size: int = Field(default=8000, ge=NUM_SPECIAL + 2, le=1_000_000)
    """Pieces in the vocabulary, the five special tokens included."""
    character_coverage: float = Field(default=0.9995, gt=0.0, le=1.0)
    """Share of characters covered by the vocabulary; the rest map to [UNK]."""
    input_sentence_size: int = Field(default=2_000_000, ge=1)
    """Most sentences (lines) trained on, a seeded uniform sample: bounds memory."""
    max_sentence_length: int = Field(default=16384, ge=16)
    """Longest training sentence in bytes; longer lines are split, not skipped."""
    num_threads: int = Field(default=2, ge=1)
    """SentencePiece trainer threads."""
    byte_fallback: bool = False
    """Decompose characters outside the vocabulary into UTF-8 byte pieces (`<0x41>`) instead
    of [UNK]; adds 256 byte pieces to the vocabulary (SentencePiece `byte_fallback`)."""
    from_init: bool = False
    """Reuse the tokenizer of the model `train.init_from` names instead of training one:
    the tokenizer stage is skipped, the corpus is encoded with the parent's tokenizer (same
    pieces, same ids) and the other `tokenizer` settings are ignored. Needs
    `train.init_from`; warm starting from a parent needs its vocabulary anyway."""
    adopt_from: str | None = None
    """A local directory holding a Hugging Face tokenizer (`tokenizer.json` and the files
    `save_pretrained` writes beside it, as in a published model's directory): the stage
    adopts it as it is instead of training SentencePiece (WordPiece, BPE, byte-level BPE
    or Unigram; its special ids and word boundaries are read from it), and the other
    `tokenizer` settings are ignored. Its identity is the files' sha256, not the path."""


class ShardConfig(StrictModel):
    """Packing of encoded documents into fixed-length rows and Arrow IPC shards."""

    seq_len: int = Field(default=128, ge=8, le=8192)
    """Tokens per row, [CLS] and [SEP] included."""
    rows_per_shard: int = Field(default=65536, ge=1)
    """Rows per Arrow IPC file."""
    encode_batch_size: int = Field(default=1024, ge=1)
    """Most documents per encode task (one single-threaded SentencePiece batch call)."""
    encode_batch_bytes: int = Field(default=1 << 20, ge=1)
    """Most UTF-8 bytes of text per encode task (a longer document is one task alone):
    with `encode_batch_size`, bounds the memory of the batches in flight, whatever the
    document lengths. The shards do not depend on it."""
    num_threads: int = Field(default=0, ge=0)
    """Encode worker threads (each runs single-threaded SentencePiece); 0 = one per core
    this process may use. The shards are byte-identical for any value."""


class MaskingConfig(StrictModel):
    """Masked-language-model corruption (Devlin et al. 2019, §3.1)."""

    mode: Literal["dynamic", "precomputed"] = "dynamic"
    """`dynamic`: a new mask per epoch, computed on the training device. `precomputed`: the
    shards stage writes `dupe_factor` masked copies of every row (the same masking
    function, keyed by (seed, copy, row)) and training cycles through them by epoch."""
    dupe_factor: int = Field(default=1, ge=1, le=100)
    """Masked copies of each row written in `precomputed` mode (BERT used 10)."""
    mlm_probability: MlmProbability = 0.15
    """Share of maskable tokens selected for prediction: a constant in (0, 1), or a schedule
    over the optimizer steps (`dynamic` mode only): `{schedule: linear, start: 0.3, end:
    0.15}` (optional `end_step`, default the last step) or `{schedule: stepwise, rates:
    [[0, 0.3], [800, 0.15]]}` (`[step, rate]` pairs from step 0); a schedule's `eval_rate`
    (default 0.15) is what held-out evaluation masks at (`mlm_pipeline.config.masking_schedule`)."""
    mask_replace_prob: float = Field(default=0.8, ge=0.0, le=1.0)
    """Share of selected tokens replaced by [MASK]."""
    random_replace_prob: float = Field(default=0.1, ge=0.0, le=1.0)
    """Share of selected tokens replaced by a random ordinary token; the rest stay unchanged."""
    selection: Literal["bernoulli", "exact_k"] = "bernoulli"
    """`bernoulli`: each maskable token is selected independently with `mlm_probability`
    (Devlin et al. 2019). `exact_k`: exactly round(mlm_probability * n) distinct maskable
    positions per row (n = maskable tokens in the row), so every row of a full batch predicts
    the same number of tokens (static shapes for compiled code)."""
    seed: int = 0
    """Key of the training masks: the mask of a row is a pure function of (seed, epoch, row)
    (evaluation masks use `eval.seed`)."""
    whole_word: bool = False
    """Select whole words (a piece starting with "▁" plus its continuation pieces), the rate
    still measured in tokens (whole-word masking, Devlin et al. 2019, google-research/bert)."""

    def masks_record(self) -> dict[str, Any]:
        """The settings that decide a mask besides the seed, as JSON values: what shard
        manifests record as `masking` next to `masking_seed` (and what digests hash)."""
        return self.model_dump(mode="json", exclude={"seed"})

    @property
    def scheduled(self) -> bool:
        """True when `mlm_probability` is a schedule rather than a constant."""
        return isinstance(self.mlm_probability, LinearRate | StepwiseRate)

    def mlm_probability_at(self, step: int, max_steps: int) -> float:
        """The selection rate of the optimizer step that follows `step` completed steps
        (`masking_schedule.rate_at`): a pure function of the step, exact under resume."""
        return rate_at(self.mlm_probability, step, max_steps)

    @property
    def eval_probability(self) -> float:
        """The fixed rate held-out evaluation masks at: the constant `mlm_probability`, or
        a schedule's `eval_rate`."""
        value = self.mlm_probability
        return value.eval_rate if isinstance(value, LinearRate | StepwiseRate) else value

    @property
    def peak_probability(self) -> float:
        """The highest rate the schedule reaches (the constant itself): bounds how many
        tokens a row may predict."""
        value = self.mlm_probability
        if isinstance(value, LinearRate):
            return max(value.start, value.end)
        if isinstance(value, StepwiseRate):
            return max(rate for _, rate in value.rates)
        return value

    @model_validator(mode="after")
    def _check_split(self) -> MaskingConfig:
        problems = []
        total = self.mask_replace_prob + self.random_replace_prob
        if total > 1.0 + 1e-9:
            problems.append(
                f"masking: mask_replace_prob + random_replace_prob = {total:g} must be <= 1")
        if self.scheduled and self.mode == "precomputed":
            problems.append(
                "masking.mlm_probability: a schedule needs masking.mode: dynamic (precomputed "
                "copies are written once, at one rate); set masking.mode: dynamic or a "
                "constant masking.mlm_probability")
        if problems:
            raise ValueError("; ".join(problems))
        return self


#: Field values a `ModelConfig.preset` fills in when the config does not set them.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # BERT (Devlin et al. 2019): weight-compatible with Hugging Face `BertForMaskedLM`,
    # global attention in every layer.
    "bert": {"norm": "post", "position": "learned", "activation": "gelu", "bias": True,
             "layer_norm_eps": 1e-12, "dropout": 0.1, "global_every": 1},
    # ModernBERT (Warner et al. 2024): pre-LN, rotary, GeGLU, no biases, LayerNorm eps
    # 1e-5, no dropout for pretraining, and its attention layout: a global layer every
    # third layer from layer 0, the others attending within a 128-token window with RoPE
    # base 10,000 (answerdotai/ModernBERT-base config.json and transformers'
    # `ModernBertConfig`: global_attn_every_n_layers 3, local_attention 128,
    # local_rope_theta 10,000). Weight-compatible with Hugging Face `ModernBertForMaskedLM`.
    "modern": {"norm": "pre", "position": "rope", "activation": "geglu", "bias": False,
               "layer_norm_eps": 1e-5, "dropout": 0.0, "global_every": 3,
               "local_attention_window": 128, "local_rope_base": 10000.0},
}
#: What a stored model config (a checkpoint's `config.model`, a manifest's) written before
#: a field existed meant by its absence: every layer global (the `modern` preset's layout
#: before its sliding-window layers) and, with document attention, positions counted along
#: the row. `ModelConfig.from_record` applies them.
LEGACY_MODEL_FIELDS: dict[str, Any] = {"global_every": 1, "document_positions": "row"}


class ModelConfig(StrictModel):
    """BERT-style encoder shape."""

    preset: Literal["bert", "modern"] | None = None
    """Architecture recipe (`MODEL_PRESETS`): `bert` = post-LN, learned positions, GELU,
    biases, global attention (Hugging Face `BertForMaskedLM` compatible); `modern` = pre-LN,
    rotary positions, GeGLU, no biases, two sliding-window layers for every global one
    (`ModernBertForMaskedLM` compatible). Fields set explicitly in the config win."""

    hidden_size: int = Field(default=128, ge=8)
    """Width of the residual stream."""
    num_layers: int = Field(default=2, ge=1)
    """Transformer blocks."""
    num_heads: int = Field(default=2, ge=1)
    """Attention heads; must divide `hidden_size`."""
    intermediate_size: int = Field(default=512, ge=8)
    """Width of the feed-forward layer."""
    norm: Literal["post", "pre"] = "post"
    """LayerNorm placement: `post` (BERT, Devlin et al. 2019: `x = LN(x + f(x))`) or `pre`
    (Xiong et al. 2020: `x = x + f(LN(x))` plus a final LayerNorm; as in ModernBERT, none
    before layer 0's attention, whose input the embeddings' LayerNorm has normalized), which
    trains stably at higher learning rates and leaves the early loss plateau much sooner."""
    position: Literal["learned", "rope"] = "learned"
    """Position information: `learned` absolute embeddings (BERT) or rotary embeddings on
    queries and keys (`rope`, Su et al. 2021), which need no training to tell neighbours
    apart and so leave the early loss plateau sooner."""
    rope_base: float = Field(default=10000.0, gt=1.0)
    """RoPE frequency base (Su et al. 2021 use 10,000)."""
    activation: Literal["gelu", "geglu"] = "gelu"
    """Feed-forward: `gelu` (BERT: `W2 gelu(W1 x)`) or `geglu` (Shazeer 2020:
    `W2 (gelu(W1 x) * (V x))`, `intermediate_size` = width of the gated product)."""
    bias: bool = True
    """Biases in linear layers and LayerNorms (BERT: yes; ModernBERT: none)."""
    dropout: float = Field(default=0.1, ge=0.0, lt=1.0)
    """Dropout on embeddings, attention probabilities and residual branches."""
    layer_norm_eps: float = Field(default=1e-12, gt=0.0)
    """LayerNorm epsilon (BERT uses 1e-12)."""
    initializer_range: float = Field(default=0.02, gt=0.0)
    """Std of the truncated-normal weight init (BERT: 0.02)."""
    global_every: int = Field(default=1, ge=1)
    """Every this many layers one attends globally, from layer 0 (ModernBERT
    `global_attn_every_n_layers`: 3 = layers 0, 3, 6, ... global); the layers between
    attend within `local_attention_window`. 1: every layer global (BERT)."""
    local_attention_window: int = Field(default=128, ge=2, multiple_of=2)
    """Width of a local (sliding-window) layer's attention in tokens (ModernBERT
    `local_attention`): a query sees the keys at most half of it away on either side
    (128: 64 before, 64 after, itself)."""
    local_rope_base: float = Field(default=10000.0, gt=1.0)
    """RoPE frequency base of the local layers (ModernBERT `local_rope_theta`);
    `rope_base` is the global layers'."""
    document_positions: Literal["restart", "row"] = "restart"
    """Position ids of packed rows under document attention (`train.document_attention`):
    `restart` at 0 in every document, so a document is encoded as if it were alone in its
    row; `row`: counted along the row, as models trained before positions restarted were
    (the same function for rotary positions, which see only distances within a
    document; learned positions differ)."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        # an unknown preset name fails on the `preset` field itself
        if isinstance(data, dict) and (preset := MODEL_PRESETS.get(data.get("preset"))):
            data = {**preset, **data}
        return data

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model: hidden_size {self.hidden_size} is not divisible by "
                             f"num_heads {self.num_heads}")
        return self

    @classmethod
    def from_record(cls, record: Any) -> ModelConfig:
        """The config a stored record (a checkpoint's or manifest's `config.model`) was
        trained with: fields it predates take their meaning then (`LEGACY_MODEL_FIELDS`:
        an old `modern` checkpoint is all-global), not today's preset defaults.

        Raises:
            pydantic.ValidationError: the record is not a valid model config (not a
                mapping, None included).
        """
        return cls.model_validate(
            {**LEGACY_MODEL_FIELDS, **record} if isinstance(record, dict) else record)

    def is_global(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) attends globally (`global_every`)."""
        return layer % self.global_every == 0

    @property
    def local_half_window(self) -> int:
        """Keys a local layer's query sees on each side: `local_attention_window // 2`."""
        return self.local_attention_window // 2

    @property
    def has_local_layers(self) -> bool:
        """True when some layer attends within a window (`global_every > 1` and a second
        layer)."""
        return self.global_every > 1 and self.num_layers > 1

    def digest_record(self, document_attention: bool) -> dict[str, Any]:
        """The config as a run's digest hashes it: the fields that cannot change what this
        model computes are left out (the local-layer fields without local layers, how
        positions are numbered without document attention or when counted along the row,
        as before that field existed), so digests made before they existed still hold."""
        unused = set()
        if self.global_every == 1:
            unused |= {"global_every", "local_attention_window", "local_rope_base"}
        if not document_attention or self.document_positions == "row":
            unused.add("document_positions")
        return self.model_dump(mode="json", exclude=unused)


#: Warm-up steps when a config sets neither `train.warmup_steps` nor `train.warmup_ratio`.
DEFAULT_WARMUP_STEPS = 100


class DistributedConfig(StrictModel):
    """Data-parallel training under `torchrun` (`torch.distributed.run`); one process when
    `nproc_per_node * nnodes == 1`."""

    nproc_per_node: int = Field(default=1, ge=1)
    """Training processes (ranks) per node: one per GPU on CUDA."""
    nnodes: int = Field(default=1, ge=1)
    """Nodes taking part; each runs the same launch (`torchrun --nnodes`)."""
    rdzv_endpoint: str | None = None
    """`host:port` of the rendezvous (`torchrun --rdzv-endpoint`); required when `nnodes > 1`,
    None on one node (a free local port is used)."""
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """`ddp`: `DistributedDataParallel`, every rank holds the whole model; `fsdp2`:
    parameters, gradients and optimizer state sharded with `fully_shard`."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """`torch.distributed` backend: `auto` = `nccl` on CUDA, `gloo` on CPU."""

    @property
    def world_size(self) -> int:
        """Total ranks: `nproc_per_node * nnodes`."""
        return self.nproc_per_node * self.nnodes

    @model_validator(mode="after")
    def _check_rendezvous(self) -> DistributedConfig:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"train.distributed: nnodes {self.nnodes} needs rdzv_endpoint "
                             "(host:port reachable from every node)")
        return self


class TrainConfig(StrictModel):
    """Optimization loop."""

    micro_batch_size: int = Field(default=32, ge=1)
    """Rows per forward/backward pass."""
    grad_accum_steps: int = Field(default=1, ge=1)
    """Micro-batches per optimizer step; global batch = micro_batch_size * grad_accum_steps."""
    max_steps: int = Field(default=1000, ge=1)
    """Optimizer steps; the LR schedule spans exactly this many."""
    max_time_s: float | None = Field(default=None, gt=0)
    """Wall-clock safety net in seconds: training stops early when it is exceeded, with a
    warning, a checkpoint and `stop_reason: time_cap` (never a silent success)."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose loss or gradient norm is not finite: `stop` fails the run naming the first
    such step and the last good checkpoint; `skip` drops its batch without an optimizer or
    schedule step, counts it (`train/skipped_steps`) and stops after `max_skipped_steps` in
    a row."""
    max_skipped_steps: int = Field(default=10, ge=1)
    """Consecutive skipped (non-finite) steps after which `nonfinite: skip` stops the run."""
    lr: Annotated[float, Field(gt=0)] | Literal["auto"] = 1e-3
    """Peak learning rate; `auto`: chosen from the model's recipe (post-LN `bert`: 5e-4
    with a 6 % warm-up unless one is set, from this project's sweep; pre-LN `modern`: 1e-3), resolved when the
    config is loaded (`mlm_pipeline.config.lr_auto`)."""
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    """Final LR as a share of the peak."""
    warmup_steps: int | None = Field(default=None, ge=0)
    """Steps of linear warm-up from 0 to `lr`; when set, it wins over `warmup_ratio`. None
    (neither set): `DEFAULT_WARMUP_STEPS` steps. `TrainConfig.warmup` is the number in effect."""
    warmup_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    """Warm-up as a share of `max_steps` (rounded to whole steps), used when `warmup_steps`
    is None (HF `TrainingArguments.warmup_ratio`)."""
    decay: Literal["linear", "cosine", "wsd"] = "linear"
    """Shape of the decay after warm-up: `linear`, `cosine` (Loshchilov & Hutter 2017), or
    `wsd` warmup-stable-decay (Hu et al. 2024, MiniCPM): constant peak LR, then a linear
    decay over the last `decay_fraction` of the steps."""
    decay_fraction: float = Field(default=0.2, gt=0.0, le=1.0)
    """`wsd` only: share of `max_steps` spent decaying at the end."""
    weight_decay: float = Field(default=0.01, ge=0.0)
    """AdamW decoupled weight decay (not applied to biases, LayerNorm, embeddings' norms)."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas."""
    eps: float = Field(default=1e-6, gt=0)
    """AdamW epsilon."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Max global gradient L2 norm; None disables clipping."""
    log_every: int = Field(default=10, ge=1)
    """Optimizer steps between metric records."""
    seed: int = 0
    """Seeds model init, data order and masking."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` picks CUDA when available."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """`auto`: bf16 autocast on CUDA and on CPUs with native bf16 instructions (AVX-512 BF16
    or AMX), fp32 otherwise."""
    compile: Literal["auto", "on", "off"] = "auto"
    """`torch.compile` the model: `auto` = on CUDA only (compilation takes tens of seconds
    and needs a C++ compiler on CPU)."""

    @field_validator("lr", mode="plain",
                     json_schema_input_type=Annotated[float, Field(gt=0)] | Literal["auto"])
    @classmethod
    def _lr_number_or_auto(cls, value: Any) -> float | str:
        """A number > 0 (YAML reads `1e-3` as a string: parsed here) or `auto`; one check
        instead of a union's, so an error names `train.lr` alone."""
        if value == "auto":
            return value
        try:
            number = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if math.isnan(number):
            raise ValueError(f"Input should be a number greater than 0 or 'auto', got {value!r}")
        if number <= 0:
            raise ValueError(f"Input should be greater than 0, got {value!r}")
        return number

    @field_validator("compile", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        """YAML 1.1 reads `on`/`off` (what `--set train.compile=on` says) as booleans."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value
    verify_shards: bool = True
    """Recompute every shard's sha256 before training and fail, naming the file, on a
    mismatch (reads the whole dataset once: about 1 s per GB)."""
    document_attention: bool = True
    """Tokens attend only within their own document of a packed row (boundaries are the
    [SEP] tokens the shards keep in-band) and positions restart in each document
    (`model.document_positions`), so a document's encoding does not depend on what it was
    packed beside; a variable-length kernel keeps the cost of a mask-free step (see the
    models page). false: every token attends to its whole row (the behaviour before this
    was the default; ablations)."""
    num_threads: int | None = Field(default=None, ge=1)
    """torch intra-op threads on CPU; None keeps torch's default."""
    checkpoint_every: int | None = Field(default=None, ge=1)
    """Steps between checkpoints; None saves only the final one."""
    checkpoint_interval_s: float | None = Field(default=600.0, gt=0)
    """Also save a checkpoint when this many seconds have passed since the last one (a slow
    machine loses at most this much work to a kill); None: by `checkpoint_every` only."""
    keep_last_checkpoints: int = Field(default=2, ge=1)
    """Checkpoints kept on disk (oldest removed first)."""
    init_from: str | None = None
    """Warm start: a model SOURCE whose weights initialize a fresh run instead of random
    ones (a checkpoint directory, a training run directory: its newest intact checkpoint,
    an MLflow run id or a `models:/NAME@ALIAS` URI: its run's checkpoint, kept in its work
    directory or uploaded with `tracking.log_training_state`), or a Hugging Face masked
    LM's `save_pretrained` directory (`BertForMaskedLM`, `ModernBertForMaskedLM`: a
    published encoder to continue pretraining on this corpus), whose `config.json` then
    replaces the `model` section (a `--set model.*` that disagrees is an error; `dropout`
    and `document_positions` stay the config's), whose tokenizer is adopted
    (`tokenizer.adopt_from`) and whose identity is the sha256 of every file read. Weights
    only: the optimizer, LR schedule (with its own warm-up), data order and step count start
    afresh. Its architecture (`model.*`), `vocab_size` and tokenizer must be this config's
    (each difference is named); a length phase may change `shards.seq_len` (a learned
    position table is cut, or extended by copying its rows) and the RoPE bases, which the
    run's lineage records (`mlm.init_changes`). The source, its digest and step are part
    of the run's digest. A resumed run continues from its own checkpoint, never from this.
    None: random initialization."""
    phase_of: str | None = None
    """The shipped config (`configs/NAME.yaml`, by NAME) whose run this config's run
    continues as its next phase, e.g. `bert-base` for `bert-base-512` (a length phase).
    The `mlm-phases` flow derives the chain of phases from it, parent first, and starts
    each phase from the previous phase's MLflow run (`train.init_from`); a config that
    names no parent is a first phase. Read by the chain only: running the config alone
    trains it as it is (from `init_from`, or from random weights). No part of the run's
    digest. None: no parent phase."""
    init_required: bool = False
    """The config continues pretraining a parent model (the shipped `adapt`): loading it
    without `init_from` is an error naming the field and what to pass, instead of a run
    from random weights at an adaptation learning rate. No part of the run's digest."""
    trust_unverified_checkpoint: bool = False
    """Resume from a checkpoint that cannot be verified (no digest of its `state.json`:
    written before checkpoints were verified); false refuses it, naming it. Damaged
    checkpoints are never used. No part of the run's digest."""
    distributed: DistributedConfig = DistributedConfig()
    """Processes and nodes of data-parallel training; each rank reads `micro_batch_size`
    rows per micro-batch, so the global batch is `micro_batch_size * grad_accum_steps *
    nproc_per_node * nnodes` rows."""

    @property
    def warmup(self) -> int:
        """Warm-up steps in effect: `warmup_steps` if set, else round(`warmup_ratio` x
        `max_steps`) if set, else `DEFAULT_WARMUP_STEPS`. Decided by the field values alone
        (not by which keys a file spelled out), so a printed config trains the same."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.warmup_ratio is not None:
            return round(self.warmup_ratio * self.max_steps)
        return DEFAULT_WARMUP_STEPS

    @model_validator(mode="after")
    def _check_schedule(self) -> TrainConfig:
        if self.init_required and self.init_from is None:
            raise ValueError(
                "train.init_from is required (train.init_required: this config continues "
                "pretraining a parent model): pass --set train.init_from=DIR, a Hugging Face "
                "save_pretrained directory (BertForMaskedLM, ModernBertForMaskedLM; e.g. "
                "`mlm-pipeline export RUN DIR` of one of our runs), or a checkpoint or run "
                "directory, an MLflow run id or models:/NAME@ALIAS URI")
        # `lr: auto` may bring its own warm-up: checked once resolved (`lr_auto.resolve_lr`).
        if self.lr != "auto" and self.warmup > self.max_steps:
            raise ValueError(f"train: warmup_steps {self.warmup} exceeds max_steps "
                             f"{self.max_steps}; lower it or set train.warmup_ratio instead")
        return self


class DataPrepConfig(StrictModel):
    """Where data preparation (ingestion and shard encoding) runs; no part of any digest:
    every executor writes the same bytes (`mlm_pipeline.ingest.partitions`,
    `mlm_pipeline.shards.parallel`)."""

    executor: Literal["local", "dask"] = "local"
    """`local`: one process (shard encoding on threads); `dask`: ingestion and shard
    encoding fan out over input partitions as Prefect tasks on a Dask cluster
    (`flows/dask_prep.py`; needs the `dask` extra)."""
    dask_address: str | None = None
    """Scheduler of an existing Dask cluster (`tcp://host:8786`; its workers must read the
    sources and the work directory at the same paths); None starts a local cluster."""
    partitions: int | None = Field(default=None, ge=1)
    """Partitions to aim at per stage (input files and byte ranges; row ranges of a
    split); None: 4 per Dask worker."""
    workers: int = Field(default=2, ge=1)
    """Workers (processes) of the local cluster started when `dask_address` is None."""
