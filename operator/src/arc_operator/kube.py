"""A small async Kubernetes API client for the few calls the operator makes.

It uses kopf's own credentials (``kopf.login_with_service_account``, then
``kopf.login_with_kubeconfig``), so the operator and its kopf core talk to the same server
with the same identity, and adds no client library. Children are written only with server-side
apply (field manager ``arc-serving-operator``, with ``force``): an apply creates a missing
object, re-applying the same manifest is a no-op, and fields dropped from a manifest are
removed. The only deletions are of router children that a routing change left over.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import kopf

from arc_operator import FIELD_MANAGER

# Plural names of the kinds the operator writes or reads.
PLURALS = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "Deployment": "deployments",
    "NetworkPolicy": "networkpolicies",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "PodDisruptionBudget": "poddisruptionbudgets",
}


class ApiError(Exception):
    """A Kubernetes API call failed; ``status`` is the HTTP status (0: no response)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Kubernetes API error {status}: {message}")
        self.status = status


def object_path(api_version: str, plural: str, namespace: str, name: str | None = None) -> str:
    """The URL path of a namespaced collection, or of one object in it."""
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


def manifest_path(manifest: Mapping[str, Any]) -> str:
    """The URL path of a manifest's object."""
    meta = manifest["metadata"]
    return object_path(
        manifest["apiVersion"], PLURALS[manifest["kind"]], meta["namespace"], meta["name"]
    )


def login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """Credentials as kopf finds them: in-cluster service account first, then kubeconfig."""
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
        settings=settings
    )
    if info is None:
        raise kopf.LoginError(
            "no Kubernetes credentials: not in a pod with a service account, and neither "
            "KUBECONFIG nor ~/.kube/config is set"
        )
    return info


class KubeApi:
    """An aiohttp session bound to one API server; re-reads credentials once on a 401.

    Invariant: ``self._session`` carries the current credentials' headers and TLS context.
    """

    def __init__(self, relogin: Callable[[], kopf.ConnectionInfo]) -> None:
        self._relogin = relogin
        self._session = self._open(relogin())

    @staticmethod
    def _open(info: kopf.ConnectionInfo) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            base_url=info.server,
            headers={**info.as_http_headers(), "User-Agent": FIELD_MANAGER},
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
            timeout=aiohttp.ClientTimeout(total=30),
        )

    async def close(self) -> None:
        """Close the session (idempotent)."""
        await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        retry_auth: bool = True,
    ) -> dict[str, Any] | None:
        """One API call; returns the JSON body, or None for 404. Raises ApiError."""
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        try:
            async with self._session.request(
                method, path, data=data, params=params, headers=headers
            ) as response:
                if response.status == 404:
                    return None
                if response.status == 401 and retry_auth:
                    # Projected service-account tokens rotate: read them again, once.
                    await self._session.close()
                    self._session = self._open(self._relogin())
                    return await self.request(
                        method,
                        path,
                        body=body,
                        params=params,
                        content_type=content_type,
                        retry_auth=False,
                    )
                if response.status >= 400:
                    text = await response.text()
                    try:
                        message = json.loads(text).get("message", text)
                    except (ValueError, AttributeError):
                        message = text
                    raise ApiError(response.status, f"{method} {path}: {message}")
                payload: dict[str, Any] = await response.json(content_type=None)
                return payload
        except (aiohttp.ClientError, TimeoutError) as error:
            raise ApiError(0, f"{method} {path}: {error!r}") from error

    async def get(self, path: str) -> dict[str, Any] | None:
        """Fetch one object, or None if it does not exist."""
        return await self.request("GET", path)

    async def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply of ``manifest``, taking over conflicting fields; creates the
        object if it does not exist. Returns the object as the API server stored it."""
        applied = await self.request(
            "PATCH",
            manifest_path(manifest),
            body=manifest,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",
        )
        if applied is None:
            raise ApiError(404, f"{manifest_path(manifest)}: its namespace or kind is not served")
        return applied

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete one object (its dependents in the background); False if it was not there."""
        path = object_path(api_version, PLURALS[kind], namespace, name)
        return await self.request("DELETE", path) is not None

    async def list(
        self, api_version: str, plural: str, namespace: str, labels: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        """Objects in ``namespace`` carrying every label in ``labels``.

        The label filter is applied here as well as by the server, so the result holds the
        documented property whatever the server does with the selector.
        """
        selector = ",".join(f"{key}={value}" for key, value in labels.items())
        listing = await self.request(
            "GET",
            object_path(api_version, plural, namespace),
            params={"labelSelector": selector},
        )
        items: list[dict[str, Any]] = (listing or {}).get("items", [])
        return [
            item
            for item in items
            if labels.items() <= (item.get("metadata", {}).get("labels") or {}).items()
        ]
