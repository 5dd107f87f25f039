"""sha256 of local files and remote objects, remembered in the work directory.

Stage identities and reuse need the sha256 of files: the ingest sources make the key of
`ingest` (`ingest_digest`, also the orchestrator's cache key), and every reused stage output
(documents, tokenizer, shards) is checked against the sha256 its manifest records
(`manifest.load_if_complete`). Reading a corpus and its outputs on every run only to find
them unchanged would cost about a second per GB, so a hash is remembered in
`<work_dir>/.hash-memo.sqlite` (`MEMO_FILE`), one row per file:

* a local file by (size, mtime_ns, ctime_ns, inode, device), its path resolved. Any write
  changes ctime, which no call can set back (`os.utime` sets atime and mtime only), so an
  in-place edit of the same size with its mtime restored is seen, in a long-lived process
  too. A row is trusted only when the file's last change (mtime or ctime) is at least
  `RACY_NS` older than the start of the hash: a file time has the granularity of the
  kernel's clock tick (1 s on some file systems), so a write in the same tick as a hash
  would keep the key ("racy git", https://git-scm.com/docs/racy-git). Such a row is
  hashed again when next asked, and trusted from then on.
* a remote object (fsspec URL) by its version id or ETag (S3 gives both, HTTP servers often
  an ETag), read from fresh metadata (fsspec's listing cache for it is dropped first): a
  cached rerun of a remote corpus reads its metadata, not its bytes. An object with
  neither is downloaded and hashed every time, never remembered. With a URL work
  directory (`mlm_pipeline.store`) these rows are also kept in the store, one small JSON
  object per URL under `<work_dir>/.hash-memo/` (`REMOTE_MEMO_DIR`), so a machine that has
  never seen the corpus (a fresh worker pod) gets its cache keys without downloading it.

SQLite locks the file while it writes, so processes sharing a work directory share the
memo safely. A memo that cannot be opened or written (a read-only work directory, a
damaged file) is skipped with one warning: hashes are then computed, never wrong. Without
a work directory the memo lives in this process only, with the same keys.

What no memo sees: a change that leaves size, times and inode alone (bit rot on the
medium, a disk written behind the kernel's back); `shards.verify_shards`, which training
runs, reads every byte of the shards.

It lives in the ingest package, the first stage that hashes, because the ground floor may
not import a stage; later stages import it. This module imports neither torch nor prefect.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, NamedTuple

from mlm_pipeline import store

logger = logging.getLogger(__name__)

#: Name of the memo database in a work directory.
MEMO_FILE = ".hash-memo.sqlite"
#: Directory of a URL work directory's store holding the rows of remote objects.
REMOTE_MEMO_DIR = ".hash-memo"
#: A file changed less than this long (ns) before its hash started is hashed again next time.
RACY_NS = 2_000_000_000
#: fsspec info keys that name one version of a remote object, most specific first.
VERSION_KEYS = ("VersionId", "version_id", "generation", "ETag", "etag")
_CHUNK = 1 << 20  # bytes read at a time
_SCHEMA = ("CREATE TABLE IF NOT EXISTS memo (name TEXT PRIMARY KEY, key TEXT NOT NULL, "
           "size INTEGER NOT NULL, sha256 TEXT NOT NULL, changed_ns INTEGER NOT NULL, "
           "hashed_at_ns INTEGER NOT NULL)")
_MEMORY_ROWS = 1 << 16  # rows the in-process memo holds before it starts again


class _Row(NamedTuple):
    key: str
    size: int
    sha256: str
    changed_ns: int
    hashed_at_ns: int


_memory: dict[str, _Row] = {}  # the memo of calls without a work directory
_memory_lock = threading.Lock()
_warned: set[Path] = set()


def hash_stream(f: IO[bytes]) -> tuple[int, str]:
    """(bytes read, hex sha256) of a binary stream, read `_CHUNK` bytes at a time."""
    h, n = hashlib.sha256(), 0
    while chunk := f.read(_CHUNK):
        h.update(chunk)
        n += len(chunk)
    return n, h.hexdigest()


def _now_ns() -> int:
    return time.time_ns()


class HashMemo:
    """sha256 of files and remote objects, remembered in `<work_dir>/.hash-memo.sqlite`
    (or in this process when `work_dir` is None); see the module docstring for the keys.

    Args:
        work_dir: the pipeline work directory (created when missing; a URL work
            directory's memo is in its local mirror, and remote objects' rows also in
            its store), or None.
    """

    def __init__(self, work_dir: str | Path | None = None) -> None:
        root = None if work_dir is None else store.work_root(work_dir)
        self.db = None if root is None else root / MEMO_FILE
        self.shared = None if root is None or store.remote_url(root) is None else (
            root / REMOTE_MEMO_DIR)

    @classmethod
    def of_stage_dir(cls, out_dir: str | Path) -> HashMemo:
        """The memo of the work directory that holds `<work_dir>/<stage>/<name>` when it has
        one, else an in-process memo (no memo file is created beside a manifest found
        elsewhere)."""
        work_dir = Path(out_dir).resolve().parent.parent
        return cls(work_dir if (work_dir / MEMO_FILE).is_file() else None)

    def file_sha256(self, path: str | Path) -> str:
        """Hex sha256 of a local file's bytes: remembered while its key is unchanged.

        Raises:
            OSError: the file cannot be read (e.g. FileNotFoundError).
        """
        real = Path(path).resolve()
        st = real.stat()
        key = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}:{st.st_dev}"
        row = self._get(str(real))
        if row is not None and row.key == key and row.changed_ns + RACY_NS <= row.hashed_at_ns:
            return row.sha256
        started = _now_ns()
        with open(real, "rb") as f:
            size, sha = hash_stream(f)
        self._put(str(real), _Row(key, size, sha, max(st.st_mtime_ns, st.st_ctime_ns), started))
        return sha

    def url_size_and_sha256(self, url: str) -> tuple[int, str]:
        """(bytes, hex sha256) of a remote object, streamed; remembered by its version id
        or ETag when fsspec reports one.

        Raises:
            ImportError: fsspec, or the backend of the URL's protocol, is missing.
            OSError: the object cannot be read (e.g. FileNotFoundError).
        """
        import fsspec  # only for URL sources

        fs, path = fsspec.core.url_to_fs(url)
        fs.invalidate_cache(path)  # a long-lived process would see a listing's old ETag
        info = fs.info(path)
        version = next((str(info[k]) for k in VERSION_KEYS if info.get(k)), None)
        key = f"{info.get('size')}:{version}"
        if version is not None:
            if (row := self._get(url)) is not None and row.key == key:
                return row.size, row.sha256
            if (row := self._get_shared(url)) is not None and row.key == key:
                self._put(url, row)
                return row.size, row.sha256
        started = _now_ns()
        with fs.open(path, "rb") as f:
            size, sha = hash_stream(f)
        if version is not None:
            self._put(url, row := _Row(key, size, sha, 0, started))
            self._put_shared(url, row)
        return size, sha

    def _shared_path(self, url: str) -> Path:
        return self.shared / (hashlib.sha256(url.encode()).hexdigest() + ".json")

    def _get_shared(self, url: str) -> _Row | None:
        """The row of `url` in the store of a URL work directory (None: none there, or no
        store, or the store unreadable: then hashed, never wrong)."""
        if self.shared is None:
            return None
        try:
            data = store.read_remote(self._shared_path(url))
            found = None if data is None else json.loads(data)
        except (OSError, ValueError) as exc:
            logger.warning("%s: hash memo row not usable (%s): the object is hashed again",
                           store.remote_url(self._shared_path(url)), exc)
            return None
        if not isinstance(found, dict) or found.get("url") != url:
            return None
        return _Row(str(found["key"]), int(found["size"]), str(found["sha256"]), 0,
                    int(found["hashed_at_ns"]))

    def _put_shared(self, url: str, row: _Row) -> None:
        if self.shared is None:
            return
        record = {"url": url, "key": row.key, "size": row.size, "sha256": row.sha256,
                  "hashed_at_ns": row.hashed_at_ns}
        try:
            store.write_remote(self._shared_path(url), json.dumps(record).encode())
        except OSError as exc:
            logger.warning("%s: hash memo row not written (%s)",
                           store.remote_url(self._shared_path(url)), exc)

    # ----------------------------------------------------------------------- storage
    def _get(self, name: str) -> _Row | None:
        if self.db is not None:
            try:
                with self._connection() as con:
                    found = con.execute("SELECT key, size, sha256, changed_ns, hashed_at_ns "
                                        "FROM memo WHERE name = ?", (name,)).fetchone()
                return None if found is None else _Row(*found)
            except (sqlite3.Error, OSError) as exc:
                self._unusable(exc)
        with _memory_lock:
            return _memory.get(name)

    def _put(self, name: str, row: _Row) -> None:
        if self.db is not None:
            try:
                with self._connection() as con:
                    con.execute("INSERT OR REPLACE INTO memo VALUES (?, ?, ?, ?, ?, ?)",
                                (name, *row))
                return
            except (sqlite3.Error, OSError) as exc:
                self._unusable(exc)
        with _memory_lock:
            if len(_memory) >= _MEMORY_ROWS:
                _memory.clear()
            _memory[name] = row

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        # One connection a call: none crosses a fork or a thread. The timeout (s) waits
        # for another process's write lock; `with con` commits (or rolls back).
        self.db.parent.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(self.db, timeout=30)
        try:
            with con:
                con.execute(_SCHEMA)
                yield con
        finally:
            con.close()

    def _unusable(self, exc: Exception) -> None:
        if self.db not in _warned:
            _warned.add(self.db)
            logger.warning("%s: hash memo not usable (%s): hashes are computed in this "
                           "process only", self.db, exc)
