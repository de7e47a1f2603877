"""Writes kubernetes-schema.json: the Kubernetes API's JSON schemas for the kinds that
deploy/kubernetes/ uses, for test_kubernetes_manifests.py to check the manifests offline.

The schemas come from the `kubernetes-validate` package (its wheel bundles the API's OpenAPI
schemas of every Kubernetes release as JSON Schema, in a strict form that refuses unknown
fields). Only the kinds used and the definitions they reach are kept, without their
descriptions, so the file stays small. Run it again when a manifest uses a new kind:

    pip download kubernetes-validate==1.37.0 --no-deps -d /tmp/kv
    PYTHONPATH=. python tests/deploy/make_kubernetes_schema.py /tmp/kv/kubernetes_validate-1.37.0-py3-none-any.whl
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "kubernetes-schema.json"
# The oldest release the manifests are meant for, and the newest the package knows.
VERSIONS = ("1.31.0", "1.37.0")
PREFIX = "kubernetes_validate/kubernetes-json-schema"


def kind_file(api_version: str, kind: str) -> str:
    """kubernetes-validate's file name of a kind: deployment-apps-v1.json, service-v1.json."""
    group, _, version = api_version.rpartition("/")
    group = group.split(".")[0]
    return f"{kind.lower()}-{group + '-' if group else ''}{version}.json"


def refs(node) -> set[str]:
    """The definition names a schema refers to."""
    found: set[str] = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            found.add(ref.rsplit("/", 1)[1])
        for value in node.values():
            found |= refs(value)
    elif isinstance(node, list):
        for value in node:
            found |= refs(value)
    return found


def plain(node, in_properties: bool = False):
    """`node` without descriptions and with every reference local (#/$defs/NAME). A property
    named `description` (an object's field) is kept."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "description" and not in_properties:
                continue
            if key == "$ref":
                value = "#/$defs/" + value.rsplit("/", 1)[1]
            out[key] = plain(value, in_properties=key == "properties")
        return out
    if isinstance(node, list):
        return [plain(value) for value in node]
    return node


def bundle(wheel: zipfile.ZipFile, version: str, kinds: set[tuple[str, str]]) -> dict:
    base = f"{PREFIX}/v{version}-local-strict"
    every = json.loads(wheel.read(f"{base}/_definitions.json"))["$defs"]
    out_kinds = {}
    for api_version, kind in sorted(kinds):
        schema = json.loads(wheel.read(f"{base}/{kind_file(api_version, kind)}"))
        schema.pop("$id", None)
        schema.pop("$schema", None)
        out_kinds[f"{api_version}/{kind}"] = plain(schema)
    wanted, todo = set(), set().union(*(refs(s) for s in out_kinds.values()))
    while todo:
        name = todo.pop()
        wanted.add(name)
        todo |= refs(every[name]) - wanted
    return {"kinds": out_kinds, "$defs": {name: plain(every[name]) for name in sorted(wanted)}}


def main(wheel_path: str) -> None:
    from tests.deploy.test_kubernetes_manifests import manifests

    kinds = {(d["apiVersion"], d["kind"]) for _, d in manifests()}
    with zipfile.ZipFile(wheel_path) as wheel:
        out = {v: bundle(wheel, v, kinds) for v in VERSIONS}
    OUT.write_text(json.dumps(out, indent=None, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"{OUT}: {', '.join(f'{a}/{k}' for a, k in sorted(kinds))} for Kubernetes {', '.join(VERSIONS)}")


if __name__ == "__main__":
    main(sys.argv[1])
