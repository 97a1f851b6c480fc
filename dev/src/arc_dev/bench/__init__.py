"""``make bench``: speed and memory figures measured side by side in one run.

1. Policy core: block accesses per second for each policy in sequential mode on
   two generated traces of about one million block accesses each, document QA
   (where ``trio``'s LFU leads) and multi-turn conversations (where its ARC and LRU
   lead), each policy's time relative to LRU's and to ARC's (``trio`` is meant to
   take at most twice ARC's time), and the bytes it holds per cache block; the
   compiled policy core here, and right after each policy the pure-Python one in a child
   process (``ARC_EVICTOR_PURE_PYTHON=1``) on the same trace.
2. Routed simulator: the same traces through a fleet of 8 replicas behind the
   ``kv_aware`` router (``arc_simulator.fleet``), sequential mode, each replica as
   large as the single cache above; block accesses per second relative to the
   same fleet code with one replica.
3. vLLM adapter: the same request stream through vLLM's own BlockPool with its
   native LRU free queue and with the plugin's policies, and the ratio.
3b. Per scheduler step at a GPU server's scale (``arc_dev.bench.step``): a document-QA
   stream through vLLM's real KVCacheManager with pools of 30,000 and 100,000 blocks and
   64 and 256 running requests; the microseconds of manager calls per step natively and
   with each policy, what the plugin adds and its share of a 10 ms step; then the plugin's
   bytes per cached block at those pools, as a share of a 7-8B model's KV block.
4. Whole process: ``arc-evictor simulate --sequential --policy arc`` on a generated
   12,000-request conversation trace against ``arc_dev.bench.reference``, a naive
   single-file ARC simulator, wall time of each whole process.
5. Load test: the open-loop dispatcher's lag at several request rates.

Targets (docs/benchmarks.md) are printed with whether this run reached them.

Figures vary with the machine; ratios from one run are what to compare.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from arc_evictor.policies import compiled, make_policy, policy_names
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
WHOLE_PROCESS_REQUESTS = 12_000
# The speed targets (docs/benchmarks.md), checked on this run's figures.
TARGET_PLUGIN_RATIO = {"lru": 1.3, "arc": 1.3, "trio": 2.0}
TARGET_ARC_DOCQA_ACCESSES = 2_000_000
TARGET_WHOLE_PROCESS_RATIO = 0.6


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


def replay_seconds(
    requests: list[TraceRequest], name: str, capacity: int, repeats: int
) -> tuple[float, float]:
    """Best-of-``repeats`` sequential replay time of policy ``name``, and its block hit rate."""
    best = float("inf")
    hit_rate = 0.0
    for _ in range(repeats):
        policy = make_policy(name, capacity)
        gc.collect()
        started = time.perf_counter()
        result = simulate_sequential(requests, policy)
        best = min(best, time.perf_counter() - started)
        hit_rate = result.block_hit_rate
    return best, hit_rate


def bench_policies(
    requests: list[TraceRequest],
    capacity: int,
    repeats: int,
    pure_speed: Callable[[str], float] | None = None,
) -> list[dict]:
    """Best-of-``repeats`` sequential replay time, and retained memory, of every policy; with
    ``pure_speed``, each policy's pure-Python speed measured right after its own."""
    accesses = sum(request.num_blocks for request in requests)
    rows = []
    for name in policy_names():
        seconds, hit_rate = replay_seconds(requests, name, capacity, repeats)
        rows.append(
            {
                "policy": name,
                "accesses": accesses,
                "seconds": seconds,
                "accesses_per_second": accesses / seconds,
                "pure_accesses_per_second": pure_speed(name) if pure_speed else None,
                "block_hit_rate": hit_rate,
                "bytes_per_block": retained_bytes(requests, name, capacity) / capacity,
            }
        )
    seconds_by_policy = {row["policy"]: row["seconds"] for row in rows}
    for row in rows:
        row["time_vs_lru"] = row["seconds"] / seconds_by_policy["lru"]
        row["time_vs_arc"] = row["seconds"] / seconds_by_policy["arc"]
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


def pure_python_speed(
    kind: str, name: str, accesses: int, capacity_fraction: float, repeats: int
) -> float:
    """Accesses per second of policy ``name`` with the pure-Python policy core, measured in a
    child process (the compiled modules are loaded here) on the same generated trace."""
    command = [
        sys.executable,
        "-m",
        "arc_dev.bench",
        "--policy-core-only",
        kind,
        "--policy",
        name,
        "--accesses",
        str(accesses),
        "--repeats",
        str(repeats),
        "--capacity-fraction",
        str(capacity_fraction),
    ]
    env = {**os.environ, "ARC_EVICTOR_PURE_PYTHON": "1"}
    output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return float(output)


def bench_whole_process(folder: Path, repeats: int) -> dict[str, float]:
    """Best-of-``repeats`` wall time of ``arc-evictor simulate`` and of the naive reference,
    each a whole process (start-up, trace parsing, replay), on one generated trace."""
    sample = ConversationParams()
    sessions = round(sample.sessions * WHOLE_PROCESS_REQUESTS / len(conversation(sample)))
    requests = conversation(ConversationParams(sessions=sessions))
    trace = folder / "conversation.jsonl"
    write_generated(trace, requests, "bailian")
    distinct = len({key for request in load_trace(trace) for key in request.keys})
    capacity = str(max(1, distinct // 10))
    commands = {
        "simulate": [
            sys.executable,
            "-m",
            "arc_simulator.cli",
            "simulate",
            str(trace),
            "--policy",
            "arc",
            "--capacity",
            capacity,
            "--sequential",
        ],
        "reference": [sys.executable, "-m", "arc_dev.bench.reference", str(trace), capacity],
    }
    best = dict.fromkeys(commands, float("inf"))
    for _ in range(repeats):
        for name, command in commands.items():  # taking turns, as the other benches do
            started = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            best[name] = min(best[name], time.perf_counter() - started)
    return {"requests": len(requests), "capacity": int(capacity), **best}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="arc-evictor-bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--accesses", type=int, default=1_000_000, help="block accesses in each trace"
    )
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument(
        "--capacity-fraction", type=float, default=0.1, help="cache size over distinct blocks"
    )
    parser.add_argument(
        "--step-repeats", type=int, default=2, help="best of this many per-step replays"
    )
    parser.add_argument(
        "--steps-only",
        action="store_true",
        help="only the per-step and memory figures at serving scale (arc_dev.bench.step)",
    )
    # The child process of pure_python_speed: one policy on one trace, accesses per second.
    parser.add_argument("--policy-core-only", choices=BENCH_TRACES, help=argparse.SUPPRESS)
    parser.add_argument("--policy", choices=policy_names(), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.policy_core_only:
        requests = bench_trace(args.policy_core_only, args.accesses)
        distinct = len({key for request in requests for key in request.keys})
        capacity = max(1, int(distinct * args.capacity_fraction))
        seconds, _ = replay_seconds(requests, args.policy, capacity, args.repeats)
        print(sum(request.num_blocks for request in requests) / seconds)
        return 0
    print(f"policy core: {'compiled (mypyc)' if compiled() else 'pure Python'}\n")
    if args.steps_only:
        from arc_dev.bench import step

        step.main(args.step_repeats)
        return 0
    routed_inputs = []
    arc_docqa = 0.0
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
            f"{'policy':<8} {'accesses/s':>12} {'pure Py/s':>12} {'speed-up':>9} {'seconds':>8} "
            f"{'time/LRU':>9} {'time/ARC':>9} {'hit rate':>9} {'bytes/block':>12}"
        )
        rows = bench_policies(
            requests,
            capacity,
            args.repeats,
            lambda name, kind=kind: pure_python_speed(
                kind, name, args.accesses, args.capacity_fraction, args.repeats
            ),
        )
        for row in rows:
            speed, pure_speed = row["accesses_per_second"], row["pure_accesses_per_second"]
            print(
                f"{row['policy']:<8} {speed:>12,.0f} {pure_speed:>12,.0f} "
                f"{speed / pure_speed:>8.2f}x {row['seconds']:>8.3f} {row['time_vs_lru']:>8.2f}x "
                f"{row['time_vs_arc']:>8.2f}x {row['block_hit_rate']:>9.3f} "
                f"{row['bytes_per_block']:>12,.0f}"
            )
            if kind == "docqa" and row["policy"] == "arc":
                arc_docqa = speed
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
        f"{'pool':<12} {'policy':<7} {'block ops':>10} {'hit blocks':>10} {'ns/op':>8} "
        f"{'ratio':>7} {'policy ns/op':>13} {'rest ratio':>11}"
    )
    plugin_ratios = {}
    rows = bench_block_pool()
    native_ns = rows[0]["ns_per_block_op"]
    for row in rows:
        policy_ns = row["policy_ns_per_block_op"]
        # The rest: the adapter's and vLLM's Python around the policy calls, over native.
        share = (
            f"{policy_ns:>13.1f} {(row['ns_per_block_op'] - policy_ns) / native_ns:>10.2f}x"
            if policy_ns is not None
            else ""
        )
        print(
            f"{row['pool']:<12} {row['policy']:<7} {row['block_ops']:>10,} "
            f"{row['hit_blocks']:>10,} {row['ns_per_block_op']:>8.1f} "
            f"{row['ratio_vs_native']:>6.2f}x {share}".rstrip()
        )
        if row["pool"] == "plugin":
            plugin_ratios[row["policy"]] = row["ratio_vs_native"]
    from arc_dev.bench import step

    print()
    step.main(args.step_repeats)
    with tempfile.TemporaryDirectory() as folder:
        whole = bench_whole_process(Path(folder), args.repeats)
    whole_ratio = whole["simulate"] / whole["reference"]
    print(
        f"\nwhole process: {whole['requests']:,}-request conversation trace, arc, "
        f"{whole['capacity']:,} blocks, sequential; best of {args.repeats}, wall time"
    )
    print(f"{'program':<44} {'seconds':>8} {'ratio':>7}")
    print(f"{'arc-evictor simulate':<44} {whole['simulate']:>8.2f} {whole_ratio:>6.2f}x")
    reference = "naive reference (arc_dev.bench.reference)"
    print(f"{reference:<44} {whole['reference']:>8.2f} {1:>6.2f}x")
    print("\ntargets")
    checks = [
        (f"plugin {name} <= {limit}x native", plugin_ratios[name] <= limit)
        for name, limit in TARGET_PLUGIN_RATIO.items()
    ]
    checks.append(
        (
            f"simulator arc >= {TARGET_ARC_DOCQA_ACCESSES:,} accesses/s on docqa",
            arc_docqa >= TARGET_ARC_DOCQA_ACCESSES,
        )
    )
    checks.append(
        (
            f"whole-process simulate <= {TARGET_WHOLE_PROCESS_RATIO}x reference",
            whole_ratio <= TARGET_WHOLE_PROCESS_RATIO,
        )
    )
    for label, reached in checks:
        print(f"  {'reached' if reached else 'missed ':<8} {label}")
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
