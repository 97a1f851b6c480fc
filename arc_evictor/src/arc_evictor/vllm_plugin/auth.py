"""The API-key check for every path of vLLM's API server but ``OPEN_PATHS``.

vLLM's ``AuthenticationMiddleware`` guards only ``/v1``, ``/v2``, ``/inference`` and
``/cohere``. ``authenticate_every_path`` replaces its ``__call__`` (``patches.guard_every_path``
installs it; vLLM adds the middleware only when a key is configured) and keeps its token check
(``verify_token``, constant-time), its 401 body, and its pass-through of non-HTTP scopes and
of OPTIONS (a CORS preflight carries no credentials and reaches no handler).

This module imports no vLLM: it reads only the middleware's ``app`` and ``verify_token``.
"""

from __future__ import annotations

from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

# The paths the API server answers without the key when one is configured. /health: the
# kubelet's probes send no credentials; /metrics: Prometheus scrapes without one (the chart's
# NetworkPolicies admit only Prometheus to the port). Nothing else is open: not /ping
# (SageMaker's probe; ours use /health), /version (it tells an attacker which CVEs apply),
# /openapi.json, /docs, /redoc (a map of the API for whoever holds the key), nor /tokenize,
# /invocations, /pooling, ... that vLLM's own middleware leaves open, nor any path a later vLLM
# adds. Exact matches: /metrics/ or /health/x need the key.
OPEN_PATHS = frozenset({"/health", "/metrics"})


def authenticate_every_path(self: Any, scope: Scope, receive: Receive, send: Send) -> Any:
    """``AuthenticationMiddleware.__call__`` guarding every path but ``OPEN_PATHS``."""
    if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
        return self.app(scope, receive, send)
    path = scope["path"].removeprefix(scope.get("root_path", ""))
    if path in OPEN_PATHS or self.verify_token(Headers(scope=scope)):
        return self.app(scope, receive, send)
    return JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)
