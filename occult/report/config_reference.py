"""The configuration reference page, written from the schema: `docs/configuration.md`.

Every key of `config/schema.yaml` gets one table row: its dotted name, its type and allowed values
(enums, bounds, patterns), its value in the embedded default `config/config.yaml`, whether it is
optional, and the schema's description. The page is generated, never edited by hand;
`tests/report/test_config_reference.py` fails when the committed page differs from what the schema
gives.

CLI: `python -m occult.report.config_reference --schema config/schema.yaml --defaults
config/config.yaml --out docs/configuration.md` (rule `write_config_reference`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterator

import yaml

COMMAND = ("python -m occult.report.config_reference --schema config/schema.yaml --defaults config/config.yaml "
           "--out docs/configuration.md")
LONG_DEFAULT = 60          # characters: a longer default value is summarised, not printed


def _type_text(node: dict) -> str:
    """Type and constraints of a schema node, in words."""
    if "enum" in node:
        return "one of " + ", ".join(f"`{v}`" for v in node["enum"])
    kinds = node.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds] if kinds else []
    words = " or ".join("null" if k == "null" else k for k in kinds) or "any"
    if "array" in kinds:
        items = node.get("items", {})
        if "enum" in items:
            inner = "values from " + ", ".join(f"`{v}`" for v in items["enum"])
        else:
            inner = _type_text(items) if items.get("type") != "object" else "mappings (below)"
        words = words.replace("array", f"list of {inner}")
        if node.get("minItems"):
            words += f", at least {node['minItems']}"
        if node.get("maxItems"):
            words += f", at most {node['maxItems']}"
        if node.get("uniqueItems"):
            words += ", no repeats"
    bounds = [f"≥ {node['minimum']}" if "minimum" in node else "",
              f"> {node['exclusiveMinimum']}" if "exclusiveMinimum" in node else "",
              f"≤ {node['maximum']}" if "maximum" in node else "",
              f"< {node['exclusiveMaximum']}" if "exclusiveMaximum" in node else ""]
    bounds = [b for b in bounds if b]
    if bounds:
        words += " " + ", ".join(bounds)
    if "pattern" in node:
        words += f" matching `{node['pattern']}`"
    if node.get("type") == "object" and isinstance(node.get("additionalProperties"), dict):
        words = f"mapping of name to {_type_text(node['additionalProperties'])}"
    return words


def _rows(node: dict, prefix: str, defaults: Any) -> Iterator[tuple[str, str, str, str]]:
    """(key, type, default, description) of every leaf under `node`; nested objects flattened with
    dots, lists of objects with `[]`."""
    required = set(node.get("required", []))
    for key, child in node.get("properties", {}).items():
        name = f"{prefix}{key}"
        value = defaults.get(key) if isinstance(defaults, dict) else None
        description = (child.get("description") or "").strip()
        if key not in required:
            description = f"(optional) {description}".strip()
        if child.get("type") == "object" and "properties" in child:
            if description:
                yield name, "mapping", "", description
            yield from _rows(child, f"{name}.", value)
            continue
        items = child.get("items", {})
        default = _default_text(value, isinstance(defaults, dict) and key in defaults)
        if not default and "default" in child:
            default = f"{_default_text(child['default'], True)} (built in)"
        yield name, _type_text(child), default, description
        if items.get("type") == "object" and "properties" in items:
            yield from _rows(items, f"{name}[].", None)


def _default_text(value: Any, present: bool) -> str:
    if not present:
        return ""
    text = json.dumps(value, ensure_ascii=False)
    if len(text) > LONG_DEFAULT:
        size = len(value) if isinstance(value, (list, dict)) else None
        return f"({size} entries)" if size is not None else "(long)"
    return f"`{text}`"


def _cell(text: str, html: bool = False) -> str:
    """A table cell; `html`: prose, whose angle brackets would read as HTML tags."""
    text = text.replace("|", "\\|").replace("\n", " ")
    return text.replace("<", "&lt;").replace(">", "&gt;") if html else text


def reference_markdown(schema: dict, defaults: dict) -> str:
    """The whole page: a table of the top-level keys, then one table per section."""
    lines = [
        "# Configuration reference",
        "",
        f"Generated from `config/schema.yaml` by `{COMMAND}` (rule `write_config_reference`);",
        "edit the schema, not this page. " + (schema.get("description") or "").strip(),
        "",
        "The *default* column is the embedded default, `config/config.yaml` (run `tiny`). Presets in",
        "`config/presets/` override parts of it (`snakemake --configfile config/presets/<name>.yaml`), and",
        "`--config key=value` overrides single keys. The workflow checks the result against the schema",
        "and for consistency (experts divisible by devices, N_d·E/D ≥ k, checkpoint present) before any",
        "job runs.",
        "",
    ]
    header = ["| key | type | default | description |", "|---|---|---|---|"]
    properties = schema.get("properties", {})
    top = {k: v for k, v in properties.items() if not (v.get("type") == "object" and "properties" in v)}
    lines += ["## Top level", "", *header]
    for key, kind, default, text in _rows({"properties": top, "required": schema.get("required", [])}, "", defaults):
        lines.append(f"| `{key}` | {_cell(kind)} | {_cell(default)} | {_cell(text, html=True)} |")
    for section, node in properties.items():
        if section in top:
            continue
        optional = "" if section in schema.get("required", []) else " (optional section)"
        lines += ["", f"## `{section}`{optional}", ""]
        if node.get("description"):
            lines += [node["description"].strip()[:1].upper() + node["description"].strip()[1:] + ".", ""]
        lines += header
        for key, kind, default, text in _rows(node, f"{section}.", defaults.get(section)):
            lines.append(f"| `{key}` | {_cell(kind)} | {_cell(default)} | {_cell(text, html=True)} |")
    return "\n".join(lines) + "\n"


def render(schema_path: Path, defaults_path: Path) -> str:
    for path in (schema_path, defaults_path):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: not found")
    schema = yaml.safe_load(Path(schema_path).read_text(encoding="utf-8"))
    defaults = yaml.safe_load(Path(defaults_path).read_text(encoding="utf-8"))
    if not isinstance(schema, dict) or "properties" not in schema:
        raise ValueError(f"{schema_path}: not a JSON schema with 'properties'")
    if not isinstance(defaults, dict):
        raise ValueError(f"{defaults_path}: not a mapping")
    return reference_markdown(schema, defaults)


def main(argv: list[str] | None = None) -> int:
    from occult.provenance import atomic_path

    parser = argparse.ArgumentParser(prog="python -m occult.report.config_reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("--schema", type=Path, required=True)
    parser.add_argument("--defaults", type=Path, required=True, help="the embedded default config (config/config.yaml)")
    parser.add_argument("--out", type=Path, required=True, help="the page to write (docs/configuration.md)")
    parser.add_argument("--log-json", help="JSON-lines log of this run (occult.logs)")
    args = parser.parse_args(argv)
    text = render(args.schema, args.defaults)
    with atomic_path(args.out) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    from occult.logs import run_main

    raise SystemExit(run_main("config_reference", main))
