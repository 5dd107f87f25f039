"""Stage 1, ingestion: sources (paths, globs, URLs, built-in Debian corpora) are read,
decoded, cleaned, deduplicated and split into train / validation Parquet document files.

Rooms: `stage` (the verb), `sources` (what to read), `readers` (file formats),
`cleaning` (normalization, dedup, filters), `corpora` and `page_text` (the built-in
French corpora), `documents` (reading the ingested files back for later stages).
"""

from mlm_pipeline.ingest.stage import ingest, ingest_digest

__all__ = ["ingest", "ingest_digest"]
