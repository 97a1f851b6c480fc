"""NetworkPolicy peers, as the operator's settings name who may reach the serving pods.

Each model has the shape of its Kubernetes type (camelCase on the wire), so a peer validated
here is written into the NetworkPolicy child unchanged.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from arc_operator.models.base import FrozenModel


class LabelSelectorRequirement(FrozenModel):
    """One matchExpressions entry of a Kubernetes LabelSelector."""

    key: str = Field(min_length=1)
    operator: str = Field(pattern=r"^(In|NotIn|Exists|DoesNotExist)$")
    values: list[str] | None = None


class LabelSelector(FrozenModel):
    """A Kubernetes LabelSelector (empty: everything)."""

    match_labels: dict[str, str] | None = None
    match_expressions: list[LabelSelectorRequirement] | None = None


class IPBlock(FrozenModel):
    """A Kubernetes NetworkPolicy IPBlock."""

    cidr: str = Field(min_length=1)
    except_: list[str] | None = Field(default=None, alias="except")


class NetworkPolicyPeer(FrozenModel):
    """A Kubernetes NetworkPolicyPeer: selectors, or an ipBlock alone (as the API requires)."""

    pod_selector: LabelSelector | None = None
    namespace_selector: LabelSelector | None = None
    ip_block: IPBlock | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> NetworkPolicyPeer:
        selectors = self.pod_selector is not None or self.namespace_selector is not None
        if selectors == (self.ip_block is not None):
            raise ValueError("a peer needs podSelector and/or namespaceSelector, or ipBlock alone")
        return self

    def manifest(self) -> dict[str, Any]:
        """The peer as a NetworkPolicy manifest spells it."""
        return self.model_dump(by_alias=True, exclude_none=True)
