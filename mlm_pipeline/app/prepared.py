"""Checks on prepared data outside a run: which stage outputs of a config already exist in
its work directory, found by the stages' digests without computing anything (the
`tokenize` command's tokenizer).
"""

from __future__ import annotations

from pathlib import Path

from mlm_pipeline.config import PipelineConfig


class StageMissingError(RuntimeError):
    """A stage output the command needs has not been produced for this config yet."""


def find_tokenizer(cfg: PipelineConfig) -> Path:
    """The `spm.model` that `mlm-pipeline run` trained for `cfg`, found by stage digests.

    The corpus is the ingest output of `cfg.ingest`'s digest (source contents + config);
    with a `debian:` source, whose digest needs the apt archive checked (`apt-cache`), it
    is the newest complete ingest output in `cfg.work_dir` made with this same `ingest`
    config, so nothing is fetched. The tokenizer is the output of the tokenizer digest of
    `cfg.tokenizer` and that corpus. Nothing is computed.

    Raises:
        StageMissingError: the ingest or tokenizer output for this config is not complete
            in `cfg.work_dir` (the message says to run `mlm-pipeline run` first).
        FileNotFoundError: a local source of `cfg.ingest.sources` matches no file.
    """
    from mlm_pipeline.ingest.stage import ingest_digest
    from mlm_pipeline.manifest import CorpusManifest as Corpus
    from mlm_pipeline.manifest import TokenizerManifest as Tok
    from mlm_pipeline.manifest import load_if_complete, read_manifest, stage_dir
    from mlm_pipeline.tokenizer.stage import STAGE
    from mlm_pipeline.tracking.parents import tokenizer_digest_for

    corpus, digest = None, ""
    if any(s.startswith("debian:") for s in cfg.ingest.sources):
        want = cfg.ingest.model_dump(mode="json")
        for path in stage_dir(cfg.work_dir, "ingest", "").glob("*/manifest.json"):
            m = read_manifest(path, Corpus)
            if m.config == want and (m := load_if_complete(path.parent, Corpus, m.digest)) \
                    and (corpus is None or m.created_at > corpus.created_at):
                corpus = m
    else:
        digest = ingest_digest(cfg.ingest, cfg.work_dir)
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
