"""The operator's settings (``OperatorConfig``): one environment variable per field."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field, ValidationError, field_validator

from arc_operator.models.base import FrozenModel
from arc_operator.models.peers import NetworkPolicyPeer
from arc_operator.models.spec import SpecError


class OperatorConfig(FrozenModel):
    """The operator's own settings, read once from the environment at start-up.

    ``serving_peers`` (ARC_OPERATOR_SERVING_PEERS, a JSON list of NetworkPolicyPeer objects)
    are the only clients allowed to reach the serving pods' port 8000 through each
    ServingPolicy's NetworkPolicy child; none (the default) lets nothing in (kubelet probes are
    not subject to NetworkPolicy). ``network_policy`` false (ARC_OPERATOR_NETWORK_POLICY) makes
    no NetworkPolicy at all, for clusters whose own policies govern the serving pods.
    """

    env_names: ClassVar[dict[str, str]] = {
        "metrics_port": "ARC_OPERATOR_METRICS_PORT",
        "status_interval": "ARC_OPERATOR_STATUS_INTERVAL",
        "scrape_timeout": "ARC_OPERATOR_SCRAPE_TIMEOUT",
        "network_policy": "ARC_OPERATOR_NETWORK_POLICY",
        "serving_peers": "ARC_OPERATOR_SERVING_PEERS",
    }

    metrics_port: int = Field(default=8000, ge=1, le=65535)
    status_interval: float = Field(default=30.0, gt=0)
    scrape_timeout: float = Field(default=5.0, gt=0)
    network_policy: bool = True
    serving_peers: tuple[NetworkPolicyPeer, ...] = ()

    @field_validator("serving_peers", mode="before")
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
        """The serving pods' allowed peers as manifests; None when no NetworkPolicy is made."""
        return [peer.manifest() for peer in self.serving_peers] if self.network_policy else None

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
