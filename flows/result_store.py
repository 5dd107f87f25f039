"""Prefect result persistence for the cached data stages without pickle.

Prefect writes a task's persisted result as a JSON record whose metadata names the
serializer, and reads it back with the serializer the record names, whatever the task was
given: a record planted in result storage that names `pickle` is unpickled (code runs) as
soon as a task with that cache key checks whether it is cached (`ResultStore.exists` reads
the whole record). Prefect's `json` serializer is no cure either: it imports and builds
whatever class a `__class__` field names.

So the data-stage tasks (`MANIFEST_RESULTS`) write with `ManifestSerializer` (the
manifest's own pydantic JSON; read back with `model_validate_json` into the one manifest
class its `stage` names, nothing imported) to `ManifestResultStorage`: the default local
result storage (`PREFECT_RESULTS_LOCAL_STORAGE_PATH`, read when used), whose reads hand
Prefect only records that are JSON and name `ManifestSerializer`. Anything else (a pickle
record, a damaged file) is logged and reported as missing, so the task runs and its new
record replaces the bad one. Records are written through a temporary name and a rename, so
a concurrent run never reads half of one.

This module is imported by `pretraining.py`, next to it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import uuid
from pathlib import Path
from typing import Any

from prefect._internal.compatibility.async_dispatch import async_dispatch
from prefect.filesystems import LocalFileSystem
from prefect.serializers import Serializer
from prefect.settings import get_current_settings
from pydantic import Field

from mlm_pipeline.manifest import (
    CorpusManifest,
    Manifest,
    ShardManifest,
    TokenizerManifest,
)

logger = logging.getLogger(__name__)

#: `Manifest.stage` -> the class its JSON is validated as; nothing else is ever built.
MANIFEST_CLASSES: dict[str, type[Manifest]] = {
    "ingest": CorpusManifest, "tokenizer": TokenizerManifest, "shards": ShardManifest}
SERIALIZER_TYPE = "mlm-manifest-json"


class ManifestSerializer(Serializer):
    """A stage manifest as its pydantic JSON; reads only the classes of `MANIFEST_CLASSES`.

    A failed task's exception (which Prefect persists with the task's serializer, under a
    random key, never its cache key) is kept as `{"stage": null, "error": {type, message}}`
    and read back as a `RuntimeError` with that text: no class is imported by name.
    """

    type: str = Field(default=SERIALIZER_TYPE, frozen=True)

    def dumps(self, obj: Any) -> bytes:
        """The manifest's JSON (UTF-8), or an exception's type name and message.

        Raises:
            TypeError: `obj` is neither a manifest of a cached stage nor an exception.
        """
        if isinstance(obj, BaseException):
            return json.dumps({"stage": None, "error": {"type": type(obj).__name__,
                                                        "message": str(obj)}}).encode()
        if not isinstance(obj, Manifest) or MANIFEST_CLASSES.get(obj.stage) is not type(obj):
            raise TypeError(f"{type(obj).__name__} is not a manifest of a cached data stage")
        return obj.model_dump_json().encode()

    def loads(self, blob: bytes) -> Manifest | RuntimeError:
        """The manifest of `blob`, validated as the class its `stage` names.

        Raises:
            ValueError: not JSON, no known `stage`, or not a valid manifest of it.
        """
        data = json.loads(blob)
        if data.get("stage") is None and isinstance(data.get("error"), dict):
            error = data["error"]
            return RuntimeError(f"{error.get('type')}: {error.get('message')}")
        stage = data.get("stage")
        if stage not in MANIFEST_CLASSES:
            raise ValueError(f"not a manifest of a cached data stage (stage {stage!r})")
        return MANIFEST_CLASSES[stage].model_validate_json(blob)


def check_record(content: bytes, where: str) -> bytes:
    """`content` re-encoded from what was checked (so a duplicate key cannot make Prefect
    read another serializer than the one checked) when it is a Prefect result record (JSON)
    written by `ManifestSerializer`.

    Raises:
        ValueError: anything else (the file `where` and the serializer it names are given);
            Prefect then treats the cache key as missing.
    """
    try:
        record = json.loads(content)
        named = record["metadata"]["serializer"]["type"]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{where}: not a result record of this pipeline ({exc}); "
                         "ignored, the stage runs") from None
    if named != SERIALIZER_TYPE:
        logger.warning("%s: result record written with serializer %r, not %r: never read "
                       "(a pickle record runs code when read); the stage runs and replaces it",
                       where, named, SERIALIZER_TYPE)
        raise ValueError(f"{where}: serializer {named!r} refused")
    return json.dumps(record).encode()


class ManifestResultStorage(LocalFileSystem):
    """Local result storage that only returns records `check_record` accepts and writes
    atomically; `basepath` None = Prefect's local storage path at the time of use."""

    _block_type_slug = "mlm-manifest-result-storage"

    def _resolve_path(self, path: str) -> Path:
        if not self.basepath:
            base = get_current_settings().results.local_storage_path
            return LocalFileSystem(basepath=str(base))._resolve_path(path)
        return super()._resolve_path(path)

    async def aread_path(self, path: str) -> bytes:
        """Async form of `read_path` (Prefect calls either)."""
        return self.read_path(path, _sync=True)

    @async_dispatch(aread_path)
    def read_path(self, path: str) -> bytes:
        """The bytes of the result record at `path` (relative to the storage base).

        Raises:
            ValueError: no such file, or the record does not name our manifest
                serializer (`check_record`: it is never handed to Prefect to deserialize).
        """
        resolved = self._resolve_path(path)
        if not resolved.is_file():
            raise ValueError(f"Path {resolved} does not exist or is not a file.")
        return check_record(resolved.read_bytes(), str(resolved))

    async def awrite_path(self, path: str, content: bytes) -> str:
        """Async form of `write_path` (Prefect calls either)."""
        return self.write_path(path, content, _sync=True)

    @async_dispatch(awrite_path)
    def write_path(self, path: str, content: bytes) -> str:
        """Write a result record atomically (a unique temporary file, then `os.replace`);
        returns the resolved path as a string.

        Raises:
            OSError: the record cannot be written (the temporary file is removed).
        """
        resolved = self._resolve_path(path)
        resolved.parent.mkdir(parents=True, exist_ok=True)
        tmp = resolved.with_name(f".{resolved.name}.{os.getpid()}-{secrets.token_hex(8)}.tmp")
        try:
            tmp.write_bytes(content)
            os.replace(tmp, resolved)
        finally:
            tmp.unlink(missing_ok=True)
        return str(resolved)


def manifest_result_storage() -> ManifestResultStorage:
    """The storage of `MANIFEST_RESULTS`. Prefect accepts a block on a task only with a
    server-side id; this one gets a fixed id that no server holds: the block is used as
    the object it is, and a state whose result Prefect would fetch by that id (from the
    API, in another process) fails to find it instead of reading the file unchecked."""
    storage = ManifestResultStorage()
    storage._block_document_id = uuid.uuid5(uuid.NAMESPACE_URL, "mlm-pipeline:" + SERIALIZER_TYPE)
    return storage


#: Task options of the cached data stages (`@task(..., **MANIFEST_RESULTS)`).
MANIFEST_RESULTS: dict[str, Any] = {
    "persist_result": True, "result_serializer": ManifestSerializer(),
    "result_storage": manifest_result_storage()}
