"""NetworkPolicies and pod hardening in the rendered chart.

Selectors are checked against the labels the operator really puts on serving pods
(``arc_operator.manifests``) and the labels the chart really renders on its own pods, with a
LabelSelector matcher, so a renamed label on either side fails here. The serving pods' policy
is the one the operator builds (``manifests.children``) from the settings the rendered operator
Deployment passes it (``OperatorConfig.from_env`` of its env), for the chart's ServingPolicy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from chart_helpers import CI_VALUES, NAMESPACE, by_kind, ci_values, helm_template, render

from arc_operator import manifests
from arc_operator.models import OperatorConfig, parse_spec

K8S_VERSION = "1.35.0"
# Pods that call the Kubernetes API and so get a ServiceAccount token (by component label).
API_CLIENTS = {"operator", "cleanup"}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes LabelSelector semantics (matchLabels and matchExpressions, ANDed)."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def namespace_labels(name: str) -> dict[str, str]:
    """The label the API server puts on every namespace."""
    return {"kubernetes.io/metadata.name": name}


def peer_admits(peer: dict[str, Any], namespace: str, pod_labels: dict[str, str], own: str) -> bool:
    """Whether a NetworkPolicyPeer of a policy in namespace ``own`` admits a pod."""
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], namespace_labels(namespace)):
            return False
    elif namespace != own:
        return False
    return selects(peer.get("podSelector", {}), pod_labels)


# A ServingPolicy a user creates outside the chart, named "chat".
USER_SPEC = {
    "model": {"name": "m"},
    "image": "i:1",
    "policy": "ARC",
    "cache": {"numBlocks": 512},
    "maxModelLen": 4096,
    "allowUnauthenticated": True,
}


def serving_pod_labels() -> dict[str, str]:
    """Labels of a serving pod exactly as the operator builds it."""
    return manifests.pod_template("chat", parse_spec(USER_SPEC))["metadata"]["labels"]


def pods(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(component, pod metadata, pod spec) of every pod the chart renders."""
    found = []
    for obj in objects:
        if obj["kind"] == "Pod":
            meta, spec = obj["metadata"], obj["spec"]
        elif obj["kind"] in {"Deployment", "Job"}:
            meta, spec = obj["spec"]["template"]["metadata"], obj["spec"]["template"]["spec"]
        else:
            continue
        found.append((meta["labels"]["app.kubernetes.io/component"], meta, spec))
    return found


def operator_config(objects: list[dict[str, Any]]) -> OperatorConfig:
    """The operator's settings as the rendered operator Deployment's env gives them."""
    (deployment,) = [
        obj
        for obj in by_kind(objects, "Deployment")
        if obj["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    # The downward API's POD_NAME and POD_NAMESPACE (valueFrom) are the Lease's, not settings.
    return OperatorConfig.from_env(
        {var["name"]: var["value"] for var in container["env"] if "value" in var}
    )


def serving_children(objects: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """The children the operator builds for the chart's ServingPolicy (else the user's "chat")
    placed in ``namespace``."""
    servingpolicies = by_kind(objects, "ServingPolicy")
    name, spec = "chat", parse_spec(USER_SPEC)
    if servingpolicies:
        (servingpolicy,) = servingpolicies
        name, spec = servingpolicy["metadata"]["name"], parse_spec(servingpolicy["spec"])
    config = operator_config(objects)
    return manifests.children(name, namespace, spec, config.peers(), config.monitoring())


def router_children(objects: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """The router children the operator builds for the chart's ServingPolicy in ``namespace``
    with two ready serving pods."""
    (servingpolicy,) = by_kind(objects, "ServingPolicy")
    name, spec = servingpolicy["metadata"]["name"], parse_spec(servingpolicy["spec"])
    config = operator_config(objects)
    ready = [manifests.Endpoint(f"{name}-{i}", f"10.0.0.{i + 1}") for i in range(2)]
    return manifests.router_children(
        name, namespace, spec, ready, image=config.router_image_for(spec), peers=config.peers(),
        monitoring=config.monitoring(),
    )  # fmt: skip


def engine_policy(objects: list[dict[str, Any]], namespace: str = NAMESPACE) -> dict:
    """The serving pods' NetworkPolicy, as the operator builds it in ``namespace``."""
    (found,) = by_kind(serving_children(objects, namespace), "NetworkPolicy")
    kubernetes_validate.validate(found, K8S_VERSION, strict=True)
    return found


def engine_pod_labels(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The labels of the chart's ServingPolicy's pods, as the operator builds them."""
    (deployment,) = by_kind(serving_children(objects, NAMESPACE), "Deployment")
    return deployment["spec"]["template"]["metadata"]["labels"]


def policy(objects: list[dict[str, Any]], component: str, namespace: str = NAMESPACE) -> dict:
    (found,) = [
        np
        for np in by_kind(objects, "NetworkPolicy")
        if np["metadata"]["labels"]["app.kubernetes.io/component"] == component
        and np["metadata"]["namespace"] == namespace
    ]
    return found


def admitted(np: dict[str, Any], namespace: str, labels: dict[str, str], port: int) -> bool:
    """Whether the policy's ingress rules admit a pod's connection on a port."""
    for rule in np["spec"].get("ingress", []):
        ports = {p["port"] for p in rule.get("ports", [])}
        if port in ports and any(
            peer_admits(peer, namespace, labels, np["metadata"]["namespace"])
            for peer in rule["from"]
        ):
            return True
    return False


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda path: Path(path).stem)
def test_network_policies_render_by_default_and_validate(values: Path) -> None:
    policies = by_kind(render(values), "NetworkPolicy")
    assert policies
    for np in policies:
        kubernetes_validate.validate(np, K8S_VERSION, strict=True)


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda path: Path(path).stem)
def test_every_rendered_pod_is_selected_by_a_network_policy(values: Path) -> None:
    objects = render(values)
    policies = by_kind(objects, "NetworkPolicy")
    for component, meta, _ in pods(objects):
        assert any(
            np["metadata"]["namespace"] == NAMESPACE
            and selects(np["spec"]["podSelector"], meta["labels"])
            for np in policies
        ), f"no NetworkPolicy selects the {component} pods"


def test_serving_policy_selects_the_operators_pods_on_their_port_only() -> None:
    objects = render()
    np = engine_policy(objects)
    assert selects(np["spec"]["podSelector"], engine_pod_labels(objects))
    # Another ServingPolicy's pods have their own policy.
    assert not selects(np["spec"]["podSelector"], serving_pod_labels())
    assert not selects(np["spec"]["podSelector"], {"app.kubernetes.io/name": "other"})
    assert np["spec"]["policyTypes"] == ["Ingress"]
    assert {p["port"] for rule in np["spec"]["ingress"] for p in rule["ports"]} == {manifests.PORT}


def test_serving_pods_admit_ingress_prometheus_operator_and_chart_clients_only() -> None:
    objects = render(ci_values("ingress-loadtest-values.yaml"))
    np = engine_policy(objects)
    chart_pods = {component: meta["labels"] for component, meta, _ in pods(objects)}
    for component in ("operator", "loadtest-master", "loadtest-worker", "test"):
        assert admitted(np, NAMESPACE, chart_pods[component], manifests.PORT), component
    assert not admitted(np, NAMESPACE, chart_pods["operator"], 8080)
    assert not admitted(np, NAMESPACE, chart_pods["cleanup"], manifests.PORT)
    nginx = {"app.kubernetes.io/name": "ingress-nginx", "app.kubernetes.io/component": "c"}
    assert admitted(np, "ingress-nginx", nginx, manifests.PORT)
    assert not admitted(np, "default", nginx, manifests.PORT), "only in its own namespace"
    assert admitted(np, "monitoring", {"app.kubernetes.io/name": "prometheus"}, manifests.PORT)
    # The chart's own pods are admitted from the release namespace only.
    assert not admitted(np, "elsewhere", chart_pods["operator"], manifests.PORT)
    assert not admitted(np, NAMESPACE, serving_pod_labels(), manifests.PORT)
    # A ServingPolicy in any other namespace gets the same peers (the operator builds its policy).
    assert engine_policy(objects, "team-x")["spec"]["ingress"] == np["spec"]["ingress"]
    assert engine_policy(objects, "team-x")["metadata"]["namespace"] == "team-x"


NGINX = {"app.kubernetes.io/name": "ingress-nginx", "app.kubernetes.io/component": "c"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}


def test_ingress_reaches_the_router_and_only_the_router_reaches_the_engines() -> None:
    objects = render(ci_values("routing-values.yaml"))
    chart_pods = {component: meta["labels"] for component, meta, _ in pods(objects)}
    engines = engine_policy(objects)
    (router,) = by_kind(router_children(objects, NAMESPACE), "NetworkPolicy")
    kubernetes_validate.validate(router, K8S_VERSION, strict=True)
    (router_deployment,) = by_kind(router_children(objects, NAMESPACE), "Deployment")
    router_pod = router_deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(router["spec"]["podSelector"], router_pod)
    assert not selects(router["spec"]["podSelector"], engine_pod_labels(objects))
    # ingress controller -> router -> serving pods
    assert admitted(router, "ingress-nginx", NGINX, manifests.PORT)
    assert admitted(engines, NAMESPACE, router_pod, manifests.PORT)
    assert not admitted(engines, "ingress-nginx", NGINX, manifests.PORT), "only via the router"
    # The chart's clients go through the router too.
    for component in ("loadtest-master", "loadtest-worker", "test"):
        assert admitted(router, NAMESPACE, chart_pods[component], manifests.PORT), component
        assert not admitted(engines, NAMESPACE, chart_pods[component], manifests.PORT), component
    # Only the router subscribes to the KV events.
    for port in (manifests.KV_EVENTS_PORT, manifests.KV_REPLAY_PORT):
        assert admitted(engines, NAMESPACE, router_pod, port)
        assert not admitted(engines, "ingress-nginx", NGINX, port)
        assert not admitted(engines, NAMESPACE, chart_pods["operator"], port)
    # Metrics: Prometheus scrapes both, the operator the serving pods; nothing else reaches 29000.
    assert admitted(engines, "monitoring", PROMETHEUS, manifests.PORT)
    assert admitted(engines, NAMESPACE, chart_pods["operator"], manifests.PORT)
    assert admitted(router, "monitoring", PROMETHEUS, manifests.ROUTER_METRICS_PORT)
    assert not admitted(router, "ingress-nginx", NGINX, manifests.ROUTER_METRICS_PORT)
    assert not admitted(router, "monitoring", PROMETHEUS, manifests.PORT)
    # The chart's own egress rules let its clients reach the router pods' port 8000.
    egress = policy(objects, "test")["spec"]["egress"]
    assert any(
        peer_admits(peer, NAMESPACE, router_pod, NAMESPACE)
        and {"port": manifests.PORT, "protocol": "TCP"} in rule["ports"]
        for rule in egress
        for peer in rule["to"]
    )


def gateway_pod(name: str) -> dict[str, str]:
    """A Gateway's proxy pod as GEP-1762's implementations label it."""
    return {"gateway.networking.k8s.io/gateway-name": name, "app": "proxy"}


def test_the_httproutes_gateways_reach_the_router() -> None:
    objects = render(ci_values("httproute-values.yaml"))
    (router,) = by_kind(router_children(objects, NAMESPACE), "NetworkPolicy")
    kubernetes_validate.validate(router, K8S_VERSION, strict=True)
    assert admitted(router, "gateway-system", gateway_pod("public"), manifests.PORT)
    assert not admitted(router, "gateway-system", gateway_pod("private"), manifests.PORT)
    assert not admitted(router, NAMESPACE, gateway_pod("public"), manifests.PORT)
    # Two listeners of one Gateway: one peer.
    assert (
        len(operator_config(objects).peers())
        == len(operator_config(render(sets={"servingPolicy.replicas": "2"})).peers()) + 1
    )
    assert not admitted(engine_policy(objects), "gateway-system", gateway_pod("public"), 8000)


def test_a_gateway_in_the_release_namespace_reaches_the_serving_pods() -> None:
    sets = {
        "httpRoute.enabled": "true",
        "httpRoute.parentRefs[0].name": "edge",
        # A Gateway name longer than a label value: no pod carries it, so no peer for it.
        "httpRoute.parentRefs[1].name": "g" * 64,
    }
    objects = render(sets=sets)
    engines = engine_policy(objects)
    assert admitted(engines, NAMESPACE, gateway_pod("edge"), manifests.PORT)
    assert not admitted(engines, "gateway-system", gateway_pod("edge"), manifests.PORT)
    peers = operator_config(objects).peers()
    assert peers is not None
    assert not any("g" * 64 in str(peer) for peer in peers)


def test_without_the_httproute_no_gateway_is_admitted() -> None:
    sets = {"httpRoute.parentRefs[0].name": "edge"}
    engines = engine_policy(render(sets=sets))
    assert not admitted(engines, NAMESPACE, gateway_pod("edge"), manifests.PORT)


def test_without_a_router_the_api_clients_reach_the_serving_pods() -> None:
    objects = render(sets={"servingPolicy.replicas": "3", "servingPolicy.routing.policy": "none"})
    engines = engine_policy(objects)
    assert admitted(engines, "ingress-nginx", NGINX, manifests.PORT)
    assert admitted(engines, "monitoring", PROMETHEUS, manifests.PORT)
    assert router_children(objects, NAMESPACE) == []


def test_the_chart_renders_no_serving_pod_policy_of_its_own() -> None:
    for values in CI_VALUES:
        components = {
            np["metadata"]["labels"]["app.kubernetes.io/component"]
            for np in by_kind(render(values), "NetworkPolicy")
        }
        assert "engine" not in components, values


def test_selectors_come_from_values() -> None:
    sets = {
        "networkPolicy.ingressController.namespaceSelector.matchLabels.team": "edge",
        "networkPolicy.ingressController.podSelector.matchLabels.app": "traefik",
        "networkPolicy.extraServingFrom[0].podSelector.matchLabels.app": "chat-ui",
    }
    np = engine_policy(render(sets=sets))
    traefik = {"app": "traefik", "app.kubernetes.io/name": "ingress-nginx"}
    edge = {"kubernetes.io/metadata.name": "ingress-nginx", "team": "edge"}
    assert any(
        selects(peer.get("namespaceSelector", {}), edge)
        and selects(peer.get("podSelector", {}), traefik)
        for rule in np["spec"]["ingress"]
        for peer in rule["from"]
    )
    assert admitted(np, NAMESPACE, {"app": "chat-ui"}, manifests.PORT)


def test_operator_accepts_nothing_and_reaches_dns_api_server_and_serving_pods_only() -> None:
    np = policy(render(), "operator")
    assert np["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "ingress" not in np["spec"], "no peer may connect to the operator"
    egress = np["spec"]["egress"]
    ports = {(p["port"], p["protocol"]) for rule in egress for p in rule["ports"]}
    assert ports == {(53, "UDP"), (53, "TCP"), (443, "TCP"), (6443, "TCP"), (8000, "TCP")}
    (serving_rule,) = [
        rule for rule in egress if rule["ports"] == [{"port": 8000, "protocol": "TCP"}]
    ]
    (peer,) = serving_rule["to"]
    # All namespaces are watched: serving pods anywhere, and nothing else, on port 8000.
    assert peer_admits(peer, "team-x", serving_pod_labels(), NAMESPACE)
    assert not peer_admits(peer, "team-x", {"app": "db"}, NAMESPACE)


def test_confined_operator_and_serving_policies_follow_watched_namespaces() -> None:
    objects = render(ci_values("namespaced-values.yaml"))
    for namespace in ("team-a", "team-b"):
        np = engine_policy(objects, namespace)
        assert np["metadata"]["namespace"] == namespace
        assert admitted(np, namespace, {"app.kubernetes.io/name": "prometheus"}, 8000) is False
        assert admitted(np, "monitoring", {"app.kubernetes.io/name": "prometheus"}, 8000)
        # The operator's own pods (release namespace) still reach the watched namespaces.
        operator_pod = {c: m["labels"] for c, m, _ in pods(objects)}["operator"]
        assert admitted(np, NAMESPACE, operator_pod, manifests.PORT)
    egress = policy(objects, "operator")["spec"]["egress"]
    (serving_rule,) = [rule for rule in egress if rule["ports"][0]["port"] == manifests.PORT]
    (peer,) = serving_rule["to"]
    assert peer_admits(peer, "team-b", serving_pod_labels(), NAMESPACE)
    assert not peer_admits(peer, "team-c", serving_pod_labels(), NAMESPACE)


def test_api_server_addresses_and_ports_come_from_values() -> None:
    sets = {
        "networkPolicy.apiServer.cidrs[0]": "10.0.0.1/32",
        "networkPolicy.apiServer.ports[0]": "6443",
    }
    for component in ("operator", "cleanup"):
        egress = policy(render(sets=sets), component)["spec"]["egress"]
        assert {"ipBlock": {"cidr": "10.0.0.1/32"}} in [
            peer for rule in egress for peer in rule["to"]
        ]


def test_network_policies_can_be_switched_off() -> None:
    objects = render(sets={"networkPolicy.enabled": "false"})
    assert not by_kind(objects, "NetworkPolicy")
    # The operator is told too: it gives the serving pods none.
    assert operator_config(objects).peers() is None
    assert not by_kind(serving_children(objects, NAMESPACE), "NetworkPolicy")


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda path: Path(path).stem)
def test_every_container_is_bounded_and_only_api_clients_get_a_token(values: Path) -> None:
    for component, _, spec in pods(render(values)):
        assert spec["automountServiceAccountToken"] is (component in API_CLIENTS), component
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in spec["containers"]:
            resources = container["resources"]
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[bound]), (component, bound)


def test_ingress_routes_only_the_authenticated_api() -> None:
    (ingress,) = by_kind(render(ci_values("ingress-loadtest-values.yaml")), "Ingress")
    paths = [path["path"] for rule in ingress["spec"]["rules"] for path in rule["http"]["paths"]]
    assert paths == ["/v1"]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        pytest.param(
            {"networkPolicy.apiServer.cidrs[0]": "10.0.0.1"},
            "/networkPolicy/apiServer/cidrs/0",
            id="cidr-without-prefix",
        ),
        pytest.param(
            {"networkPolicy.apiServer.ports[0]": "0"},
            "/networkPolicy/apiServer/ports/0",
            id="port-zero",
        ),
        pytest.param(
            {"networkPolicy.dns.ports[0]": "70000"}, "/networkPolicy/dns/ports/0", id="port-too-big"
        ),
        pytest.param(
            {"networkPolicy.ingressController.podSelector.matchPods": "x"},
            "/networkPolicy/ingressController/podSelector",
            id="selector-typo",
        ),
        pytest.param(
            {
                "networkPolicy.extraServingFrom[0].ipBlock.cidr": "10.0.0.0/8",
                "networkPolicy.extraServingFrom[0].podSelector.matchLabels.a": "b",
            },
            "/networkPolicy/extraServingFrom/0",
            id="ipblock-with-pod-selector",
        ),
        pytest.param(
            {"networkPolicy.enable": "true"}, "additional properties 'enable'", id="unknown-key"
        ),
        pytest.param(
            {"operator.podSecurityContext.runAsNonRoot": "false"},
            "/operator/podSecurityContext/runAsNonRoot",
            id="root-operator",
        ),
        pytest.param(
            {"loadtest.containerSecurityContext.allowPrivilegeEscalation": "true"},
            "/loadtest/containerSecurityContext/allowPrivilegeEscalation",
            id="escalation",
        ),
        pytest.param(
            {"operator.containerSecurityContext.readOnlyRootFilesystem": "false"},
            "/operator/containerSecurityContext/readOnlyRootFilesystem",
            id="writable-root",
        ),
        pytest.param(
            {"cleanup.resources.limits.cpu": "null"}, "/cleanup/resources/limits", id="no-cpu-limit"
        ),
        pytest.param(
            {"tests.resources.requests.memory": "lots"},
            "/tests/resources/requests/memory",
            id="bad-quantity",
        ),
    ],
)
def test_schema_rejects_bad_hardening_values(sets: dict[str, str], message: str) -> None:
    result = helm_template(sets=sets)
    assert result.returncode != 0, f"{sets} was accepted"
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda path: Path(path).stem)
def test_checkov_skip_annotations_render_without_blank_lines(values: Path) -> None:
    result = helm_template(values)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    skip_blocks = [
        index for index, line in enumerate(lines) if line.strip().startswith("checkov.io/skip1:")
    ]
    assert skip_blocks
    for index in skip_blocks:
        # The first skip follows its annotations: key (or a sibling annotation) directly.
        assert lines[index - 1].strip(), f"blank line before: {lines[index]}"
