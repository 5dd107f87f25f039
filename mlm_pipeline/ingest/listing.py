"""What a local source entry (a file, a directory, a glob) holds: the input files to read,
and every other entry named and counted as skipped.

Only regular files (or links to them) are ever opened. Every other entry of a source
directory (walked recursively) or among a glob's matches is skipped and named with its
kind (`SkippedFile`, listed in the corpus manifest and in a warning): `fifo`, `device`,
`socket` (opening a FIFO would block the run), `symlink_loop`, `dangling_symlink`,
`symlink_to_directory` (not followed, as `Path.rglob` does not follow them either),
`directory` (a directory named like an input file, `x.jsonl/`: not read as a file; its
contents are walked like any subdirectory's), `unreadable_directory`, `unreadable`, and
`unsupported_type` (a regular file whose name has none of `SUPPORTED_SUFFIXES`). Kinds are
told by `stat`, which opens nothing.

This module imports neither torch nor prefect.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import stat
from pathlib import Path

from mlm_pipeline.manifest import SkippedFile

logger = logging.getLogger(__name__)

FORMATS = (".txt", ".jsonl", ".json", ".csv", ".parquet")
COMPRESSIONS = (".gz", ".zst", ".bz2", ".xz")
#: Input file name endings read from directories and accepted from globs and paths.
SUPPORTED_SUFFIXES = FORMATS + tuple(
    f + c for f in FORMATS if f != ".parquet" for c in COMPRESSIONS)


def supported(name: str) -> bool:
    """Whether a file name ends with one of `SUPPORTED_SUFFIXES`."""
    return name.endswith(SUPPORTED_SUFFIXES)


def skipped_warning(entry: str, skipped: list[str]) -> None:
    """Log the files of unsupported type skipped in `entry` (count and first names)."""
    if skipped:
        shown = ", ".join(skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        logger.warning("ingest.sources: %s: skipped %d file(s) of unsupported type (%s)",
                       entry, len(skipped), shown)


def special_warning(entry: str, special: list[SkippedFile], root: Path | None) -> None:
    """Log every entry of `entry` that is not a regular file, by name (relative to `root`
    when given) and kind."""
    if special:
        shown = ", ".join(f"{Path(s.path).relative_to(root) if root else s.path} ({s.reason})"
                          for s in special)
        logger.warning("ingest.sources: %s: skipped %d entries that are not regular input "
                       "files, never opened: %s", entry, len(special), shown)


def local_files(entry: str, skipped: list[SkippedFile] | None,
                warn: bool = True) -> list[Path]:
    """Regular files of a local entry: the file, a directory's files of a supported type,
    or a glob's matches (of any type: `resolve_sources` refuses unsupported ones); sorted,
    possibly empty.

    Args:
        entry: a path, directory or glob (`~` expanded).
        skipped: when given, every other entry met is appended to it, in path order.
        warn: log the skipped entries (by kind, with their names).
    """
    p = Path(entry).expanduser()
    other: list[SkippedFile] = []
    if p.is_dir():
        every = _walk(p, other)
        unsupported = [f for f in every if not supported(f.name)]
        if warn:
            skipped_warning(entry, [str(f.relative_to(p)) for f in unsupported])
            special_warning(entry, other, p)
        other += [SkippedFile(path=str(f), reason="unsupported_type") for f in unsupported]
        other.sort(key=lambda s: Path(s.path))
        found = [f for f in every if supported(f.name)]
    elif p.is_file():
        found = [p]
    else:
        found = []
        for g in sorted(glob.glob(os.path.expanduser(entry), recursive=True)):
            kind = _kind(Path(g))
            if kind is None:
                found.append(Path(g))
            elif kind != "directory":  # a directory matched by a glob is no input file
                other.append(SkippedFile(path=g, reason=kind))
        if warn:
            special_warning(entry, other, None)
    if skipped is not None:
        skipped += other
    return found


def _kind(p: Path) -> str | None:
    """None for a regular file or a link to one; else what `p` is: `directory`, `fifo`,
    `device`, `socket`, `symlink_loop`, `dangling_symlink`, `unreadable` or `special`."""
    try:
        mode = p.stat().st_mode  # follows links; opens nothing, so a FIFO never blocks
    except OSError as e:
        if p.is_symlink():
            return "symlink_loop" if e.errno == errno.ELOOP else "dangling_symlink"
        return "unreadable"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "socket" if stat.S_ISSOCK(mode) else "special"


def _walk(root: Path, skipped: list[SkippedFile]) -> list[Path]:
    """Regular files under `root` (links to regular files included), sorted as
    `sorted(root.rglob("*"))` sorts them. Every other entry is appended to `skipped` with
    its kind, and so is a directory named like an input file (walked all the same)."""
    files: list[Path] = []
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError:
            skipped.append(SkippedFile(path=str(d), reason="unreadable_directory"))
            continue
        for e in entries:
            p = Path(e.path)
            if e.is_dir(follow_symlinks=False):
                stack.append(p)
                if supported(e.name):
                    skipped.append(SkippedFile(path=str(p), reason="directory"))
                continue
            kind = _kind(p)
            if kind is None:
                files.append(p)
            else:
                reason = "symlink_to_directory" if kind == "directory" else kind
                skipped.append(SkippedFile(path=str(p), reason=reason))
    skipped.sort(key=lambda s: Path(s.path))
    return sorted(files)
