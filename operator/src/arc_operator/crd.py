"""Generate the ServingPolicy CRD from the pydantic models (the single source of truth).

``python -m arc_operator.crd`` prints the CRD as YAML; ``python -m arc_operator.crd PATH``
writes it (the Helm chart commits it at ``charts/arc-serving/crds/``, and a test asserts the
committed file equals this output).

Pydantic emits JSON Schema 2020-12; a CRD takes a *structural* OpenAPI v3.0 schema. The
translation inlines ``$ref``s, turns ``Optional`` (``anyOf`` with null) into an optional
property, turns numeric ``exclusiveMinimum`` into the v3.0 boolean form, maps open objects
to ``x-kubernetes-preserve-unknown-fields``, and drops titles and ``additionalProperties:
false`` (the API server prunes unknown fields instead).
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from arc_operator import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from arc_operator.generated import write_or_print
from arc_operator.models import ServingPolicySpec
from arc_operator.status import ServingPolicyStatus

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Policy", "type": "string", "jsonPath": ".spec.policy"},
    {"name": "Routing", "type": "string", "jsonPath": ".status.routingPolicy"},
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
    },
    {"name": "Hit Rate", "type": "number", "format": "float", "jsonPath": ".status.hitRate"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Active", "type": "string", "jsonPath": ".status.activePolicy", "priority": 1},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "priority": 1},
]


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Translate one pydantic JSON-schema node into a structural OpenAPI v3.0 node."""
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    # anyOf first: an optional nested model is anyOf [{$ref}, null], resolved just below.
    if "anyOf" in node:
        variants = [v for v in node.pop("anyOf") if v != {"type": "null"}]
        if len(variants) != 1:
            raise ValueError(f"cannot express anyOf {variants!r} in a structural schema")
        node = {**variants[0], **node}
        if node.get("default", "") is None:
            del node["default"]
    if "$ref" in node:
        # Sibling keys (description, default) override the referenced definition's.
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **node}
    node.pop("title", None)
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    if node.get("additionalProperties") is True:
        del node["additionalProperties"]
        node["x-kubernetes-preserve-unknown-fields"] = True
    if isinstance(node.get("exclusiveMinimum"), int | float) and not isinstance(
        node["exclusiveMinimum"], bool
    ):
        node["minimum"] = node["exclusiveMinimum"]
        node["exclusiveMinimum"] = True
    if "description" in node:
        # The first paragraph is for users; later ones (invariants) are for developers.
        node["description"] = " ".join(node["description"].split("\n\n")[0].split())
    return {
        key: (
            {name: _structural(sub, defs) for name, sub in value.items()}
            if key == "properties"
            else _structural(value, defs)
        )
        for key, value in node.items()
        if key != "$defs"
    }


def model_schema(model: type[Any]) -> dict[str, Any]:
    """The structural schema of one pydantic model, with camelCase property names."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def build_crd() -> dict[str, Any]:
    """The full CustomResourceDefinition object for servingpolicies.arcserving.io."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A vLLM deployment with a prefix-cache eviction "
                            "policy (LRU, ARC, ...) that the arc-serving operator manages.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": model_schema(ServingPolicySpec),
                                "status": model_schema(ServingPolicyStatus),
                            },
                        }
                    },
                }
            ],
        },
    }


def render_crd() -> str:
    """The CRD as the YAML text committed in the chart."""
    header = (
        "# Generated by `python -m arc_operator.crd` from operator/src/arc_operator/models/.\n"
        "# Do not edit by hand: change the models and regenerate.\n"
    )
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    """Print the CRD, or write it to the one path given."""
    return write_or_print("arc_operator.crd", render_crd, argv)


if __name__ == "__main__":
    sys.exit(main())
