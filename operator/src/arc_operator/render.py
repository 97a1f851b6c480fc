"""Write the children the operator would build, for scanners (``make audit``).

``python -m arc_operator.render RENDERED.yaml OUTDIR`` reads YAML documents (``helm template``
output), and for every ServingPolicy among them writes ``OUTDIR/NAMESPACE-NAME-MODE.yaml``: the
children ``manifests.children`` builds for its spec, once per switch mode (the spec's own and
the other), since the pod template differs between them. When the operator's settings name a
router image (ARC_OPERATOR_ROUTER_IMAGE) it also writes ``NAMESPACE-NAME-router-POLICY.yaml``:
the router children (``manifests.router_children``, with one ready pod) for ``kv_aware`` and
``round_robin`` (static workers, and service discovery with its Role), whatever the spec's own
routing, so the scan covers both kinds of router; without one it says so on stderr. The
NetworkPolicies' peers come from the operator's settings in the environment
(``OperatorConfig.from_env``), as in the operator.

The rendered Deployments carry checkov's skip annotations (``checkov_skips``,
``router_checkov_skips``): the checks that are wrong for any Deployment built from a
ServingPolicy, each with its reason. They are added here, for the scan only; the operator's
live objects carry no scanner annotations.

Bad input (unreadable file, invalid YAML, an invalid spec, bad settings) prints one line naming
the problem and exits 1 without writing anything.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import yaml

from arc_operator import KIND
from arc_operator import manifests as mf
from arc_operator.models import OperatorConfig, RoutingPolicy, SpecError, SwitchMode, parse_spec
from arc_serving_common.names import API_KEY_ENV

# The routing policies whose router children are scanned: one with static workers, one with
# service discovery (the other discovery policies differ only in --policy).
SCANNED_ROUTING = (RoutingPolicy.KV_AWARE, RoutingPolicy.ROUND_ROBIN)
# The ready serving pod the scanned kv_aware router routes to.
SCANNED_ENDPOINT = mf.Endpoint(pod="scanned-pod", ip="10.0.0.1")


def checkov_skips(image: str) -> dict[str, str]:
    """checkov's skip annotations (``checkov.io/skipN: CHECK=reason``) for a Deployment of
    ``image`` (the spec's): the checks that are wrong for it, each with the reason."""
    skips = [
        f"CKV_K8S_35=vLLM reads its API key only from the environment ({API_KEY_ENV}) or its "
        "command line, which any process lister sees; the kubelet fills it from the Secret",
        "CKV_K8S_15=the image is the ServingPolicy's spec.image; the cluster's default pull "
        "policy applies (Always for :latest, IfNotPresent for a fixed tag or digest)",
    ]
    if "@" not in image:
        skips.append(
            "CKV_K8S_43=the image is the ServingPolicy's spec.image as its author wrote it; "
            "write image@sha256:... there to pin it"
        )
    return {f"checkov.io/skip{index}": skip for index, skip in enumerate(skips, start=1)}


def router_checkov_skips(image: str, policy: RoutingPolicy) -> dict[str, str]:
    """checkov's skip annotations for a router Deployment of ``image`` routing by ``policy``."""
    skips = [
        "CKV_K8S_35=the router reads its API key only from its command line (--api-key); its "
        f"argument is $({API_KEY_ENV}), which the kubelet expands from the Secret at start",
        "CKV_K8S_15=the image is routing.image or the operator's router image; the cluster's "
        "default pull policy applies (Always for :latest, IfNotPresent for a tag or digest)",
    ]
    if "@" not in image:
        skips.append(
            "CKV_K8S_43=the image is routing.image or ARC_OPERATOR_ROUTER_IMAGE as written; "
            "write image@sha256:... there to pin it"
        )
    if policy is not RoutingPolicy.KV_AWARE:
        skips.append(
            "CKV_K8S_38=service discovery watches the serving pods through the API, with the "
            "token of its ServiceAccount, whose Role reads pods in this namespace only"
        )
    return {f"checkov.io/skip{index}": skip for index, skip in enumerate(skips, start=1)}


def annotated(child: dict[str, Any], skips: dict[str, str]) -> dict[str, Any]:
    """``child`` as the scanner reads it: a Deployment with ``skips``, anything else as is."""
    if child["kind"] != "Deployment":
        return child
    metadata = {**child["metadata"], "annotations": skips}
    return {**child, "metadata": metadata}


def render(documents: list[Any], config: OperatorConfig) -> dict[str, str]:
    """File name -> YAML of the children, for every ServingPolicy in ``documents``."""
    files: dict[str, str] = {}
    peers, monitoring = config.peers(), config.monitoring()
    for document in documents:
        if not isinstance(document, dict) or document.get("kind") != KIND:
            continue
        meta = document.get("metadata") or {}
        name, namespace = meta.get("name"), meta.get("namespace") or "default"
        try:
            spec = parse_spec(document.get("spec"))
        except SpecError as error:
            raise SpecError(f"ServingPolicy {name}: {error}") from None
        for mode in SwitchMode:
            variant = spec.model_copy(update={"switch_mode": mode})
            children = [
                annotated(child, checkov_skips(spec.image))
                for child in mf.children(name, namespace, variant, peers, monitoring)
            ]
            files[f"{namespace}-{name}-{mode.value.lower()}.yaml"] = yaml.safe_dump_all(
                children, sort_keys=False
            )
        image = spec.routing.image or config.router_image
        for policy in SCANNED_ROUTING if image else ():
            routing = spec.routing.model_copy(update={"policy": policy})
            variant = spec.model_copy(update={"routing": routing})
            children = [
                annotated(child, router_checkov_skips(image, policy))
                for child in mf.router_children(
                    name,
                    namespace,
                    variant,
                    (SCANNED_ENDPOINT,),
                    image=image,
                    peers=peers,
                    monitoring=monitoring,
                )
            ]
            files[f"{namespace}-{name}-router-{policy.value}.yaml"] = yaml.safe_dump_all(
                children, sort_keys=False
            )
    return files


def main(argv: list[str] | None = None) -> int:
    """Render the children of the ServingPolicies in one file into one directory."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m arc_operator.render RENDERED.yaml OUTDIR", file=sys.stderr)
        return 2
    source, out = Path(args[0]), Path(args[1])
    try:
        documents = list(yaml.safe_load_all(source.read_text(encoding="utf-8")))
        config = OperatorConfig.from_env(os.environ)
        files = render(documents, config)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, SpecError) as error:
        print(f"arc_operator.render: {source}: {error}", file=sys.stderr)
        return 1
    if not files:
        print(f"arc_operator.render: {source}: no ServingPolicy found", file=sys.stderr)
        return 1
    if not config.router_image:
        print(
            "arc_operator.render: ARC_OPERATOR_ROUTER_IMAGE is not set: router children of "
            "ServingPolicies without routing.image are not rendered",
            file=sys.stderr,
        )
    out.mkdir(parents=True, exist_ok=True)
    for file_name, text in files.items():
        (out / file_name).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
