"""arc_evictor's vLLM plugin: vLLM's own KV block pool evicts by an arc_evictor policy.

Entry point ``vllm.general_plugins: arc_evictor = arc_evictor.vllm_plugin:register``. vLLM
calls ``register`` in every process it starts (API server, engine core, workers). It does
nothing unless ``ARC_EVICTOR_POLICY`` or ``ARC_EVICTOR_CONFIG`` is set; then it validates the
settings and the vLLM version and raises (stopping start-up) on any problem, and patches vLLM
so the engine core's device block pool is a ``PolicyBlockPool``. Before each scheduler step the
engine core polls the policy file, switches policy live, and publishes metrics (so an idle
engine applies a file change with its next request; see ``config``).

When an API key is configured (``VLLM_API_KEY``), ``register`` also makes vLLM's key check
guard every HTTP path of the API server but ``/health`` and ``/metrics`` (vLLM's own guards
only ``/v1`` and a few other prefixes; see ``auth.OPEN_PATHS``). vLLM loads general plugins
in the API server process while parsing its arguments, before it builds the app.

Modules: ``block_pool`` (the policy-driven ``PolicyBlockPool``), ``patches`` (installs it and
the key guard into vLLM, and lists every vLLM internal the plugin touches in
``VLLM_INTERNALS``), ``auth`` (the key guard), ``config``, ``metrics``, ``version``. Only
``block_pool`` and ``patches`` import vLLM internals; ``register`` imports them lazily, and only
after ``version.check_vllm_version`` accepted the installed vLLM, so another version stops
start-up with that check's message rather than an ImportError from vLLM's moved internals.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from arc_evictor.vllm_plugin.config import PluginConfigError, PolicyFileWatcher, Settings
from arc_evictor.vllm_plugin.metrics import PluginMetrics, multiprocess_enabled
from arc_evictor.vllm_plugin.version import check_vllm_version
from arc_serving_common.names import API_KEY_ENV, METRIC_NAMES

if TYPE_CHECKING:
    from arc_evictor.vllm_plugin.block_pool import PolicyBlockPool

logger = logging.getLogger("vllm.arc_evictor")

__all__ = ["METRIC_NAMES", "SWITCH_LOG", "PluginConfigError", "PluginRuntime", "register"]

# The engine log's line for each live switch (tests and operators parse it): old policy, new
# policy, resident blocks the new policy holds, resident blocks before the switch; then, counted
# in vLLM's own prefix-cache map (what a request can hit), its cached blocks the new policy
# holds and all its cached blocks; the switch's duration.
SWITCH_LOG = (
    "arc_evictor: policy switch %s -> %s: %d of %d resident blocks kept; "
    "vLLM's prefix cache: %d of %d cached blocks resident; in %.1f ms"
)


class PluginRuntime:
    """Per-process plugin state: settings, the file watcher, metrics, the live pools."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.watcher = (
            PolicyFileWatcher(settings.config_path, settings.poll_seconds, settings.policy)
            if settings.config_path is not None
            else None
        )
        self.metrics: PluginMetrics | None = None

    def on_pool(self, pool: PolicyBlockPool) -> None:
        """A new device pool: metrics exist from here on (engine core process only)."""
        if self.metrics is None:
            if not multiprocess_enabled():
                logger.warning(
                    "arc_evictor: PROMETHEUS_MULTIPROC_DIR is not set, so the engine core's "
                    "arc_evictor_* metrics cannot reach the API server's /metrics"
                )
            self.metrics = PluginMetrics()
        logger.info(
            "arc_evictor: block pool of %d blocks evicts by %s",
            pool.num_gpu_blocks,
            pool.policy.describe(),
        )
        self.metrics.sync(pool)

    def on_step(self) -> None:
        """Before each scheduler step: maybe switch policy, then publish metrics.

        Once per step is enough: every block-pool change of a step (hits, allocations, frees
        at ``update_from_output``) is published by the next step's call, and vLLM runs one more
        step after the last request finishes, to clear it from the batch. Before a switch the
        outgoing policy's counts are published first: the new policy's counters start at zero.
        """
        from arc_evictor.vllm_plugin import patches

        pools = patches.live_pools()
        if self.watcher is not None:
            name = self.watcher.poll()
            error = self.watcher.take_error()
            if error:
                logger.error("arc_evictor: %s", error)
            if name is not None:
                self.publish(pools)
                self.switch(name, pools)
        self.publish(pools)

    def publish(self, pools: list[PolicyBlockPool]) -> None:
        """Add each pool's policy counts since the previous call to the Prometheus metrics."""
        if self.metrics is not None:
            for pool in pools:
                self.metrics.sync(pool)

    def switch(self, name: str, pools: list[PolicyBlockPool]) -> None:
        """Switch every pool (and pools built later) to policy ``name``.

        Each switch logs one line (SWITCH_LOG) with the resident blocks before it and how
        many of those the new policy holds, and the same check against vLLM's own block pool:
        the blocks its prefix-cache map holds (what a request can hit) and how many of those
        the new policy holds. All four equal: no cached block was lost, none is untracked.
        """
        from arc_evictor.vllm_plugin import patches

        for pool in pools:
            started = time.perf_counter()
            old = pool.policy
            before = list(old.resident_keys())
            new = pool.switch_policy(name)
            elapsed_ms = (time.perf_counter() - started) * 1000
            kept = sum(1 for key in before if key in new)
            cached = pool.prefix_cache_keys()
            resident = pool.resident_hashes(new)
            tracked = sum(1 for key in cached if key in resident)
            logger.info(SWITCH_LOG, old.describe(), new.describe(), kept, len(before),
                        tracked, len(cached), elapsed_ms)  # fmt: skip
        patches.set_policy_name(name)


_runtime: PluginRuntime | None = None
_guarded = False  # the API key guard is installed in this process


def register() -> None:
    """vLLM's general-plugin hook; idempotent; raises to stop start-up on bad settings.

    With an API key in ``VLLM_API_KEY`` (how the operator, the chart and ``VllmServer`` pass
    it) the key guards every path but ``auth.OPEN_PATHS``, also without a policy set; an
    unsupported vLLM then stops start-up rather than serve with vLLM's narrower guard.
    """
    global _runtime, _guarded
    settings = Settings.from_env()
    wants_guard = bool(os.environ.get(API_KEY_ENV)) and not _guarded
    if not wants_guard and (settings is None or _runtime is not None):
        return
    check_vllm_version()  # before importing vLLM internals, which may fail on another vLLM
    from arc_evictor.vllm_plugin import patches

    if wants_guard:
        patches.guard_every_path()
        _guarded = True
    if settings is None or _runtime is not None:
        return
    runtime = PluginRuntime(settings)
    patches.install(settings.policy, on_step=runtime.on_step, on_pool=runtime.on_pool)
    _runtime = runtime
