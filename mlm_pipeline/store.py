"""The work directory: a local directory, or an object-store URL mirrored on local disk.

`work_dir` is a local path (the default, `.mlm-pipeline`), or a URL of any fsspec protocol
with a writable backend (`s3://bucket/prefix`: s3fs; `gs://`, `az://` likewise). A URL work
directory is the store of record; every machine works in a local mirror,
`<cache_home()>/work/<sha256(url)[:16]>/`, of the same layout, with the URL in its
`.store-url` file. Stages keep reading and writing local files; this module moves them:

* **publish**: a stage's files are uploaded when it writes its `manifest.json`, the
  manifest last, so a manifest in the store means a complete output (names starting with
  `.`, locks and temporaries, stay local); checkpoints are uploaded as they are saved and
  removed as they are pruned (`sync_children`), so a run killed on one machine resumes on
  another.
* **reuse** (`read_remote`, `remote_sizes`): an output in the store but not in the mirror
  is reused from the store's manifest and one listing of its directory (sizes checked).
* **fetch** (`fetch`, `fetch_tree`): a file is downloaded, checked against its manifest's
  size and sha256, the first time something reads it through `Manifest.file`, so training
  reads the shards it needs and nobody downloads a corpus only to find the shards cached.

Credentials and endpoints come only from the environment, as fsspec's backends read them
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, an instance role, ...;
`FSSPEC_S3_ENDPOINT_URL` for an S3-compatible endpoint), never from the config.

Two machines that build the same missing stage at once both upload it; outputs are named by
the digest of their inputs and written deterministically, so either copy is the same output
(the stage lock is per machine). This module imports no stage, neither torch nor prefect;
fsspec only for a URL work directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Environment variable naming the project's one cache directory: fetched corpora
#: (`ingest.corpora`) and, under `work/`, the local mirrors of URL work directories.
CACHE_ENV = "MLM_PIPELINE_CACHE"
#: Its former name for the mirrors alone, refused with a message naming `CACHE_ENV`.
_OLD_CACHE_ENV = "MLM_PIPELINE_CACHE_DIR"
#: File in a mirror's root holding the URL it mirrors.
MARKER = ".store-url"
#: The file a stage directory's completeness hangs on: uploaded last, read first.
MANIFEST = "manifest.json"
_CHUNK = 1 << 20  # bytes hashed at a time


def is_url(work_dir: str | os.PathLike[str]) -> bool:
    """Whether `work_dir` is an object-store URL (`scheme://...`, not `file://`)."""
    text = os.fspath(work_dir)
    return "://" in text and not text.startswith("file://")


def _normal_url(url: str) -> str:
    return url.rstrip("/")


def cache_home() -> Path:
    """The project's cache directory, absolute: `$MLM_PIPELINE_CACHE`, else
    `$XDG_CACHE_HOME/mlm-pipeline`, else `~/.cache/mlm-pipeline`.

    Raises:
        ValueError: `$MLM_PIPELINE_CACHE_DIR` (the mirrors' former variable) is set: it is no
            longer read, and a mirror moved without a word would be downloaded again.
    """
    if os.environ.get(_OLD_CACHE_ENV):
        raise ValueError(f"${_OLD_CACHE_ENV} is no longer read: set ${CACHE_ENV} instead "
                         f"(the mirrors of URL work directories are in ${CACHE_ENV}/work)")
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return (Path(base).expanduser() / "mlm-pipeline").resolve()


def cache_root() -> Path:
    """The directory holding the mirrors of URL work directories: `cache_home()/work`.

    Raises:
        ValueError: see `cache_home`.
    """
    return cache_home() / "work"


def work_root(work_dir: str | os.PathLike[str]) -> Path:
    """The local directory stages write in: `work_dir` itself (absolute), or the mirror of
    a URL work directory (created with its `.store-url` marker; `_probe`d once a process).

    Raises:
        ValueError, ImportError, OSError: a URL work directory that cannot be written
            (`_probe`; the URL is named).
    """
    text = os.fspath(work_dir).removeprefix("file://")
    if not is_url(text):
        return Path(text).expanduser().resolve()
    url = _normal_url(text)
    if url not in _probed:
        _probe(url)
    root = cache_root() / hashlib.sha256(url.encode()).hexdigest()[:16]
    marker = root / MARKER
    if not marker.is_file():  # written whole (ranks of one node may race here)
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f"{MARKER}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(url + "\n")
        os.replace(tmp, marker)
    return root


_probed: set[str] = set()  # URL work directories this process could write to


def _probe(url: str) -> None:
    """Write `<url>/.store-url` once per process, so a wrong URL or missing credentials fail
    at the start of a run, not at its first publish.

    Raises:
        ValueError: fsspec knows no such protocol (the URL is named).
        ImportError: the protocol's package is missing (e.g. `s3fs` for `s3://`).
        OSError: the store refused the write (the URL, cause and credential sources named).
    """
    try:
        fs, path = _fs(url)
    except ValueError as exc:
        raise ValueError(f"work_dir {url}: {exc}") from exc
    try:
        fs.pipe_file(f"{path.rstrip('/')}/{MARKER}", (url + "\n").encode())
    except Exception as exc:  # botocore and aiohttp errors are not OSError
        raise OSError(f"work_dir {url}: cannot write to the store ({type(exc).__name__}: "
                      f"{exc}); credentials and the endpoint come from the environment "
                      "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or AWS_PROFILE; "
                      "FSSPEC_S3_ENDPOINT_URL for an S3-compatible store)") from exc
    _probed.add(url)


def work_id(work_dir: str | os.PathLike[str]) -> str:
    """What identifies a work directory across processes and machines: its URL, or its
    absolute local path."""
    text = os.fspath(work_dir)
    return _normal_url(text) if is_url(text) else str(work_root(text))


def remote_url(local: str | os.PathLike[str]) -> str | None:
    """The store URL of a path inside the mirror of a URL work directory, or None (a local
    work directory, or a path outside any mirror)."""
    path = Path(local).absolute()
    for root in (path, *path.parents):
        marker = root / MARKER
        if marker.is_file():
            url = marker.read_text().strip()
            rel = path.relative_to(root).as_posix()
            return url if rel == "." else f"{url}/{rel}"
    return None


def _fs(url: str) -> tuple[Any, str]:
    import fsspec  # only for URL work directories

    return fsspec.core.url_to_fs(url)


def _remote(local: str | os.PathLike[str]) -> tuple[Any, str] | None:
    """(file system, path in it) of the store's copy of `local`, or None without a store."""
    url = remote_url(local)
    return None if url is None else _fs(url)


def read_remote(local: str | os.PathLike[str]) -> bytes | None:
    """The bytes of the store's copy of a small mirrored file (a manifest, a memo row), or
    None when the path has no store or the store has no such object.

    Raises:
        OSError: the store cannot be reached or read (other than a missing object).
    """
    if (remote := _remote(local)) is None:
        return None
    fs, path = remote
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None


def write_remote(local: str | os.PathLike[str], data: bytes) -> bool:
    """Write `data` as the store's copy of `local` (nothing is written locally); False when
    the path has no store.

    Raises:
        OSError: the store refused the write.
    """
    if (remote := _remote(local)) is None:
        return False
    fs, path = remote
    fs.pipe_file(path, data)
    return True


def remote_sizes(local_dir: str | os.PathLike[str]) -> dict[str, int]:
    """{path relative to `local_dir` (POSIX): size in bytes} of every object under the
    store's copy of `local_dir`, from one fresh listing ({} without a store).

    Raises:
        OSError: the store cannot be listed.
    """
    if (remote := _remote(local_dir)) is None:
        return {}
    fs, path = remote
    fs.invalidate_cache(path)
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    prefix = path.rstrip("/") + "/"
    return {name[len(prefix):]: int(info.get("size") or 0) for name, info in found.items()
            if name.startswith(prefix) and info.get("type", "file") != "directory"}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def fetch(local: str | os.PathLike[str], size: int | None = None,
          sha256: str | None = None) -> bool:
    """Download the store's copy of a mirrored file that is missing locally, to a temporary
    name renamed once checked (readers never see a partial file; the ranks of one node may
    fetch at once); True when downloaded, False when it is already there or has no store.

    Args:
        local: the file's path in the mirror.
        size: expected bytes, when a manifest records them.
        sha256: expected hex sha256, when a manifest records it.

    Raises:
        FileNotFoundError: the store has no such object (the URL is named).
        ValueError: the downloaded bytes differ from `size` or `sha256` (the URL is named;
            nothing is kept).
        OSError: the store cannot be read.
    """
    path = Path(local)
    if path.exists():
        return False
    url = remote_url(path)
    if url is None:
        return False
    fs, rpath = _fs(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        try:
            fs.get_file(rpath, tmp)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{url}: not in the work directory's store") from exc
        got = os.path.getsize(tmp)
        if size is not None and got != size:
            raise ValueError(f"{url}: {got} bytes downloaded, its manifest records {size}")
        if sha256 is not None and (actual := _sha256(Path(tmp))) != sha256:
            raise ValueError(f"{url}: sha256 {actual} downloaded, its manifest records "
                             f"{sha256}")
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    logger.info("fetched %s (%d bytes)", url, path.stat().st_size)
    return True


def fetch_tree(local_dir: str | os.PathLike[str], last: str | None = None) -> int:
    """Download every object under the store's copy of `local_dir` that is missing
    locally (`last`, e.g. a checkpoint's `state.json`, after the others); returns how
    many files were downloaded (0 without a store).

    Raises:
        OSError: the store cannot be listed or read.
    """
    root = Path(local_dir)
    sizes = remote_sizes(root)
    return sum(fetch(root / name, sizes[name])
               for name in sorted(sizes, key=lambda n: (n == last, n)))


def _local_files(local_dir: Path) -> list[str]:
    """Files under `local_dir` (POSIX, relative), none under a name starting with `.`."""
    out = []
    for path in sorted(local_dir.rglob("*")):
        rel = path.relative_to(local_dir)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts):
            out.append(rel.as_posix())
    return out


def publish(local_dir: str | os.PathLike[str], last: str = MANIFEST,
            changed_only: bool = False, exclude: tuple[str, ...] = ()) -> int:
    """Upload the files of a mirrored directory, `last` (its manifest) after all the others,
    except names starting with `.` (locks, temporaries); returns the files uploaded (0
    without a store).

    Args:
        local_dir: the directory in the mirror.
        last: the file uploaded after every other.
        changed_only: upload only the files the store lacks or holds with another size
            (checkpoints, and the growing metrics log); False uploads every file, so an
            object damaged in the store is replaced.
        exclude: names directly under `local_dir` not uploaded (a run's `checkpoints/`,
            which `sync_children` uploads in its own order).

    Raises:
        OSError: the store refused a write (the manifest, last, is then not uploaded, so the
            store never shows an incomplete output as complete).
    """
    root = Path(local_dir)
    url = remote_url(root)
    if url is None:
        return 0
    fs, rpath = _fs(url)
    have = remote_sizes(root) if changed_only else {}
    sent = 0
    for name in sorted(_local_files(root), key=lambda n: (n == last, n)):
        if name.split("/", 1)[0] in exclude:
            continue
        if changed_only and have.get(name) == (root / name).stat().st_size:
            continue
        fs.put_file(str(root / name), f"{rpath.rstrip('/')}/{name}")
        sent += 1
    if sent:
        logger.info("published %s: %d files", url, sent)
    return sent


def remove_remote(local: str | os.PathLike[str]) -> bool:
    """Delete the store's copy of a mirrored file or directory (recursively); False when
    it has no store or the store holds nothing there.

    Raises:
        OSError: the store refused the deletion.
    """
    if (remote := _remote(local)) is None:
        return False
    fs, path = remote
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        return False
    return True


def remote_children(local_dir: str | os.PathLike[str]) -> list[str]:
    """Names of the entries directly under the store's copy of `local_dir` ([] without a
    store or when it holds nothing there).

    Raises:
        OSError: the store cannot be listed.
    """
    return sorted({name.split("/", 1)[0] for name in remote_sizes(local_dir)})


def sync_children(local_dir: str | os.PathLike[str], last: str) -> None:
    """Make the store's copy of `local_dir` hold the same subdirectories as the mirror
    (checkpoints after a save and its pruning): each local one is published (what the store
    lacks; `last`, e.g. `state.json`, last), then the store's others are removed. Nothing
    without a store.

    Raises:
        OSError: the store refused a write or a deletion.
    """
    root = Path(local_dir)
    if remote_url(root) is None or not root.is_dir():
        return
    local = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    for name in local:
        publish(root / name, last=last, changed_only=True)
    for name in set(remote_children(root)) - set(local):
        if not name.startswith("."):
            remove_remote(root / name)


def complete_children(local_dir: str | os.PathLike[str], marker: str) -> list[str]:
    """Names of the subdirectories of the store's copy of `local_dir` that hold `marker`
    (complete checkpoints: their `state.json`, uploaded last), sorted; [] without a store.

    Raises:
        OSError: the store cannot be listed.
    """
    return sorted(name.split("/", 1)[0] for name in remote_sizes(local_dir)
                  if name.count("/") == 1 and name.endswith("/" + marker))
