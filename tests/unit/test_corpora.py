"""Unit tests of `mlm_pipeline.ingest.corpora` and `mlm_pipeline.ingest.page_text` that need no network."""

from __future__ import annotations

import gzip
import struct

import pytest

from mlm_pipeline.ingest import corpora, corpus_extract, page_text


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


def test_one_cache_variable_for_corpora_and_mirrors(monkeypatch, tmp_path):
    from mlm_pipeline import store

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("MLM_PIPELINE_CACHE", str(tmp_path))
    assert corpora.default_cache_dir() == tmp_path.resolve()
    assert store.cache_root() == tmp_path.resolve() / "work"
    monkeypatch.delenv("MLM_PIPELINE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert corpora.default_cache_dir() == tmp_path.resolve() / ".cache" / "mlm-pipeline"
    monkeypatch.setenv("MLM_PIPELINE_CACHE_DIR", str(tmp_path / "old"))
    with pytest.raises(ValueError, match=r"\$MLM_PIPELINE_CACHE instead"):
        store.cache_root()


def test_default_set_is_html_only():
    names = corpora.DEBIAN_CORPUS_SETS["fr"]
    assert set(names) == {"libreoffice-help-fr", "debian-handbook-fr", "debian-reference-fr"}
    assert all(corpora.DEBIAN_CORPORA[n].kind == "html" for n in names)


def _write_stardict(base, name, articles):
    """A StarDict dictionary as StarDict 2.4.2 lays it out: `.idx` records (UTF-8 headword,
    NUL, big-endian 32-bit offset and size) over a gzipped `.dict`. `articles` is a list
    of (headwords, markup); every headword of an article points at the same bytes."""
    data, idx = b"", b""
    for words, markup in articles:
        body = markup.encode("utf-8")
        for w in words:
            idx += w.encode("utf-8") + b"\0" + struct.pack(">II", len(data), len(body))
        data += body
    base.mkdir(parents=True)
    (base / f"{name}.idx").write_bytes(idx)
    (base / f"{name}.dict.dz").write_bytes(gzip.compress(data))


def test_littre_is_a_general_domain_stardict_corpus():
    spec = corpora.DEBIAN_CORPORA["littre-fr"]
    assert spec.kind == "stardict" and spec.packages == ("stardict-xmlittre",)
    assert "littre-fr" in corpora.DEBIAN_CORPUS_SETS["fr-general"]
    assert set(corpora.DEBIAN_CORPUS_SETS["fr"]) < set(corpora.DEBIAN_CORPUS_SETS["fr-general"])
    assert "littre-fr" not in corpora.DEBIAN_CORPUS_SETS["fr"]  # the default stays small


def test_littre_articles_keep_definitions_and_quotations(tmp_path):
    # Markup as XMLittré writes it: pronunciation, numbered senses, quotations in blue with
    # author (red) and work (green), then HISTORIQUE (Old French) and ÉTYMOLOGIE sections.
    chat = ("<i><small>(cha) s. m.</small></i>\n\n<b>1°</b> Animal domestique. \n"
            '<span foreground="#0000CD">Le chat est doux</span>, '
            '<span foreground="#B22222">BUFFON</span>, <span foreground="#556B2F">Chat.</span>.'
            " Proverbe &amp; suite.\n\n<b><big>HISTORIQUE</big></b>\n\nXIIe s. Li chaz.\n\n"
            "<b><big>ÉTYMOLOGIE</big></b>\n\nLat. cattus.")
    poil = "<i><small>(poil) s. m.</small></i>\n    Ce qui couvre la peau des animaux."
    base = tmp_path / "tree" / "usr/share/stardict/dic"
    _write_stardict(base, "XMLittre", [(["CHAT", "CHATS"], chat), (["POIL"], poil),
                                       (["POIL"], "Second article, homographe.")])
    spec = corpora.DEBIAN_CORPORA["littre-fr"]
    docs = corpus_extract.extract_documents(spec, "stardict-xmlittre", tmp_path / "tree" / spec.subdir)
    assert docs == [
        {"id": "stardict-xmlittre:XMLittre/CHAT", "source": "stardict-xmlittre", "lang": "fr",
         "text": "1° Animal domestique.\nLe chat est doux. Proverbe & suite."},
        {"id": "stardict-xmlittre:XMLittre/POIL", "source": "stardict-xmlittre", "lang": "fr",
         "text": "Ce qui couvre la peau des animaux."},
        {"id": "stardict-xmlittre:XMLittre/POIL (2)", "source": "stardict-xmlittre",
         "lang": "fr", "text": "Second article, homographe."},
    ]


def test_stardict_record_past_the_dictionary_is_named(tmp_path):
    base = tmp_path / "dic"
    _write_stardict(base, "D", [(["MOT"], "texte")])
    (base / "D.idx").write_bytes(b"MOT\0" + struct.pack(">II", 0, 99))
    with pytest.raises(RuntimeError, match=r"D\.idx.*'MOT'.*past the end"):
        corpus_extract.stardict_docs(base / "D.idx", None)
    (base / "D.dict.dz").write_bytes(b"not gzip")
    with pytest.raises(RuntimeError, match=r"D\.dict\.dz"):
        corpus_extract.stardict_docs(base / "D.idx", None)
