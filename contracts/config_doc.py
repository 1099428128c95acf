"""The configuration reference (docs/configuration.md) rendered from KvServeConfig, so it cannot drift.

Every field with its type, constraints, default and description, grouped by the `# --- section ---` comments of
contracts/config.py; a section model's keys (config.SECTIONS) in a table below its field. docs/configuration.md
keeps a hand-written preface above MARKER; everything from the marker on is this module's output, and
tests/contracts/test_config_doc.py fails when the file differs from it.

    python -m contracts.config_doc                                   # the generated part, on stdout
    python -m contracts.config_doc --write docs/configuration.md     # replace the part below the marker
    python -m contracts.config_doc --check docs/configuration.md     # exit 1 when the file is stale
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from contracts import config as config_module
from contracts.config import SECTIONS, KvServeConfig

MARKER = "<!-- Generated below by `python -m contracts.config_doc --write docs/configuration.md`: do not edit. -->"
DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

_SECTION = re.compile(r"^\s*# --- (?P<title>.+?) ---\s*$")


def field_sections() -> list[tuple[str, list[str]]]:
    """The config's sections in source order, each with its field names in source order."""
    source = inspect.getsource(config_module)
    lines = source.splitlines()
    headers = [(number, match["title"]) for number, line in enumerate(lines, 1) if (match := _SECTION.match(line))]
    class_node = next(
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef) and node.name == KvServeConfig.__name__
    )
    sections: list[tuple[str, list[str]]] = []
    for node in class_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        if name not in KvServeConfig.model_fields:
            continue
        title = next((title for number, title in reversed(headers) if number < node.lineno), "general")
        if not sections or sections[-1][0] != title:
            sections.append((title, []))
        sections[-1][1].append(name)
    return sections


def _type_text(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " / ".join(f"`{value}`" for value in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join("unset" if arg is type(None) else _type_text(arg) for arg in get_args(annotation))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_text(arg) for arg in get_args(annotation))}]"
    return annotation.__name__


def _constraints_text(field: FieldInfo) -> str:
    bounds = []
    for item in field.metadata:
        if isinstance(item, annotated_types.Gt):
            bounds.append(f"> {item.gt:g}")
        elif isinstance(item, annotated_types.Ge):
            bounds.append(f">= {item.ge:g}")
        elif isinstance(item, annotated_types.Lt):
            bounds.append(f"< {item.lt:g}")
        elif isinstance(item, annotated_types.Le):
            bounds.append(f"<= {item.le:g}")
    return ", ".join(bounds)


def _default_text(field: FieldInfo) -> str:
    value = field.default_factory() if field.default is PydanticUndefined else field.default  # type: ignore[call-arg]
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"  # as YAML writes it
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_reference() -> str:
    """The generated part of docs/configuration.md: MARKER, then one table per section of the config."""
    fields = KvServeConfig.model_fields
    out = [
        MARKER,
        "",
        "## Reference",
        "",
        "Every key of `contracts/config.py`, in its sections. Each is also read from the environment as `KVSERVE_`",
        "plus the key in capitals (`max_num_seqs` as `KVSERVE_MAX_NUM_SEQS`). *unset* is YAML's `null` (or no key).",
    ]
    for title, names in field_sections():
        heading, _, note = title.partition(" (")
        if " " not in note:  # a one-word aside stays in the heading: "L1 (kvstore)"
            heading, note = title, ""
        out += ["", f"### {heading[0].upper()}{heading[1:]}", ""]
        if note:
            out += [f"{note[0].upper()}{note[1:].removesuffix(')')}.", ""]
        out += _table([(name, fields[name]) for name in names])
        for name in names:
            if name in SECTIONS:  # its keys, in a table of their own
                out += ["", *_table(list(SECTIONS[name].model_fields.items()))]
    return "\n".join(out) + "\n"


def _table(fields: list[tuple[str, FieldInfo]]) -> list[str]:
    rows = ["| key | type | default | what |", "| --- | --- | --- | --- |"]
    for name, field in fields:
        if name in SECTIONS:
            kind, default = "section", ""
        else:
            kind, default = _type_text(field.annotation), _default_text(field)
            if constraints := _constraints_text(field):
                kind += f" ({constraints})"
        description = field.description or ""
        rows.append(f"| `{name}` | {_cell(kind)} | {_cell(default)} | {_cell(description)} |")
    return rows


def split_at_marker(text: str) -> tuple[str, str]:
    """A configuration doc's hand-written preface and its generated part (from MARKER on; empty if none)."""
    at = text.find(MARKER)
    return (text, "") if at < 0 else (text[:at], text[at:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m contracts.config_doc", description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", metavar="FILE", help="replace FILE's part below the marker (keeps its preface)")
    action.add_argument("--check", metavar="FILE", help="exit 1 when FILE's generated part is stale")
    args = parser.parse_args(argv)
    reference = render_reference()
    if args.write:
        path = Path(args.write)
        preface, _ = split_at_marker(path.read_text() if path.exists() else "")
        path.write_text(preface + reference)
        return 0
    if args.check:
        _, generated = split_at_marker(Path(args.check).read_text())
        if generated != reference:
            print(f"{args.check} is stale: run python -m contracts.config_doc --write {args.check}", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
