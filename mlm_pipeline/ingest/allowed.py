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
are not checked, unless an event chose that config (`under_allow_list`): then its own
`ingest.sources` are read only when they pass the deployment's allow-list too, so that
every source a run reads passes it, whoever named it.

A hard link is not a link to follow: it is the file itself under another name, so a hard
link that someone made inside an allowed root to a file outside it is read (no path
check, `realpath` included, can tell it from a file created there). Keep write access to
the allowed roots to those who may choose what is read (the security page of the docs).

The check of a source string is not enough: a directory inside an allowed root may hold a
file symlink leading out of it, and a glob inside the root may match one. So, with an
allow-list set, every file that a source inside an allowed root (by its resolved path, or
by its name as written) expands to is resolved (`os.path.realpath`) and must lie inside an
allowed root too (`confine`); a URL source's expanded object URLs must each pass the URL
check. A file leading out is skipped, never opened, and named in the corpus manifest's
`skipped_files` with the kind `outside_allowed_sources`. Readers check each such file again
when they open it (`escaped`), so a link swapped in after listing is refused as well.

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from mlm_pipeline.config import IngestConfig, PipelineConfig
from mlm_pipeline.manifest import SkippedFile

#: `SkippedFile.reason` of a file that resolves outside every allowed root.
OUTSIDE = "outside_allowed_sources"


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


def _local_roots(allowed: Sequence[str]) -> list[str]:
    """The allowed local roots (and the paths of `file://` prefixes), each as written
    (absolute, `~` expanded) and resolved."""
    roots = [os.path.expanduser(a.removeprefix("file://")) for a in allowed
             if ("://" not in a or a.startswith("file://")) and not a.startswith("debian:")]
    return sorted({os.path.abspath(r) for r in roots} | {os.path.realpath(r) for r in roots})


def _inside(path: str, roots: Sequence[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def is_confined(source: str, allowed: Sequence[str] | None) -> bool:
    """Whether the files `source` expands to must stay inside the allowed roots: an
    allow-list is set and the source (a path, glob or URL, not `debian:`) lies inside an
    allowed root or URL prefix, resolved or by its name as written."""
    if allowed is None or source.startswith("debian:"):
        return False
    if refused_reason(source, allowed) is None:
        return True
    return "://" not in source and _inside(
        os.path.abspath(os.path.expanduser(source)), _local_roots(allowed))


def escaped(path: str | Path, allowed: Sequence[str] | None) -> str | None:
    """Why the input file `path` may not be read under `allowed`; None when it may.

    A file that lies inside an allowed root by its name (or a URL under an allowed
    prefix) must resolve inside one (a URL: pass `refused_reason`); files outside every
    root by name are not this check's (the config's own sources), nor is anything when
    `allowed` is None.
    """
    if allowed is None:
        return None
    path = str(path)
    if "://" in path:
        if not any("://" in a and path.startswith(a.rstrip("/")) for a in allowed):
            return None
        why = refused_reason(path, allowed)
        if why is None and path.startswith("file://"):
            return escaped(path.removeprefix("file://"), allowed)
        return None if why is None else f"{path}: {why}"
    roots = _local_roots(allowed)
    if not _inside(os.path.abspath(path), roots):
        return None
    real = os.path.realpath(path)
    if _inside(real, [os.path.realpath(r) for r in roots]):
        return None
    return f"{path} resolves to {real}, inside no allowed root (ingest.allowed_sources)"


def confine(source: str, found: list, allowed: Sequence[str] | None,
            skipped: list[SkippedFile]) -> list:
    """The files of `found` (expanded from `source`) that may be read under `allowed`.

    When `is_confined(source, allowed)`, every file is resolved and one leading outside
    every allowed root (a file symlink, a glob match through a link) is left out and
    appended to `skipped` with the kind `OUTSIDE`; otherwise `found` is returned as is.

    Args:
        source: the `ingest.sources` entry.
        found: its files (local paths or URLs), in order.
        allowed: `ingest.allowed_sources` (None: no check).
        skipped: where the left-out files are named.

    Returns:
        The files kept, in order.
    """
    if not is_confined(source, allowed):
        return found
    kept = []
    for f in found:
        if "://" in str(f):
            bad = refused_reason(str(f), allowed) is not None
            if not bad and str(f).startswith("file://"):  # a local file: links too
                bad = escaped(str(f).removeprefix("file://"), allowed) is not None
        else:
            real = os.path.realpath(os.path.abspath(os.path.expanduser(str(f))))
            bad = not _inside(real, [os.path.realpath(r) for r in _local_roots(allowed)])
        if bad:
            skipped.append(SkippedFile(path=str(f), reason=OUTSIDE))
        else:
            kept.append(f)
    return kept


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


def _read_sources(cfg: PipelineConfig) -> list[tuple[str, str]]:
    """(field, source) for every input a run of `cfg` reads as data: `ingest.sources`,
    `eval.holdout_sources` and the linear probe's local `data_path`."""
    found = [(f"ingest.sources[{i}]", s) for i, s in enumerate(cfg.ingest.sources)]
    found += [(f"eval.holdout_sources[{i}]", s) for i, s in enumerate(cfg.eval.holdout_sources)]
    if cfg.linear_probe.data_path is not None:
        found.append(("linear_probe.data_path", cfg.linear_probe.data_path))
    return found


def under_allow_list(cfg: PipelineConfig, allowed: Sequence[str] | None,
                     event_sources: Sequence[str] | None = None, *,
                     quote: bool = True) -> PipelineConfig:
    """`cfg`, a config an event chose, under the deployment's allow-list `allowed`: its
    `ingest.allowed_sources` replaced by `allowed`, `event_sources` (when the event named
    some) in place of `ingest.sources`, and every data input the run will read
    (`ingest.sources`, `eval.holdout_sources`, `linear_probe.data_path`) checked against
    `allowed` before anything is read. Without this, a config file an event named could
    list any file of the worker as its corpus.

    Args:
        cfg: the config the event chose (a shipped config, or a file in `config_dirs`).
        allowed: the deployment config's `ingest.allowed_sources` (None: no source passes).
        event_sources: the sources the event named, or None.
        quote: False for a file nobody vouches for: a refusal names the fields of its
            sources (`ingest.sources[2]`), never their text.

    Returns:
        The config to run.

    Raises:
        ValueError: a source is refused (one line per source, with the reason unless
            `quote` is False; the allow-list named).
    """
    ingest = cfg.ingest.model_copy(update={"allowed_sources": allowed})
    cfg = cfg.model_copy(update={"ingest": ingest})
    if event_sources is not None:
        cfg = with_event_sources(cfg, event_sources)
    own = [(f, s) for f, s in _read_sources(cfg)
           if event_sources is None or not f.startswith("ingest.sources")]
    refused = [(f, s, refused_reason(s, allowed or [])) for f, s in own]
    refused = [(f, s, why) for f, s, why in refused if why is not None]
    if refused:
        lines = "\n".join(f"  {f} = {s!r}: {why}" if quote else f"  {f}"
                          for f, s, why in refused)
        listed = (f"ingest.allowed_sources = {list(allowed)}" if allowed is not None else
                  "the deployment's config sets no ingest.allowed_sources")
        raise ValueError("inputs of the config an event chose refused before reading "
                         f"anything (the deployment's allow-list applies):\n{lines}\n"
                         f"({listed})")
    return cfg
