"""The repository explains itself: README stays short, every relative link in the docs
resolves, and every document the code points to is in the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "proto" / "README.md"])
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: Documents named in code comments and docstrings ("see docs/policies.md", "README").
DOC_REF = re.compile(r"\b((?:docs|proto|engine_adapter/data/vidur)/[\w./-]+\.md)\b")
#: The design document the first version cited, which never was in the repository.
OUTSIDE = "ARCHITECTURE " + "§"


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / p for p in out.stdout.split()]


def test_readme_is_a_front_page() -> None:
    """What it is, the two commands, one results table and links: details live in docs/."""
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 8 * 1024
    assert "make demo" in text and "make test" in text


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in LINK.findall(doc.read_text()):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        path = target.split("#", 1)[0]
        if path and not (doc.parent / path).exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to missing files: {broken}"


def test_code_points_only_into_the_repository() -> None:
    """No reference to a design document outside the repository; every docs path named in
    code, proto and generated stubs exists."""
    missing = []
    for f in tracked("*.py", "*.pyi", "*.proto", "Makefile"):
        text = f.read_text(errors="replace")
        assert OUTSIDE not in text, f"{f.relative_to(ROOT)} cites a document not in the repository"
        missing += [f"{f.relative_to(ROOT)}: {ref}" for ref in DOC_REF.findall(text) if not (ROOT / ref).exists()]
    assert not missing, missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_page_has_a_title_and_a_body(doc: Path) -> None:
    text = doc.read_text()
    assert text.startswith("# ") and len(text) > 300, f"{doc.relative_to(ROOT)} is empty or has no title"
