"""Installs the plugin into vLLM 0.32 or 0.33, and lists every vLLM internal the plugin touches.

``VLLM_INTERNALS`` is that list for the installed vLLM (``VLLM_INTERNALS_BY_SERIES`` holds one
per supported release series): the targeted vLLM version and, for each private attribute the
plugin reads or calls, each vLLM symbol it patches and each ``BlockPool`` method
``PolicyBlockPool`` overrides, where vLLM defines it and what the plugin uses it for. Files read
to write it: ``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``, ``kv_cache_manager.py``,
``single_type_kv_cache_manager.py``, ``kv_cache_coordinator.py``, ``sched/scheduler.py``,
``vllm/v1/simple_kv_offload/manager.py`` and
``vllm/entrypoints/serve/middleware/authenticate.py``. A test holds the list complete (an AST
scan of the plugin's modules) and checks every entry against the installed vLLM; the public
attributes of the same classes the pool reads (``free_block_queue``, ``blocks``,
``cached_block_hashes_by_block``, ``metrics_collector``, ``req_to_blocks``, ...) are
exercised by the tests that drive vLLM's own KV cache manager. To support another vLLM,
re-read those files and walk this list, and the readers of ``free_block_queue``
(``docs/plugin.md``, "vLLM internals touched").

Only this module and ``block_pool`` import vLLM internals, and ``register`` imports them only
after ``version.check_vllm_version`` accepted the installed vLLM.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from vllm.entrypoints.serve.middleware import authenticate as vllm_authenticate
from vllm.v1.core import kv_cache_coordinator, kv_cache_manager, single_type_kv_cache_manager
from vllm.v1.core.sched import scheduler as vllm_scheduler
from vllm.v1.request import Request
from vllm.v1.simple_kv_offload import manager as simple_kv_offload

from arc_evictor.vllm_plugin.auth import authenticate_every_path
from arc_evictor.vllm_plugin.block_pool import Allocation, BlockPool, PolicyBlockPool
from arc_evictor.vllm_plugin.version import TARGET_VLLM, UnsupportedVllmError, vllm_series
from arc_serving_common.names import CONFIG_ENV, POLICY_ENV

# private: a private attribute read or called; patched: replaced in vLLM by the plugin;
# overridden: a ``BlockPool`` method ``PolicyBlockPool`` redefines.
InternalKind = Literal["private", "patched", "overridden"]


@dataclass(frozen=True, slots=True)
class VllmInternal:
    """One vLLM name the plugin depends on that vLLM does not promise to keep."""

    owner: str  # dotted path of the vLLM class or module that holds ``name``
    name: str
    kind: InternalKind
    use: str  # what the plugin uses it for


@dataclass(frozen=True, slots=True)
class VllmInternals:
    """The vLLM internals the plugin touches, as read in vLLM ``vllm_version``.

    ``changes`` says what differs from the previous supported series and how the plugin
    follows it (empty for the first).
    """

    vllm_version: str
    entries: tuple[VllmInternal, ...]
    changes: str = ""


_BLOCK_POOL = "vllm.v1.core.block_pool.BlockPool"
_SINGLE_TYPE_MANAGER = "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager"
_KV_CACHE_MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager"

_ENTRIES = (
    VllmInternal(
        "vllm.v1.core.kv_cache_utils.KVCacheBlock",
        "_block_hash",
        "private",
        "the slot behind the block_hash property, read in its place on the hot paths of "
        "PolicyBlockPool.cache_full_blocks and free_blocks",
    ),
    VllmInternal(
        "vllm.v1.core.block_pool.BlockHashToBlockMap",
        "_cache",
        "private",
        "the dict behind BlockPool.cached_block_hash_to_block: "
        "PolicyBlockPool.prefix_cache_keys lists the keys vLLM's prefix-cache map holds "
        "(the live-switch log line, verify)",
    ),
    VllmInternal(
        _BLOCK_POOL,
        "_maybe_evict_cached_block",
        "private",
        "takes a block out of vLLM's prefix-cache map with vLLM's own BlockRemoved events "
        "and KV cache metrics: on eviction (one copy at a time, in vLLM's order) and in "
        "evict_blocks",
    ),
    VllmInternal(
        _BLOCK_POOL,
        "_reuse_watchers",
        "private",
        "PolicyBlockPool.get_new_blocks checks for callbacks waiting on reused blocks, as "
        "vLLM's get_new_blocks does",
    ),
    VllmInternal(
        _BLOCK_POOL,
        "_notify_reuse",
        "private",
        "PolicyBlockPool.get_new_blocks runs those callbacks, as vLLM's get_new_blocks does",
    ),
    VllmInternal(
        _SINGLE_TYPE_MANAGER,
        "_partial_hit_reqs",
        "private",
        "the allocate_new_blocks wrapper gives no keys to the new blocks of a request with "
        "a partial prefix-cache hit",
    ),
    VllmInternal(
        "vllm.v1.core.kv_cache_coordinator",
        "BlockPool",
        "patched",
        "the name a KV cache coordinator builds its pool by; replaced by a factory that "
        "builds a PolicyBlockPool while KVCacheManager.__init__ runs (the device pool) and "
        "vLLM's own BlockPool otherwise (a KV connector's CPU or lookup pool)",
    ),
    VllmInternal(
        _KV_CACHE_MANAGER,
        "__init__",
        "patched",
        "wrapped: marks the device pool for the factory above; refuses KV cache layouts the "
        "policy pool does not model (check_supported_layout)",
    ),
    VllmInternal(
        "vllm.v1.simple_kv_offload.manager.SimpleCPUOffloadScheduler",
        "__init__",
        "patched",
        "wrapped: refuses lazy offloading (lazy_offload), which finds the blocks to offload "
        "by walking BlockPool.free_block_queue, where the policy pool keeps no cached block",
    ),
    VllmInternal(
        _KV_CACHE_MANAGER,
        "allocate_slots",
        "patched",
        "wrapped: sets the pool's Allocation for the request being allocated and counts "
        "the blocks a new request looks up",
    ),
    VllmInternal(
        _SINGLE_TYPE_MANAGER,
        "allocate_new_blocks",
        "patched",
        "wrapped: tells the Allocation where the new blocks start in the request's block "
        "table, and their block size and group",
    ),
    VllmInternal(
        "vllm.v1.core.sched.scheduler.Scheduler",
        "schedule",
        "patched",
        "wrapped: runs the plugin's per-step hook (live policy switch, metrics) first",
    ),
    VllmInternal(
        "vllm.entrypoints.serve.middleware.authenticate.AuthenticationMiddleware",
        "__call__",
        "patched",
        "replaced by auth.authenticate_every_path: the API key guards every path but "
        "auth.OPEN_PATHS",
    ),
    VllmInternal(
        _BLOCK_POOL, "__init__", "overridden", "extended: the same arguments and policy_name"
    ),
    VllmInternal(
        _BLOCK_POOL,
        "get_num_free_blocks",
        "overridden",
        "free blocks without a hash plus evictable cached blocks",
    ),
    VllmInternal(_BLOCK_POOL, "touch", "overridden", "a committed hit: pin, then find"),
    VllmInternal(
        _BLOCK_POOL,
        "get_new_blocks",
        "overridden",
        "each new block: a free block without a hash, else the policy's victim; handed out "
        "in vLLM's free-queue order",
    ),
    VllmInternal(
        _BLOCK_POOL,
        "cache_full_blocks",
        "overridden",
        "extended: a key decided after allocation enters the policy",
    ),
    VllmInternal(_BLOCK_POOL, "free_blocks", "overridden", "ref 1 -> 0: unpin"),
    VllmInternal(_BLOCK_POOL, "evict_blocks", "overridden", "invalidation: remove"),
    VllmInternal(
        _BLOCK_POOL, "reset_prefix_cache", "overridden", "extended: the policy is cleared"
    ),
    VllmInternal(_BLOCK_POOL, "unpin_blocks", "overridden", "refused: HiSparse is not modelled"),
    VllmInternal(
        _BLOCK_POOL,
        "cache_partial_block",
        "overridden",
        "extended: the block's policy entry follows its primary hash; a partial key of a "
        "cached block stays vLLM's lookup metadata and leaves with the block",
    ),
    VllmInternal(
        _BLOCK_POOL,
        "move_block_hashes",
        "overridden",
        "refused: moving hashes between blocks (copy-on-write) is not modelled",
    ),
)

# The same names, read again in each release (the files listed in the module docstring).
VLLM_INTERNALS_BY_SERIES = {
    "0.32": VllmInternals(TARGET_VLLM["0.32"], _ENTRIES),
    "0.33": VllmInternals(
        TARGET_VLLM["0.33"],
        _ENTRIES,
        changes="BlockPool.touch and free_blocks no longer count the null block's references "
        "(block_pool.NULL_BLOCK_REFCOUNTED follows); BlockPool.__init__ takes "
        "num_hash_lookahead_tokens (passed through); get_computed_blocks takes "
        "max_cache_hit_length and block tables drop leading null blocks (no pool call "
        "changes). Every entry above exists unchanged.",
    ),
}
# The table of the installed vLLM (``version.vllm_series`` refused any other before import).
VLLM_INTERNALS = VLLM_INTERNALS_BY_SERIES[vllm_series()]

_POOLS: weakref.WeakSet[PolicyBlockPool] = weakref.WeakSet()


def live_pools() -> list[PolicyBlockPool]:
    """Every policy pool alive in this process (one per engine core)."""
    return list(_POOLS)


# The single-type managers whose block-pool calls the policy pool models (exact classes:
# subclasses such as R-SWA, sink or HiSparse managers call the pool differently).
SUPPORTED_MANAGERS: tuple[type, ...] = (
    single_type_kv_cache_manager.FullAttentionManager,
    single_type_kv_cache_manager.SlidingWindowManager,
    single_type_kv_cache_manager.ChunkedLocalAttentionManager,
)


def describe_layout(manager: Any) -> str:
    """The KV cache layout as vLLM built it: each group's spec and manager class."""
    groups = manager.kv_cache_config.kv_cache_groups
    return ", ".join(
        f"{type(group.kv_cache_spec).__name__}/{type(single).__name__}"
        for group, single in zip(groups, manager.coordinator.single_type_managers, strict=True)
    )


LAZY_OFFLOAD_REFUSED = (
    "arc_evictor does not support vLLM's SimpleCPUOffloadConnector in lazy mode "
    '(kv_connector_extra_config "lazy_offload": true): it finds the blocks to offload by '
    "walking the device pool's free_block_queue, where the plugin keeps only blocks without "
    "a hash, so it would never offload a cached block. Use the connector's eager mode, or "
    f"unset {POLICY_ENV}/{CONFIG_ENV}."
)


def check_supported_layout(manager: Any) -> None:
    """Refuse KV cache layouts the policy pool does not model, naming the layout.

    Supported: any number of groups, each full attention, sliding window or chunked local
    attention, sharing vLLM's one block pool, with equal or different block sizes (a
    full-attention group with blocks larger than the hash unit caches partial blocks,
    ``PolicyBlockPool.cache_partial_block``; ``docs/plugin.md``, "Supported vLLM and models").
    Refused: Mamba, cross-attention and every other manager, and partial prefix-cache hits.
    """
    singles = manager.coordinator.single_type_managers
    unsupported = [type(m).__name__ for m in singles if type(m) not in SUPPORTED_MANAGERS]
    if unsupported:
        raise UnsupportedVllmError(
            "arc_evictor drives KV cache groups of full, sliding-window and chunked local "
            f"attention; this model's layout is [{describe_layout(manager)}] "
            f"({', '.join(unsupported)} unsupported). Unset {POLICY_ENV}/{CONFIG_ENV} "
            "for this model."
        )
    if manager.coordinator.enable_partial_hash_hits:
        raise UnsupportedVllmError(
            "arc_evictor does not support partial prefix-cache hits; this model's layout is "
            f"[{describe_layout(manager)}]"
        )


_installed: dict[str, Any] = {}


def install(
    policy_name: str,
    on_step: Callable[[], None],
    on_pool: Callable[[PolicyBlockPool], None],
) -> None:
    """Patch vLLM so the device pool every KV cache manager builds is a PolicyBlockPool.

    A pool another coordinator builds (a KV connector's CPU offload or lookup pool) stays
    vLLM's own; SimpleCPUOffloadConnector's lazy mode is refused (``LAZY_OFFLOAD_REFUSED``).
    ``on_step`` runs before every scheduler step (live switching, metrics); ``on_pool`` runs
    once per new pool. Idempotent within a process. Every patched path checks for a
    ``PolicyBlockPool`` first, so a pool built otherwise behaves as vLLM's own.
    """
    if _installed:
        return

    def make_pool(*args: Any, **kwargs: Any) -> BlockPool:
        if not _installed["building_device_pool"]:
            # Another coordinator's pool (a KV connector's CPU offload or lookup pool): its
            # owner registers hashes and frees blocks its own way, so it stays vLLM's.
            return BlockPool(*args, **kwargs)
        pool = PolicyBlockPool(*args, policy_name=_installed["policy"], **kwargs)
        _POOLS.add(pool)
        on_pool(pool)
        return pool

    orig_manager_init = kv_cache_manager.KVCacheManager.__init__
    orig_allocate_slots = kv_cache_manager.KVCacheManager.allocate_slots
    orig_new_blocks = single_type_kv_cache_manager.SingleTypeKVCacheManager.allocate_new_blocks
    orig_schedule = vllm_scheduler.Scheduler.schedule
    orig_offload_init = simple_kv_offload.SimpleCPUOffloadScheduler.__init__
    offload_signature = inspect.signature(orig_offload_init)

    @functools.wraps(orig_manager_init)
    def manager_init(self: Any, *args: Any, **kwargs: Any) -> None:
        _installed["building_device_pool"] = True
        try:
            orig_manager_init(self, *args, **kwargs)
        finally:
            _installed["building_device_pool"] = False
        if isinstance(self.block_pool, PolicyBlockPool):
            check_supported_layout(self)

    @functools.wraps(orig_offload_init)
    def offload_init(self: Any, *args: Any, **kwargs: Any) -> None:
        # Built by the scheduler before its KV cache manager: refused before either exists.
        bound = offload_signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["lazy_offload"]:
            raise UnsupportedVllmError(LAZY_OFFLOAD_REFUSED)
        orig_offload_init(self, *args, **kwargs)

    @functools.wraps(orig_allocate_slots)
    def allocate_slots(self: Any, request: Request, *args: Any, **kwargs: Any) -> Any:
        pool = self.block_pool
        if not isinstance(pool, PolicyBlockPool):
            return orig_allocate_slots(self, request, *args, **kwargs)
        singles = self.coordinator.single_type_managers
        first = not singles[0].req_to_blocks.get(request.request_id)
        pool.allocation = Allocation(request)
        try:
            result = orig_allocate_slots(self, request, *args, **kwargs)
        finally:
            pool.allocation = None
        if first and result is not None:
            # Every group looks up its own blocks (a hit is counted per group's block).
            hashes = len(request.block_hashes) * pool.hash_block_size
            pool.block_queries += sum(hashes // single.block_size for single in singles)
        return result

    @functools.wraps(orig_new_blocks)
    def allocate_new_blocks(self: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        pool = self.block_pool
        allocation = pool.allocation if isinstance(pool, PolicyBlockPool) else None
        if allocation is not None and request_id not in self._partial_hit_reqs:
            allocation.start = len(self.req_to_blocks[request_id])
            allocation.block_size = self.block_size
            allocation.group_id = self.kv_cache_group_id
        try:
            return orig_new_blocks(self, request_id, *args, **kwargs)
        finally:
            if allocation is not None:
                allocation.start = None

    @functools.wraps(orig_schedule)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        on_step()
        return orig_schedule(self, *args, **kwargs)

    _installed["policy"] = policy_name
    _installed["building_device_pool"] = False
    kv_cache_coordinator.BlockPool = make_pool  # type: ignore[assignment,misc]
    kv_cache_manager.KVCacheManager.__init__ = manager_init  # type: ignore[method-assign]
    simple_kv_offload.SimpleCPUOffloadScheduler.__init__ = offload_init  # type: ignore[method-assign]
    kv_cache_manager.KVCacheManager.allocate_slots = allocate_slots  # type: ignore[method-assign]
    single_type_kv_cache_manager.SingleTypeKVCacheManager.allocate_new_blocks = (  # type: ignore[method-assign]
        allocate_new_blocks
    )
    vllm_scheduler.Scheduler.schedule = schedule  # type: ignore[method-assign]


def set_policy_name(name: str) -> None:
    """The policy new pools start with (after a live switch, new pools follow it)."""
    _installed["policy"] = name


def guard_every_path() -> None:
    """Make vLLM's API-key middleware guard every path but ``auth.OPEN_PATHS``. Idempotent.

    vLLM adds the middleware only when a key is configured (``--api-key`` or ``VLLM_API_KEY``)
    and builds it after general plugins were loaded in the API server process (argument
    parsing loads them), so patching the class here puts the guard in front of every route.
    """
    vllm_authenticate.AuthenticationMiddleware.__call__ = authenticate_every_path  # type: ignore[method-assign]
