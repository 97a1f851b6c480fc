"""Shared pieces of the fuzz tests: the profile's settings and the case counter."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

settings.register_profile(
    "fuzz",
    derandomize=True,  # the same cases on every run and machine
    deadline=None,  # case times vary with the machine; speed is make bench's business
    database=None,  # nothing written into the tree
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Cases run per target (a target is one parser or validator); printed at the session's end.
CASES: Counter[str] = Counter()


# The share of each target's cases a run takes: make test-fast sets ARC_FUZZ_FRACTION=0.1 and
# runs the first tenth of the same cases (the profile is derandomized); make test runs them all.
FRACTION = float(os.environ.get("ARC_FUZZ_FRACTION", "1"))


def fuzz_settings(max_examples: int) -> settings:
    """The ``fuzz`` profile (see conftest) with this test's number of cases (times FRACTION)."""
    cases = max(1, round(max_examples * FRACTION))
    return settings(settings.get_profile("fuzz"), max_examples=cases)


def count(target: str) -> None:
    """Record one case run against ``target``."""
    CASES[target] += 1


# Keys of generated maps: mostly label keys, what the CRD's maps hold, and any text.
MAP_KEYS = st.from_regex(
    r"([a-z0-9]{1,4}\.[a-z]{1,3}/)?[A-Za-z0-9]([-_.a-z]{0,4}[a-z0-9])?", fullmatch=True
) | st.text(max_size=8)


def from_openapi(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Instances of an OpenAPI 3.0 structural schema (the subset CRDs use), all valid.

    Handles object (properties, required, ``oneOf`` of ``required`` lists, preserved unknown
    fields, maps with a value schema), string (enum, pattern, min/maxLength), integer and
    number (minimum, maximum, boolean exclusiveMinimum, multipleOf), boolean and array.
    Optional properties come and go.
    """
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
            return st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)
        if isinstance(schema.get("additionalProperties"), dict):
            # A map. Its keys have no schema (a CRD checks them with CEL, if at all): mostly
            # label keys, the keys Kubernetes maps hold, and any text.
            values = from_openapi(schema["additionalProperties"])
            size = min(3, schema.get("maxProperties", 3))
            return st.dictionaries(MAP_KEYS, values, max_size=size)
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        choices = [set(option["required"]) for option in schema.get("oneOf", [])] or [set()]
        every = set().union(*choices)
        return st.one_of([_object(properties, required | one, every - one) for one in choices])
    if kind == "string":
        if "pattern" in schema:
            text = st.from_regex(schema["pattern"], fullmatch=True)
        else:
            text = st.text(min_size=schema.get("minLength", 0), max_size=20)
        low, high = schema.get("minLength", 0), schema.get("maxLength", 10**9)
        return text.filter(lambda value: low <= len(value) <= high)
    if kind == "integer":
        step = schema.get("multipleOf", 1)
        low = -(-schema.get("minimum", -(2**40)) // step)
        high = schema.get("maximum", 2**40) // step
        return st.integers(low, high).map(lambda value: value * step)
    if kind == "number":
        return st.floats(
            min_value=schema.get("minimum"),
            max_value=schema.get("maximum"),
            exclude_min=bool(schema.get("exclusiveMinimum")),
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        return st.lists(from_openapi(schema.get("items", {})), max_size=3)
    raise NotImplementedError(f"schema not covered by the fuzz generator: {schema}")


def _object(
    properties: dict[str, Any], required: set[str], forbidden: set[str]
) -> st.SearchStrategy[dict[str, Any]]:
    fixed = {name: from_openapi(properties[name]) for name in sorted(required)}
    optional = {
        name: from_openapi(sub)
        for name, sub in sorted(properties.items())
        if name not in required and name not in forbidden
    }
    return st.fixed_dictionaries(fixed, optional=optional)
