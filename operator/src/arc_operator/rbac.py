"""The operator's RBAC rules: the one list the Helm chart's ClusterRole uses.

Least privilege: the operator lists, watches and patches ServingPolicies (kopf's annotations and
the status subresource), server-side applies its children (Deployment, Service, NetworkPolicy,
ConfigMap, PodDisruptionBudgets, and the router's ServiceAccount, Role and RoleBinding:
``patch``, and ``create``, which the API server also checks when an apply creates the object),
lists/watches them (to recreate one deleted behind its back at once), gets the Deployments
(their rollouts), lists and watches the serving pods (to scrape their /metrics and to follow the
ready set a kv_aware router routes to), and creates events. It deletes only the router children
a routing change leaves over (Deployment, Service, NetworkPolicy, ServiceAccount, Role,
RoleBinding) and the PodDisruptionBudgets a spec with one pod no longer has; everything else
goes with its ServingPolicy through Kubernetes' garbage collector. kopf runs standalone with CRD
scanning off, so it needs no peering objects and no CRD access.

``DELEGATED`` are the grants the operator holds only to hand them on: the API server lets it
create the router's Role (pods get, list, watch) only if it holds every permission in it.

``FOR_ADMISSION`` are the grants no request of the operator uses but an admission check
demands: every child's owner reference (``kopf.adopt``) sets ``blockOwnerDeletion``, which the
``OwnerReferencesPermissionEnforcement`` admission plugin (on in OpenShift, and in
tests/cluster) allows only to a user who may update the owner's ``finalizers`` subresource.
Without it such an API server refuses every child: "cannot set blockOwnerDeletion if an
ownerReference refers to a resource you can't set finalizers on".

``lease_rules`` are the leader election's (``arc_operator.leadership``), granted by a Role in
the operator's own namespace only: ``get`` and ``update`` on its one Lease, by name, and
``create``, which RBAC cannot restrict by name (the name of an object to create is not in the
request's URL). They are kept out of ``RULES``: those are granted in every watched namespace.

``python -m arc_operator.rbac`` prints the rules as YAML; ``python -m arc_operator.rbac
PATH`` writes them (committed at ``charts/arc-serving/files/operator-rbac-rules.yaml``);
``python -m arc_operator.rbac --lease [PATH]`` does the same for the lease rules, with
``LEASE_NAME`` where the chart puts its Lease's name (``files/operator-lease-rules.yaml``).
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from arc_operator import GROUP, PLURAL
from arc_operator.generated import write_or_print

RULES: list[dict[str, Any]] = [
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["list", "watch", "patch"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["patch"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/finalizers"], "verbs": ["update"]},
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": [""],
        "resources": ["services", "serviceaccounts"],
        "verbs": ["list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "verbs": ["list", "watch", "create", "patch"],
    },
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["rbac.authorization.k8s.io"],
        "resources": ["roles", "rolebindings"],
        "verbs": ["list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["policy"],
        "resources": ["poddisruptionbudgets"],
        "verbs": ["list", "watch", "create", "patch", "delete"],
    },
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]
LEASE_GROUP = "coordination.k8s.io"
# The Lease's name in the committed lease rules; the chart replaces it with its own.
LEASE_NAME = "LEASE_NAME"


def lease_rules(name: str) -> list[dict[str, Any]]:
    """The leader election's rules on the Lease ``name``."""
    return [
        {"apiGroups": [LEASE_GROUP], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": [LEASE_GROUP],
            "resources": ["leases"],
            "resourceNames": [name],
            "verbs": ["get", "update"],
        },
    ]


# (group, resource, verb) granted only so that the operator may grant it to the router's Role.
DELEGATED = frozenset({("", "pods", "get")})
# (group, resource, verb) granted only for an admission check on the children's owner references.
FOR_ADMISSION = frozenset({(GROUP, f"{PLURAL}/finalizers", "update")})


def render_rules() -> str:
    """The rules as the YAML list committed in the chart."""
    header = (
        "# Generated by `python -m arc_operator.rbac` from operator/src/arc_operator/rbac.py.\n"
        "# Do not edit by hand: the chart's operator ClusterRole loads this list.\n"
    )
    return header + yaml.safe_dump(RULES, sort_keys=False)


def render_lease_rules() -> str:
    """The lease rules as the YAML list committed in the chart."""
    header = (
        "# Generated by `python -m arc_operator.rbac --lease` from\n"
        "# operator/src/arc_operator/rbac.py. Do not edit by hand: the chart's operator lease\n"
        f"# Role loads this list and puts its Lease's name in place of {LEASE_NAME}.\n"
    )
    return header + yaml.safe_dump(lease_rules(LEASE_NAME), sort_keys=False)


def allows(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    """Whether ``rules`` grant ``verb`` on ``group``/``resource`` (resource may be a/sub)."""
    return any(
        group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
        for rule in rules
    )


def main(argv: list[str] | None = None) -> int:
    """Print the rules (``--lease``: the lease rules), or write them to the one path given."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--lease"]:
        return write_or_print("arc_operator.rbac --lease", render_lease_rules, args[1:])
    return write_or_print("arc_operator.rbac", render_rules, args)


if __name__ == "__main__":
    sys.exit(main())
