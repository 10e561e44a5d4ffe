"""The public texts a receipt scores: files every Debian machine or Python install has.

Each candidate names a file by where it lives (Debian's license folder, man pages and
package docs; the running interpreter's standard library). A receipt takes the first
`count` candidates present on the machine, in the order below, and records each file's
sha256 so that two receipts can be checked to have read the same bytes. gzip files
(man pages, changelogs) are decompressed; every file is read as UTF-8 (bad bytes replaced).

Shape legend: [T] token ids of one passage.
"""
from __future__ import annotations

import gzip
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TextSource:
    """A public text: a short name and how to find its file."""

    name: str
    where: str  # "abs" (an absolute path) or "stdlib" (relative to the stdlib folder)
    path: str

    def resolve(self) -> Path:
        if self.where == "stdlib":
            return Path(sysconfig.get_paths()["stdlib"]) / self.path
        return Path(self.path)


CANDIDATES: tuple[TextSource, ...] = (
    TextSource("GPL-3", "abs", "/usr/share/common-licenses/GPL-3"),
    TextSource("Apache-2.0", "abs", "/usr/share/common-licenses/Apache-2.0"),
    TextSource("textwrap.py", "stdlib", "textwrap.py"),
    TextSource("ls.1", "abs", "/usr/share/man/man1/ls.1.gz"),
    TextSource("base-files changelog", "abs", "/usr/share/doc/base-files/changelog.gz"),
    TextSource("heapq.py", "stdlib", "heapq.py"),
    # fallbacks, used only when one of the above is missing
    TextSource("LGPL-2.1", "abs", "/usr/share/common-licenses/LGPL-2.1"),
    TextSource("dpkg changelog", "abs", "/usr/share/doc/dpkg/changelog.gz"),
    TextSource("bisect.py", "stdlib", "bisect.py"),
    TextSource("MPL-2.0", "abs", "/usr/share/common-licenses/MPL-2.0"),
)


@dataclass(frozen=True)
class Passage:
    """One scored text: its token ids and what they came from."""

    name: str
    source: str  # the file path read
    sha256: str  # of the file's bytes as stored (compressed when gzip)
    ids: tuple[int, ...]  # [T] token ids of the whole text (the receipt uses a prefix of them)


def read_text(path: Path) -> tuple[str, str]:
    """(text, sha256 of the stored bytes) of a plain or gzip file."""
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    data = gzip.decompress(raw) if path.suffix == ".gz" else raw
    return data.decode("utf-8", errors="replace"), digest


def find_texts(count: int, candidates=CANDIDATES) -> list[tuple[TextSource, Path]]:
    """The first `count` candidates whose files exist; ValueError when fewer exist."""
    if count < 1:
        raise ValueError(f"texts: count must be >= 1; got {count}")
    found = [(c, c.resolve()) for c in candidates if c.resolve().is_file()]
    if len(found) < count:
        missing = [str(c.resolve()) for c in candidates if not c.resolve().is_file()]
        raise ValueError(f"texts: need {count} public texts, found {len(found)}; missing {missing}")
    return found[:count]


def load_passages(tokenizer, *, count: int, min_tokens: int, candidates=CANDIDATES) -> list[Passage]:
    """Tokenize the first `count` present texts; each must give at least `min_tokens` ids
    (ValueError naming the text otherwise). tokenizer: anything with encode(str) -> ids."""
    out = []
    for src, path in find_texts(count, candidates):
        text, digest = read_text(path)
        ids = tuple(int(i) for i in tokenizer.encode(text))
        if len(ids) < min_tokens:
            raise ValueError(f"text {src.name!r} ({path}) has {len(ids)} tokens; need >= {min_tokens}")
        out.append(Passage(src.name, str(path), digest, ids))
    return out
