"""Built-in French corpora, fetched from Debian packages with the ordinary apt clients.

Users' machines may reach nothing but package registries, so the default corpus is text
that Debian ships: translated documentation in HTML (and, optionally, man pages). A
corpus is downloaded with `apt-get download` (nothing is installed), unpacked with
`dpkg-deb -x` into a temporary directory, converted to plain text and written as JSONL,
one document per line: `{"id", "text", "source", "lang"}`, sorted by id, NFC, without
control characters, paragraphs separated by a blank line, exact-duplicate texts removed.

Debian's translations fall back to the English original for strings nobody translated;
`drop_english_lines` removes lines that read as English prose (a function-word test).

Layout of the cache (`default_cache_dir()` unless told otherwise):
`debs/*.deb`, `corpora/<name>.jsonl` and `corpora/<name>.stamp.json` (package versions
and `EXTRACTOR_VERSION`): a corpus is rebuilt only when its stamp no longer matches.

Standard library only; imports neither torch nor prefect.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import html.parser
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

#: Bump when the text extraction changes, so cached JSONL corpora are rebuilt.
EXTRACTOR_VERSION = 1


@dataclass(frozen=True)
class DebianCorpus:
    """Where a corpus lives in its Debian package(s) and how its text is extracted."""

    packages: tuple[str, ...]
    """Debian packages read, in order; each document's `source` is its package."""
    subdir: str
    """Directory inside the unpacked package holding the documents."""
    include: str
    """Regex (searched) on the path relative to `subdir` of the files to read."""
    exclude: str = ""
    """Regex on the same relative path of files to skip (tables of contents, indexes)."""
    kind: Literal["html", "man"] = "html"
    """`html`: stdlib HTML-to-text; `man`: gzipped roff rendered by groff."""
    root: str = ""
    """`attr=value` of the HTML element holding the page body; empty reads the whole page."""
    lang: str = "fr"
    """BCP 47 language recorded in every document."""
    min_chars: int = 200
    """Documents shorter than this (characters) are left out (stubs, redirects)."""


DEBIAN_CORPORA: dict[str, DebianCorpus] = {
    # LibreOffice's French help, ~2,400 short how-to pages (MPL-2.0).
    "libreoffice-help-fr": DebianCorpus(
        ("libreoffice-help-fr",), "usr/share/libreoffice/help/fr", r"\.html$",
        root="id=DisplayArea",
    ),
    # "Le cahier de l'administrateur Debian", one document per section page (GPL-2+).
    "debian-handbook-fr": DebianCorpus(
        ("debian-handbook",), "usr/share/doc/debian-handbook/html/fr-FR", r"^[^/]+\.html$",
        exclude=r"^(index\.html|ix01)",
    ),
    # "Référence Debian", one document per chapter (GPL-2+).
    "debian-reference-fr": DebianCorpus(
        ("debian-reference-fr",), "usr/share/debian-reference", r"^[^/]+\.fr\.html$",
        exclude=r"^index\.",
    ),
    # French man pages (GPL-3+ translations); needs groff, ~30 s of rendering on 2 cores.
    "manpages-fr": DebianCorpus(
        ("manpages-fr", "manpages-fr-dev"), "usr/share/man/fr", r"^man[0-9n][^/]*/[^/]+\.gz$",
        kind="man",
    ),
}
#: Names that stand for several corpora; `fr` is the default set (HTML only: no groff, fast).
DEBIAN_CORPUS_SETS: dict[str, tuple[str, ...]] = {
    "fr": ("libreoffice-help-fr", "debian-handbook-fr", "debian-reference-fr"),
}


def default_cache_dir() -> Path:
    """`$MLM_PIPELINE_CACHE` when set, else `~/.cache/mlm-pipeline`."""
    env = os.environ.get("MLM_PIPELINE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mlm-pipeline"


def fetch_debian_corpus(name: str, cache_dir: Path) -> list[Path]:
    """Download, extract and cache a built-in corpus (or a set such as `fr`).

    Args:
        name: a key of `DEBIAN_CORPORA` or of `DEBIAN_CORPUS_SETS`.
        cache_dir: cache root; `.deb` files go to `debs/`, JSONL files to `corpora/`.

    Returns:
        The JSONL file of each corpus, in the order of the set.

    Raises:
        ValueError: `name` is unknown (the known names are listed).
        RuntimeError: not a Debian system (no apt-get/dpkg-deb); a package is unavailable
            or cannot be downloaded and only root could refresh the apt lists; groff is
            missing for man pages; a package cannot be unpacked or holds no document.
    """
    if name in DEBIAN_CORPUS_SETS:
        names = DEBIAN_CORPUS_SETS[name]
    elif name in DEBIAN_CORPORA:
        names = (name,)
    else:
        known = sorted(DEBIAN_CORPORA) + sorted(DEBIAN_CORPUS_SETS)
        raise ValueError(f"unknown Debian corpus {name!r}; known names: {', '.join(known)}")
    apt = _Apt(Path(cache_dir).expanduser())
    if apt.available:
        apt.lookup([p for n in names for p in DEBIAN_CORPORA[n].packages])
    return [_fetch_one(n, apt) for n in names]


# ------------------------------------------------------------------------------ apt/dpkg
class _Apt:
    """apt-cache/apt-get/dpkg-deb calls for one fetch; `apt-get update` runs at most once."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.debs = cache_dir / "debs"
        self.root = os.geteuid() == 0
        self.updated = False
        self.versions: dict[str, str | None] = {}  # candidate version cache
        self.available = all(shutil.which(t) for t in ("apt-get", "apt-cache", "dpkg-deb"))

    def run(self, *cmd: str, cwd: Path | None = None) -> str:
        """Run an apt/dpkg command in the C locale; returns stdout.

        Raises:
            subprocess.CalledProcessError: the command exits non-zero.
        """
        env = dict(os.environ, LC_ALL="C", DEBIAN_FRONTEND="noninteractive")
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
        if r.returncode:
            raise subprocess.CalledProcessError(r.returncode, cmd, r.stdout, r.stderr)
        return r.stdout

    def update(self, why: str) -> None:
        """Refresh the package lists once (root only), else tell the user to."""
        if self.updated:
            raise RuntimeError(f"{why}, even after apt-get update (needs Debian 12 bookworm main)")
        if not self.root:
            raise RuntimeError(f"{why}: the apt package lists are missing or stale and only root "
                               "can refresh them; run 'sudo apt-get update' and retry")
        logger.info("running apt-get update (%s)", why)
        try:
            self.run("apt-get", "update", "-qq")
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"apt-get update failed: {exc.stderr.strip()}") from None
        self.updated = True
        self.versions.clear()

    def candidate(self, pkg: str) -> str | None:
        """Version `apt-get download` would fetch, or None when apt knows no candidate."""
        if pkg not in self.versions:
            self.lookup([pkg])
        return self.versions[pkg]

    def lookup(self, pkgs: list[str]) -> None:
        """Candidate versions of several packages with one `apt-cache policy` (~0.4 s)."""
        found, cur = {}, None
        for line in self.run("apt-cache", "policy", *pkgs).splitlines():
            if line.endswith(":") and not line.startswith(" "):
                cur = line[:-1]
            elif cur and (m := re.match(r"\s+Candidate:\s*(\S+)", line)):
                found[cur] = m.group(1)
        self.versions.update({p: None if found.get(p, "(none)") == "(none)" else found[p]
                              for p in pkgs})

    def deb_id(self, deb: Path) -> tuple[str, str] | None:
        """(Package, Version) of a `.deb`, or None when dpkg-deb cannot read it."""
        try:
            fields = dict(re.findall(r"^(\w+): (.*)$", self.run("dpkg-deb", "-f", str(deb)), re.M))
        except subprocess.CalledProcessError:
            return None
        return fields.get("Package", ""), fields.get("Version", "")

    def _cached(self, pkg: str, version: str) -> Path | None:
        for f in sorted(self.debs.glob(f"{pkg}_*.deb")):
            if self.deb_id(f) == (pkg, version):
                return f
        return None

    def download(self, pkg: str, version: str) -> Path:
        """The `.deb` of `pkg` at `version`, from the cache or `apt-get download`."""
        if (f := self._cached(pkg, version)) is not None:
            return f
        logger.info("downloading %s %s", pkg, version)
        self.debs.mkdir(parents=True, exist_ok=True)
        sandbox = ["-o", "APT::Sandbox::User=root"] if self.root else []
        # Into a temporary directory first, so an interrupted download leaves no partial .deb.
        with tempfile.TemporaryDirectory(dir=self.debs, prefix=".download-") as tmp:
            self.run("apt-get", "download", "-qq", *sandbox, f"{pkg}={version}", cwd=Path(tmp))
            got = sorted(Path(tmp).glob("*.deb"))
            if not got:
                raise RuntimeError(f"apt-get download {pkg}={version} produced no .deb")
            for old in self.debs.glob(f"{pkg}_*.deb"):  # other versions of the same package
                if (self.deb_id(old) or (pkg,))[0] == pkg:
                    old.unlink()
            os.replace(got[0], self.debs / got[0].name)
        return self.debs / got[0].name


def _fetch_one(name: str, apt: _Apt) -> Path:
    spec = DEBIAN_CORPORA[name]
    out = apt.cache_dir / "corpora" / f"{name}.jsonl"
    stamp = out.with_name(f"{name}.stamp.json")
    old = json.loads(stamp.read_text()) if stamp.is_file() and out.is_file() else None
    usable = old is not None and old.get("extractor") == EXTRACTOR_VERSION
    if not apt.available:
        if usable:
            logger.warning("%s: apt-get/dpkg-deb not found; using the cached %s", name, out)
            return out
        raise RuntimeError(
            "built-in corpora come from Debian packages, but apt-get/dpkg-deb were not found "
            "(not a Debian/Ubuntu system?); pass your own .txt/.jsonl files in ingest.sources")
    versions: dict[str, str] = {}
    for pkg in spec.packages:
        ver = apt.candidate(pkg)
        if ver is None and usable:
            logger.warning("%s: apt knows no version of %s; using the cached %s", name, pkg, out)
            return out
        if ver is None:
            apt.update(f"Debian package {pkg!r} is not available from the apt sources")
            ver = apt.candidate(pkg)
            if ver is None:
                raise RuntimeError(f"Debian package {pkg!r} is not available from the apt "
                                   "sources (needs Debian 12 bookworm main)")
        versions[pkg] = ver
    if old == {"extractor": EXTRACTOR_VERSION, "packages": versions}:
        logger.info("%s: up to date (%s)", name, _fmt(versions))
        return out
    debs = {}
    try:
        if spec.kind == "man":
            _ensure_groff(apt)
        for pkg in spec.packages:
            versions[pkg], debs[pkg] = _download(apt, pkg, versions[pkg])
    except RuntimeError as exc:
        if not usable:
            raise
        logger.warning("%s: %s; using the cached %s", name, exc, out)
        return out
    want = {"extractor": EXTRACTOR_VERSION, "packages": versions}
    docs: list[dict[str, str]] = []
    with tempfile.TemporaryDirectory(dir=apt.cache_dir, prefix=".unpack-") as tmp:
        for pkg, deb in debs.items():
            tree = Path(tmp) / pkg
            try:
                apt.run("dpkg-deb", "-x", str(deb), str(tree))
            except subprocess.CalledProcessError as exc:
                raise RuntimeError(f"could not unpack {deb}: {exc.stderr.strip()}") from None
            docs += _extract(spec, pkg, tree / spec.subdir)
    if not docs:
        raise RuntimeError(f"{name}: no document found in {_fmt(versions)} under {spec.subdir}")
    n = _write_jsonl(out, docs, spec.min_chars)
    stamp.write_text(json.dumps(want, sort_keys=True) + "\n")
    logger.info("%s: wrote %d documents from %s to %s", name, n, _fmt(versions), out)
    return out


def _download(apt: _Apt, pkg: str, version: str) -> tuple[str, Path]:
    """(version, .deb path); refreshes the lists once when the download fails."""
    try:
        return version, apt.download(pkg, version)
    except subprocess.CalledProcessError as exc:
        # Stale lists name a version the mirror no longer has: refresh once and retry.
        apt.update(f"could not download {pkg} {version}: {exc.stderr.strip()}")
        version = apt.candidate(pkg) or version
        try:
            return version, apt.download(pkg, version)
        except subprocess.CalledProcessError as exc2:
            raise RuntimeError(f"could not download Debian package {pkg} {version}: "
                               f"{exc2.stderr.strip()}") from None


def _fmt(versions: dict[str, str]) -> str:
    return ", ".join(f"{p} {v}" for p, v in versions.items())


def _ensure_groff(apt: _Apt) -> None:
    if shutil.which("groff"):
        return
    if not apt.root:
        raise RuntimeError("groff renders the man-page corpus but is not installed: "
                           "run 'sudo apt-get install groff-base' and retry")
    logger.info("installing groff-base (renders man pages)")
    cmd = ("apt-get", "install", "-y", "-qq", "--no-install-recommends", "groff-base")
    try:
        apt.run(*cmd)
    except subprocess.CalledProcessError:
        apt.update("could not install groff-base")
        try:
            apt.run(*cmd)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"could not install groff-base: {exc.stderr.strip()}") from None


# ----------------------------------------------------------------------------- extraction
def _extract(spec: DebianCorpus, pkg: str, base: Path) -> list[dict[str, str]]:
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
    else:
        root = tuple(spec.root.split("=", 1)) if spec.root else None
        texts = [html_to_text(p.read_bytes().decode("utf-8", "replace"), root) for _, p in files]
        rels = [rel for rel, _ in files]
    return [{"id": f"{pkg}:{rel}", "text": drop_english_lines(t) if spec.lang != "en" else t,
             "source": pkg, "lang": spec.lang} for rel, t in zip(rels, texts) if t]


def _write_jsonl(path: Path, docs: list[dict[str, str]], min_chars: int) -> int:
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
