"""The serving API key in the chart: its Secret, the references to it, and the schema.

``helm template`` has no cluster, so ``lookup`` finds no Secret and a generated key differs
at every render; the tests compare references and shapes, and use ``apiKey.value`` wherever
they need a known key.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
from chart_helpers import RELEASE, by_kind, ci_values, helm_template, one, render

from arc_loadtest.replay import LOADTEST_API_KEY_ENV
from arc_operator.models import parse_spec

SECRET = f"{RELEASE}-arc-serving-api-key"
KNOWN_KEY = "k3y-under-test_0123456789~+/="


def secrets_of(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return by_kind(objects, "Secret")


def container_env(pod_spec: dict[str, Any], name: str) -> dict[str, Any] | None:
    (container,) = pod_spec["containers"]
    found = [var for var in container.get("env", []) if var["name"] == name]
    return found[0] if found else None


def loadtest_jobs(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [job for job in by_kind(objects, "Job") if "-lt-" in job["metadata"]["name"]]


def test_default_install_creates_a_random_key_secret_the_servingpolicy_references() -> None:
    objects = render()
    secret = one(objects, "Secret")
    assert secret["metadata"]["name"] == SECRET and secret["type"] == "Opaque"
    key = base64.b64decode(secret["data"]["api-key"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", key)
    spec = one(objects, "ServingPolicy")["spec"]
    assert spec["apiKeySecretRef"] == {"name": SECRET, "key": "api-key"}
    assert "allowUnauthenticated" not in spec
    assert parse_spec(spec).api_key_secret_ref is not None
    # No cluster for lookup: every render draws a fresh key (an install keeps the first).
    again = base64.b64decode(one(render(), "Secret")["data"]["api-key"]).decode()
    assert again != key


def test_a_given_value_is_the_key_and_appears_in_no_other_object() -> None:
    sets = {
        "servingPolicy.apiKey.value": KNOWN_KEY,
        "servingPolicy.apiKey.secretKey": "token",
        "loadtest.enabled": "true",
        "loadtest.trace.existingConfigMap": "t",
        "ingress.enabled": "true",
    }
    objects = render(sets=sets)
    secret = one(objects, "Secret")
    assert base64.b64decode(secret["data"]["token"]).decode() == KNOWN_KEY
    encoded = base64.b64encode(KNOWN_KEY.encode()).decode()
    for obj in objects:
        if obj is secret:
            continue
        text = json.dumps(obj)
        where = f"{obj['kind']} {obj['metadata']['name']}"
        assert KNOWN_KEY not in text and encoded not in text, f"the key is in {where}"
    # Every consumer reads the key from the Secret, by reference.
    reference = {"secretKeyRef": {"name": SECRET, "key": "token"}}
    for job in loadtest_jobs(objects):
        env = container_env(job["spec"]["template"]["spec"], LOADTEST_API_KEY_ENV)
        assert env is not None and env["valueFrom"] == reference
    # The helm test pod mounts the key as a file (checkov CKV_K8S_35: no secrets in env).
    (volume,) = one(objects, "Pod")["spec"]["volumes"]
    assert volume["secret"] == {
        "secretName": SECRET,
        "items": [{"key": "token", "path": "api-key"}],
    }


def test_existing_secret_is_referenced_and_no_secret_is_rendered() -> None:
    sets = {
        "servingPolicy.apiKey.create": "false",
        "servingPolicy.apiKey.existingSecret": "team-keys",
        "servingPolicy.apiKey.secretKey": "vllm.key",
        "loadtest.enabled": "true",
        "loadtest.trace.existingConfigMap": "t",
    }
    objects = render(sets=sets)
    assert not secrets_of(objects)
    spec = one(objects, "ServingPolicy")["spec"]
    assert spec["apiKeySecretRef"] == {"name": "team-keys", "key": "vllm.key"}
    for job in loadtest_jobs(objects):
        env = container_env(job["spec"]["template"]["spec"], LOADTEST_API_KEY_ENV)
        assert env["valueFrom"] == {"secretKeyRef": {"name": "team-keys", "key": "vllm.key"}}


def test_loadtest_against_another_service_takes_its_own_key_secret() -> None:
    objects = render(ci_values("namespaced-values.yaml"))
    assert not secrets_of(objects) and not by_kind(objects, "ServingPolicy")
    jobs = loadtest_jobs(objects)
    assert len(jobs) == 2
    for job in jobs:
        env = container_env(job["spec"]["template"]["spec"], LOADTEST_API_KEY_ENV)
        assert env["valueFrom"] == {"secretKeyRef": {"name": "chat-api-key", "key": "token"}}
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        assert not any("api-key" in arg or "api_key" in arg for arg in args)


def test_opting_out_is_explicit_and_leaves_no_key_anywhere() -> None:
    sets = {
        "servingPolicy.apiKey.enabled": "false",
        "loadtest.enabled": "true",
        "loadtest.trace.existingConfigMap": "t",
    }
    objects = render(sets=sets)
    assert not secrets_of(objects)
    spec = one(objects, "ServingPolicy")["spec"]
    assert spec["allowUnauthenticated"] is True and "apiKeySecretRef" not in spec
    assert parse_spec(spec).allow_unauthenticated
    for job in loadtest_jobs(objects):
        assert container_env(job["spec"]["template"]["spec"], LOADTEST_API_KEY_ENV) is None
    script = one(objects, "Pod")["spec"]["containers"][0]["args"][0]
    assert "Authorization" not in script


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        pytest.param({"servingPolicy.apiKey.value": "short"}, "/servingPolicy/apiKey/value",
                     id="value-too-short"),
        pytest.param({"servingPolicy.apiKey.value": "has a space in the key"},
                     "/servingPolicy/apiKey/value", id="value-with-spaces"),
        pytest.param({"servingPolicy.apiKey.value": 'quote"in-the-key-123'},
                     "/servingPolicy/apiKey/value", id="value-with-quote"),
        pytest.param({"servingPolicy.apiKey.existingSecret": "Team_Keys",
                      "servingPolicy.apiKey.create": "false"},
                     "/servingPolicy/apiKey/existingSecret", id="secret-name-not-dns"),
        pytest.param({"servingPolicy.apiKey.secretKey": "a/b"},
                     "/servingPolicy/apiKey/secretKey", id="secret-key-with-slash"),
        pytest.param({"servingPolicy.apiKey.secretKey": ".."},
                     "/servingPolicy/apiKey/secretKey", id="secret-key-dot-dot"),
        pytest.param({"servingPolicy.apiKey.existingSecret": "keys"},
                     "/servingPolicy/apiKey/existingSecret", id="existing-and-create"),
        pytest.param({"servingPolicy.apiKey.create": "false"},
                     "/servingPolicy/apiKey/create", id="no-key-source"),
        pytest.param({"servingPolicy.apiKey.create": "false",
                      "servingPolicy.apiKey.existingSecret": "keys",
                      "servingPolicy.apiKey.value": "0123456789abcdefXYZ"},
                     "/servingPolicy/apiKey/value", id="value-with-existing-secret"),
        pytest.param({"servingPolicy.apiKey.token": "x"}, "/servingPolicy/apiKey",
                     id="unknown-property"),
        pytest.param({"servingPolicy.apiKey.enabled": "maybe"},
                     "/servingPolicy/apiKey/enabled", id="enabled-not-boolean"),
        pytest.param({"loadtest.apiKeySecret.name": "Bad Name"},
                     "/loadtest/apiKeySecret/name", id="loadtest-secret-name"),
        pytest.param({"loadtest.apiKeySecret.key": "a b"},
                     "/loadtest/apiKeySecret/key", id="loadtest-secret-key"),
    ],
)  # fmt: skip
def test_schema_rejects_bad_api_key_values(sets: dict[str, str], message: str) -> None:
    result = helm_template(sets=sets)
    assert result.returncode != 0, f"accepted {sets}"
    assert "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr, result.stderr
    assert not result.stdout.strip(), "nothing is rendered for rejected values"
