"""Built-in French corpora, fetched from Debian packages with the ordinary apt clients.

Users' machines may reach nothing but package registries, so the default corpus is text
that Debian ships: translated documentation in HTML (and, optionally, man pages, and the
general-domain Littré dictionary, whose StarDict articles quote French literature). A
corpus is downloaded with `apt-get download` (nothing is installed), unpacked with
`dpkg-deb -x` into a temporary directory, converted to plain text by
`mlm_pipeline.ingest.page_text` or, for a StarDict dictionary, `corpus_extract.stardict_docs`
(for a non-English corpus, lines of untranslated English dropped) and written as JSONL,
one document per line: `{"id", "text", "source", "lang"}`, sorted by id, NFC, without
control characters, paragraphs separated by a blank line, exact-duplicate texts removed.

Layout of the cache (`default_cache_dir()` unless told otherwise): `debs/*.deb`,
`corpora/<name>.jsonl` and `corpora/<name>.stamp.json` (package versions and
`EXTRACTOR_VERSION`): a corpus is rebuilt only when its stamp no longer matches.

Standard library only; imports neither torch nor prefect.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mlm_pipeline.ingest.corpus_extract import extract_documents, write_jsonl
from mlm_pipeline.progress import Progress, active
from mlm_pipeline.store import cache_home

logger = logging.getLogger(__name__)

#: Bump when the text extraction (`corpus_extract`, `mlm_pipeline.ingest.page_text`) changes, so
#: cached JSONL corpora are rebuilt.
EXTRACTOR_VERSION = 1  # the StarDict extraction was added without changing the others


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
    kind: Literal["html", "man", "stardict"] = "html"
    """`html`: stdlib HTML-to-text; `man`: gzipped roff rendered by groff; `stardict`: a
    StarDict dictionary (`include` matches its `.idx`), one document per article."""
    root: str = ""
    """`attr=value` of the HTML element holding the page body; empty reads the whole page."""
    lang: str = "fr"
    """BCP 47 language recorded in every document."""
    min_chars: int = 200
    """Documents shorter than this (characters) are left out (stubs, redirects)."""
    drop: str = ""
    """`stardict` only: regex (dot matches newline) of article markup removed before the
    tags are stripped (pronunciations, citation sources, sections in Old French)."""


DEBIAN_CORPORA: dict[str, DebianCorpus] = {
    # LibreOffice's French help, ~2,400 short how-to pages (MPL-2.0).
    "libreoffice-help-fr": DebianCorpus(
        ("libreoffice-help-fr",), "usr/share/libreoffice/help/fr", r"\.html$",
        root="id=DisplayArea"),
    # "Le cahier de l'administrateur Debian", one document per section page (GPL-2+).
    "debian-handbook-fr": DebianCorpus(
        ("debian-handbook",), "usr/share/doc/debian-handbook/html/fr-FR", r"^[^/]+\.html$",
        exclude=r"^(index\.html|ix01)"),
    # "Référence Debian", one document per chapter (GPL-2+).
    "debian-reference-fr": DebianCorpus(
        ("debian-reference-fr",), "usr/share/debian-reference", r"^[^/]+\.fr\.html$",
        exclude=r"^index\."),
    # Émile Littré's "Dictionnaire de la langue française" (1863-1877, public domain; XML
    # edition GPL-2+), 31 MB .deb: definitions and quotations of French literature, ~34,000
    # articles, ~39 MB of text. Kept: the definitions and quotations; dropped: the
    # pronunciation, the author and work of each quotation, and the HISTORIQUE (Old French
    # quotations) and ÉTYMOLOGIE sections.
    "littre-fr": DebianCorpus(
        ("stardict-xmlittre",), "usr/share/stardict/dic", r"^XMLittre\.idx$", kind="stardict",
        drop=(r'\A\s*<i><small>.*?</small></i>|<span foreground="#(?:B22222|556B2F)">.*?</span>'
              r"|<b><big>(?:HISTORIQUE|ÉTYMOLOGIE)</big></b>.*")),
    # French man pages (GPL-3+ translations); needs groff, ~30 s of rendering on 2 cores.
    "manpages-fr": DebianCorpus(
        ("manpages-fr", "manpages-fr-dev"), "usr/share/man/fr", r"^man[0-9n][^/]*/[^/]+\.gz$",
        kind="man"),
}
#: Names that stand for several corpora; `fr` is the default set (HTML only: no groff, fast);
#: `fr-general` adds the Littré's general-domain prose (5x the text of `fr`).
DEBIAN_CORPUS_SETS: dict[str, tuple[str, ...]] = {
    "fr": ("libreoffice-help-fr", "debian-handbook-fr", "debian-reference-fr"),
    "fr-general": ("libreoffice-help-fr", "debian-handbook-fr", "debian-reference-fr",
                   "littre-fr"),
}


def default_cache_dir() -> Path:
    """The project's cache directory (`store.cache_home`: `$MLM_PIPELINE_CACHE`, else
    `$XDG_CACHE_HOME/mlm-pipeline` or `~/.cache/mlm-pipeline`)."""
    return cache_home()


def fetch_corpora(names: list[str], cache_dir: str | Path | None = None) -> list[Path]:
    """`fetch_debian_corpus` of each name, into `cache_dir` (None: `default_cache_dir()`);
    the JSONL files of all of them, in order.

    Raises:
        The errors of `fetch_debian_corpus`.
    """
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    return [path for name in names for path in fetch_debian_corpus(name, cache)]


def fetch_debian_corpus(name: str, cache_dir: Path,
                        progress: Progress | None = None) -> list[Path]:
    """Download, extract and cache a built-in corpus (or a set such as `fr`).

    Args:
        name: a key of `DEBIAN_CORPORA` or of `DEBIAN_CORPUS_SETS`.
        cache_dir: cache root; `.deb` files go to `debs/`, JSONL files to `corpora/`.
        progress: reporter of stage `fetch` (packages, with `deb_bytes` of the `.deb` files
            extracted); None: `mlm_pipeline.progress.active()`'s (set by `ingest`).

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
    packages = [p for n in names for p in DEBIAN_CORPORA[n].packages]
    meter = _FetchMeter(progress or active(), len(packages), name)
    if apt.available:
        apt.lookup(packages)
    out = [_fetch_one(n, apt, meter) for n in names]
    meter.progress.finish("fetch")
    return out


class _FetchMeter:
    """Stage `fetch`: packages done (extracted, or of a corpus used as cached), `.deb` bytes."""

    def __init__(self, progress: Progress, total: int, name: str) -> None:
        self.progress, self.done, self.bytes = progress, 0, 0
        progress.start("fetch", float(total), "packages", f"debian:{name}")

    def add(self, packages: int, deb: Path | None = None, phase: str = "download") -> None:
        """`packages` more are done (`deb`: the one just extracted)."""
        self.done, self.bytes = self.done + packages, self.bytes + (deb.stat().st_size if deb else 0)
        fields = {"deb_bytes": self.bytes} if self.bytes else {}
        self.progress.update("fetch", float(self.done), phase=phase, **fields)


# ------------------------------------------------------------------------------ apt/dpkg
class _Apt:
    """apt-cache/apt-get/dpkg-deb calls for one fetch; `apt-get update` runs at most once."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir, self.debs = cache_dir, cache_dir / "debs"
        self.root, self.updated = os.geteuid() == 0, False
        self.versions: dict[str, str | None] = {}  # candidate version cache
        self.available = all(shutil.which(t) for t in ("apt-get", "apt-cache", "dpkg-deb"))

    def run(self, *cmd: str, cwd: Path | None = None) -> str:
        """Run an apt/dpkg command in the C locale; returns stdout.

        Raises:
            subprocess.CalledProcessError: the command exits non-zero.
        """
        env = dict(os.environ, LC_ALL="C", DEBIAN_FRONTEND="noninteractive")
        r = subprocess.run(cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True)
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
            fields = dict(re.findall(r"^(\w+): (.*)$", self.run("dpkg-deb", "-f", str(deb)), re.MULTILINE))
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


def _fetch_one(name: str, apt: _Apt, meter: _FetchMeter) -> Path:
    before, path = meter.done, _fetch_packages(name, apt, meter)
    # The packages of a corpus used as cached or up to date count as done too.
    meter.add(len(DEBIAN_CORPORA[name].packages) - (meter.done - before), phase="cached")
    return path


def _fetch_packages(name: str, apt: _Apt, meter: _FetchMeter) -> Path:
    """The JSONL file of corpus `name`, rebuilt (a package done once extracted) or cached."""
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
            docs += extract_documents(spec, pkg, tree / spec.subdir)
            meter.add(1, deb, phase="extract")
    if not docs:
        raise RuntimeError(f"{name}: no document found in {_fmt(versions)} under {spec.subdir}")
    n = write_jsonl(out, docs, spec.min_chars)
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
