"""Arrow IPC shard files: atomic writing and zero-copy reading.

A shard is an Arrow IPC file (Feather v2, uncompressed) holding one record batch of
fixed-size-list columns, `(rows, seq_len)` each: `input_ids` (uint16 or uint32), plus
`labels` (int32, -100 where not predicted) for precomputed masked copies. The layout and
the packing of rows are documented in `mlm_pipeline.shards.stage`. This module imports numpy and
pyarrow only.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
from pyarrow import ipc

from mlm_pipeline.locks import temp_path
from mlm_pipeline.manifest import FileEntry, ShardManifest, sha256_file

logger = logging.getLogger(__name__)

#: Name of a masked copy's shard: copy index, shard index (`mlm_pipeline.shards.stage` docstring).
MASKED_COPY_NAME = re.compile(r"train-copy(\d+)-(\d{5})\.arrow")


class _HashingFile:
    """A binary file that hashes what is written to it (sha256), so a shard is never read
    back to be described.

    With `substitute = (buffer, body_path)`, the write of exactly that Arrow buffer (pyarrow
    writes a record batch's body buffer as one `write`) is replaced by the bytes of the
    file `body_path`, streamed in 1 MiB chunks: the buffer is a placeholder of the right
    size that is never read.
    """

    def __init__(self, f: BinaryIO, substitute: tuple[pa.Buffer, Path] | None = None) -> None:
        self.f, self.sha, self.closed = f, hashlib.sha256(), False
        self.substitute, self.substituted = substitute, False

    def write(self, data) -> int:
        """Hash `data` (bytes-like) and write it; returns the bytes written."""
        if self.substitute is not None and isinstance(data, pa.Buffer):
            placeholder, body_path = self.substitute
            if data.address == placeholder.address and data.size == placeholder.size:
                return self._write_file(body_path, data.size)
        self.sha.update(data)
        return self.f.write(data)

    def _write_file(self, body_path: Path, size: int) -> int:
        written = 0
        with open(body_path, "rb") as body:
            while chunk := body.read(1 << 20):
                self.sha.update(chunk)
                written += self.f.write(chunk)
        if written != size:
            raise RuntimeError(f"{body_path}: {written} bytes, the shard body needs {size}")
        self.substituted = True
        return written

    def flush(self) -> None:
        """Flush the underlying file's buffer."""
        self.f.flush()

    def close(self) -> None:
        """Mark closed only: pyarrow closes its sink, the real file is closed by its owner."""
        self.closed = True


def write_arrow(out_dir: Path, path: Path, columns: dict[str, np.ndarray],
                seq_len: int) -> FileEntry:
    """Write (rows, seq_len) arrays as fixed-size-list columns in one record batch,
    atomically: a temporary name unique to the process (`locks.temp_path`), fsync, then
    rename, so a crash never leaves a partial file under `path`. The arrays are wrapped, not
    copied.

    Args:
        out_dir: the stage directory `FileEntry.path` is relative to.
        path: the shard's final path, inside `out_dir`.
        columns: column name -> C-contiguous-able numeric array of shape (rows, seq_len).
        seq_len: tokens per row.

    Returns:
        The file's entry: size in bytes, sha256 (computed while writing), rows, tokens.

    Raises:
        OSError: the file cannot be written (the temporary file is removed).
    """
    return _write(out_dir, path, columns, seq_len, None)


def write_arrow_from_body(out_dir: Path, path: Path, name: str, body_path: Path,
                          dtype: np.dtype, seq_len: int) -> FileEntry:
    """Write a one-column shard whose rows are the raw bytes of `body_path`: the file
    `write_arrow(out_dir, path, {name: rows}, seq_len)` writes for the (rows, seq_len)
    `dtype` array those bytes hold, byte for byte, without holding the rows in memory (the
    shard writer appends rows to `body_path` as they are packed).

    Args:
        out_dir, path, seq_len: as in `write_arrow`.
        name: the column name (`input_ids`).
        body_path: C-order rows, `rows * seq_len * dtype.itemsize` bytes.
        dtype: numpy dtype of the ids (uint16 or uint32).

    Returns:
        The file's entry, as `write_arrow`.

    Raises:
        ValueError: the body's size is not a whole number of rows.
        RuntimeError: pyarrow did not write the body as one buffer (the placeholder's bytes
            would be in the file; the temporary file is removed).
        OSError: a file cannot be read or written.
    """
    row_bytes = seq_len * np.dtype(dtype).itemsize
    rows, extra = divmod(body_path.stat().st_size, row_bytes)
    if extra:
        raise ValueError(f"{body_path}: {body_path.stat().st_size} bytes is not a whole "
                         f"number of {row_bytes}-byte rows")
    # The placeholder is an anonymous mapping whose pages are never touched, so it takes
    # no memory (np.zeros may take heap memory and clear it: it did, by 11 MiB, at 16 MiB).
    # The mapping is unmapped when the last view of it is gone (not closed here: a
    # traceback may still hold a view).
    anon = mmap.mmap(-1, max(rows * row_bytes, 1))
    placeholder = np.frombuffer(anon, dtype, rows * seq_len).reshape(rows, seq_len)
    return _write(out_dir, path, {name: placeholder}, seq_len, body_path)


def _write(out_dir: Path, path: Path, columns: dict[str, np.ndarray], seq_len: int,
           body_path: Path | None) -> FileEntry:
    """`write_arrow`, with the first column's buffer written from `body_path` when given."""
    buffers = [pa.py_buffer(np.ascontiguousarray(a)) for a in columns.values()]
    arrays = [pa.FixedSizeListArray.from_arrays(
        pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), a.size, [None, buf]), seq_len)
        for a, buf in zip(columns.values(), buffers)]
    schema = pa.schema([pa.field(n, a.type, nullable=False) for n, a in zip(columns, arrays)])
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            sink = _HashingFile(f, None if body_path is None else (buffers[0], body_path))
            with ipc.new_file(sink, schema) as w:
                w.write_batch(pa.record_batch(arrays, schema=schema))
            if body_path is not None and not sink.substituted and buffers[0].size:
                raise RuntimeError(f"{path}: pyarrow did not write the shard body as one "
                                   "buffer; cannot substitute it from the body file")
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    rows = len(arrays[0])
    return FileEntry(path=str(path.relative_to(out_dir)), bytes=size,
                     sha256=sink.sha.hexdigest(), rows=rows, tokens=rows * seq_len)


_IDS = (pa.uint16(), pa.uint32())


def _map_columns(path: str | os.PathLike[str], kinds: dict[str, tuple]) -> list[np.ndarray]:
    """Memory-map the fixed-size-list columns `kinds` (name -> allowed value types) of an
    Arrow IPC file as `(rows, seq_len)` arrays: zero-copy views for one record batch,
    a read-only copy otherwise. Errors name the file (see `open_shard`)."""
    path = Path(path)
    try:
        reader = ipc.open_file(pa.memory_map(str(path), "r"))
    except pa.ArrowInvalid as exc:
        raise ValueError(f"{path}: not an Arrow IPC file: {exc}") from exc
    schema = reader.schema
    types = [f.type for f in schema]
    if (
        schema.names != list(kinds)
        or not all(pa.types.is_fixed_size_list(t) for t in types)
        or any(t.value_type not in k for t, k in zip(types, kinds.values()))
        or len({t.list_size for t in types}) != 1
    ):
        wanted = ", ".join(f"{n!r}: fixed_size_list<{'|'.join(map(str, k))}>"
                           for n, k in kinds.items())
        raise ValueError(f"{path}: expected columns {wanted} of one length, got schema {schema}")
    seq_len = types[0].list_size
    out = []
    for j, name in enumerate(kinds):
        parts = []
        for i in range(reader.num_record_batches):
            column = reader.get_batch(i).column(j)
            if column.null_count or column.values.null_count:
                raise ValueError(f"{path}: record batch {i} of {name!r} holds nulls")
            start = column.offset * seq_len
            values = column.values.to_numpy(zero_copy_only=True)
            parts.append(values[start : start + len(column) * seq_len].reshape(-1, seq_len))
        if len(parts) != 1:
            if parts:
                logger.debug("%s: %d record batches, copied into one array", path, len(parts))
            parts = [np.concatenate(parts) if parts
                     else np.empty((0, seq_len), types[j].value_type.to_pandas_dtype())]
            parts[0].flags.writeable = False
        out.append(parts[0])
    return out


def open_shard(path: str | os.PathLike[str]) -> np.ndarray:
    """Memory-map a shard as a read-only `(rows, seq_len)` array of token ids.

    Shards written by `write_shards` hold one record batch, and the array is a zero-copy
    view of the mapped file (the mapping stays open while the array lives). A file with
    several record batches is read too, but copied into one array.

    Args:
        path: an Arrow IPC file with one column `input_ids`, `fixed_size_list<uint16|uint32>`.

    Returns:
        uint16 or uint32 (the stored type) array of shape `(rows, seq_len)`.

    Raises:
        ValueError: the file is not an Arrow IPC file, its schema is not the one above, or it
            holds nulls (the file is named).
    """
    return _map_columns(path, {"input_ids": _IDS})[0]


def open_masked_shard(path: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
    """Memory-map a masked copy's shard (`train-copy{c}-{i:05d}.arrow`), zero-copy.

    Args:
        path: an Arrow IPC file with columns `input_ids` (`fixed_size_list<uint16|uint32>`)
            and `labels` (`fixed_size_list<int32>`) of one length, as `write_shards` writes.

    Returns:
        `(input_ids, labels)`, read-only `(rows, seq_len)` arrays: the corrupted ids
        (stored dtype) and int32 labels (-100 where not predicted).

    Raises:
        ValueError: the file is not an Arrow IPC file, its schema is not the one above, or it
            holds nulls (the file is named).
    """
    return tuple(_map_columns(path, {"input_ids": _IDS, "labels": (pa.int32(),)}))


def verify_shards(manifest: ShardManifest) -> None:
    """Recompute the sha256 of every shard of both splits and compare with the manifest.

    Raises:
        ValueError: a shard is missing or its sha256 differs (the file is named), or its
            path is outside the manifest's directory (`ManifestPathError`).
    """
    for split in (manifest.train, manifest.validation):
        for entry in split.shards:
            path = manifest.file(entry.path)
            if not path.is_file():
                raise ValueError(f"{path}: shard listed in {manifest.path} is missing")
            actual = sha256_file(path)
            if actual != entry.sha256:
                raise ValueError(
                    f"{path}: sha256 {actual} differs from {entry.sha256} in {manifest.path}: "
                    "the shard is corrupt; delete it and rerun to rebuild the shards")


def masked_copies(manifest: ShardManifest) -> int:
    """Masked copies of the training split the manifest lists (0 without precomputed
    masking): `ShardSplit.masked_copies`, or, for manifests written before that field, the
    copies named `train-copy{c}-{i:05d}.arrow` among the shards."""
    if manifest.train.masked_copies:
        return manifest.train.masked_copies
    return len({int(m.group(1)) for e in manifest.train.shards
                if (m := MASKED_COPY_NAME.fullmatch(e.path))})


def split_shards(manifest: ShardManifest, split: str, copy: int | None = None) -> list[FileEntry]:
    """The shard entries of `split`: the unmasked ones (`copy=None`), or those of masked
    copy `copy` of the training split, in row order (empty when there is no such copy).

    The entries are `k + 1` equal runs, the unmasked shards then copy 0, 1, ... (module
    docstring), `k = masked_copies(manifest)` for the training split and 0 for validation.

    Raises:
        ValueError: the number of entries is not a multiple of `k + 1` (the manifest is
            named).
    """
    entries = getattr(manifest, split).shards
    k = masked_copies(manifest) if split == "train" else 0
    n, extra = divmod(len(entries), k + 1)
    if extra:
        raise ValueError(f"{manifest.path}: {len(entries)} {split} shards do not split into "
                         f"the unmasked rows and {k} masked copies of equal length")
    if copy is None:
        return entries[:n]
    if not 0 <= copy < k:
        return []
    return entries[n * (copy + 1) : n * (copy + 2)]
