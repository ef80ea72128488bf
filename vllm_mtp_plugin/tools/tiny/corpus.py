"""The text the trained tiny DeepSeek learns from: Django's documentation (prose) and source (code).

Both come from one pinned source distribution on PyPI, so every machine with pip gets the same
bytes and nothing is committed: Django 5.2.19, BSD-3-Clause (``LICENSE`` in the archive; the
project: https://www.djangoproject.com). Its ``docs/**/*.txt`` are English technical prose
(reStructuredText: tutorials, how-tos, reference, release notes, ~6 MB) and its ``django/**/*.py``
Python code (~6 MB), so a model trained on it continues prose and code differently, and
acceptance can be measured per kind of prompt. One document in ``HELD_OUT_EVERY`` (chosen by a
stable hash of its path) is held out for perplexity and MTP accuracy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

PACKAGE, VERSION, LICENSE = "Django", "5.2.19", "BSD-3-Clause"
SDIST = f"django-{VERSION}.tar.gz"
SDIST_SHA256 = "ad03d8abc51dbff95ebf34b27123cf0c26a3b62db7ba0cd520783686362533d1"
HELD_OUT_EVERY = 20
KINDS = {"prose": ("docs/", ".txt"), "code": ("django/", ".py")}


@dataclasses.dataclass(frozen=True)
class Document:
    kind: str  # "prose" or "code"
    path: str  # inside the archive, without its top folder
    text: str

    @property
    def held_out(self) -> bool:
        return zlib.crc32(self.path.encode()) % HELD_OUT_EVERY == 0


class CorpusError(RuntimeError):
    pass


def fetch_sdist(cache_dir: Path) -> Path:
    """``pip download`` the pinned source archive into ``cache_dir`` (once) and check its hash."""
    cache_dir = Path(cache_dir)
    archive = cache_dir / SDIST
    if not archive.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--no-binary", ":all:", f"{PACKAGE}=={VERSION}", "--dest", str(cache_dir)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not archive.exists():
            raise CorpusError(f"could not download {PACKAGE} {VERSION} from the package index "
                              f"(`{' '.join(cmd[2:])}`): {proc.stderr.strip()[-500:]}")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise CorpusError(f"{archive} has sha256 {digest}, expected {SDIST_SHA256}: "
                          "delete it and build again")
    return archive


def read_documents(archive: Path) -> list[Document]:
    """Every prose and code document of the archive, in archive order."""
    docs = []
    with tarfile.open(archive) as tar:
        for member in tar:
            if not member.isfile():
                continue
            path = member.name.split("/", 1)[-1]
            kind = next((k for k, (top, ext) in KINDS.items()
                         if path.startswith(top) and path.endswith(ext)), None)
            if kind is None:
                continue
            text = tar.extractfile(member).read().decode("utf-8", errors="replace")
            if text.strip():
                docs.append(Document(kind, path, text))
    return docs


def summary(docs: list[Document]) -> dict:
    """Documents and characters per kind and split: what the build records next to the model."""
    out: dict = {"package": PACKAGE, "version": VERSION, "license": LICENSE,
                 "sdist_sha256": SDIST_SHA256, "held_out_every": HELD_OUT_EVERY}
    for doc in docs:
        split = "held_out" if doc.held_out else "train"
        row = out.setdefault(f"{doc.kind}_{split}", {"documents": 0, "characters": 0})
        row["documents"] += 1
        row["characters"] += len(doc.text)
    return out
