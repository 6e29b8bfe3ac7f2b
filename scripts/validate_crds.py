"""Validate the custom resources of a rendered kustomization against local schemas.

    validate_crds.py RENDERED.yaml BUILTIN_OUT.yaml SCHEMA.json... [--expect KIND]
                     [--expect-schemas-in DIR]

kubernetes-validate knows only the built-in kinds (and only warns on others), so
scripts/lint_deploy.sh runs this first: every document whose apiVersion and kind
match a schema's ``const``s is checked with jsonschema (unknown fields are errors
where the schema says ``additionalProperties: false``), and the core objects it
embeds (the schema's ``x-flashserve-embedded``: a path, a core kind, ``each`` for
a list) are written out as documents of that kind, beside every document that
matched no schema, to BUILTIN_OUT for kubernetes-validate --strict. So a
LeaderWorkerSet's pod templates are validated as strictly as a StatefulSet's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml


def _kind_of(schema: dict[str, Any]) -> tuple[str, str]:
    props = schema["properties"]
    return props["apiVersion"]["const"], props["kind"]["const"]


def _at(doc: dict[str, Any], path: list[str]) -> Any:
    for key in path:
        if not isinstance(doc, dict) or key not in doc:
            return None
        doc = doc[key]
    return doc


def embedded(doc: dict[str, Any], schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The core objects ``doc`` embeds, as documents kubernetes-validate can check."""
    name = doc["metadata"]["name"]
    out: list[dict[str, Any]] = []
    for entry in schema.get("x-flashserve-embedded", []):
        found = _at(doc, entry["path"])
        if found is None:
            continue
        items = found if entry.get("each") else [found]
        for i, item in enumerate(items):
            where = f"{name}-{entry['path'][-1].lower()}" + (f"-{i}" if entry.get("each") else "")
            if entry["kind"] == "PodTemplate":
                out.append(
                    {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": where},
                        "template": item,
                    }
                )
            else:  # an object with its own metadata (a claim template)
                out.append({"apiVersion": "v1", "kind": entry["kind"], **item})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rendered", type=Path)
    parser.add_argument("builtin_out", type=Path)
    parser.add_argument("schemas", type=Path, nargs="+")
    parser.add_argument("--expect", action="append", default=[], help="a kind that must occur")
    parser.add_argument(
        "--expect-schemas-in",
        type=Path,
        default=None,
        help="a directory: the kind of every *.schema.json in it must occur",
    )
    args = parser.parse_args(argv)
    if args.expect_schemas_in is not None:
        for path in sorted(args.expect_schemas_in.glob("*.schema.json")):
            args.expect.append(_kind_of(json.loads(path.read_text()))[1])
    schemas = {}
    for path in args.schemas:
        schema = json.loads(path.read_text())
        schemas[_kind_of(schema)] = schema
    docs = [d for d in yaml.safe_load_all(args.rendered.read_text()) if d]
    builtin: list[dict[str, Any]] = []
    seen: set[str] = set()
    for doc in docs:
        schema = schemas.get((doc.get("apiVersion"), doc.get("kind")))
        if schema is None:
            builtin.append(doc)
            continue
        try:
            jsonschema.validate(doc, schema)
        except jsonschema.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path)
            print(
                f"{doc['kind']}/{doc['metadata']['name']}: {where}: {exc.message}", file=sys.stderr
            )
            return 1
        seen.add(doc["kind"])
        builtin.extend(embedded(doc, schema))
    missing = [kind for kind in args.expect if kind not in seen]
    if missing:
        print(f"no {', '.join(missing)} rendered", file=sys.stderr)
        return 1
    args.builtin_out.write_text(yaml.safe_dump_all(builtin))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
