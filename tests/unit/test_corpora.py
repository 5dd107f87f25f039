"""Unit tests of `mlm_pipeline.ingest.corpora` and `mlm_pipeline.ingest.page_text` that need no network."""

from __future__ import annotations

import pytest

from mlm_pipeline.ingest import corpora, page_text


def test_html_to_text_keeps_visible_text_and_pre_layout():
    page = """<html><head><title>T</title><script>var x = 1;</script></head><body>
    <div class="navheader">Précédent | Suivant</div>
    <div id="DisplayArea"><h1>Titre  du&nbsp;chapitre</h1>
    <p>Premier   paragraphe,
    sur deux lignes.</p><ul><li>un</li><li>deux</li></ul>
    <pre>  indenté
    ligne 2</pre><table><tr><td>a</td><td>b</td></tr></table></div>
    <div class="footer">pied</div></body></html>"""
    # HTML whitespace runs (no-break spaces included) collapse to one space.
    want = ("Titre du chapitre\n\nPremier paragraphe, sur deux lignes.\n\nun\ndeux"
            "\n\n  indenté\n    ligne 2\n\na b")
    assert page_text.html_to_text(page, ("id", "DisplayArea")) == want
    assert "Précédent" not in page_text.html_to_text(page)
    assert "pied" not in page_text.html_to_text(page)


def test_clean_text_normalizes_and_removes_controls():
    raw = "cafe\u0301\r\nA\u200bB\x07\tC\u2028D\n\n\n\nE  F  "
    assert page_text.clean_text(raw) == "caf\u00e9\nAB C\nD\n\nE F"


def test_drop_english_lines():
    text = ("Ce paragraphe est en français, avec des mots ordinaires.\n"
            "This sentence was left untranslated and should be removed from the corpus.\n"
            "apt install the-package\n"
            "Une autre ligne en français.")
    assert page_text.drop_english_lines(text) == (
        "Ce paragraphe est en français, avec des mots ordinaires.\n"
        "apt install the-package\nUne autre ligne en français.")


def test_unknown_name_lists_known_names(tmp_path):
    with pytest.raises(ValueError, match="debian-handbook-fr.*fr"):
        corpora.fetch_debian_corpus("klingon", tmp_path)


def test_not_debian_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no apt-get, no dpkg-deb
    with pytest.raises(RuntimeError, match="ingest.sources"):
        corpora.fetch_debian_corpus("debian-reference-fr", tmp_path)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MLM_PIPELINE_CACHE", str(tmp_path))
    assert corpora.default_cache_dir() == tmp_path
    monkeypatch.delenv("MLM_PIPELINE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert corpora.default_cache_dir() == tmp_path / ".cache" / "mlm-pipeline"


def test_default_set_is_html_only():
    names = corpora.DEBIAN_CORPUS_SETS["fr"]
    assert set(names) == {"libreoffice-help-fr", "debian-handbook-fr", "debian-reference-fr"}
    assert all(corpora.DEBIAN_CORPORA[n].kind == "html" for n in names)
