"""Sources named by an event, checked against `ingest.allowed_sources` before any file is read.

Whoever can emit a `corpus.updated` event chooses what a worker reads (and uploads with the
run), so a source that came from an event is used only when it matches the config's
allow-list (`IngestConfig.allowed_sources`):

* a local path (file, directory or glob; `~` expanded, relative to the working directory)
  must resolve, symbolic links and `..` followed, to an allowed root or inside one (an
  allowed root is resolved the same way);
* a URL (`scheme://...`) must start with an allowed URL prefix, at a `/` boundary unless the
  prefix ends with `/`, and have no `.` or `..` path segment;
* `debian:NAME` must be listed as such.

No list (None) allows no event source. Sources of the config itself are the user's own and
are not checked. This module imports neither torch nor prefect.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mlm_pipeline.config import IngestConfig, PipelineConfig


def refused_reason(source: str, allowed: Sequence[str]) -> str | None:
    """Why `source` matches no entry of `allowed`; None when it matches one."""
    if not source.strip():
        return "empty source"
    if "://" in source:
        scheme_path = source.split("://", 1)[1]
        if any(part in (".", "..") for part in scheme_path.split("?", 1)[0].split("/")):
            return "a URL with a '.' or '..' path segment"
        for prefix in (a for a in allowed if "://" in a):
            if source == prefix or (source.startswith(prefix)
                                    and (prefix.endswith("/") or source[len(prefix)] == "/")):
                return None
        return "no allowed URL prefix matches"
    if source.startswith("debian:"):
        return None if source in allowed else "this debian: corpus is not listed"
    try:
        real = Path(source).expanduser().resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        return f"cannot be resolved ({exc})"
    for root in (a for a in allowed if "://" not in a and not a.startswith("debian:")):
        real_root = Path(root).expanduser().resolve()
        if real == real_root or real_root in real.parents:
            return None
    return f"resolves to {real}, inside no allowed root"


def check_event_sources(sources: Sequence[str], allowed: Sequence[str] | None) -> None:
    """Refuse event sources that `allowed` (`ingest.allowed_sources`) does not cover.

    Raises:
        ValueError: one line per refused source with the reason, and the allow-list (or
            that the config has none).
    """
    if not sources:
        raise ValueError("an event named an empty list of sources")
    refused = [(s, refused_reason(s, allowed or [])) for s in sources]
    refused = [(s, why) for s, why in refused if why is not None]
    if refused:
        lines = "\n".join(f"  {s!r}: {why}" for s, why in refused)
        listed = (f"ingest.allowed_sources = {list(allowed)}" if allowed is not None else
                  "the config sets no ingest.allowed_sources, so events may name no source")
        raise ValueError(f"sources from an event refused before reading anything:\n{lines}\n"
                         f"({listed})")


def with_event_sources(cfg: PipelineConfig, sources: Sequence[str]) -> PipelineConfig:
    """`cfg` reading `sources` (from an event) instead of `ingest.sources`, once they pass
    `check_event_sources` against `cfg.ingest.allowed_sources`.

    Raises:
        ValueError: a source is refused (see `check_event_sources`).
    """
    check_event_sources(sources, cfg.ingest.allowed_sources)
    ingest = IngestConfig.model_validate({**cfg.ingest.model_dump(), "sources": list(sources)})
    return cfg.model_copy(update={"ingest": ingest})
