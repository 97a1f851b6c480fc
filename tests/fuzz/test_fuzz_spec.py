"""Fuzz ServingPolicy specs through the operator's validation (``parse_spec``).

Specs come from the CRD's own ``openAPIV3Schema`` (generated from the operator's models at
test time, so new fields such as ``apiKeySecretRef`` are fuzzed as soon as they exist), then
get mutated, or are random dicts. Properties:
- ``parse_spec`` returns a model or raises SpecError naming ``spec.<field>``; nothing else;
- whatever the API server would refuse by the schema (checked with ``jsonschema`` against the
  same schema), the operator refuses too;
- a spec the schema allows and the operator refuses breaks one of the operator's own rules,
  all of them deliberate (the CRD holds some only as CEL, which jsonschema cannot run):
  ``OPERATOR_ONLY`` below lists them;
- every accepted spec yields children (Deployment, Service, ConfigMap); a sample of them pass
  ``kubernetes-validate`` against the Kubernetes schemas.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import jsonschema
import kubernetes_validate
from fuzz_support import count, from_openapi, fuzz_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arc_operator import crd, manifests
from arc_operator.models import SpecError, parse_spec

K8S_VERSION = "1.33"


def _go_regex(node: Any) -> Any:
    """The schema with Go's regexp anchors: ``$`` ends the text (Python's also allows a
    trailing newline), so jsonschema judges patterns the way the API server does."""
    if isinstance(node, dict):
        out = {key: _go_regex(value) for key, value in node.items()}
        if isinstance(out.get("pattern"), str) and out["pattern"].endswith("$"):
            out["pattern"] = out["pattern"][:-1] + r"\Z"
        return out
    if isinstance(node, list):
        return [_go_regex(item) for item in node]
    return node


CRD_SPEC_SCHEMA = _go_regex(
    crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
)
# The API server validates CRDs by OpenAPI 3.0, which keeps draft 4's boolean exclusiveMinimum.
API_SERVER = jsonschema.Draft4Validator(CRD_SPEC_SCHEMA)
SPEC_FIELDS = sorted(CRD_SPEC_SCHEMA["properties"])

# Operator rules the schema cannot express (CEL rules, which jsonschema does not run, or
# rules kept only in the operator). A schema-valid spec the operator refuses must match one.
OPERATOR_ONLY = [
    # The API server prunes unknown fields silently; the operator names them.
    r"Extra inputs are not permitted",
    # Beyond int64 the API server keeps a number only as an imprecise float (or refuses it).
    r"integer out of the int64 range|is not a JSON number",
    r"cannot serve maxModelLen=\d+: the cache holds only",  # CEL numBlocks*blockSize rule
    r"apiKeySecretRef is required",  # CEL: a key or allowUnauthenticated, exactly one
    r"set apiKeySecretRef or allowUnauthenticated: true, not both",
    r"engineArgs may not set",  # operator-owned vLLM flags
    r"routing\.args may not set",  # operator-owned router flags
    r"env may not set",  # operator-owned environment variables
    r"is not a valid Secret data key",  # "." and "..": the API server's own check
    r"model\.name must be an absolute path under /models",  # CEL: a volume's model path
    r"may not contain '\.\.'",  # a hostPath with "..": the API server's own check
    # CEL: node selector keys, and the tolerations' cross-field rules (ValidateTolerations).
    r"is not a label key",
    r"operator must be Exists when key is empty",
    r"value must be empty when operator is Exists",
    r"tolerationSeconds needs effect NoExecute",
    # valueFrom is free-form in the CRD; a bad one would fail at the Deployment instead.
    r"env ['\"].*['\"]: (set value or valueFrom, not both|valueFrom)",
]


# Built once: a strategy built per draw would compile the schema's regexes again every case.
SCHEMA_SPECS = from_openapi(CRD_SPEC_SCHEMA)


def pruned(node: Any) -> Any:
    """What the API server validates: a field set to null (in a schema without ``nullable``)
    is dropped first, so ``replicas: null`` means the default, not an error."""
    if isinstance(node, dict):
        return {key: pruned(value) for key, value in node.items() if value is not None}
    if isinstance(node, list):
        return [pruned(item) for item in node]
    return node


def api_server_refuses(spec: Any) -> set[str]:
    """The top-level fields the schema complains about (empty when it accepts the spec)."""
    fields = set()
    for error in API_SERVER.iter_errors(pruned(spec)):
        if error.absolute_path:
            fields.add(str(error.absolute_path[0]))
        elif error.validator == "required":
            fields.add(re.match(r"'(\w+)' is a required property", error.message)[1])  # type: ignore[index]
        else:
            fields.add("")  # the spec as a whole (not an object)
    return fields


def judge(spec: Any) -> tuple[Any, str | None]:
    """Parse ``spec``: (model, None) or (None, the SpecError's message); nothing else."""
    try:
        return parse_spec(spec), None
    except SpecError as error:
        message = str(error)
        assert message.startswith("spec"), message
        return None, message


def check_agreement(spec: Any) -> Any:
    model, problem = judge(spec)
    refused = api_server_refuses(spec)
    if refused:
        assert model is None, f"the API server refuses {spec!r} ({refused}) but the operator not"
        assert problem is not None
        # The operator names at least one field the API server would name, or the place of a
        # value JSON cannot carry (it stops at those, as the API server's decoder would).
        not_json = re.search(OPERATOR_ONLY[1], problem)
        assert not_json or any(field in problem for field in refused), (
            refused,
            problem,
        )
    elif model is None:
        assert problem is not None
        known = [rule for rule in OPERATOR_ONLY if re.search(rule, problem)]
        assert known, (spec, problem)
    if model is not None:
        children = manifests.children("fuzz", "serving", model, [])
        kinds = [child["kind"] for child in children]
        budget = ["PodDisruptionBudget"] if model.replicas > 1 else []
        assert kinds == ["Deployment", "Service", "NetworkPolicy", "ConfigMap", *budget]
    return model


@given(spec=SCHEMA_SPECS)
@fuzz_settings(2_000)
def test_schema_valid_specs_parse_or_break_an_operator_rule(spec: dict[str, Any]) -> None:
    count("spec: from the CRD schema")
    check_agreement(spec)


json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.sampled_from(["LRU", "arc", "Hot", "4", "16Gi", "-1", "--port=1", "VLLM_API_KEY", "."])
)
json_values = st.recursive(
    json_leaf,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=12), children, max_size=3)
    ),
    max_leaves=10,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    paths = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            paths += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            paths += _paths(value, (*prefix, index))
    return paths


@st.composite
def mutated_specs(draw: st.DrawFn) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """A schema-valid spec with one place changed: (spec, the changed path)."""
    spec = copy.deepcopy(draw(SCHEMA_SPECS))
    paths = _paths(spec)
    path = draw(st.sampled_from(paths)) if paths else (draw(st.sampled_from(SPEC_FIELDS)),)
    parent: Any = spec
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    action = draw(st.sampled_from(["replace", "delete", "add key", "wrap"]))
    if action == "delete" and isinstance(parent, dict):
        parent.pop(last, None)
    elif action == "add key" and isinstance(parent, dict):
        parent[draw(st.sampled_from(["extra", "Replicas", "policy_", "apikeysecretref"]))] = draw(
            json_values
        )
    elif action == "wrap" and isinstance(parent, dict | list):
        parent[last] = [parent[last]]
    else:
        value = draw(json_values)
        if isinstance(parent, dict) or (isinstance(parent, list) and isinstance(last, int)):
            parent[last] = value
    return spec, path


@given(case=mutated_specs())
@fuzz_settings(2_000)
def test_mutated_specs_are_refused_by_name(case: tuple[dict[str, Any], tuple[Any, ...]]) -> None:
    count("spec: mutated")
    spec, _ = case
    check_agreement(spec)


@given(
    spec=st.dictionaries(
        st.sampled_from(SPEC_FIELDS) | st.text(max_size=10), json_values, max_size=12
    )
    | json_values
)
@fuzz_settings(2_000)
def test_random_specs_raise_only_spec_errors(spec: Any) -> None:
    count("spec: random values")
    check_agreement(spec)


accepted = SCHEMA_SPECS.map(lambda spec: judge(spec)[0]).filter(lambda m: m is not None)


# Most schema-valid specs break a rule only CEL or the operator holds (the API key choice, a
# volume's model path, a toleration's fields), so accepted ones are a small share of the draws.
ACCEPTED_SETTINGS = fuzz_settings(200)


@given(model=accepted)
@settings(
    ACCEPTED_SETTINGS,
    suppress_health_check=[*ACCEPTED_SETTINGS.suppress_health_check, HealthCheck.filter_too_much],
)
def test_accepted_specs_make_children_kubernetes_accepts(model: Any) -> None:
    count("spec: children through kubernetes-validate")
    # One peer, so the NetworkPolicy's ingress rule is validated too.
    for child in manifests.children("fuzz", "serving", model, [{"podSelector": {}}]):
        kubernetes_validate.validate(json.loads(json.dumps(child)), K8S_VERSION, strict=True)


def test_lax_coercions_are_refused() -> None:
    """Found by fuzzing: pydantic's lax mode took "3" and true for integers and 10**30 as a
    replica count, all of which the API server refuses."""
    base = {
        "model": {"name": "m"},
        "image": "vllm",
        "cache": {"numBlocks": 512},
        "maxModelLen": 4096,
        "allowUnauthenticated": True,
    }
    assert parse_spec(base).replicas == 1
    for field, value in [
        ("replicas", "3"),
        ("replicas", True),
        ("replicas", 10**30),
        ("maxModelLen", 4096.5),
        ("allowUnauthenticated", "true"),
    ]:
        spec = {**base, field: value}
        # (jsonschema knows no int64 limit; the API server's decoder has one)
        assert api_server_refuses(spec) or value == 10**30, (field, value)
        try:
            parse_spec(spec)
        except SpecError as error:
            assert f"spec.{field}" in str(error), error
        else:
            raise AssertionError(f"{field}={value!r} accepted")
