"""What every stage manifest shares: `Manifest`, `FileEntry`, the digest, atomic writes,
finding and reusing a stage's output.

Each stage writes its outputs into a content-addressed directory
`<work_dir>/<stage>/<digest[:16]>/` and a `manifest.json` beside them. The digest is a
sha256 over the stage name, its config and the digests of its inputs, so it is the stage's
identity: a rerun with unchanged inputs finds the manifest and skips the work
(`load_if_complete`). With a URL work directory (`mlm_pipeline.store`) the stage directory
is in the local mirror, published and fetched as the functions below say. This module
imports neither torch nor prefect.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path, PurePath
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from mlm_pipeline import __version__, store

logger = logging.getLogger(__name__)

#: Bump when a stage's output format changes, so old cached outputs are not reused.
FORMAT_VERSION = 1


class ManifestPathError(ValueError):
    """A path in a manifest that is not inside its stage directory (the manifest is named)."""


class OutsideWorkDirError(ValueError):
    """A stage output (a manifest's `output_dir`, or the directory a manifest is read from)
    outside the work directory: never read, never reused (the manifest is named)."""


def check_in_work_dir(output_dir: str | os.PathLike[str], work_dir: str | os.PathLike[str],
                      what: str = "stage output") -> Path:
    """`output_dir`, resolved, once it is inside `work_dir` (resolved; a URL work
    directory's local mirror, `store.work_root`): nothing outside the work directory is
    ever a stage output, whatever a manifest, a result record or a parameter says.

    Returns:
        The resolved `output_dir`.

    Raises:
        OutsideWorkDirError: it is not (both directories and `what` are named).
    """
    out = Path(output_dir).expanduser().resolve()
    root = store.work_root(work_dir).resolve()
    if out != root and root not in out.parents:
        raise OutsideWorkDirError(f"{what} {out} is outside the work directory {root} "
                                  f"(work_dir {work_dir}): refused, nothing read from it")
    return out


class FileEntry(BaseModel):
    """One output file: path relative to the manifest's directory, size and checksum."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    """Path relative to `Manifest.output_dir`."""
    bytes: int
    """Size in bytes."""
    sha256: str
    """Hex sha256 of the file's bytes."""
    rows: int | None = None
    """Records in the file (documents or token rows), when it has records."""
    tokens: int | None = None
    """Tokens in the file, for token shards."""


class Manifest(BaseModel):
    """Fields common to every stage manifest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: str
    """Stage name (`ingest`, `tokenizer`, `shards`, `train`, `evaluate`)."""
    digest: str
    """Hex sha256 identity of the stage: config + input digests (see `compute_digest`)."""
    output_dir: str
    """Absolute directory holding the outputs and `manifest.json`."""
    config: dict[str, Any]
    """The stage config as JSON."""
    inputs: dict[str, str]
    """Name -> digest of every input (upstream manifests or raw files)."""
    package_version: str = __version__
    """mlm_pipeline version that wrote it."""
    created_at: float
    """Unix time (s) when the manifest was written."""
    wall_time_s: float
    """Seconds the stage took."""

    @property
    def path(self) -> Path:
        """Path of this manifest's `manifest.json`."""
        return Path(self.output_dir) / "manifest.json"

    def file(self, rel: str) -> Path:
        """Absolute path of an output file given relative to `output_dir`: the one check of
        every path read from a manifest, so a tampered manifest cannot make a stage read, or
        upload, a file outside its stage directory. In the mirror of a URL work directory a
        missing file (or directory: a checkpoint) is downloaded first, checked against this
        manifest's records.

        Raises:
            ManifestPathError: `rel` is absolute or has a `..` part, or resolves (through a
                symbolic link) outside `output_dir`; the manifest is named.
            ValueError: a downloaded file differs from its record (the URL is named).
            OSError: the store cannot be read.
        """
        path = self._local(rel)
        if not path.exists() and store.remote_url(path) is not None:
            entry = next((e for e in _file_entries(self) if e.path == rel), None)
            if entry is not None:
                store.fetch(path, entry.bytes, entry.sha256)
            elif not store.fetch_tree(path):  # a directory (a checkpoint), or one file
                with contextlib.suppress(FileNotFoundError):
                    store.fetch(path)
        return path

    def _local(self, rel: str) -> Path:
        """`file`'s checks, without fetching from a store."""
        root, given = Path(self.output_dir), PurePath(rel)
        if given.anchor or ".." in given.parts:
            raise ManifestPathError(f"{self.path}: path {rel!r} is not relative to the "
                                    f"stage directory {root} without '..'; refused")
        try:
            real, real_root = (root / rel).resolve(), root.resolve()
        except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
            raise ManifestPathError(f"{self.path}: path {rel!r}: {exc}; refused") from exc
        if real != real_root and real_root not in real.parents:
            raise ManifestPathError(f"{self.path}: path {rel!r} resolves to {real}, outside "
                                    f"the stage directory {real_root} (a symbolic link); refused")
        return root / rel


M = TypeVar("M", bound=Manifest)


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes (sorted keys, no whitespace) for hashing."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=_jsonable).encode()


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    raise TypeError(f"cannot hash {type(obj).__name__} into a digest")


def compute_digest(stage: str, config: Any, inputs: Mapping[str, str]) -> str:
    """Digest that identifies a stage's output.

    Args:
        stage: stage name.
        config: the stage config (pydantic model or JSON-able value).
        inputs: name -> digest of each input; order does not matter.

    Returns:
        64 hex characters of sha256 over `FORMAT_VERSION`, the stage, the canonical config
        JSON and the sorted inputs.
    """
    h = hashlib.sha256()
    h.update(canonical_json({"format": FORMAT_VERSION, "stage": stage}))
    h.update(canonical_json(config))
    h.update(canonical_json(dict(sorted(inputs.items()))))
    return h.hexdigest()


def sha256_file(path: str | os.PathLike[str], chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read in `chunk_bytes` chunks (memory stays flat)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def file_entry(root: Path, path: Path, **counts: int | None) -> FileEntry:
    """Describe `path` (inside `root`) with its size and sha256."""
    return FileEntry(path=str(path.relative_to(root)), bytes=path.stat().st_size,
                     sha256=sha256_file(path), **counts)


def stage_dir(work_dir: str | os.PathLike[str], stage: str, digest: str) -> Path:
    """`<work_dir>/<stage>/<digest[:16]>`, absolute; in the local mirror for a URL work
    directory (`store.work_root`)."""
    return store.work_root(work_dir) / stage / digest[:16]


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file in the same directory and a rename,
    so readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600 files; give the usual umask-based mode for shared work dirs.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_manifest(manifest: Manifest, changed_only: bool = False) -> Path:
    """Write `manifest.json` atomically into the manifest's `output_dir`; returns its path. In
    the mirror of a URL work directory the stage directory is then published, the manifest
    last (`store.publish`; `changed_only`: only the files the store lacks or holds with
    another size, for a training run whose checkpoints were uploaded as saved).

    Raises:
        OSError: the file, or the store, cannot be written.
    """
    atomic_write_text(manifest.path, manifest.model_dump_json(indent=2) + "\n")
    store.publish(manifest.path.parent, changed_only=changed_only)
    return manifest.path


def find_manifest(out_dir: str | os.PathLike[str], cls: type[M],
                  work_dir: str | os.PathLike[str] | None = None) -> M:
    """The manifest of stage directory `out_dir`: its `manifest.json`, or the store's copy
    for the mirror of a URL work directory (then written to the mirror); its `output_dir`
    is `out_dir`. Its files are not checked (`load_if_complete` does). With `work_dir`,
    `out_dir` must be inside it (`check_in_work_dir`).

    Raises:
        FileNotFoundError: neither the directory nor the store holds a manifest.
        OutsideWorkDirError: `out_dir` is outside `work_dir` (nothing is read).
        ValueError: it does not validate as `cls` (the path is named).
    """
    out = (check_in_work_dir(out_dir, work_dir, f"{cls.__name__} directory")
           if work_dir is not None else Path(out_dir).resolve())
    path = out / "manifest.json"
    if path.is_file():
        m = read_manifest(path, cls)
        return m if m.output_dir == str(out) else m.model_copy(update={"output_dir": str(out)})
    data = store.read_remote(path)
    if data is None:
        raise FileNotFoundError(f"{path}: no manifest" + (
            f" (nor {store.remote_url(path)})" if store.remote_url(path) else ""))
    return _mirrored(out, cls, data)


def _mirrored(out: Path, cls: type[M], data: bytes) -> M:
    """The store's manifest `data` of stage directory `out`, with `out` as its `output_dir`,
    written to the mirror as such.

    Raises:
        ValueError: `data` does not validate as `cls` (the URL is named).
    """
    try:
        m = cls.model_validate_json(data)
    except ValueError as exc:
        raise ValueError(f"{store.remote_url(out / 'manifest.json')}: not a valid "
                         f"{cls.__name__}: {exc}") from exc
    m = m.model_copy(update={"output_dir": str(out)})
    atomic_write_text(out / "manifest.json", m.model_dump_json(indent=2) + "\n")
    return m


def read_manifest(path: str | os.PathLike[str], cls: type[M]) -> M:
    """Load a manifest JSON file (or a directory holding `manifest.json`) as `cls`.

    Raises:
        FileNotFoundError: when the file does not exist.
        ValueError: when it does not validate as `cls` (the path is named).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "manifest.json"
    try:
        return cls.model_validate_json(p.read_bytes())
    except FileNotFoundError:
        raise
    except Exception as exc:  # pydantic ValidationError or JSON error
        raise ValueError(f"{p}: not a valid {cls.__name__}: {exc}") from exc


def load_if_complete(out_dir: Path, cls: type[M], digest: str,
                     sha256: Callable[[Path], str] | None = None,
                     work_dir: str | os.PathLike[str] | None = None) -> M | None:
    """The manifest in `out_dir` when it exists, has `digest`, and every file it lists still
    exists with the recorded size and, when `sha256` (path -> hex digest, e.g.
    `mlm_pipeline.ingest.hashing.HashMemo.file_sha256`) is given, the recorded sha256; else
    None (the stage must run). A changed file is named in a warning. A moved or copied stage
    directory is reused where it is (the manifest's `output_dir` is `out_dir`, resolved).

    In the mirror of a URL work directory, an output complete in the mirror is published if
    the store lacks its manifest (a run killed while publishing); one missing from the mirror
    is reused when the store's manifest has `digest` and one listing shows every file it lists
    with the recorded size (nothing is downloaded: `Manifest.file` fetches each when read).

    With `work_dir`, `out_dir` must be inside it (`check_in_work_dir`).

    Raises:
        ManifestPathError: a listed path is not inside `out_dir` (`Manifest.file`).
        OutsideWorkDirError: `out_dir` is outside `work_dir` (nothing is read).
        OSError: the store cannot be read or written.
    """
    if work_dir is not None:
        check_in_work_dir(out_dir, work_dir, f"{cls.__name__} directory")
    m = _load_local(out_dir, cls, digest, sha256)
    if store.remote_url(out_dir) is None:
        return m
    if m is not None:
        if store.read_remote(m.path) is None:
            store.publish(out_dir)
        return m
    data = store.read_remote(out_dir / "manifest.json")
    try:
        m = None if data is None else cls.model_validate_json(data)
    except ValueError:
        return None
    if m is None or m.digest != digest:
        return None
    m = m.model_copy(update={"output_dir": str(out_dir.resolve())})
    sizes = store.remote_sizes(out_dir)
    for entry in _file_entries(m):
        local = m._local(entry.path)  # the path checks, before anything is fetched
        if local.is_file() and (local.stat().st_size != entry.bytes or (
                sha256 is not None and sha256(local) != entry.sha256)):
            logger.warning("%s: %s differs from its manifest; it is fetched again from %s",
                           m.stage, local, store.remote_url(local))
            local.unlink()
        have = local.stat().st_size if local.is_file() else sizes.get(entry.path)
        if have != entry.bytes:
            return None
    return _mirrored(out_dir.resolve(), cls, data)


def _load_local(out_dir: Path, cls: type[M], digest: str,
                sha256: Callable[[Path], str] | None) -> M | None:
    """`load_if_complete` in `out_dir` alone (never a store)."""
    p = out_dir / "manifest.json"
    if not p.is_file():
        return None
    try:
        m = read_manifest(p, cls)
    except ValueError:
        return None
    if m.digest != digest:
        return None
    here = str(out_dir.resolve())
    if Path(m.output_dir).resolve() != Path(here):
        m = m.model_copy(update={"output_dir": here})
    files = [(m._local(entry.path), entry) for entry in _file_entries(m)]
    if any(not f.is_file() or f.stat().st_size != e.bytes for f, e in files):
        return None
    for f, entry in files if sha256 is not None else ():
        if (actual := sha256(f)) != entry.sha256:
            if store.remote_url(f) is None:  # else fetched again (`load_if_complete`)
                logger.warning("%s: %s changed: sha256 %s, its manifest %s records %s; the "
                               "stage is rebuilt", m.stage, f, actual, p, entry.sha256)
            return None
    return m


def _file_entries(obj: Any) -> list[FileEntry]:
    if isinstance(obj, FileEntry):
        return [obj]
    if isinstance(obj, BaseModel):
        obj = [getattr(obj, name) for name in type(obj).model_fields]
    elif isinstance(obj, dict):
        obj = list(obj.values())
    return [e for v in obj for e in _file_entries(v)] if isinstance(obj, (list, tuple)) else []


class Stopwatch:
    """Wall-clock timer for a stage: `elapsed` is seconds since creation."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.created_at = time.time()

    @property
    def elapsed(self) -> float:
        """Seconds since the stopwatch was created."""
        return time.perf_counter() - self.start
