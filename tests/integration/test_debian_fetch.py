"""Real Debian corpora: fetch, extract, cache (needs the Debian apt archive: slow).

The handbook (a few MB) is fetched on every push; the Littré (a 31 MB package) is the `full`
tier: CI runs it in one slice of the landings, every one with CI_FULL=1."""

from __future__ import annotations

import json
import re
import shutil
import unicodedata
from collections import Counter

import pytest

from mlm_pipeline.config import IngestConfig
from mlm_pipeline.ingest import corpora
from mlm_pipeline.ingest.stage import ingest, read_documents

# The Quickstart test fetches debian:fr on every push; these checks run on one slice of the
# landings in CI.
pytestmark = [pytest.mark.slow, pytest.mark.full]

# Independent language checks (not the module's filter): common French function words,
# and English ones that French prose does not use.
FRENCH = {"le", "la", "les", "de", "des", "du", "un", "une", "et", "est", "en", "pour", "dans",
          "avec", "sur", "par", "qui", "que", "ne", "pas", "au", "aux", "ce", "il", "se", "sont",
          "être", "vous", "à"}
ENGLISH = {"the", "and", "with", "which", "that", "this", "you", "from", "are", "have", "would",
           "should", "their"}


def words(line: str) -> list[str]:
    return re.findall(r"\w+", line.lower())


@pytest.fixture(scope="module")
def handbook(tmp_path_factory):
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        pytest.skip("not a Debian system")
    cache = tmp_path_factory.mktemp("cache")
    (path,) = corpora.fetch_debian_corpus("debian-handbook-fr", cache)
    return cache, path


def test_handbook_jsonl_is_clean_french(handbook):
    _, path = handbook
    assert path.name == "debian-handbook-fr.jsonl"
    docs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert 80 <= len(docs) <= 200  # 113 section pages in 11.20220922
    assert all(set(d) == {"id", "text", "source", "lang"} for d in docs)
    assert all(d["lang"] == "fr" and d["source"] == "debian-handbook" for d in docs)
    ids = [d["id"] for d in docs]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert len({d["text"] for d in docs}) == len(docs)
    for d in docs:
        t = d["text"]
        assert len(t) >= 200 and t == t.strip()
        assert unicodedata.normalize("NFC", t) == t
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", t), d["id"]
        assert "\n\n\n" not in t
    # Sentence-like lines (commands, logs and code listings mostly do not end with ".").
    prose = [ws for d in docs for line in d["text"].split("\n")
             if len(ws := words(line)) >= 8 and line.endswith(".")]
    assert len(prose) > 1000
    french = sum(any(w in FRENCH for w in ws) for ws in prose) / len(prose)
    english = sum(sum(w in ENGLISH for w in ws) >= 3 for ws in prose) / len(prose)
    assert french > 0.85, french  # 0.94 with debian-handbook 11.20220922
    assert english < 0.01, english


def test_handbook_is_cached_and_rebuilt_without_download(handbook):
    cache, path = handbook
    (deb,) = (cache / "debs").glob("debian-handbook_*.deb")
    deb_mtime, jsonl_mtime = deb.stat().st_mtime_ns, path.stat().st_mtime_ns
    assert corpora.fetch_debian_corpus("debian-handbook-fr", cache) == [path]
    assert path.stat().st_mtime_ns == jsonl_mtime  # stamp matched: nothing rebuilt
    data = path.read_bytes()
    path.unlink()
    assert corpora.fetch_debian_corpus("debian-handbook-fr", cache) == [path]
    assert path.read_bytes() == data  # deterministic extraction
    assert deb.stat().st_mtime_ns == deb_mtime  # from the cached .deb, not downloaded again
    assert not list(cache.glob(".unpack-*"))  # unpacked tree removed


def test_ingest_debian_source(handbook, tmp_path):
    cache, path = handbook
    n_docs = sum(1 for _ in path.open(encoding="utf-8"))
    cfg = IngestConfig(sources=["debian:debian-handbook-fr"], cache_dir=str(cache),
                       validation_fraction=0.05)
    m = ingest(cfg, tmp_path)
    assert m.documents_read == n_docs and m.documents_kept == n_docs
    assert m.documents_validation >= 1 and m.sources[0].path == str(path)
    ids = [i for i, _ in read_documents([m.file(e.path) for e in m.train + m.validation])]
    assert sorted(ids) == sorted(json.loads(line)["id"] for line in path.open(encoding="utf-8"))


def test_littre_is_general_domain_french(tmp_path):
    """The Littré (31 MB .deb) holds the guide's general-domain answers, without markup."""
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        pytest.skip("not a Debian system")
    (path,) = corpora.fetch_debian_corpus("littre-fr", tmp_path)
    docs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert 20_000 <= len(docs) <= 40_000  # 29,702 articles of >= 200 chars in 1:1.0-2
    assert all(d["source"] == "stardict-xmlittre" and len(d["text"]) >= 200 for d in docs)
    text = "\n".join(d["text"] for d in docs)
    assert len(text) > 30_000_000  # 36.3 M characters in 1:1.0-2
    assert not re.search(r"<[a-z/]|&[a-z]+;|, ,", text)  # markup, dangling citation commas
    assert not re.search(r"^(HISTORIQUE|ÉTYMOLOGIE)$", text, re.MULTILINE)  # dropped sections
    counts = Counter(w for line in text.split("\n") for w in words(line))
    # 1:1.0-2: banque 154, chat 382, poil 354, pelage 15, fourrure 48.
    for word, least in {"banque": 100, "chat": 200, "poil": 200, "pelage": 10,
                        "fourrure": 30}.items():
        assert counts[word] >= least, (word, counts[word])
    (chat,) = (d for d in docs if d["id"] == "stardict-xmlittre:XMLittre/CHAT")
    assert chat["text"].startswith("1° Animal domestique, de l'ordre des carnassiers")
    prose = [ws for line in text.split("\n") if len(ws := words(line)) >= 8]
    french = sum(any(w in FRENCH for w in ws) for ws in prose) / len(prose)
    assert french > 0.9, french
