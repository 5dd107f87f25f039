"""Checks on prepared data: which stage outputs of a config already exist in its work
directory, found by the stages' digests without computing anything (`find_tokenizer`, the
`tokenize` command's tokenizer), and whether the data one flow prepared is what another
flow's config needs (`read_prepared`, `check_prepared`: the `train-evaluate` flow reading
what `prepare-data` made).
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from mlm_pipeline.config import PipelineConfig
from mlm_pipeline.manifest import (CorpusManifest, Manifest, ShardManifest, TokenizerManifest,
                                   find_manifest)
from mlm_pipeline.store import work_id, work_root

M = TypeVar("M", bound=Manifest)


class StageMissingError(RuntimeError):
    """A stage output the command needs has not been produced for this config yet."""


def find_tokenizer(cfg: PipelineConfig) -> Path:
    """The `spm.model` that `mlm-pipeline run` trained for `cfg`, found by stage digests
    (nothing computed): the ingest output of `cfg.ingest`'s digest (with a `debian:`
    source, whose digest needs the apt archive, the newest complete one made with this
    `ingest` config), then the tokenizer output of that corpus and `cfg.tokenizer`.

    Raises:
        StageMissingError: the ingest or tokenizer output for this config is not complete
            in `cfg.work_dir` (the message says to run `mlm-pipeline run` first).
        FileNotFoundError: a local source of `cfg.ingest.sources` matches no file.
    """
    from mlm_pipeline.ingest.holdout import read_holdout
    from mlm_pipeline.ingest.stage import ingest_digest
    from mlm_pipeline.manifest import CorpusManifest as Corpus
    from mlm_pipeline.manifest import TokenizerManifest as Tok
    from mlm_pipeline.manifest import load_if_complete, read_manifest, stage_dir
    from mlm_pipeline.tokenizer.stage import STAGE
    from mlm_pipeline.app.parents import tokenizer_digest_for

    corpus, digest = None, ""
    if any(s.startswith("debian:") for s in cfg.ingest.sources):
        want = cfg.ingest.model_dump(mode="json")
        for path in stage_dir(cfg.work_dir, "ingest", "").glob("*/manifest.json"):
            m = read_manifest(path, Corpus)
            if m.config == want and (m := load_if_complete(path.parent, Corpus, m.digest)) \
                    and (corpus is None or m.created_at > corpus.created_at):
                corpus = m
    else:
        digest = ingest_digest(cfg.ingest, cfg.work_dir, read_holdout(cfg))
        corpus = load_if_complete(stage_dir(cfg.work_dir, "ingest", digest), Corpus, digest)
    if corpus is not None:
        digest = tokenizer_digest_for(cfg, corpus)
        out = stage_dir(cfg.work_dir, STAGE, digest)
        if (tok := load_if_complete(out, Tok, digest)) is not None:
            return tok.file(tok.model.path)
    raise StageMissingError(
        f"no {'ingest' if corpus is None else 'tokenizer'} output for config {cfg.name!r} in "
        f"work_dir {cfg.work_dir!r} (digest {digest[:16] or 'of this ingest config'}); run "
        "`mlm-pipeline run` with this config first, or pass --tokenizer PATH/TO/spm.model")


def read_prepared(cls: type[M], path: str, digest: str, url: str | None = None,
                  work_dir: str | None = None) -> M:
    """Load the stage manifest at `path` as `cls` and check it is the one with `digest`,
    with its files; one with a `url` inside the URL work directory `work_dir` is read in
    this machine's mirror, or from the store (the preparing machine had its own mirror).

    Args:
        cls: the manifest type.
        path: absolute path of the stage's `manifest.json` where it was prepared.
        digest: the manifest's digest the prepared data names.
        url: the manifest's URL in the store of a URL work directory (None: local).
        work_dir: the work directory every path must be inside (None: not checked).

    Raises:
        FileNotFoundError: the manifest, or a file it lists, is missing or changed
            (a work directory other than the one `prepare-data` wrote, or cleaned).
        ValueError: the file is not a valid `cls`, or its digest is not `digest`;
            with `work_dir`, a path outside it (`OutsideWorkDirError`, nothing read).
    """
    from mlm_pipeline.tracking.records import outputs_exist

    where = Path(path)
    if url and work_dir and url.startswith(work_id(work_dir) + "/"):
        where = work_root(work_dir) / url[len(work_id(work_dir)) + 1:]
    manifest = find_manifest(where.parent, cls, work_dir)
    if manifest.digest != digest:
        raise ValueError(f"{path}: digest {manifest.digest[:16]}, the prepared data "
                         f"names {digest[:16]}: the stage was rebuilt since")
    if not outputs_exist(manifest, work_dir):
        raise FileNotFoundError(f"{path}: files it lists are missing or changed; "
                                "run prepare-data again")
    return manifest


def check_prepared(cfg: PipelineConfig, corpus: CorpusManifest, tokenizer: TokenizerManifest,
                   shards: ShardManifest, tokenizer_path: str, shards_path: str) -> None:
    """Check that prepared data matches `cfg`: the tokenizer and shards must be what
    `cfg.tokenizer`, `cfg.shards` and `cfg.masking` make from this corpus (by digest, no
    data read). `train.*`, `model.*`, `eval.*` are free: a sweep.

    Args:
        cfg: the config that will train on the data.
        corpus, tokenizer, shards: the prepared manifests (`read_prepared`).
        tokenizer_path, shards_path: the tokenizer's and shards' `manifest.json` as the
            prepared data names them (for the messages).

    Raises:
        ValueError: a digest differs (the data was prepared with other tokenizer, shards
            or masking settings).
    """
    from mlm_pipeline.shards import shards_digest
    from mlm_pipeline.app.parents import tokenizer_digest_for

    if tokenizer.digest != tokenizer_digest_for(cfg, corpus):
        raise ValueError(f"{tokenizer_path}: not the tokenizer this config's `tokenizer` "
                         "section makes from this corpus; prepare the data with the same "
                         "config")
    if shards.digest != shards_digest(cfg.shards, corpus, tokenizer, cfg.masking):
        raise ValueError(f"{shards_path}: not the shards this config's `shards` and "
                         "`masking` sections make; prepare the data with the same config")
