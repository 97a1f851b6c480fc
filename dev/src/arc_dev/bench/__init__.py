"""``make bench``: speed and memory figures measured side by side in one run.

1. Policy core: block accesses per second for each policy in sequential mode on
   two generated traces of about one million block accesses each, document QA
   (where ``trio``'s LFU leads) and multi-turn conversations (where its ARC and LRU
   lead), each policy's time relative to LRU's and to ARC's (``trio`` is meant to
   take at most twice ARC's time), and the bytes it holds per cache block.
2. Routed simulator: the same traces through a fleet of 8 replicas behind the
   ``kv_aware`` router (``arc_simulator.fleet``), sequential mode, each replica as
   large as the single cache above; block accesses per second relative to the
   same fleet code with one replica.
3. vLLM adapter: the same request stream through vLLM's own BlockPool with its
   native LRU free queue and with the plugin's policies, and the ratio.
4. Load test: the open-loop dispatcher's lag at several request rates.

Figures vary with the machine; ratios from one run are what to compare.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from arc_evictor.policies import make_policy, policy_names
from arc_serving_common.traces import TraceRequest, load_trace
from arc_simulator.fleet import simulate_fleet
from arc_simulator.generate import (
    ConversationParams,
    DocQAParams,
    GeneratedRequest,
    conversation,
    docqa,
    write_generated,
)
from arc_simulator.simulate import simulate_sequential

BENCH_TRACES = ("docqa", "conversation")
ROUTED_POLICY = "trio"  # the recommended policy
ROUTED_ROUTER = "kv_aware"
ROUTED_REPLICAS = (1, 8)


def bench_trace(kind: str, target_accesses: int, seed: int = 0) -> list[TraceRequest]:
    """A generated trace (16-token blocks) with about ``target_accesses`` block accesses."""
    requests: list[GeneratedRequest]
    if kind == "docqa":
        params = DocQAParams(seed=seed)
        per_request = params.document_tokens / 16
        questions = target_accesses / per_request / params.documents
        requests = docqa(DocQAParams(questions_per_document=questions, seed=seed))
    elif kind == "conversation":
        # Sessions vary in length: measure the default trace, then scale the session count.
        sample = ConversationParams(seed=seed)
        accesses = sum(request.input_length // 16 for request in conversation(sample))
        sessions = max(1, round(sample.sessions * target_accesses / accesses))
        requests = conversation(ConversationParams(sessions=sessions, seed=seed))
    else:
        raise ValueError(f"unknown bench trace {kind!r}; expected one of {BENCH_TRACES}")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "bench.jsonl"
        write_generated(path, requests, "bailian")
        return load_trace(path)


def retained_bytes(requests: list[TraceRequest], name: str, capacity: int) -> int:
    """Bytes a policy holds after a sequential replay (its lists, ghosts, counts), traced
    by tracemalloc in a run of its own: tracing slows every allocation."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        policy = make_policy(name, capacity)
        simulate_sequential(requests, policy)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def bench_policies(requests: list[TraceRequest], capacity: int, repeats: int) -> list[dict]:
    """Best-of-``repeats`` sequential replay time, and retained memory, of every policy."""
    accesses = sum(request.num_blocks for request in requests)
    rows = []
    for name in policy_names():
        best = float("inf")
        hit_rate = 0.0
        for _ in range(repeats):
            policy = make_policy(name, capacity)
            gc.collect()
            started = time.perf_counter()
            result = simulate_sequential(requests, policy)
            best = min(best, time.perf_counter() - started)
            hit_rate = result.block_hit_rate
        rows.append(
            {
                "policy": name,
                "accesses": accesses,
                "seconds": best,
                "accesses_per_second": accesses / best,
                "block_hit_rate": hit_rate,
                "bytes_per_block": retained_bytes(requests, name, capacity) / capacity,
            }
        )
    seconds = {row["policy"]: row["seconds"] for row in rows}
    for row in rows:
        row["time_vs_lru"] = row["seconds"] / seconds["lru"]
        row["time_vs_arc"] = row["seconds"] / seconds["arc"]
    return rows


def bench_routed(requests: list[TraceRequest], capacity: int, repeats: int) -> list[dict]:
    """Best-of-``repeats`` time of the routed simulator at each of ``ROUTED_REPLICAS``."""
    accesses = sum(request.num_blocks for request in requests)
    rows = []
    for replicas in ROUTED_REPLICAS:
        best = float("inf")
        for _ in range(repeats):
            gc.collect()
            started = time.perf_counter()
            result, _ = simulate_fleet(
                requests, ROUTED_POLICY, capacity, replicas, ROUTED_ROUTER, sequential=True
            )
            best = min(best, time.perf_counter() - started)
        rows.append(
            {
                "replicas": replicas,
                "seconds": best,
                "accesses_per_second": accesses / best,
                "block_hit_rate": result.block_hit_rate,
                "request_imbalance": result.request_imbalance,
            }
        )
    for row in rows:
        row["speed_vs_one"] = row["accesses_per_second"] / rows[0]["accesses_per_second"]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="arc-evictor-bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--accesses", type=int, default=1_000_000, help="block accesses in each trace"
    )
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument(
        "--capacity-fraction", type=float, default=0.1, help="cache size over distinct blocks"
    )
    args = parser.parse_args(argv)
    routed_inputs = []
    for kind in BENCH_TRACES:
        requests = bench_trace(kind, args.accesses)
        distinct = len({key for request in requests for key in request.keys})
        capacity = max(1, int(distinct * args.capacity_fraction))
        print(
            f"policy core, sequential mode, {kind}: {len(requests)} requests, "
            f"{sum(r.num_blocks for r in requests):,} block accesses, {distinct:,} distinct "
            f"blocks, capacity {capacity:,} blocks; best of {args.repeats}, one core"
        )
        print(
            f"{'policy':<8} {'accesses/s':>12} {'seconds':>8} {'time/LRU':>9} {'time/ARC':>9} "
            f"{'hit rate':>9} {'bytes/block':>12}"
        )
        for row in bench_policies(requests, capacity, args.repeats):
            print(
                f"{row['policy']:<8} {row['accesses_per_second']:>12,.0f} "
                f"{row['seconds']:>8.3f} {row['time_vs_lru']:>8.2f}x "
                f"{row['time_vs_arc']:>8.2f}x {row['block_hit_rate']:>9.3f} "
                f"{row['bytes_per_block']:>12,.0f}"
            )
        print()
        routed_inputs.append((kind, requests, capacity))
    for kind, requests, capacity in routed_inputs:
        print(
            f"routed simulator, sequential mode, {kind}: {ROUTED_ROUTER} router, "
            f"{ROUTED_POLICY}, {capacity:,} blocks per replica; best of {args.repeats}, one core"
        )
        print(
            f"{'replicas':>8} {'accesses/s':>12} {'seconds':>8} {'vs 1':>7} {'hit rate':>9} "
            f"{'req imbal':>9}"
        )
        for row in bench_routed(requests, capacity, args.repeats):
            print(
                f"{row['replicas']:>8} {row['accesses_per_second']:>12,.0f} "
                f"{row['seconds']:>8.3f} {row['speed_vs_one']:>6.2f}x "
                f"{row['block_hit_rate']:>9.3f} {row['request_imbalance']:>9.2f}"
            )
        print()
    # Imported here: vLLM takes seconds to import and gevent patches nothing until used.
    from arc_dev.bench.dispatch import bench_dispatch
    from arc_dev.bench.plugin import bench_block_pool

    print("vLLM adapter: one sequential request stream through vLLM 0.32's BlockPool")
    print(
        f"{'pool':<12} {'policy':<7} {'block ops':>10} {'hit blocks':>10} {'ns/op':>8} {'ratio':>7}"
    )
    for row in bench_block_pool():
        print(
            f"{row['pool']:<12} {row['policy']:<7} {row['block_ops']:>10,} "
            f"{row['hit_blocks']:>10,} {row['ns_per_block_op']:>8.1f} "
            f"{row['ratio_vs_native']:>6.2f}x"
        )
    print("\nload test: open-loop dispatch lag (client work per request, no server)")
    print(f"{'rate/s':>7} {'requests':>9} {'lag p50 ms':>11} {'p90 ms':>8} {'p99 ms':>8}")
    for rate in (5.0, 20.0, 50.0):
        result = bench_dispatch(rate_rps=rate, requests=int(rate * 10))
        lag = result["dispatch_lag_s"]
        print(
            f"{rate:>7.0f} {result['requests']:>9} {lag['p50'] * 1000:>11.1f} "
            f"{lag['p90'] * 1000:>8.1f} {lag['p99'] * 1000:>8.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
