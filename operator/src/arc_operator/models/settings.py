"""The operator's settings (``OperatorConfig``): one environment variable per field."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field, ValidationError, field_validator

from arc_operator.models.base import FrozenModel
from arc_operator.models.peers import NetworkPolicyPeer
from arc_operator.models.spec import ServingPolicySpec, SpecError


class OperatorConfig(FrozenModel):
    """The operator's own settings, read once from the environment at start-up.

    ``serving_peers`` (ARC_OPERATOR_SERVING_PEERS, a JSON list of NetworkPolicyPeer objects)
    are the clients allowed to reach a ServingPolicy's API port 8000 through its NetworkPolicy
    children: the serving pods' when its routing policy is none, the router pods' otherwise.
    ``monitoring_peers`` (ARC_OPERATOR_MONITORING_PEERS, the same form: Prometheus and the
    operator itself, which scrapes the pods' /metrics) may also reach the serving pods' port
    8000, where vLLM serves /metrics, whatever the routing, and the router pods' metrics port
    29000. None (the default) lets nothing in (kubelet probes are not subject to
    NetworkPolicy). ``network_policy`` false (ARC_OPERATOR_NETWORK_POLICY) makes no
    NetworkPolicy at all, for clusters whose own policies govern the pods.

    ``router_image`` (ARC_OPERATOR_ROUTER_IMAGE) is the router image of every ServingPolicy
    whose routing.image is unset; empty, such a ServingPolicy with routing is refused.
    """

    env_names: ClassVar[dict[str, str]] = {
        "metrics_port": "ARC_OPERATOR_METRICS_PORT",
        "status_interval": "ARC_OPERATOR_STATUS_INTERVAL",
        "scrape_timeout": "ARC_OPERATOR_SCRAPE_TIMEOUT",
        "network_policy": "ARC_OPERATOR_NETWORK_POLICY",
        "serving_peers": "ARC_OPERATOR_SERVING_PEERS",
        "monitoring_peers": "ARC_OPERATOR_MONITORING_PEERS",
        "router_image": "ARC_OPERATOR_ROUTER_IMAGE",
    }

    metrics_port: int = Field(default=8000, ge=1, le=65535)
    status_interval: float = Field(default=30.0, gt=0)
    scrape_timeout: float = Field(default=5.0, gt=0)
    network_policy: bool = True
    serving_peers: tuple[NetworkPolicyPeer, ...] = ()
    monitoring_peers: tuple[NetworkPolicyPeer, ...] = ()
    router_image: str = ""

    @field_validator("serving_peers", "monitoring_peers", mode="before")
    @classmethod
    def _peers_json(cls, value: Any) -> Any:
        # The environment holds text: a JSON list.
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"not a JSON list of NetworkPolicyPeer objects ({error})"
                ) from None
        return value

    def peers(self) -> list[dict[str, Any]] | None:
        """The API clients' peers as manifests; None when no NetworkPolicy is made."""
        return [peer.manifest() for peer in self.serving_peers] if self.network_policy else None

    def router_image_for(self, spec: ServingPolicySpec) -> str:
        """The router image of ``spec``: routing.image, else ``router_image``; SpecError when
        both are unset."""
        image = spec.routing.image or self.router_image
        if not image:
            raise SpecError(
                "spec.routing.image: not set, and the operator has no default "
                f"({self.env_names['router_image']}); set one of them"
            )
        return image

    def monitoring(self) -> list[dict[str, Any]]:
        """The metrics scrapers' peers as manifests."""
        return [peer.manifest() for peer in self.monitoring_peers]

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> OperatorConfig:
        """Read the settings; raise SpecError naming the variable for a bad value."""
        values = {field: environ[var] for field, var in cls.env_names.items() if environ.get(var)}
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            problems = [
                f"{cls.env_names[str(item['loc'][0])]}={values[str(item['loc'][0])]!r}: "
                + "".join(f"[{step}]" for step in item["loc"][1:])
                + (": " if len(item["loc"]) > 1 else "")
                + item["msg"]
                for item in error.errors()
            ]
            raise SpecError("invalid operator settings: " + "; ".join(problems)) from None
