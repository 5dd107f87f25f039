"""Text out of the unpacked Debian packages of a built-in corpus (`corpora`): the
documents of one package (HTML pages and man pages through `page_text`, StarDict
dictionary articles parsed here) and the JSONL file they are written to.

Standard library only; imports neither torch nor prefect.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import html
import json
import os
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from mlm_pipeline.ingest.page_text import (
    clean_text,
    drop_english_lines,
    html_to_text,
    render_man,
)

if TYPE_CHECKING:
    from mlm_pipeline.ingest.corpora import DebianCorpus


def extract_documents(spec: DebianCorpus, pkg: str, base: Path) -> list[dict[str, str]]:
    """Documents of one unpacked package (id = `<package>:<path under subdir>`)."""
    inc, exc = re.compile(spec.include), re.compile(spec.exclude) if spec.exclude else None
    files = []
    for p in sorted(base.rglob("*")):
        rel = p.relative_to(base).as_posix()
        if p.is_symlink() or not p.is_file() or not inc.search(rel) or (exc and exc.search(rel)):
            continue  # symlinked pages are aliases of another document
        files.append((rel, p))
    if spec.kind == "man":
        # groff runs in a subprocess, so threads render pages in parallel (at most 2: the
        # budget is a 2-core machine).
        with concurrent.futures.ThreadPoolExecutor(min(2, os.cpu_count() or 1)) as ex:
            texts = list(ex.map(render_man, (p for _, p in files)))
        rels = [rel.removesuffix(".gz") for rel, _ in files]
    elif spec.kind == "stardict":
        drop = re.compile(spec.drop, re.DOTALL) if spec.drop else None
        articles = [(f"{rel.removesuffix('.idx')}/{word}", text)
                    for rel, p in files for word, text in stardict_docs(p, drop)]
        rels, texts = [a for a, _ in articles], [t for _, t in articles]
    else:
        root = tuple(spec.root.split("=", 1)) if spec.root else None
        texts = [html_to_text(p.read_bytes().decode("utf-8", "replace"), root) for _, p in files]
        rels = [rel for rel, _ in files]
    return [{"id": f"{pkg}:{rel}", "text": drop_english_lines(t) if spec.lang != "en" else t,
             "source": pkg, "lang": spec.lang} for rel, t in zip(rels, texts) if t]


def stardict_docs(idx: Path, drop: re.Pattern[str] | None) -> list[tuple[str, str]]:
    """(headword, text) of each article of a StarDict dictionary with Pango-markup articles.

    Format (StarDict 2.4.2 `doc/StarDictFileFormat`): the `.idx` holds records of a UTF-8
    headword, a NUL byte, then the article's offset and size in bytes (32-bit big-endian)
    in the uncompressed `.dict`; `.dict.dz` is dictzip, i.e. gzip. An article listed under
    several headwords (spelling variants) is read once, under its first headword; a
    headword repeated for another article gets ` (2)`, ` (3)`... Text: `drop` matches
    removed, tags stripped, entities unescaped, the commas left dangling by removed spans
    before a period removed (`text, , .` -> `text.`), then `clean_text`.

    Raises:
        RuntimeError: the `.dict.dz` beside `idx` is missing or unreadable, or an `.idx`
            record is truncated or points past the end of the dictionary.
    """
    dz = idx.with_name(idx.name.removesuffix(".idx") + ".dict.dz")
    try:
        data = gzip.decompress(dz.read_bytes())
    except (OSError, EOFError) as exc:
        raise RuntimeError(f"cannot read the StarDict dictionary {dz}: {exc}") from None
    raw, pos, seen, names, out = idx.read_bytes(), 0, set(), {}, []
    while pos < len(raw):
        end = raw.find(b"\0", pos)
        if end < 0 or end + 9 > len(raw):
            raise RuntimeError(f"{idx}: truncated record at byte {pos}")
        word = raw[pos:end].decode("utf-8", "replace").strip()
        off, size = struct.unpack(">II", raw[end + 1:end + 9])
        pos = end + 9
        if off + size > len(data):
            raise RuntimeError(f"{idx}: the article of {word!r} ends at byte {off + size}, "
                               f"past the end of {dz.name} ({len(data)} bytes)")
        if (off, size) in seen:
            continue
        seen.add((off, size))
        names[word] = names.get(word, 0) + 1
        article = data[off:off + size].decode("utf-8", "replace")
        text = html.unescape(re.sub(r"<[^>]*>", "", drop.sub("", article) if drop else article))
        text = re.sub(r"(?:[ \t]*,)+[ \t]*\.", ".", text)
        out.append((word if names[word] == 1 else f"{word} ({names[word]})", clean_text(text)))
    return out


def write_jsonl(path: Path, docs: list[dict[str, str]], min_chars: int) -> int:
    """Write documents sorted by id, without short or duplicate texts, atomically."""
    seen: set[str] = set()
    kept = []
    for d in sorted(docs, key=lambda d: d["id"]):
        if len(d["text"]) >= min_chars and d["text"] not in seen:
            seen.add(d["text"])
            kept.append(d)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A per-process name opened normally (not mkstemp, which makes the file 0600): a
    # shared cache stays readable under the user's umask.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for d in kept:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(kept)
