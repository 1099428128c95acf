"""docs/configuration.md is rendered from the config schema, and the README stays a short page whose links work."""

from __future__ import annotations

import re
from pathlib import Path

from contracts.config import SECTIONS, KvServeConfig
from contracts.config_doc import DOC_PATH, MARKER, field_sections, main, render_reference, split_at_marker

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 150
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_configuration_doc_is_the_rendering_of_the_schema() -> None:
    preface, generated = split_at_marker(DOC_PATH.read_text())
    assert preface.strip(), "docs/configuration.md lost its hand-written preface"
    assert generated == render_reference(), (
        "docs/configuration.md is stale: run python -m contracts.config_doc --write docs/configuration.md"
    )


def test_every_field_is_rendered_once_in_a_section() -> None:
    listed = [name for _, names in field_sections() for name in names]
    assert sorted(listed) == sorted(KvServeConfig.model_fields)
    reference = render_reference()
    for name in KvServeConfig.model_fields:
        assert reference.count(f"| `{name}` |") == 1, name


def test_every_key_of_a_section_is_rendered_once() -> None:
    reference = render_reference()
    for section in SECTIONS.values():
        for name in section.model_fields:
            assert reference.count(f"| `{name}` |") == 1, name


def test_write_keeps_the_preface_and_check_sees_staleness(tmp_path: Path) -> None:
    doc = tmp_path / "configuration.md"
    doc.write_text(f"# Configuration\n\nHand-written.\n\n{MARKER}\n\nold table\n")
    assert main(["--check", str(doc)]) == 1
    assert main(["--write", str(doc)]) == 0
    assert doc.read_text() == "# Configuration\n\nHand-written.\n\n" + render_reference()
    assert main(["--check", str(doc)]) == 0


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in page.read_text().splitlines() if re.match(r"#{1,6} ", line)}


def _broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{page.name}: {target} (no such heading)")
    return broken


def test_readme_is_short_and_its_docs_links_resolve() -> None:
    readme = REPO / "README.md"
    assert len(readme.read_text().splitlines()) <= README_MAX_LINES
    linked_docs = {target.partition("#")[0] for target in LINK.findall(readme.read_text())}
    assert {f"docs/{page.name}" for page in (REPO / "docs").glob("*.md")} <= linked_docs, "a doc the README omits"
    pages = [readme, *sorted((REPO / "docs").glob("*.md"))]
    assert [link for page in pages for link in _broken_links(page)] == []


def test_readme_keeps_the_quick_start_commands() -> None:
    readme = (REPO / "README.md").read_text()
    for command in ("make up ", "make up RANKS=2 ", "make test ", "make test-compose "):
        assert f"\n{command}" in readme, command
