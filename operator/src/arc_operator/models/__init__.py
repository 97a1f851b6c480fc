"""The operator's pydantic models, by concern; this package's names are what the rest imports.

- ``spec``: the ServingPolicy spec, its cross-field rules and ``parse_spec``;
- ``peers``: the NetworkPolicy peers the serving and router pods admit;
- ``settings``: the operator's own settings (``OperatorConfig``, from the environment);
- ``base``: the frozen, camelCase base every model shares.

The status model lives with the code that builds it, in ``arc_operator.status``. The models
are frozen and do no I/O: everything they need is in the data they validate, so a test can
build them from plain dicts, and ``arc_operator.crd`` generates the CRD's schema from them.
"""

from __future__ import annotations

from arc_operator.models.settings import OperatorConfig
from arc_operator.models.spec import (
    DEFAULT_FLEET_ROUTING,
    DEFAULT_KV_AWARE_TEMPERATURE,
    MODEL_DIR,
    NO_TELEMETRY_ENV,
    OFFLINE_ENV,
    OWNED_ENV,
    ROUTER_TEMPERATURE,
    WRITABLE_DIR_ENV,
    RoutingPolicy,
    ServingPolicySpec,
    SpecError,
    SwitchMode,
    Toleration,
    parse_spec,
    router_arg,
)

__all__ = [
    "DEFAULT_FLEET_ROUTING",
    "DEFAULT_KV_AWARE_TEMPERATURE",
    "MODEL_DIR",
    "NO_TELEMETRY_ENV",
    "OFFLINE_ENV",
    "OWNED_ENV",
    "ROUTER_TEMPERATURE",
    "WRITABLE_DIR_ENV",
    "OperatorConfig",
    "RoutingPolicy",
    "ServingPolicySpec",
    "SpecError",
    "SwitchMode",
    "Toleration",
    "parse_spec",
    "router_arg",
]
