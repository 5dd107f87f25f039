"""Our SentencePiece tokenizer as a Hugging Face `tokenizers` / `transformers` tokenizer.

`build_hf_tokenizer` builds a `tokenizers.Tokenizer` explicitly from the `.model` proto,
so that `transformers.AutoTokenizer.from_pretrained(out_dir)` encodes text to exactly the
ids of `Tokenizer`, with [CLS] and [SEP] around them. Nothing is guessed by a slow
tokenizer class (in transformers 5, `AlbertTokenizer(vocab_file=...)` silently builds an
all-[UNK] tokenizer). Its parts, in SentencePiece's order:

- normalizer: the corpus's Unicode form from the tokenizer manifest (NFC or NFKC, which
  `Tokenizer` applies with `unicodedata` before SentencePiece); SentencePiece's own rule
  table; its whitespace handling (`remove_extra_whitespaces`: spaces stripped at the
  start, runs collapsed to one, "▁" stripped at the end, as SentencePiece strips after
  escaping; `escape_whitespaces`: " " becomes "▁").
  The rule table is our stage's (every Unicode space to " ") written out as `Replace`
  rules when it maps single characters only; any other table (e.g. `nmt_nfkc`) becomes
  `normalizers.Precompiled`, which differs from SentencePiece on some multi-character
  graphemes (https://github.com/huggingface/tokenizers/issues/2334: "\u00a0\u0301"
  loses its accent);
- pre-tokenizer: `Metaspace(prepend_scheme="always", split=False)`, SentencePiece's
  `add_dummy_prefix`, once for every piece of text between special tokens (as
  `Tokenizer.encode_with_mask` encodes each part on its own); no split at spaces, so the
  model segments a whole text at once, as SentencePiece does. For a Unigram model, a
  `Split` also cuts the text inside every occurrence of a control or byte piece's name,
  or the normalizer breaks it with an unknown character where no cut is safe (see
  `_reserved_cuts`);
- model: `Unigram` with the same pieces and scores, or `BPE` with merges ranked by the
  merged piece's score; `[UNK]` fused over runs of unknown characters; byte fallback
  when the model has it;
- post-processor: `[CLS] $A [SEP]` (pairs `[CLS] $A [SEP] $B [SEP]`);
- special tokens: `[PAD]` 0, `[UNK]` 1, `[CLS]` 2, `[SEP]` 3, `[MASK]` 4.

transformers' own converter (`SpmConverter.build_tokenizer_from_spm_proto` in
`convert_slow_tokenizer.py`, transformers 5) guided the whitespace rules and merges.

Literal special tokens. By default a text holding a special name gives its id: "[MASK]"
4, as `transformers.pipeline("fill-mask")` needs, and "[PAD]", "[UNK]", "[CLS]", "[SEP]"
0-3, the `transformers` convention; `Tokenizer.encode_with_mask` (our fill-mask probes)
does the same, so a probe encodes alike on both sides (and "[SEP]" in a probe is the
document boundary the model saw in training). With `split_special_tokens=True` no name is
matched and every text encodes as `Tokenizer.encode` does: the ids of our shards, where a
document that writes "[SEP]" about BERT must not inject a boundary or a mask.

Decoding writes every special id as its name, [UNK] included (or, with
`skip_special_tokens=True`, none), as `Tokenizer.decode` does.

This module imports neither torch nor prefect; `tokenizers`, `transformers` and
`sentencepiece_model_pb2` (protobuf) are imported inside the functions.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from mlm_pipeline.config import MASK_ID, SPECIAL_TOKENS, UNK_ID
from mlm_pipeline.errors import MissingDependencyError
from mlm_pipeline.manifest import TokenizerManifest
from mlm_pipeline.tokenizer.tokenizer import Tokenizer

if TYPE_CHECKING:  # pragma: no cover
    import tokenizers

logger = logging.getLogger(__name__)

#: SentencePiece's word-boundary marker, U+2581.
SPACE_SYMBOL = "\u2581"
#: How to repair an install that lacks what export needs (base dependencies), named in the
#: errors.
INSTALL_HINT = "pip install --force-reinstall mlm-pipeline (or -e . in a checkout)"
#: `ModelProto.SentencePiece.Type` and `TrainerSpec.ModelType` values
#: (sentencepiece_model.proto).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_UNIGRAM, _BPE = 1, 2
#: Rule tables with more keys are not decoded (`nmt_nfkc` has about 225,000).
_MAX_RULES = 1024
#: More leading spaces than any decoded text has: the decoder's `Strip` drops them all.
_STRIP_ALL = 1 << 30


def require(module: str):
    """Import `module`, or explain how to repair the install that lacks it.

    Raises:
        MissingDependencyError: the module cannot be imported (a base dependency of this
            package is missing or broken; the message says how to reinstall).
    """
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:
        raise MissingDependencyError(
            f"export needs {module}, which cannot be imported ({exc}); it is a dependency "
            f"of mlm-pipeline, so this install is incomplete: {INSTALL_HINT}") from exc


def read_model_proto(path: str | os.PathLike[str]):
    """The parsed `ModelProto` of a SentencePiece `.model` file.

    Raises:
        RuntimeError: protobuf is not installed.
        ValueError: the file is not a SentencePiece model proto.
    """
    pb2 = require("sentencepiece.sentencepiece_model_pb2")
    proto = pb2.ModelProto()
    try:
        proto.ParseFromString(Path(path).read_bytes())
    except Exception as exc:  # protobuf's DecodeError
        raise ValueError(f"{path}: not a SentencePiece model proto ({exc})") from exc
    return proto


def charsmap_rules(blob: bytes, limit: int = _MAX_RULES) -> dict[str, str] | None:
    """The rules of a SentencePiece `precompiled_charsmap`: key text -> replacement.

    The blob is a little-endian uint32 trie size, a darts-clone double-array trie of
    uint32 units over the keys' UTF-8 bytes, then the NUL-terminated replacements the
    leaves point into (sentencepiece `normalizer.cc`, `DecodePrecompiledCharsMap`).

    Returns:
        All rules, or None when there are more than `limit` (not decoded further).

    Raises:
        ValueError: the blob is truncated or not UTF-8.
    """
    try:
        (size,) = struct.unpack_from("<I", blob, 0)
        units = struct.unpack_from(f"<{size // 4}I", blob, 4)
        strings = blob[4 + size:]
        rules: dict[str, str] = {}

        def offset(u: int) -> int:  # darts-clone unit: offset, label, has_leaf bit
            return (u >> 10) << ((u & (1 << 9)) >> 6)

        stack = [(offset(units[0]), b"")]
        while stack:
            pos, key = stack.pop()
            for byte in range(1, 256):
                child = pos ^ byte
                if child >= len(units) or units[child] & ((1 << 31) | 0xFF) != byte:
                    continue
                unit, nxt = units[child], child ^ offset(units[child])
                if (unit >> 8) & 1:
                    start = units[nxt] & 0x7FFFFFFF
                    value = strings[start:strings.index(b"\0", start)]
                    rules[(key + bytes([byte])).decode("utf-8")] = value.decode("utf-8")
                    if len(rules) > limit:
                        return None
                stack.append((nxt, key + bytes([byte])))
    except (struct.error, IndexError, ValueError) as exc:  # UnicodeDecodeError too
        raise ValueError(f"malformed precompiled_charsmap ({exc})") from exc
    return rules


def _check_supported(proto, path: Path) -> None:
    """Raises ValueError for SentencePiece options our stage never sets and the export
    does not reproduce (the message names them)."""
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    wrong = []
    if trainer.model_type not in (_UNIGRAM, _BPE):
        wrong.append(f"model_type {trainer.model_type} (unigram or bpe supported)")
    if trainer.treat_whitespace_as_suffix:
        wrong.append("treat_whitespace_as_suffix")
    if not spec.escape_whitespaces:
        wrong.append("escape_whitespaces false")
    if any(p.type in (_USER_DEFINED, _UNUSED) for p in proto.pieces):
        wrong.append("user-defined or unused pieces")
    if proto.denormalizer_spec.precompiled_charsmap:
        wrong.append("a denormalizer")
    if wrong:
        raise ValueError(f"{path}: SentencePiece options the export does not reproduce: "
                         + ", ".join(wrong))


def _rule_steps(tk, blob: bytes) -> list:
    """Normalizers applying a SentencePiece rule table as SentencePiece does."""
    from tokenizers import normalizers

    rules = charsmap_rules(blob)
    if rules is None or any(len(key) != 1 for key in rules):
        # Longest-match multi-character rules: only `Precompiled` has them
        # (https://github.com/huggingface/tokenizers/issues/2334).
        return [normalizers.Precompiled(blob)]
    by_target: dict[str, list[str]] = {}
    for key, target in sorted(rules.items()):
        by_target.setdefault(target, []).append(key)
    return [normalizers.Replace(tk.Regex("[" + "".join(map(_regex_char, keys)) + "]"), target)
            for target, keys in by_target.items()]


def _regex_char(c: str) -> str:
    """`c` as an Oniguruma regex atom (letters and digits as is, the rest as \\x{HEX})."""
    return c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}"


def _reserved_cuts(proto) -> tuple[str | None, list[tuple[str, str]]]:
    """What keeps a Unigram model from matching reserved pieces in text: cuts, and breaks.

    SentencePiece never matches the name of a control, unknown or byte piece ("[MASK]",
    "<0x41>") in text; `tokenizers`' Unigram matches every vocabulary entry. A cut between
    two characters of each name where no normal piece spans the pair (and, without byte
    fallback, not between two unknown characters, which SentencePiece fuses into one [UNK])
    changes no segmentation SentencePiece can make; the pattern matches the part before
    each cut (`merged_with_previous`). A name with no such cut gets, without byte fallback,
    a break: an unknown character (`_break_char`) the normalizer inserts between two of its
    unknown characters (one [UNK] run either way, so the ids stay SentencePiece's). A name
    with neither is named in a warning.

    Returns:
        (the cut pattern, or None when there is nothing to cut; the breaks, as
        `(name, name with the break)` pairs).
    """
    normal = [p.piece for p in proto.pieces if p.type == _NORMAL]
    pairs = {piece[i:i + 2] for piece in normal for i in range(len(piece) - 1)}
    known = {piece for piece in normal if len(piece) == 1}
    fuse = not proto.trainer_spec.byte_fallback
    cuts: dict[str, list[str]] = {}
    breaks: list[tuple[str, str]] = []
    # (enumerate: a protobuf repeated field has no `.index` in every protobuf release)
    for index, p in enumerate(proto.pieces):
        if p.type not in (_UNKNOWN, _CONTROL, _BYTE):
            continue
        name = p.piece
        unknown_pair = None
        for k in range(1, len(name)):
            a, b = name[k - 1], name[k]
            both_unknown = a not in known and b not in known
            if a + b not in pairs and not (fuse and both_unknown):
                cuts.setdefault(name[:k], []).append(name[k:])
                break
            if fuse and both_unknown and unknown_pair is None:
                unknown_pair = k
        else:
            if unknown_pair is not None:
                k = unknown_pair
                breaks.append((name, name[:k] + _break_char(normal) + name[k:]))
            else:
                logger.warning("piece %r (id %d) has no safe cut: a text holding it may "
                               "encode to its id instead of SentencePiece's pieces", name,
                               index)
    if not cuts:
        return None, breaks
    return "|".join("".join(map(_regex_char, head))
                    + "(?=" + "|".join("".join(map(_regex_char, t)) for t in tails) + ")"
                    for head, tails in sorted(cuts.items())), breaks


def _break_char(normal: list[str]) -> str:
    """A character of no normal piece (so unknown to the model, and spanned by no piece):
    the first free one of the Private Use Area."""
    used = set("".join(normal))
    return next(c for c in map(chr, range(0xE000, 0xF900)) if c not in used)


def _bpe_merges(proto) -> list[tuple[str, str]]:
    """Merges for a `tokenizers` BPE that encodes as SentencePiece's BPE.

    SentencePiece merges, at each step, the adjacent pair whose concatenation is the
    normal piece with the highest score (leftmost on ties); `tokenizers` merges the pair
    of lowest rank. Every split of every normal piece into two normal pieces is a merge,
    ranked by the merged piece's score, then its id (as transformers' converter does).
    """
    normal = {p.piece: (p.score, i) for i, p in enumerate(proto.pieces) if p.type == _NORMAL}
    ranked = []
    for piece, (score, i) in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-score, i, cut, left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def build_hf_tokenizer(tokenizer: Tokenizer) -> tokenizers.Tokenizer:
    """The `tokenizers.Tokenizer` that encodes as `tokenizer` (see the module docstring).

    Args:
        tokenizer: a loaded `Tokenizer` (its `normalization` comes from its manifest).

    Returns:
        A tokenizer whose `encode(text).ids` is `[CLS] + ids + [SEP]`.

    Raises:
        RuntimeError: `tokenizers` or protobuf is not installed.
        ValueError: the model uses SentencePiece options the export does not reproduce,
            or its rule table is malformed.
    """
    tk = require("tokenizers")
    from tokenizers import decoders, normalizers, pre_tokenizers, processors

    proto = read_model_proto(tokenizer.path)
    _check_supported(proto, tokenizer.path)
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    byte_fallback = trainer.byte_fallback
    pre, breaks = [], []
    if trainer.model_type == _UNIGRAM:
        vocab = [(p.piece, p.score) for p in proto.pieces]
        hf = tk.Tokenizer(tk.models.Unigram(vocab, unk_id=UNK_ID, byte_fallback=byte_fallback))
        cuts, breaks = _reserved_cuts(proto)
        if cuts is not None:
            pre.append(pre_tokenizers.Split(tk.Regex(cuts), behavior="merged_with_previous"))
    else:
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
        hf = tk.Tokenizer(tk.models.BPE(vocab, _bpe_merges(proto), unk_token=trainer.unk_piece,
                                        fuse_unk=True, byte_fallback=byte_fallback))

    steps = []
    if tokenizer.normalization:
        steps.append(getattr(normalizers, tokenizer.normalization)())
    if spec.precompiled_charsmap:
        steps += _rule_steps(tk, spec.precompiled_charsmap)
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Replace(tk.Regex(r"\A +"), ""),
                  normalizers.Replace(tk.Regex(" {2,}"), " ")]
    steps.append(normalizers.Replace(" ", SPACE_SYMBOL))
    if spec.remove_extra_whitespaces:  # after escaping: a text's own trailing "▁" too
        steps.append(normalizers.Replace(tk.Regex(rf"{SPACE_SYMBOL}+\z"), ""))
    steps += [normalizers.Replace(name, broken) for name, broken in breaks]
    if spec.add_dummy_prefix:
        # SentencePiece adds the dummy prefix before a text's own leading "▁" too;
        # Metaspace adds none to a text that starts with one.
        steps.append(normalizers.Replace(tk.Regex(rf"\A{SPACE_SYMBOL}"), SPACE_SYMBOL * 2))
        pre.insert(0, pre_tokenizers.Metaspace(replacement=SPACE_SYMBOL,
                                               prepend_scheme="always", split=False))
    hf.normalizer = normalizers.Sequence(steps)
    if pre:
        hf.pre_tokenizer = pre_tokenizers.Sequence(pre)

    parts = [decoders.Replace(SPACE_SYMBOL, " ")]
    if byte_fallback:
        parts.append(decoders.ByteFallback())
    parts.append(decoders.Fuse())
    if spec.add_dummy_prefix:
        # SentencePiece drops the leading "▁" of each piece until it has written a
        # character: a text's first "▁" piece, and one before a skipped [UNK] ("▁",
        # [UNK], "▁et" decodes to "et"), leave no space. Strip counts characters.
        parts.append(decoders.Strip(content=" ", left=_STRIP_ALL, right=0))
    hf.decoder = decoders.Sequence(parts)

    hf.add_special_tokens([tk.AddedToken(piece, special=True, normalized=False)
                           for piece in SPECIAL_TOKENS])
    cls, sep = "[CLS]", "[SEP]"
    hf.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, SPECIAL_TOKENS[cls]), (sep, SPECIAL_TOKENS[sep])])
    got = {piece: hf.token_to_id(piece) for piece in SPECIAL_TOKENS}
    if got != SPECIAL_TOKENS:  # pragma: no cover - the proto was checked on loading
        raise ValueError(f"{tokenizer.path}: special token ids {got} differ from "
                         f"{SPECIAL_TOKENS}")
    return hf


def export_tokenizer(
    source: Tokenizer | TokenizerManifest | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    model_max_length: int | None = None,
) -> list[Path]:
    """Write a `transformers` tokenizer directory for our tokenizer.

    For our SentencePiece tokenizer, `AutoTokenizer.from_pretrained(out_dir)` then gives a
    `PreTrainedTokenizerFast` whose pad, unk, cls, sep and mask tokens are `[PAD]`,
    `[UNK]`, `[CLS]`, `[SEP]` and `[MASK]` (ids 0-4), and whose model inputs are
    `input_ids` and `attention_mask`. An adopted Hugging Face tokenizer is written back as
    it came (`AutoTokenizer` reads its stage directory and saves it: the same class, the
    same files and ids), with `model_max_length` set.

    Args:
        source: a `Tokenizer`, or what `Tokenizer.load` accepts (a manifest, a stage
            directory, a `.model` file with its manifest beside it).
        out_dir: created if needed; existing tokenizer files are replaced.
        model_max_length: tokens the model takes (its `seq_len`); None leaves it unset.

    Returns:
        The files written (`tokenizer.json`, `tokenizer_config.json`, and whatever else
        the installed `transformers` writes with them).

    Raises:
        RuntimeError: `transformers`, `tokenizers` or protobuf is not installed, or the
            saved adopted tokenizer's special ids differ from the stage's.
        ValueError: the model uses SentencePiece options the export does not reproduce.
        FileNotFoundError: `source` does not exist.
    """
    tok = source if isinstance(source, Tokenizer) else Tokenizer.load(source)
    if tok.encoder_spec()[0] == "pretrained":
        return _export_pretrained(tok, Path(out_dir), model_max_length)
    hf = build_hf_tokenizer(tok)
    transformers = require("transformers")
    names = {f"{role}_token": piece
             for role, piece in zip(("pad", "unk", "cls", "sep", "mask"), SPECIAL_TOKENS)}
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=hf, clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"], **names, **extra)
    if fast.mask_token_id != MASK_ID:  # pragma: no cover - a transformers change
        raise RuntimeError(f"mask token id {fast.mask_token_id}, expected {MASK_ID}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [Path(p) for p in fast.save_pretrained(out)]
    logger.info("tokenizer %s exported to %s (%s normalization)", tok.path, out,
                tok.normalization or "no")
    return written


def _export_pretrained(tok: Tokenizer, out: Path, model_max_length: int | None) -> list[Path]:
    """`export_tokenizer` of an adopted tokenizer: `AutoTokenizer` over its stage
    directory (which holds its `tokenizer.json` and companion files), saved to `out`."""
    transformers = require("transformers")
    fast = transformers.AutoTokenizer.from_pretrained(str(tok.path.parent))
    if model_max_length is not None:
        fast.model_max_length = model_max_length
    ids = tok.special_ids
    got = (fast.pad_token_id, fast.cls_token_id, fast.sep_token_id, fast.mask_token_id)
    want = (ids.pad_id, ids.cls_id, ids.sep_id, ids.mask_id)
    if got != want:
        raise RuntimeError(f"{tok.path.parent}: transformers reads the special ids "
                           f"(pad, cls, sep, mask) {got}, the stage recorded {want}")
    out.mkdir(parents=True, exist_ok=True)
    written = [Path(p) for p in fast.save_pretrained(out)]
    logger.info("adopted tokenizer %s exported to %s", tok.path, out)
    return written
