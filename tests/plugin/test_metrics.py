"""Metrics: the plugin's Prometheus counts across live switches, and vLLM's own KV cache
metrics unchanged by the plugin."""

from __future__ import annotations

import gc
import json
import random
from pathlib import Path

import pytest
from managers import admit, kv_cache_config, make_manager, make_request
from prometheus_client import CollectorRegistry
from vllm.v1.core import kv_cache_coordinator
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

from arc_evictor.vllm_plugin import PluginRuntime
from arc_evictor.vllm_plugin.block_pool import PolicyBlockPool
from arc_evictor.vllm_plugin.config import Settings
from arc_evictor.vllm_plugin.metrics import PluginMetrics
from arc_evictor.vllm_plugin.patches import set_policy_name

BS = 4


def doc(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 30_000) for _ in range(tokens)]


def run(manager: KVCacheManager, seeds: range) -> None:
    """Distinct prompts of 2 full blocks and a partial one, each admitted then freed."""
    for seed in seeds:
        request = make_request(doc(seed, 2 * BS + 1), BS)
        assert admit(manager, request) is not None
        manager.free(request)


def test_counters_restart_with_each_policy_even_two_switches_between_syncs() -> None:
    registry = CollectorRegistry()
    metrics = PluginMetrics(registry)
    manager = make_manager("lru", num_blocks=7, block_size=BS)
    pool = manager.block_pool

    def sample(name: str, **labels: str) -> float:
        value = registry.get_sample_value(name, labels)
        assert value is not None, (name, labels)
        return value

    run(manager, range(10))
    metrics.sync(pool)
    lru_evictions = sample("arc_evictor_evictions_total", list="lru")
    assert lru_evictions == pool.policy.counters.evictions["lru"] > 0
    assert sample("arc_evictor_policy_info", policy="lru") == 1

    # Two switches before the next sync: the policy is lru again, with counts from zero.
    pool.switch_policy("arc")
    pool.switch_policy("lru")
    run(manager, range(100, 104))
    metrics.sync(pool)
    assert sample("arc_evictor_policy_switches_total") == 2
    assert sample("arc_evictor_evictions_total", list="lru") == (
        lru_evictions + pool.policy.counters.evictions["lru"]
    )

    pool.switch_policy("arc")
    run(manager, range(200, 204))
    metrics.sync(pool)
    assert sample("arc_evictor_policy_info", policy="arc") == 1
    assert sample("arc_evictor_policy_info", policy="lru") == 0
    assert sample("arc_evictor_resident_blocks", list="lru") == 0
    assert sample("arc_evictor_resident_blocks", list="t1") == len(pool.policy)
    assert sample("arc_evictor_evictions_total", list="t1") == pool.policy.counters.evictions["t1"]
    assert sample("arc_evictor_policy_switches_total") == 3


def test_vllm_kv_cache_eviction_events_match_the_native_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM reports each block it reuses as evicted (an event per sampled block); the plugin
    # must report the same, blocks without a hash (partial last blocks) included.
    set_policy_name("lru")
    events = {}
    for kind in ("native", "plugin"):
        collector = KVCacheMetricsCollector(sample_rate=1.0)
        with monkeypatch.context() as patch:
            if kind == "native":
                patch.setattr(kv_cache_coordinator, "BlockPool", BlockPool)
            manager = KVCacheManager(
                kv_cache_config(10, BS),
                max_model_len=10 * BS,
                scheduler_block_size=BS,
                hash_block_size=BS,
                enable_caching=True,
                metrics_collector=collector,
            )
        assert isinstance(manager.block_pool, PolicyBlockPool) == (kind == "plugin")
        run(manager, range(12))
        events[kind] = len(collector.drain_events())
    assert events["plugin"] == events["native"] > 0


def test_a_live_switch_publishes_the_outgoing_policys_last_counts(tmp_path: Path) -> None:
    """The engine's step hook: evictions made just before a file-driven switch still count."""
    gc.collect()  # pools of earlier tests must not share this runtime's registry
    policy_file = tmp_path / "policy.json"
    policy_file.write_text(json.dumps({"policy": "lru"}), encoding="utf-8")
    runtime = PluginRuntime(Settings(policy="lru", config_path=policy_file, poll_seconds=0.0))
    registry = CollectorRegistry()
    runtime.metrics = PluginMetrics(registry)
    manager = make_manager("lru", num_blocks=7, block_size=BS)
    pool = manager.block_pool
    runtime.on_step()

    run(manager, range(10))  # this step evicts; the next step's hook publishes it
    evicted = pool.policy.counters.evictions["lru"]
    assert evicted > 0
    policy_file.write_text(json.dumps({"policy": "arc"}), encoding="utf-8")
    runtime.on_step()

    assert pool.policy.name == "arc"
    assert registry.get_sample_value("arc_evictor_evictions_total", {"list": "lru"}) == evicted
    assert registry.get_sample_value("arc_evictor_policy_switches_total") == 1
