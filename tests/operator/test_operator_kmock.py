"""The real kopf operator against kmock's in-memory Kubernetes API.

The test plays the API server's controllers: it creates ServingPolicies over HTTP, marks
pods ready (status.podIP 127.0.0.1, where a real /metrics text is served) and sets the
Deployment's rollout status; the operator does everything else through the API.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from arc_operator import FIELD_MANAGER, GROUP, rbac
from arc_operator.handlers import CHILD_KINDS
from arc_serving_common.names import CONFIG_ENV, POLICY_ENV
from tests.operator.conftest import (
    BUDGETS,
    CONFIGMAPS,
    DEPLOYMENTS,
    MONITORING_PEERS,
    NAMESPACE,
    NETWORKPOLICIES,
    ROLEBINDINGS,
    ROLES,
    SERVICES,
    SERVING_PEERS,
    SP_PATH,
    SP_RESOURCE,
    condition,
    create_pod,
    create_sp,
    creations,
    edit_spec,
    eventually,
    is_apply,
    make_spec,
    metrics_text,
    operator_applies,
    operator_deletes,
    operator_writes,
    status_of,
    stored,
)

pytestmark = pytest.mark.asyncio

VERBS = {
    "list": "list",
    "watch": "watch",
    "fetch": "get",
    "create": "create",
    "update": "patch",
    "delete": "delete",
}
CHILDREN = [
    (DEPLOYMENTS, "demo"),
    (SERVICES, "demo"),
    (NETWORKPOLICIES, "demo"),
    (CONFIGMAPS, "demo-policy"),
]


async def run_pods(cluster, name: str, count: int) -> None:
    """Ready pods for ServingPolicy ``name`` and a Deployment status saying so."""
    for index in range(count):
        await create_pod(cluster, name, f"{name}-pod-{index}", "127.0.0.1")
    response = await cluster.patch(
        f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}",
        json={"status": {"replicas": count, "readyReplicas": count, "updatedReplicas": count}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert response.status == 200, await response.text()


def template_of(cluster, name: str) -> dict[str, Any]:
    return stored(cluster, DEPLOYMENTS, name)["spec"]["template"]


async def test_a_stale_json_patch_gets_422_and_changes_nothing(cluster) -> None:
    """The API server's answer that kopf's optimistic concurrency relies on (see conftest)."""
    await create_sp(cluster, "demo", make_spec(policy="LRU"))
    await edit_spec(cluster, "demo", 2, policy="ARC")
    response = await cluster.patch(
        f"{SP_PATH}/demo",
        json=[
            {"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
            {"op": "replace", "path": "/spec/policy", "value": "DBL"},
        ],
        headers={"Content-Type": "application/json-patch+json"},
    )
    assert response.status == 422, await response.text()
    assert stored(cluster, SP_RESOURCE, "demo")["spec"]["policy"] == "ARC"


async def test_create_makes_owned_children_with_policy_config(cluster, operator) -> None:
    await create_sp(cluster, "demo", make_spec(policy="ARC"))
    deployment = await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo"))
    configmap = await eventually(lambda: stored(cluster, CONFIGMAPS, "demo-policy"))
    service = await eventually(lambda: stored(cluster, SERVICES, "demo"))
    policy = await eventually(lambda: stored(cluster, NETWORKPOLICIES, "demo"))
    for child in (deployment, configmap, service, policy):
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["uid"] == "uid-demo" and owner["kind"] == "ServingPolicy"
        assert owner["controller"] is True
    assert json.loads(configmap["data"]["policy.json"]) == {"policy": "arc"}
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}]
    # The serving pods admit only the configured peers, on port 8000.
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    # Without routing, the API's clients and the metrics scrapers reach port 8000.
    assert policy["spec"]["ingress"] == [
        {"ports": [{"port": 8000, "protocol": "TCP"}], "from": SERVING_PEERS + MONITORING_PEERS}
    ]
    await eventually(lambda: status_of(cluster, "demo").get("observedGeneration") == 1)
    assert condition(cluster, "demo", "Valid")["status"] == "True"
    assert condition(cluster, "demo", "Ready")["reason"] == "RolloutInProgress"


async def test_status_reports_pods_policy_and_hit_rate(cluster, operator, pod_metrics) -> None:
    pod_metrics.text = metrics_text("arc", hits=0, queries=0)
    await create_sp(
        cluster, "demo", make_spec(policy="ARC", replicas=2, routing={"policy": "none"})
    )
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo"))
    await run_pods(cluster, "demo", 2)
    await eventually(lambda: condition(cluster, "demo", "Ready").get("status") == "True")
    status = status_of(cluster, "demo")
    assert status["phase"] == "Ready"
    assert status["activePolicy"] == "ARC"
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)
    assert condition(cluster, "demo", "PolicyApplied")["reason"] == "PolicyActive"

    # 300 of 400 queried tokens hit between readings, steadily (a pass that follows another
    # at once would otherwise see no queries and report no rate): the rate is 0.75.
    pod_metrics.serve_traffic("arc", hits=300, queries=400)
    await eventually(lambda: status_of(cluster, "demo").get("hitRate") == pytest.approx(0.75))


async def test_hot_switch_rewrites_only_the_configmap(cluster, operator, pod_metrics) -> None:
    pod_metrics.text = metrics_text("lru", hits=0, queries=0)
    await create_sp(cluster, "demo", make_spec(policy="LRU", switchMode="Hot"))
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo"))
    await run_pods(cluster, "demo", 1)
    await eventually(lambda: condition(cluster, "demo", "Ready").get("status") == "True")
    template_before = template_of(cluster, "demo")

    await edit_spec(cluster, "demo", 2, policy="ARC")
    await eventually(
        lambda: (
            json.loads(stored(cluster, CONFIGMAPS, "demo-policy")["data"]["policy.json"])
            == {"policy": "arc"}
        )
    )
    # The pods still report LRU until the plugin reads the new file: a switch in progress.
    await eventually(
        lambda: condition(cluster, "demo", "PolicyApplied").get("reason") == "Switching"
    )
    assert condition(cluster, "demo", "Ready")["status"] == "False"
    assert template_of(cluster, "demo") == template_before

    pod_metrics.text = metrics_text("arc", hits=0, queries=0)
    await eventually(lambda: status_of(cluster, "demo").get("activePolicy") == "ARC")
    await eventually(lambda: condition(cluster, "demo", "Ready").get("status") == "True")
    assert template_of(cluster, "demo") == template_before


def engine_env(cluster, name: str) -> dict[str, str | None]:
    (container,) = template_of(cluster, name)["spec"]["containers"]
    return {var["name"]: var.get("value") for var in container["env"]}


async def test_restart_switch_changes_the_pod_template(cluster, operator) -> None:
    await create_sp(cluster, "demo", make_spec(policy="LRU", switchMode="Restart"))
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo"))
    assert engine_env(cluster, "demo")[POLICY_ENV] == "lru"

    await edit_spec(cluster, "demo", 2, policy="ARC")
    await eventually(lambda: engine_env(cluster, "demo")[POLICY_ENV] == "arc")
    strategy = stored(cluster, DEPLOYMENTS, "demo")["spec"]["strategy"]
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0
    # Old pods would not switch live: nothing in the template points at the ConfigMap.
    template = template_of(cluster, "demo")
    assert CONFIG_ENV not in engine_env(cluster, "demo")
    assert all("configMap" not in volume for volume in template["spec"]["volumes"])
    # The ConfigMap (applied after the Deployment) still records the policy.
    await eventually(
        lambda: (
            json.loads(stored(cluster, CONFIGMAPS, "demo-policy")["data"]["policy.json"])
            == {"policy": "arc"}
        )
    )


async def test_rejected_child_reports_apply_rejected_and_keeps_the_policy(
    cluster, operator
) -> None:
    await create_sp(cluster, "demo", make_spec(policy="LRU", switchMode="Hot"))
    await eventually(lambda: condition(cluster, "demo", "Valid").get("status") == "True")
    # The API server refuses the new Deployment (as for a quota or an admission policy).
    message = "admission webhook denied the request: cpu 8 exceeds the namespace limit"
    before = stored(cluster, DEPLOYMENTS, "demo")

    def refuse() -> dict[str, Any]:
        # kmock records every write before reactions run; a real server stores nothing on 422.
        cluster.objects[DEPLOYMENTS, NAMESPACE, "demo"] = before
        return {"kind": "Status", "code": 422, "message": message}

    cluster[DEPLOYMENTS]["patch"] << 422 << refuse

    await edit_spec(cluster, "demo", 2, policy="ARC", resources={"gpus": 1, "cpu": "8"})
    # (The stand-in refuses every Deployment write, so a timer pass still holding generation 1
    # may report ApplyRejected first; the edit's own report is the one for generation 2.)
    valid = await eventually(
        lambda: (
            condition(cluster, "demo", "Valid").get("reason") == "ApplyRejected"
            and status_of(cluster, "demo").get("observedGeneration") == 2
            and condition(cluster, "demo", "Valid")
        )
    )
    assert valid["status"] == "False" and message in valid["message"]
    assert status_of(cluster, "demo")["phase"] == "Invalid"
    assert status_of(cluster, "demo")["observedGeneration"] == 2
    events = await eventually(
        lambda: [
            e
            for e in (dict(obj.raw) for obj in cluster.objects.values() if not obj.deleted)
            if e.get("reason") == "ApplyRejected"
        ]
    )
    assert message in events[0]["message"]
    # The Deployment goes first, so its rejection left the running pods' policy alone.
    configmap = stored(cluster, CONFIGMAPS, "demo-policy")
    assert json.loads(configmap["data"]["policy.json"]) == {"policy": "lru"}


async def test_children_are_written_only_by_server_side_apply_as_the_operator(
    cluster, operator
) -> None:
    await create_sp(cluster, "demo", make_spec())
    await eventually(lambda: condition(cluster, "demo", "Valid").get("status") == "True")
    deployment = stored(cluster, DEPLOYMENTS, "demo")
    applies = len(operator_applies(cluster, DEPLOYMENTS))
    # The timer applies every child at each pass; the same manifest each time, which the API
    # server finds unchanged.
    await eventually(lambda: len(operator_applies(cluster, DEPLOYMENTS)) >= applies + 3)
    for resource, name in CHILDREN:
        sent = operator_applies(cluster, resource)
        assert all(
            request.params == {"fieldManager": FIELD_MANAGER, "force": "true"} for request in sent
        )
        assert all(request.data == sent[0].data for request in sent)
        assert creations(cluster, resource, name) == 1
    assert stored(cluster, DEPLOYMENTS, "demo") == deployment
    # Nothing but the manifest is written: no digest or scanner annotations on live objects.
    assert "annotations" not in deployment["metadata"]
    # Applies are the only writes, and only the Deployment is read back (for its rollout):
    # no child is fetched to be compared here.
    fetched = {
        request.resource
        for request in list(cluster)
        if request.action is not None
        and request.action.value.lower() == "fetch"
        and "kmock" not in request.headers.get("User-Agent", "")
    }
    assert fetched & {resource for resource, _ in CHILDREN} == {DEPLOYMENTS}
    for resource, _ in CHILDREN:
        assert operator_writes(cluster, resource, "POST") == 0


async def test_invalid_spec_sets_valid_false_and_changes_nothing(cluster, operator) -> None:
    await create_sp(cluster, "demo", make_spec(policy="LRU"))
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo"))
    await eventually(lambda: condition(cluster, "demo", "Valid").get("status") == "True")
    deployment_before = stored(cluster, DEPLOYMENTS, "demo")
    configmap_before = stored(cluster, CONFIGMAPS, "demo-policy")

    # Both cache sizes, and an unknown policy.
    await edit_spec(
        cluster,
        "demo",
        2,
        policy="FIFO",
        cache={"blockSize": 16, "numBlocks": 512, "gpuMemoryUtilization": 0.9},
    )
    valid = await eventually(
        lambda: (
            condition(cluster, "demo", "Valid").get("status") == "False"
            and condition(cluster, "demo", "Valid")
        )
    )
    assert valid["reason"] == "InvalidSpec"
    assert "spec.policy" in valid["message"] and "ARC" in valid["message"]
    assert "exactly one of numBlocks or gpuMemoryUtilization" in valid["message"]
    assert status_of(cluster, "demo")["phase"] == "Invalid"
    assert condition(cluster, "demo", "Ready")["reason"] == "InvalidSpec"
    events = await eventually(
        lambda: [
            e
            for e in (dict(obj.raw) for obj in cluster.objects.values() if not obj.deleted)
            if e.get("reason") == "InvalidSpec"
        ]
    )
    assert events[0]["involvedObject"]["name"] == "demo"
    assert events[0]["type"] == "Warning"
    assert stored(cluster, DEPLOYMENTS, "demo") == deployment_before
    assert stored(cluster, CONFIGMAPS, "demo-policy") == configmap_before


GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


async def test_placement_reaches_both_deployments_and_a_bad_one_changes_nothing(
    cluster, operator
) -> None:
    placed = make_spec(
        nodeSelector={"pool": "gpu"},
        tolerations=[GPU_TOLERATION],
        routing={"policy": "round_robin", "nodeSelector": {"pool": "cpu"}},
    )
    await create_sp(cluster, "demo", placed)
    router = await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo-router"))
    await eventually(lambda: condition(cluster, "demo", "Valid").get("status") == "True")
    serving_pod = template_of(cluster, "demo")["spec"]
    assert serving_pod["nodeSelector"] == {"pool": "gpu"}
    assert serving_pod["tolerations"] == [GPU_TOLERATION]
    router_pod = router["spec"]["template"]["spec"]
    assert router_pod["nodeSelector"] == {"pool": "cpu"} and "tolerations" not in router_pod
    serving_before = stored(cluster, DEPLOYMENTS, "demo")

    # A toleration the API server would refuse in a pod: neither Deployment is touched.
    bad = {"key": "nvidia.com/gpu", "operator": "Exists", "value": "present"}
    await edit_spec(cluster, "demo", 2, routing={"tolerations": [bad]}, tolerations=[bad])
    valid = await eventually(
        lambda: (
            condition(cluster, "demo", "Valid").get("status") == "False"
            and condition(cluster, "demo", "Valid")
        )
    )
    assert valid["reason"] == "InvalidSpec"
    for field in ("spec.tolerations[0]", "spec.routing.tolerations[0]"):
        assert f"{field}: value must be empty when operator is Exists" in valid["message"]
    assert stored(cluster, DEPLOYMENTS, "demo") == serving_before
    assert stored(cluster, DEPLOYMENTS, "demo-router") == router


async def test_deleting_the_policy_leaves_cleanup_to_owner_references(cluster, operator) -> None:
    await create_sp(cluster, "demo", make_spec())
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo"))
    runtime = operator.memo["runtime"]
    # One lock per policy, reused by every pass (not a new one per call).
    assert runtime.lock(NAMESPACE, "demo") is runtime.lock(NAMESPACE, "demo")
    assert (NAMESPACE, "demo") in runtime.locks
    response = await cluster.delete(f"{SP_PATH}/demo")
    assert response.status == 200, await response.text()
    await eventually(lambda: stored(cluster, SP_RESOURCE, "demo") is None)
    # The deleted policy's lock is dropped, so locks do not pile up over the operator's life.
    await eventually(lambda: (NAMESPACE, "demo") not in runtime.locks)
    # kmock has no garbage collector; in a cluster it deletes these through their owner.
    for resource, name in [
        (DEPLOYMENTS, "demo"),
        (SERVICES, "demo"),
        (NETWORKPOLICIES, "demo"),
        (CONFIGMAPS, "demo-policy"),
    ]:
        (owner,) = stored(cluster, resource, name)["metadata"]["ownerReferences"]
        assert owner["uid"] == "uid-demo" and owner["blockOwnerDeletion"] is True
    # The operator deletes no serving child (its only deletions are of router children).
    for resource, name in CHILDREN:
        assert name not in operator_deletes(cluster, resource)


async def test_operator_restart_resumes_without_duplicates(cluster, operator) -> None:
    await create_sp(cluster, "demo", make_spec(policy="ARC"))
    await eventually(lambda: condition(cluster, "demo", "Valid").get("status") == "True")
    await operator.stop(graceful=True)
    before = {resource: stored(cluster, resource, name) for resource, name in CHILDREN}
    applied = len(operator_applies(cluster, CONFIGMAPS))  # the last child of a pass

    await operator.start()
    # The resumed operator re-applies every child, and the server finds them unchanged.
    await eventually(lambda: len(operator_applies(cluster, CONFIGMAPS)) > applied)
    for resource, name in CHILDREN:
        assert stored(cluster, resource, name) == before[resource]
    await edit_spec(cluster, "demo", 2, replicas=3, routing={"policy": "none"})
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo")["spec"]["replicas"] == 3)
    await eventually(lambda: status_of(cluster, "demo").get("observedGeneration") == 2)
    # The restarted operator created nothing: every child is the object it was.
    for resource, name in CHILDREN:
        assert creations(cluster, resource, name) == 1
        uid = stored(cluster, resource, name)["metadata"]["uid"]
        assert uid == before[resource]["metadata"]["uid"]
    after = stored(cluster, DEPLOYMENTS, "demo")
    assert after["spec"]["template"] == before[DEPLOYMENTS]["spec"]["template"]


def configured_policy(cluster) -> dict[str, Any]:
    return json.loads(stored(cluster, CONFIGMAPS, "demo-policy")["data"]["policy.json"])


def handled_spec(cluster) -> dict[str, Any]:
    """The spec kopf last finished handling: its diff base, written after the line that says
    a cause is processed."""
    annotations = stored(cluster, SP_RESOURCE, "demo")["metadata"].get("annotations") or {}
    handled = annotations.get(f"{GROUP}/last-handled-configuration")
    return json.loads(handled)["spec"] if handled else {}


def passes_after_creation(caplog) -> list[str]:
    """kopf's "<Cause> is processed: …" lines but the creation's (which kmock can repeat),
    without the object's prefix."""
    lines = [m.split("] ")[-1] for r in caplog.records if "is processed" in (m := r.getMessage())]
    return [line for line in lines if not line.startswith("Creation ")]


async def create_arc_policy(cluster, caplog) -> None:
    """ServingPolicy "demo" at ARC, created and handled, with kopf's INFO lines captured."""
    caplog.set_level(logging.INFO, logger="kopf.objects")
    await create_sp(cluster, "demo", make_spec(policy="ARC"))
    await eventually(lambda: handled_spec(cluster).get("policy") == "ARC")


async def test_a_spec_changed_while_stopped_is_reconciled_once_at_start(
    cluster, operator, caplog
) -> None:
    await create_arc_policy(cluster, caplog)
    await operator.stop(graceful=True)
    await edit_spec(cluster, "demo", 2, policy="LRU")

    await operator.start()
    await eventually(lambda: handled_spec(cluster).get("policy") == "LRU")
    # kopf mixes the resume handler into the first cause of an object it lists at start,
    # here an update: one pass, not the update's and the resume's.
    assert passes_after_creation(caplog) == ["Updating is processed: 1 succeeded; 0 failed."]
    assert configured_policy(cluster) == {"policy": "lru"}


async def test_a_label_edit_runs_no_pass_and_a_spec_edit_runs_one(
    cluster, operator, caplog
) -> None:
    await create_arc_policy(cluster, caplog)
    response = await cluster.patch(
        f"{SP_PATH}/demo",
        json={"metadata": {"labels": {"team": "search"}}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert response.status == 200, await response.text()
    await edit_spec(cluster, "demo", 2, policy="LRU")

    await eventually(lambda: handled_spec(cluster).get("policy") == "LRU")
    assert passes_after_creation(caplog) == ["Updating is processed: 1 succeeded; 0 failed."]
    assert configured_policy(cluster) == {"policy": "lru"}


async def drift_and_repair(cluster) -> None:
    """Edit the children behind the operator's back; its timer puts them back."""
    await eventually(lambda: stored(cluster, CONFIGMAPS, "demo-policy"))  # the last child
    policy_path = f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies/demo"
    for path, change in [
        (f"/api/v1/namespaces/{NAMESPACE}/services/demo", {"spec": {"ports": []}}),
        (policy_path, {"spec": {"ingress": [{}]}}),
        (f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/demo", {"spec": {"replicas": 7}}),
    ]:
        response = await cluster.patch(
            path, json=change, headers={"Content-Type": "application/merge-patch+json"}
        )
        assert response.status == 200, await response.text()
    await eventually(lambda: stored(cluster, SERVICES, "demo")["spec"]["ports"] != [])
    await eventually(
        lambda: stored(cluster, NETWORKPOLICIES, "demo")["spec"]["ingress"][0].get("from")
    )
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo")["spec"]["replicas"] == 1)


async def test_timer_repairs_drifted_children(cluster, operator) -> None:
    await create_sp(cluster, "demo", make_spec())
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo"))
    await drift_and_repair(cluster)


async def test_operator_requests_stay_within_its_rbac_rules(cluster, operator, pod_metrics) -> None:
    pod_metrics.text = metrics_text("arc", hits=1, queries=2)
    await create_sp(cluster, "demo", make_spec(policy="ARC"))
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo"))
    await run_pods(cluster, "demo", 1)
    await drift_and_repair(cluster)
    await edit_spec(cluster, "demo", 2, policy="LRU")
    await eventually(
        lambda: "lru" in stored(cluster, CONFIGMAPS, "demo-policy")["data"]["policy.json"]
    )
    # Routing on, changed and off: the router's children are created, then deleted.
    await edit_spec(cluster, "demo", 3, routing={"policy": "round_robin"})
    await eventually(lambda: stored(cluster, ROLEBINDINGS, "demo-router"))
    await edit_spec(cluster, "demo", 4, routing={"policy": "kv_aware"})
    await eventually(lambda: stored(cluster, ROLES, "demo-router") is None)
    await edit_spec(cluster, "demo", 5, routing={"policy": "none"})
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo-router") is None)
    # Two replicas, then one: the PodDisruptionBudget is created, then deleted.
    await edit_spec(cluster, "demo", 6, replicas=2)
    await eventually(lambda: stored(cluster, BUDGETS, "demo"))
    await edit_spec(cluster, "demo", 7, replicas=1)
    await eventually(lambda: stored(cluster, BUDGETS, "demo") is None)
    await edit_spec(cluster, "demo", 8, replicas=-1)
    await eventually(lambda: condition(cluster, "demo", "Valid").get("status") == "False")
    # The Warning event is posted after the status patch; wait for it, not for the status.
    await eventually(
        lambda: any(
            "involvedObject" in dict(obj.raw) and dict(obj.raw).get("type") == "Warning"
            for obj in cluster.objects.values()
            if not obj.deleted
        )
    )
    used = set()
    for request in list(cluster):
        if (
            request.resource is None
            or request.resource.plural is None
            or "kmock" in request.headers.get("User-Agent", "")
        ):
            continue  # discovery, or the test itself acting as a user or controller
        # The API server authorizes a server-side apply as patch, and as create too when the
        # object does not exist.
        verbs = {"patch", "create"} if is_apply(request) else {VERBS[request.action.value.lower()]}
        plural = request.resource.plural
        resource = f"{plural}/{request.subresource}" if request.subresource else plural
        for verb in verbs:
            assert rbac.allows(rbac.RULES, request.resource.group, resource, verb), (
                f"{verb} {request.resource.group}/{resource} is not granted by arc_operator.rbac"
            )
            used.add((request.resource.group, resource, verb))
    granted = {
        (group, resource, verb)
        for rule in rbac.RULES
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    # Every granted permission is exercised, so the list holds nothing superfluous, but for
    # what the operator holds only to grant it to the router's Role and what an admission check
    # on its owner references demands (tests/cluster/test_rbac.py shows both on a real API).
    assert granted - used == rbac.DELEGATED | rbac.FOR_ADMISSION


async def test_disruption_budgets_follow_the_replicas_and_routing(cluster, operator) -> None:
    """Serving and router PodDisruptionBudgets exist exactly with more than one pod: created,
    updated with disruption.maxUnavailable, deleted when the replicas drop to one or routing
    goes off, and recreated when deleted behind the operator's back."""
    await create_sp(cluster, "demo", make_spec(replicas=1))
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo"))
    await eventually(lambda: status_of(cluster, "demo").get("observedGeneration") == 1)
    assert stored(cluster, BUDGETS, "demo") is None
    routing = {"policy": "round_robin", "replicas": 2}
    await edit_spec(cluster, "demo", 2, replicas=3, routing=routing)
    serving = await eventually(lambda: stored(cluster, BUDGETS, "demo"))
    router = await eventually(lambda: stored(cluster, BUDGETS, "demo-router"))
    assert serving["spec"]["maxUnavailable"] == 1 and router["spec"]["maxUnavailable"] == 1
    (owner,) = serving["metadata"]["ownerReferences"]
    assert owner["uid"] == "uid-demo"
    await edit_spec(cluster, "demo", 3, disruption={"maxUnavailable": 2})
    await eventually(lambda: stored(cluster, BUDGETS, "demo")["spec"]["maxUnavailable"] == 2)
    response = await cluster.delete(
        f"/apis/policy/v1/namespaces/{NAMESPACE}/poddisruptionbudgets/demo"
    )
    assert response.status == 200, await response.text()
    await eventually(lambda: stored(cluster, BUDGETS, "demo"))
    await edit_spec(cluster, "demo", 4, routing={"policy": "none"})
    await eventually(lambda: stored(cluster, BUDGETS, "demo-router") is None)
    await edit_spec(cluster, "demo", 5, replicas=1)
    await eventually(lambda: stored(cluster, BUDGETS, "demo") is None)
    # A pass that runs before the index has seen a deletion may ask again (a 404, harmless).
    assert set(operator_deletes(cluster, BUDGETS)) == {"demo-router", "demo"}


async def test_spec_without_api_key_or_opt_out_is_invalid_and_creates_nothing(
    cluster, operator
) -> None:
    spec = {k: v for k, v in make_spec().items() if k != "apiKeySecretRef"}
    await create_sp(cluster, "open", spec)
    valid = await eventually(
        lambda: (
            condition(cluster, "open", "Valid").get("status") == "False"
            and condition(cluster, "open", "Valid")
        )
    )
    assert valid["reason"] == "InvalidSpec"
    assert "apiKeySecretRef is required" in valid["message"]
    assert "allowUnauthenticated: true" in valid["message"]
    assert stored(cluster, DEPLOYMENTS, "open") is None
    assert stored(cluster, CONFIGMAPS, "open-policy") is None


async def test_pods_take_the_api_key_from_the_secret_and_the_operator_never_reads_it(
    cluster, operator
) -> None:
    await create_sp(cluster, "demo", make_spec(apiKeySecretRef={"name": "keys", "key": "vllm"}))
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo"))
    (container,) = template_of(cluster, "demo")["spec"]["containers"]
    (key_var,) = [var for var in container["env"] if var["name"] == "VLLM_API_KEY"]
    assert key_var == {
        "name": "VLLM_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "keys", "key": "vllm", "optional": False}},
    }
    assert not any(arg.startswith("--api-key") for arg in container["args"])
    # The kubelet resolves secretKeyRef; the operator has no RBAC on Secrets and asks for none.
    assert not any(
        getattr(request.resource, "plural", None) == "secrets" for request in list(cluster)
    )


async def test_child_watches_ask_the_server_for_managed_objects_only(cluster, operator) -> None:
    await create_sp(cluster, "demo", make_spec())
    await eventually(lambda: stored(cluster, CONFIGMAPS, "demo-policy"))
    watched: dict[str, set[str]] = {}
    for request in list(cluster):
        if (
            request.resource is None
            or request.action is None
            or request.action.value.lower() not in {"list", "watch"}
            or "kmock" in request.headers.get("User-Agent", "")
        ):
            continue
        watched.setdefault(request.resource.plural, set()).add(
            request.params.get("labelSelector", "")
        )
    # Every child kind is listed and watched only with the operator's managed-by selector, so
    # the API server never streams other applications' Deployments, Services or ConfigMaps.
    for _, _, plural in CHILD_KINDS:
        assert watched.get(plural) == {"app.kubernetes.io/managed-by=arc-serving-operator"}, (
            plural,
            watched.get(plural),
        )
