"""``python -m arc_operator.render``: the operator's children for scanners (``make audit``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from arc_operator import render
from arc_operator.models import OperatorConfig
from arc_serving_common.names import CONFIG_ENV, POLICY_ENV
from tests.operator.conftest import ROUTER_IMAGE, SERVING_PEERS, make_servingpolicy, make_spec


def write_rendered(path: Path, *documents: object) -> Path:
    path.write_text(yaml.safe_dump_all(documents))
    return path


def test_every_servingpolicy_is_rendered_in_both_switch_modes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ARC_OPERATOR_SERVING_PEERS", json.dumps(SERVING_PEERS))
    monkeypatch.delenv("ARC_OPERATOR_ROUTER_IMAGE", raising=False)
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "other"}}
    source = write_rendered(
        tmp_path / "chart.yaml", config_map, make_servingpolicy("demo", make_spec())
    )
    assert render.main([str(source), str(tmp_path / "out")]) == 0
    files = sorted(path.name for path in (tmp_path / "out").iterdir())
    assert files == ["serving-demo-hot.yaml", "serving-demo-restart.yaml"]
    for name, env in [("hot", CONFIG_ENV), ("restart", POLICY_ENV)]:
        text = (tmp_path / "out" / f"serving-demo-{name}.yaml").read_text()
        children = list(yaml.safe_load_all(text))
        kinds = [child["kind"] for child in children]
        assert kinds == ["Deployment", "Service", "NetworkPolicy", "ConfigMap"]
        (container,) = children[0]["spec"]["template"]["spec"]["containers"]
        assert env in {var["name"] for var in container["env"]}
        assert children[2]["spec"]["ingress"][0]["from"] == SERVING_PEERS
        # Only the scanned Deployment carries checkov's skips.
        assert "checkov.io/skip1" in children[0]["metadata"]["annotations"]
        assert all("annotations" not in child["metadata"] for child in children[1:])
    # Without a router image no router is rendered, and the command says so.
    assert "ARC_OPERATOR_ROUTER_IMAGE is not set" in capsys.readouterr().err


def test_router_children_are_rendered_for_static_workers_and_for_discovery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ARC_OPERATOR_ROUTER_IMAGE", ROUTER_IMAGE)
    source = write_rendered(tmp_path / "chart.yaml", make_servingpolicy("demo", make_spec()))
    assert render.main([str(source), str(tmp_path / "out")]) == 0
    files = sorted(path.name for path in (tmp_path / "out").iterdir())
    assert files == [
        "serving-demo-hot.yaml",
        "serving-demo-restart.yaml",
        "serving-demo-router-kv_aware.yaml",
        "serving-demo-router-round_robin.yaml",
    ]
    for policy, kinds in [
        ("kv_aware", ["ServiceAccount", "Deployment", "Service", "NetworkPolicy"]),
        (
            "round_robin",
            ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "NetworkPolicy"],
        ),
    ]:
        text = (tmp_path / "out" / f"serving-demo-router-{policy}.yaml").read_text()
        children = list(yaml.safe_load_all(text))
        assert [child["kind"] for child in children] == kinds
        (deployment,) = [child for child in children if child["kind"] == "Deployment"]
        assert deployment["spec"]["replicas"] == 1
        assert "--policy" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        skipped = {s.split("=", 1)[0] for s in deployment["metadata"]["annotations"].values()}
        token = {"CKV_K8S_38"} if policy == "round_robin" else set()
        assert skipped == {"CKV_K8S_15", "CKV_K8S_35", "CKV_K8S_43"} | token


def skipped_checks(image: str) -> dict[str, str]:
    """Check id -> reason, from the skip annotations of the rendered Deployment of ``image``."""
    policy = make_servingpolicy("demo", make_spec(image=image))
    rendered = yaml.safe_load_all(
        render.render([policy], OperatorConfig())["serving-demo-hot.yaml"]
    )
    deployment = next(child for child in rendered if child["kind"] == "Deployment")
    return dict(skip.split("=", 1) for skip in deployment["metadata"]["annotations"].values())


def test_deployment_skips_have_reasons_and_digest_pins_need_no_image_skip() -> None:
    tagged = skipped_checks("ghcr.io/arc-serving/vllm:0.1.0")
    assert set(tagged) == {"CKV_K8S_15", "CKV_K8S_35", "CKV_K8S_43"}
    assert all(len(reason) > 20 for reason in tagged.values())
    pinned = skipped_checks("ghcr.io/arc-serving/vllm@sha256:" + "0" * 64)
    assert set(pinned) == {"CKV_K8S_15", "CKV_K8S_35"}


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "No such file"),
        ("a: [", "while parsing"),
        ("kind: ConfigMap\n", "no ServingPolicy found"),
        (yaml.safe_dump(make_servingpolicy("bad", make_spec(replicas=-1))), "ServingPolicy bad:"),
    ],
)
def test_bad_input_names_the_problem_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, problem: str
) -> None:
    source = tmp_path / "chart.yaml"
    if content is not None:
        source.write_text(content)
    assert render.main([str(source), str(tmp_path / "out")]) == 1
    assert problem in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bad_operator_settings_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ARC_OPERATOR_SERVING_PEERS", "[{}]")
    source = write_rendered(tmp_path / "chart.yaml", make_servingpolicy("demo", make_spec()))
    assert render.main([str(source), str(tmp_path / "out")]) == 1
    assert "ARC_OPERATOR_SERVING_PEERS" in capsys.readouterr().err
    assert render.main([]) == 2
