"""Which KV cache layouts the plugin drives, and the start-up refusal of the others.

The driven layouts (``managers.SUPPORTED_LAYOUTS``) are exercised step by step against vLLM in
``test_stock_equality.py``; here, each is accepted as vLLM builds it, and a layout with a
manager the pool does not model stops start-up with a message naming the layout. Pools that
KV connectors build for themselves stay vLLM's, and lazy CPU offloading is refused.
"""

from __future__ import annotations

import pytest
from managers import REFUSED_LAYOUTS, SUPPORTED_LAYOUTS, kv_cache_config, make_manager
from vllm.config import DeviceConfig, VllmConfig
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

from arc_evictor.vllm_plugin import patches
from arc_evictor.vllm_plugin.block_pool import PolicyBlockPool
from arc_evictor.vllm_plugin.version import UnsupportedVllmError

BS = 4


@pytest.mark.parametrize("layout", SUPPORTED_LAYOUTS)
def test_supported_layout_gets_one_policy_pool_for_every_group(layout: str) -> None:
    manager = make_manager("arc", 32, BS, layout=layout)
    singles = manager.coordinator.single_type_managers
    assert len(singles) == len(layout.split("+"))
    assert {id(single.block_pool) for single in singles} == {id(manager.block_pool)}
    assert all(type(single) in patches.SUPPORTED_MANAGERS for single in singles)


@pytest.mark.parametrize("layout", REFUSED_LAYOUTS)
def test_unsupported_layout_is_refused_naming_the_layout(layout: str) -> None:
    with pytest.raises(UnsupportedVllmError, match=r"layout is \[FullAttentionSpec/") as error:
        make_manager("lru", 32, BS, layout=layout)
    assert "MambaSpec/MambaManager" in str(error.value)
    assert "MambaManager unsupported" in str(error.value)


def test_unsupported_layout_runs_on_vllms_own_pool() -> None:
    # Without the plugin (policy None) vLLM builds the same layout as usual.
    manager = make_manager(None, 32, BS, layout=REFUSED_LAYOUTS[0])
    assert len(manager.coordinator.single_type_managers) == 2


def test_a_pool_built_outside_the_kv_cache_manager_stays_vllms() -> None:
    # KV connectors build coordinators of their own (SimpleCPUOffloadConnector's CPU pool,
    # which registers hashes with BlockPool._insert_block_hash): those pools stay vLLM's.
    coordinator = get_kv_cache_coordinator(
        kv_cache_config=kv_cache_config(16, BS, "full+swa"),
        max_model_len=16 * BS,
        max_in_flight_tokens=16 * BS,
        use_eagle=False,
        enable_caching=True,
        enable_kv_cache_events=False,
        dcp_world_size=1,
        pcp_world_size=1,
        scheduler_block_size=BS,
        hash_block_size=BS,
    )
    assert type(coordinator.block_pool) is BlockPool
    # The device pool of a KV cache manager built afterwards is still the policy pool.
    assert isinstance(make_manager("arc", 16, BS).block_pool, PolicyBlockPool)


def test_lazy_cpu_offloading_is_refused_at_start_up_naming_it() -> None:
    # The scheduler builds the connector's offload scheduler before its KV cache manager;
    # lazy mode would walk free_block_queue, which holds no cached block under the plugin.
    with pytest.raises(UnsupportedVllmError) as error:
        SimpleCPUOffloadScheduler(
            # A CPU device: vLLM 0.33 cannot infer one on a machine without a GPU.
            VllmConfig(device_config=DeviceConfig(device="cpu")),
            kv_cache_config(16, BS),
            cpu_capacity_bytes=1 << 20,
            scheduler_block_size=BS,
            hash_block_size=BS,
            lazy_offload=True,
        )
    assert str(error.value) == patches.LAZY_OFFLOAD_REFUSED
    assert "SimpleCPUOffloadConnector in lazy mode" in str(error.value)
    assert '"lazy_offload": true' in str(error.value)
