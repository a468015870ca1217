"""The docs the code cites exist: every `docs/PAGE.md` named in a source file is a page of docs/, and every section it
names in quotes right after (`docs/pipeline.md, "Schedule"`) is one of that page's headings."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("protocol", "kernels", "swarm", "node", "tui", "bench/lab", "tests")
CITE = re.compile(r'docs/(?P<page>[a-z_]+\.md)(?:,?\s+"(?P<section>[^"]+)")?')


def headings(page: Path) -> set[str]:
    return {line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")}


def citations() -> list[tuple[str, str, str | None]]:
    out = []
    for folder in SOURCES:
        for f in sorted((ROOT / folder).rglob("*.py")):
            text = re.sub(r"\s+", " ", f.read_text())  # a citation may wrap across lines
            out += [(str(f.relative_to(ROOT)), m["page"], m["section"]) for m in CITE.finditer(text)]
    return out


def test_every_page_and_section_the_code_cites_exists():
    found = citations()
    assert len(found) >= 20  # the code cites its docs (the pattern still matches them)
    missing = [(f, page, section) for f, page, section in found
               if not (ROOT / "docs" / page).is_file()
               or (section is not None and section not in headings(ROOT / "docs" / page))]
    assert not missing, missing


def test_the_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert pages and all(f"({p})" in index for p in pages)


def test_no_code_cites_design_notes_outside_the_repository():
    bare = re.compile(r"(?<![\w/])(?:algorithms|design|crowd|conventions|pipeline)\.md\b")
    found = [str(f.relative_to(ROOT)) for folder in SOURCES for f in sorted((ROOT / folder).rglob("*.py"))
             if bare.search(f.read_text().replace("bench/results/pipeline.md", ""))]
    assert found == []
