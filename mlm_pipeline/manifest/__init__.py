"""Stage manifests: small JSON records of what a stage wrote and what it depended on.

`base` holds what every stage shares (`Manifest`, `FileEntry`, the digest, atomic writes,
`stage_dir`, `load_if_complete`); `stages` holds each stage's manifest. Both are
re-exported here, the one import path of the project (`from mlm_pipeline.manifest import
ShardManifest`). This package imports neither torch nor prefect.
"""

from mlm_pipeline.manifest.base import (
    FORMAT_VERSION, FileEntry, M, Manifest, ManifestPathError, OutsideWorkDirError, Stopwatch,
    atomic_write_text, canonical_json, check_in_work_dir, compute_digest, file_entry,
    find_manifest, load_if_complete, read_manifest, sha256_file, stage_dir, write_manifest)
from mlm_pipeline.manifest.stages import (
    BadFile, CorpusManifest, EvalManifest, ShardManifest, ShardSplit, SkippedFile, SourceEntry,
    TokenizerManifest, TrainManifest, ValidationOverlap)

__all__ = [
    "FORMAT_VERSION", "BadFile", "CorpusManifest", "EvalManifest", "FileEntry", "M",
    "Manifest", "ManifestPathError", "OutsideWorkDirError", "ShardManifest", "ShardSplit",
    "SkippedFile", "SourceEntry", "Stopwatch", "TokenizerManifest", "TrainManifest",
    "atomic_write_text", "canonical_json", "check_in_work_dir", "compute_digest",
    "file_entry", "find_manifest", "load_if_complete", "read_manifest", "sha256_file",
    "stage_dir", "write_manifest", "ValidationOverlap",
]
