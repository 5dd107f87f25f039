"""Plain text of documentation pages: HTML pages, man pages and text cleaning.

Used by `mlm_pipeline.ingest.corpora` to turn the files of unpacked Debian packages into
documents: `html_to_text` (stdlib `html.parser`; navigation, tables of contents, headers,
footers and scripts left out, `<pre>` layout kept), `render_man` (gzipped roff rendered by
groff), `clean_text` (NFC, no control characters, paragraphs separated by a blank line).

Debian's translations fall back to the English original for strings nobody translated;
`drop_english_lines` removes lines that read as English prose (a function-word test).

A change to the text these functions return must bump `corpora.EXTRACTOR_VERSION`, so
cached corpora are rebuilt.

Standard library only; imports neither torch nor prefect.
"""

from __future__ import annotations

import gzip
import html.parser
import os
import re
import subprocess
import unicodedata
from pathlib import Path

# C0/C1 controls except \t and \n, zero-width and bidi marks, and the BOM.
_CTRL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060\ufeff]")


def clean_text(text: str) -> str:
    """NFC; line and paragraph separators become `\\n`; controls removed; lines trimmed,
    inner space runs collapsed and blank-line runs reduced to one blank line."""
    text = re.sub("\r\n?|[\u2028\u2029]", "\n", text)
    text = _CTRL.sub("", unicodedata.normalize("NFC", text).replace("\t", " "))
    text = "\n".join(re.sub(r" {2,}", " ", line.strip()) for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


# ---------------------------------------------------------------------------------- HTML
_BLOCK2 = {"p", "div", "section", "article", "main", "pre", "blockquote", "table", "ul", "ol",
           "dl", "h1", "h2", "h3", "h4", "h5", "h6", "figure", "hr", "details", "summary",
           "center", "address", "fieldset"}
_BLOCK1 = {"li", "dt", "dd", "tr", "br", "caption", "figcaption", "label", "option"}
_SKIP_TAGS = {"script", "style", "head", "noscript", "nav", "header", "footer", "aside",
              "button", "input", "select", "textarea", "form", "iframe", "svg", "object",
              "template", "title"}
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param",
         "source", "track", "wbr"}
# class/id tokens whose whole subtree is navigation or decoration (Publican, DocBook,
# Sphinx and LibreOffice help pages).
_SKIP_CLASSES = {"docnav", "toc", "navheader", "navfooter", "headerlink", "sphinxsidebar",
                 "related", "footer", "breadcrumb", "breadcrumbs", "banner", "copyright",
                 "relatedtopics", "debug", "list-of-tables", "list-of-figures",
                 "list-of-examples", "indexdiv", "toctree-wrapper"}
_SKIP_IDS = {"banner", "title", "SearchFrame", "DonationFrame", "DEBUG", "Contents", "Index"}
# Private-use sentinels protect whitespace inside <pre> from clean_text's collapsing.
_PRE_SP, _PRE_NL = "\ue000", "\ue001"


class _HTMLText(html.parser.HTMLParser):
    """Visible text of a page; `root` = (attr, value) keeps only the first element
    carrying that attribute (e.g. `("id", "DisplayArea")`)."""

    def __init__(self, root: tuple[str, ...] | None) -> None:
        super().__init__(convert_charrefs=True)
        self.root, self.root_seen = root, False
        self.stack: list[tuple[str, bool, bool, bool]] = []  # tag, skipping, in_root, in_pre
        self.out: list[str] = []

    def _state(self) -> tuple[bool, bool, bool]:
        return self.stack[-1][1:] if self.stack else (False, self.root is None, False)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        """HTMLParser callback: open an element (skip, root and <pre> state; block separator)."""
        skipping, in_root, in_pre = self._state()
        ad = dict(attrs)
        classes = set((ad.get("class") or "").split())
        if self.root and not in_root and not self.root_seen:
            k, v = self.root
            if (k == "class" and v in classes) or ad.get(k) == v:
                in_root = self.root_seen = True
        if (tag in _SKIP_TAGS or classes & _SKIP_CLASSES or ad.get("id") in _SKIP_IDS
                or ad.get("role") in ("navigation", "search")):
            skipping = True
        in_pre = in_pre or tag == "pre"
        if not skipping and in_root:
            self._sep(tag)
        if tag not in _VOID:
            self.stack.append((tag, skipping, in_root, in_pre))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        """HTMLParser callback for a self-closing element: only its separator counts."""
        skipping, in_root, _ = self._state()
        if not skipping and in_root:
            self._sep(tag)

    def handle_endtag(self, tag: str) -> None:
        """HTMLParser callback: close up to the matching element (tolerates unclosed tags)."""
        # Pop to the matching tag: tolerates unclosed <p>, <li>, ...
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                skipping, in_root = self.stack[i][1:3]
                del self.stack[i:]
                if not skipping and in_root:
                    self._sep(tag)
                return

    def _sep(self, tag: str) -> None:
        if tag in _BLOCK2:
            self.out.append("\n\n")
        elif tag in _BLOCK1 and not (self.out and self.out[-1] in ("\n", "\n\n")):
            self.out.append("\n")  # one line break between list items, not a blank line
        elif tag in ("td", "th"):
            self.out.append(" ")

    def handle_data(self, data: str) -> None:
        """HTMLParser callback: keep visible text (whitespace kept inside <pre>)."""
        skipping, in_root, in_pre = self._state()
        if skipping or not in_root:
            return
        if in_pre:
            self.out.append(data.replace(" ", _PRE_SP).replace("\n", _PRE_NL))
        else:
            self.out.append(re.sub(r"\s+", " ", data))

    def text(self) -> str:
        """The collected text, cleaned: paragraphs separated by blank lines."""
        t = clean_text(re.sub(r" *\n *", "\n", "".join(self.out)).replace(_PRE_NL, "\n"))
        lines = (line.rstrip() for line in t.replace(_PRE_SP, " ").split("\n"))
        return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


def html_to_text(raw: str, root: tuple[str, ...] | None = None) -> str:
    """Plain text of an HTML page: blocks become paragraphs, `<pre>` layout is kept,
    navigation, tables of contents, headers, footers and scripts are left out.

    Args:
        raw: the page source.
        root: `(attr, value)` of the element holding the body; None reads the whole page.

    Returns:
        Cleaned text (see `clean_text`), paragraphs separated by a blank line.
    """
    p = _HTMLText(root)
    p.feed(raw)
    p.close()
    return p.text()


# --------------------------------------------------------------------------- man pages
_MAN_DROP_SECTIONS = {"TRADUCTION", "COLOPHON"}  # translator credits, man-pages colophon
_BOX_RULE = re.compile(r"^[\s\u2500-\u257f+=_-]*[\u2500-\u257f][\s\u2500-\u257f+=_-]*$")
_BOX_COLS = re.compile(r"\s*[\u2500-\u257f]+\s*")
_MAN_HEADING = re.compile(r"^[A-ZÀ-ÖØ-Þ0-9][A-ZÀ-ÖØ-Þ0-9 ,'’/()-]*$")


def render_man(path: Path) -> str:
    """Plain text of a gzipped roff man page rendered by groff; "" for `.so` aliases.

    Flags: `-k` UTF-8 input (preconv), `-t` tables, `-P-cbou` no SGR or overstrike, a
    4000-en line length so paragraphs are not hard-wrapped, `-rHY=0` no hyphenation. The
    running header and footer and the TRADUCTION/COLOPHON sections are removed.
    """
    with gzip.open(path, "rb") as f:
        raw = f.read()
    body = [ln for ln in raw.split(b"\n") if ln.strip() and not ln.startswith((b'.\\"', b"'\\\""))]
    if body and body[0].startswith(b".so "):
        return ""
    cmd = ["groff", "-k", "-t", "-man", "-Tutf8", "-P-cbou", "-rLL=4000n", "-rHY=0"]
    r = subprocess.run(cmd, input=raw, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       timeout=60, env=dict(os.environ, LC_ALL="C.UTF-8"))
    lines = r.stdout.decode("utf-8", "replace").split("\n")
    nonempty = [i for i, ln in enumerate(lines) if ln.strip()]
    if len(nonempty) < 3:
        return ""
    kept, skipping = [], False
    for ln in lines[nonempty[0] + 1:nonempty[-1]]:
        if _BOX_RULE.match(ln):
            continue  # a table's horizontal rule
        if "│" in ln or "┃" in ln:
            ln = _BOX_COLS.sub(" | ", ln).strip(" |")
        if ln and not ln[0].isspace() and _MAN_HEADING.match(ln.strip()):
            skipping = ln.strip() in _MAN_DROP_SECTIONS
        if not skipping:
            kept.append(ln)
    return clean_text("\n".join(kept))


# ------------------------------------------------------------ untranslated-English filter
# English function words rare in French (STRONG) and a broader list (BROAD) that alone
# would also match French "on/or/as". Measured on French, German and Dutch reviews:
# <0.4% of their sentences match (nearly all quoting English); ~95% of long English lines do.
_EN_STRONG = frozenset("the and with which that this you your from are have has been would "
                       "should could there their they these those when what into because "
                       "however".split())
_EN_BROAD = frozenset("the of and to is in for on that with as by this be it are an or from "
                      "can you not which if will was at have has but".split())


def english_like(line: str) -> bool:
    """True for a line of English prose (not code, not a bare command name)."""
    words = re.findall(r"\w+", line.lower())
    strong = sum(w in _EN_STRONG for w in words)
    broad = sum(w in _EN_BROAD for w in words)
    return ((strong >= 2 and strong >= 0.06 * len(words))
            or (strong >= 1 and broad >= 3 and broad >= 0.2 * len(words)))


def drop_english_lines(text: str) -> str:
    """Remove the lines (paragraphs, list items) of `text` that read as English prose.

    Debian's translated documentation (po4a, Publican, LibreOffice) falls back to the
    English original for untranslated strings: ~34% of the French handbook before this.
    """
    kept = [line for line in text.split("\n") if not english_like(line)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip("\n")
