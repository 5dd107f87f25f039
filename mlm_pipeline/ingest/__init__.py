"""Stage 1, ingestion: sources (paths, globs, URLs, built-in Debian corpora) are read,
decoded, cleaned, deduplicated and split into train / validation Parquet document files.

Rooms: `stage` (the verb), `writer` (the Parquet document files of each split),
`accounting` (records -> cleaned documents, every record and bad file counted),
`sources` (what to read, hashes, byte streams), `listing` (what a directory or glob
holds; special entries named and skipped), `readers` (file formats),
`json_array` (`.json` arrays, resynchronised after a syntax error), `cleaning`
(screening, splitting, dedup, filters), `corpora`, `corpus_extract` and `page_text` (the
built-in French corpora), `documents` (reading the ingested files back for later stages),
`holdout` (the fixed benchmark text, kept out of the corpus), `allowed` (event-named
sources checked against `ingest.allowed_sources`), `hashing` (sha256 of local and remote
inputs, remembered), `partitions` (ingestion over input partitions, in parallel),
`overlap` (validation lines that occur in training removed, the n-gram overlap left).
"""

from mlm_pipeline.ingest.holdout import Holdout, read_holdout
from mlm_pipeline.ingest.stage import ingest, ingest_digest

__all__ = ["Holdout", "ingest", "ingest_digest", "read_holdout"]
