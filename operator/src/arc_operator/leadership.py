"""Leader election on a ``coordination.k8s.io/v1`` Lease, so that of several operator
processes exactly one acts: client-go's ``leaderelection`` (what controller-runtime's managers
use), its decisions and its default timings, over the operator's own ``KubeApi``.

A candidate reads the Lease every ``RETRY_PERIOD_S`` and takes it when it is absent, released
(no holder), already its own, or unchanged for the record's ``leaseDurationSeconds`` as timed
by the candidate's own monotonic clock from when it first saw that record (clocks of different
machines are never compared). The leader renews it every ``RETRY_PERIOD_S`` and stops leading
when no renewal has succeeded for ``RENEW_DEADLINE_S``, which is before any other candidate
can take it, or at once when it reads another holder. Stopping gracefully, it releases the
Lease (client-go's ``ReleaseOnCancel``) so that a follower takes over at its next read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

from arc_operator.kube import ApiError, object_path

# client-go's defaults (and controller-runtime's): a leader that cannot renew for
# RENEW_DEADLINE_S stops, LEASE_DURATION_S - RENEW_DEADLINE_S before a follower may take over.
LEASE_DURATION_S = 15
RENEW_DEADLINE_S = 10.0
RETRY_PERIOD_S = 2.0
LEASE_API_VERSION = "coordination.k8s.io/v1"
# metav1.MicroTime's wire format.
MICROTIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"

logger = logging.getLogger(__name__)


class LeaseApi(Protocol):
    """What the elector needs of ``KubeApi``: one request, the JSON body back (None: 404),
    ``ApiError`` on any other failure."""

    async def request(
        self, method: str, path: str, *, body: Any = None
    ) -> dict[str, Any] | None: ...


def micro_time(moment: datetime) -> str:
    """``moment`` as a Lease's acquireTime/renewTime (MicroTime, UTC)."""
    return moment.astimezone(UTC).strftime(MICROTIME_FORMAT)


def default_identity(env: Mapping[str, str] = os.environ) -> str:
    """The pod's name (``POD_NAME``, from the downward API) with a random suffix, so that a
    restarted container is a new candidate, as controller-runtime names them; outside a pod,
    ``hostname_pid``."""
    pod = env.get("POD_NAME")
    if pod:
        return f"{pod}_{uuid.uuid4()}"
    return f"{socket.gethostname()}_{os.getpid()}"


class LeaseElector:
    """One candidate (``identity``) for the Lease ``namespace/name``.

    Invariants:

    - ``leading`` is True only after a write of the Lease naming ``identity`` succeeded, and
      turns False when ``keep_leading`` returns or ``release`` begins. ``keep_leading``
      returns at the latest ``renew_deadline`` after the start of the last renewal that
      succeeded, so the leader stops before any follower, which waits ``lease_duration`` from
      when it saw that renewal, can take the Lease; it returns at once when it reads another
      holder.
    - Every write is a create or a PUT carrying the resourceVersion this candidate read: when
      someone else wrote in between, the API server answers 409 and the write is lost, never
      made over theirs.
    - A Lease held by another identity is taken only once its record has stayed the same for
      its ``leaseDurationSeconds`` on this process's monotonic ``clock``, counted from when
      this process first saw that record; a released Lease (no holder) is taken at once.
    - ``leaseTransitions`` grows by one at every change of holder; ``acquireTime`` is when the
      current holder took the Lease, ``renewTime`` its last renewal.
    """

    def __init__(
        self,
        api: LeaseApi,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_duration: int = LEASE_DURATION_S,
        renew_deadline: float = RENEW_DEADLINE_S,
        retry_period: float = RETRY_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._api = api
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self._clock, self._now, self._sleep = clock, now, sleep
        self._collection = object_path(LEASE_API_VERSION, "leases", namespace)
        self._path = object_path(LEASE_API_VERSION, "leases", namespace, name)
        # The last Lease read or written (its resourceVersion goes with the next write), its
        # spec as last seen changed, and when (clock) it was seen to change.
        self._lease: dict[str, Any] | None = None
        self._observed: dict[str, Any] | None = None
        self._observed_at = 0.0
        # When (clock) the last successful write of ours began.
        self._renewed_at = 0.0
        self.leading = False

    def __str__(self) -> str:
        return f"lease {self.namespace}/{self.name}"

    @property
    def holder(self) -> str:
        """The holder in the record last seen ("" for none)."""
        return str((self._observed or {}).get("holderIdentity") or "")

    def _observe(self, lease: dict[str, Any]) -> None:
        spec = dict(lease.get("spec") or {})
        if spec != self._observed:
            self._observed, self._observed_at = spec, self._clock()
        self._lease = lease

    def _expired(self) -> bool:
        duration = (self._observed or {}).get("leaseDurationSeconds") or self.lease_duration
        return self._clock() >= self._observed_at + duration

    def _record(self, acquire_time: str | None, transitions: int) -> dict[str, Any]:
        now = micro_time(self._now())
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_duration,
            "acquireTime": acquire_time or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    async def _write(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The stored Lease, or None when another writer won (409) or it went away (404)."""
        try:
            return await self._api.request(method, path, body=body)
        except ApiError as error:
            if error.status == 409:
                logger.debug(f"{self}: {error}")
                return None
            raise

    async def try_acquire_or_renew(self) -> bool:
        """One read and, unless another holder's lease is live, one write naming this
        candidate; whether it now holds the Lease. Raises ``ApiError`` on an API failure."""
        started = self._clock()
        lease = await self._api.request("GET", self._path)
        if lease is None:
            body = {
                "apiVersion": LEASE_API_VERSION,
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._record(None, 0),
            }
            written = await self._write("POST", self._collection, body)
        else:
            self._observe(lease)
            spec = self._observed or {}
            holder = self.holder
            ours = holder == self.identity
            if holder and not ours and not self._expired():
                return False
            record = self._record(
                spec.get("acquireTime") if ours else None,
                int(spec.get("leaseTransitions") or 0) + (0 if ours else 1),
            )
            written = await self._write("PUT", self._path, {**lease, "spec": record})
        if written is None:
            return False
        self._observe(written)
        self._renewed_at = started
        self.leading = True
        return True

    async def acquire(self) -> None:
        """Try every ``retry_period`` until this candidate holds the Lease."""
        reported: str | None = None
        while True:
            try:
                async with asyncio.timeout(self.renew_deadline):
                    if await self.try_acquire_or_renew():
                        logger.info(f"{self}: acquired as {self.identity}")
                        return
                if self.holder != reported:
                    reported = self.holder
                    logger.info(f"{self}: held by {reported or 'nobody'}; following")
            except TimeoutError:
                logger.warning(f"{self}: no answer within {self.renew_deadline:g} s")
            except ApiError as error:
                logger.warning(f"{self}: {error}")
            await self._sleep(self.retry_period)

    async def keep_leading(self) -> str:
        """Renew every ``retry_period``; return why this candidate stopped leading: no renewal
        succeeded within ``renew_deadline`` of the start of the last one that did, or another
        identity holds the Lease."""
        while True:
            deadline = self._renewed_at + self.renew_deadline
            await self._sleep(max(0.0, min(self.retry_period, deadline - self._clock())))
            problem = await self._renew_before(deadline)
            if problem is None:
                continue
            holder = self.holder
            if holder and holder != self.identity:
                reason = f"the lease is held by {holder}"
            elif self._clock() >= deadline:
                reason = f"no renewal within {self.renew_deadline:g} s: {problem}"
            else:
                logger.warning(f"{self}: renewal failed ({problem}); retrying")
                continue
            self.leading = False
            return reason

    async def _renew_before(self, deadline: float) -> str | None:
        """One renewal, abandoned at ``deadline``: None if it succeeded, else what failed."""
        remaining = deadline - self._clock()
        if remaining <= 0:
            return "the renew deadline passed"
        try:
            async with asyncio.timeout(remaining):
                if await self.try_acquire_or_renew():
                    return None
            return f"the lease changed under us (holder {self.holder or 'none'})"
        except TimeoutError:
            return f"no answer within {remaining:.1f} s"
        except ApiError as error:
            return str(error)

    async def release(self) -> bool:
        """Give the Lease up if this candidate leads (client-go's ``ReleaseOnCancel``): no
        holder and a 1-second duration, so a follower takes it at its next read. Whether the
        release was written (False: not leading, or someone wrote since our last renewal)."""
        if not self.leading or self._lease is None:
            return False
        self.leading = False
        now = micro_time(self._now())
        record = {
            "leaseDurationSeconds": 1,
            "acquireTime": now,
            "renewTime": now,
            "leaseTransitions": int((self._observed or {}).get("leaseTransitions") or 0),
        }
        written = await self._write("PUT", self._path, {**self._lease, "spec": record})
        if written is not None:
            self._observe(written)
            logger.info(f"{self}: released")
        return written is not None
