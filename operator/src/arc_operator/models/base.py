"""The base of every operator model: frozen, closed, camelCase on the wire."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class FrozenModel(BaseModel):
    """Immutable, refuses unknown fields, and reads and writes camelCase aliases (the
    Kubernetes spelling) while accepting the Python field names too."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
    )
