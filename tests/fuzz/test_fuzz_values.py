"""Fuzz the chart's values through ``values.schema.json``, in process and through real helm.

The schema and values are read from the chart at test time, and mutations are made
generically on the values tree (defaults merged with each ``ci/`` variant), so keys other
engineers add are fuzzed too. helm 4 validates with the draft the schema's ``$schema`` names
(draft-07 here); ``jsonschema``'s validator for that draft is the in-process oracle.

Properties:
- a leaf given a value of another JSON type is refused, naming its path: no value in the
  chart is left untyped (a schema gap shows up as a failure naming the path);
- an unknown key in any object is refused unless that object is a declared free-form map;
- random values anywhere are judged without error, each complaint carrying a path;
- on a sample, ``helm template`` agrees with ``jsonschema`` (refuses exactly when it does, and
  names a path jsonschema names) and renders when both accept.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from fuzz_support import count, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "arc-serving"
HELM = REPO / ".tools" / "bin" / "helm"
SCHEMA = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
VALIDATOR_CLASS = jsonschema.validators.validator_for(SCHEMA)
VALIDATOR = VALIDATOR_CLASS(SCHEMA)
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
VARIANTS = {"values.yaml": {}} | {
    path.name: yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    for path in sorted((CHART / "ci").glob("*.yaml"))
}


def coalesce(defaults: Any, user: Any) -> Any:
    """Helm's merge of user values onto defaults: maps merge, a null deletes a default (a null
    for a key without a default stays, and the schema judges it), others replace."""
    if not (isinstance(defaults, dict) and isinstance(user, dict)):
        return copy.deepcopy(user)
    merged = copy.deepcopy(defaults)
    for key, value in user.items():
        if value is None and key in merged:
            merged.pop(key)
        else:
            merged[key] = coalesce(merged.get(key), value)
    return merged


BASES = {name: coalesce(DEFAULTS, variant) for name, variant in VARIANTS.items()}


def errors(values: Any) -> list[tuple[str, str]]:
    """jsonschema's complaints as (path like helm's '/a/b', message)."""
    return [
        (pointer(error.absolute_path), error.message) for error in VALIDATOR.iter_errors(values)
    ]


def pointer(path: Any) -> str:
    """A JSON pointer, as helm prints paths ('/' in a key is '~1', '~' is '~0')."""
    # helm prints the root as ''.
    return "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in path)


GO_ESCAPES = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r"}
GO_ESCAPES |= {"\t": "\\t", "\v": "\\v", "\\": "\\\\"}


def go_escaped(text: str) -> str:
    """``text`` as helm prints a path (Go's strconv.Quote without the quotes): unprintable
    characters escaped as \\n, \\xNN, \\uNNNN or \\UNNNNNNNN."""

    def escape(char: str) -> str:
        if char in GO_ESCAPES:
            return GO_ESCAPES[char]
        if char.isprintable() or char == " ":
            return char
        code = ord(char)
        return (
            f"\\x{code:02x}"
            if code < 0x80
            else (f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
        )

    return "".join(escape(char) for char in text)


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    """Follow local references (``#/definitions/NAME``), the only kind this schema has."""
    while "$ref" in schema:
        node: Any = SCHEMA
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


FREE: dict[str, Any] = {}  # inside an open object: a Kubernetes object passed through as is


def key_schema(schema: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The schema of map key ``key`` by the map's patternProperties (a map whose keys have a
    syntax, such as a node selector's label keys); None when no pattern takes it."""
    for pattern, sub in schema.get("patternProperties", {}).items():
        if isinstance(sub, dict) and re.search(pattern, key):
            return sub
    return None


def subschema(path: tuple[Any, ...]) -> dict[str, Any] | None:
    """The schema a value at ``path`` must meet (properties, maps, items); FREE inside an
    open object (no additionalProperties: a Kubernetes type the chart passes through, such
    as a pod securityContext, checked by the API server); None where the schema says nothing.
    """
    node: dict[str, Any] = SCHEMA
    for part in path:
        node = _resolve(node)
        if isinstance(part, int):
            node = node.get("items")  # type: ignore[assignment]
        elif part in node.get("properties", {}):
            node = node["properties"][part]
        elif (by_pattern := key_schema(node, part)) is not None:
            node = by_pattern
        elif node.get("type") == "object" and node.get("additionalProperties", True) is True:
            return FREE
        else:
            node = node.get("additionalProperties")  # type: ignore[assignment]
        if not isinstance(node, dict):
            return None
    return _resolve(node)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield prefix, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _paths(value, (*prefix, index))


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def allows(schema: dict[str, Any], kind: str) -> bool:
    types = schema.get("type")
    if types is None:
        return True
    types = [types] if isinstance(types, str) else types
    return kind in types or (kind == "integer" and "number" in types)


OTHER_VALUES: dict[str, Any] = {
    "null": None,
    "boolean": True,
    "integer": 7,
    "number": 0.5,
    "string": "x",
    "array": ["x"],
    "object": {"x": 1},
}


def put(values: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(values)
    node: Any = out
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return out


LEAVES = sorted(
    {
        (name, path)
        for name, base in BASES.items()
        for path, value in _paths(base)
        if path and not isinstance(value, dict | list)
    },
    key=repr,
)
OBJECTS = sorted(
    {
        (name, path)
        for name, base in BASES.items()
        for path, value in _paths(base)
        if isinstance(value, dict)
    },
    key=repr,
)


def test_every_variant_meets_the_schema() -> None:
    assert VALIDATOR_CLASS is jsonschema.Draft7Validator, SCHEMA.get("$schema")
    for name, values in BASES.items():
        assert errors(values) == [], name


@given(leaf=st.sampled_from(LEAVES), kind=st.sampled_from(sorted(OTHER_VALUES)))
@fuzz_settings(2_000)
def test_a_leaf_of_another_type_is_refused_by_path(
    leaf: tuple[str, tuple[Any, ...]], kind: str
) -> None:
    count("values: leaf of another type")
    name, path = leaf
    schema = subschema(path)
    if schema is FREE:
        return
    assert schema is not None and ("type" in schema or "enum" in schema or "const" in schema), (
        f"{'.'.join(map(str, path))} has no type in values.schema.json"
    )
    original = BASES[name]
    for part in path:
        original = original[part]
    if kind == json_type(original) or (allows(schema, kind) and "enum" not in schema):
        return  # the same type, or one the schema allows here: nothing to refuse
    found = errors(put(BASES[name], path, OTHER_VALUES[kind]))
    where = pointer(path)
    assert any(where.startswith(at) for at, _ in found), (where, kind, found)


@given(
    obj=st.sampled_from(OBJECTS),
    key=st.sampled_from(["bogus", "Enabled", "replica", "x-extra", "annotations_"]),
)
@fuzz_settings(2_000)
def test_an_unknown_key_is_refused_unless_the_map_is_free(
    obj: tuple[str, tuple[Any, ...]], key: str
) -> None:
    count("values: unknown key")
    name, path = obj
    schema = subschema(path)
    assert schema is not None, f"{'.'.join(map(str, path))} is not in values.schema.json"
    if schema is FREE:
        return
    node = BASES[name]
    for part in path:
        node = node[part]
    if key in node or key in schema.get("properties", {}) or key_schema(schema, key):
        return
    free = schema.get("additionalProperties", True)
    values = put(BASES[name], (*path, key), "x") if path else {**BASES[name], key: "x"}
    found = errors(values)
    if free is False:
        where = pointer(path)
        assert any(at == where and repr(key) in message for at, message in found), found


SCALARS = (
    st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10)
    | st.sampled_from(["", "true", "10%", "ARC", "1Gi", "-1", "Hot", "a" * 70, "https://x"])
)


def json_values(nulls: bool) -> st.SearchStrategy[Any]:
    """Random JSON values; ``nulls``: nulls among them (helm's merge deletes on null)."""
    return st.recursive(
        st.none() | SCALARS if nulls else SCALARS,
        lambda children: (
            st.lists(children, max_size=3)
            | st.dictionaries(st.text(max_size=8), children, max_size=3)
        ),
        max_leaves=8,
    )


# Built once: a recursive strategy built per draw costs more than the draw.
JSON_VALUES = {nulls: json_values(nulls) for nulls in (True, False)}


@st.composite
def mutated_values(
    draw: st.DrawFn, nulls: bool = True
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(variant, user values file, what helm validates): a variant with 1-3 places changed.

    ``nulls``: also set keys to null, which makes helm drop the default (see the helm test).
    """
    name = draw(st.sampled_from(sorted(BASES)))
    user = copy.deepcopy(BASES[name])
    for _ in range(draw(st.integers(1, 3))):
        paths = [path for path, _ in _paths(user) if path]
        path = draw(st.sampled_from(paths))
        node: Any = user
        for part in path[:-1]:
            node = node[part]
        action = draw(
            st.sampled_from(["replace", "replace", "delete", "null"][: 4 if nulls else 3])
        )
        if action == "delete" and isinstance(node, dict):
            del node[path[-1]]
        elif action == "null" and isinstance(node, dict):
            node[path[-1]] = None
        else:
            node[path[-1]] = draw(JSON_VALUES[nulls])
    return name, user, coalesce(DEFAULTS, user)


@given(case=mutated_values())
@fuzz_settings(2_000)
def test_random_values_are_judged_with_paths(
    case: tuple[str, dict[str, Any], dict[str, Any]],
) -> None:
    count("values: random mutations (jsonschema)")
    _, _, merged = case
    for at, message in errors(merged):
        # Only a missing top-level section is reported at the root, and it names the key.
        assert at.startswith("/") or "is a required property" in message, (at, message)


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    if not HELM.is_file():
        pytest.fail(f"{HELM} is missing: run `make tools` (it fetches helm)")
    with tempfile.TemporaryDirectory(prefix="fuzz-values-") as name:
        yield Path(name)


# Nulls included: helm's merge deletes a key set to null, so a null section must fail the
# schema ("missing property"), never reach a template as a nil pointer.
@given(case=mutated_values(nulls=True))
@fuzz_settings(150)
def test_helm_agrees_with_jsonschema(
    folder: Path, case: tuple[str, dict[str, Any], dict[str, Any]]
) -> None:
    count("values: helm template agreement")
    _, user, merged = case
    path = folder / "values.yaml"
    path.write_text(yaml.safe_dump(user), encoding="utf-8")
    result = subprocess.run(
        [str(HELM), "template", "rel", str(CHART), "--namespace", "llm", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    found = errors(merged)
    schema_failed = "don't meet the specifications of the schema" in result.stderr
    assert schema_failed == bool(found), (found, result.stderr[-2000:])
    if found:
        printed = [go_escaped(at) for at, _ in found]
        assert any(f"'{at}'" in result.stderr for at in printed), (found, result.stderr)
    else:
        # The templates refuse some combinations a schema cannot express, with their own
        # `fail` message ("execution error at (TEMPLATE): ..."); nothing else may fail.
        assert result.returncode == 0 or "execution error at (" in result.stderr, result.stderr
