"""One offline vLLM engine (``vllm.LLM``) at one ``max_num_seqs``: every policy's batch run.

``make demo-batch`` (``arc_dev.demo_batch``) starts this module once per engine, in a process
of its own at a lower CPU priority, with the plugin's variables (``ARC_EVICTOR_CONFIG``) or,
for the ``stock`` row, with none: vLLM loads the plugin through its own
``vllm.general_plugins`` entry point in every process it starts, and a process it has patched
cannot be unpatched, so the stock engine never shares a process with the plugin's.

For each policy in turn: rewrite the policy file and step the engine until the plugin reports
the switch (``arc_evictor_policy_info``), empty the prefix cache (``LLM.reset_prefix_cache``,
which also clears the policy's state), then ``LLM.generate`` the whole set at once. The
block counts are the plugin's counters (``arc_evictor_block_*``, read from the multiprocess
metrics directory as vLLM's API server reads them); on the stock engine vLLM's own per-request
prefix-cache hits (``RequestOutput.num_cached_tokens``) over the block size, over the set's
full prompt blocks. Latencies come from vLLM's request metrics (``RequestOutput.metrics``).

Invariant: a run is reported only when every prompt was answered with its requested number of
tokens and the engine ran the policy named (checked after the run); otherwise the process exits
with status 1 and a message. The results go to ``--result`` as JSON (``EngineResult``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from arc_dev.demo import (
    BLOCK_TOKENS,
    POLL_MS,
    STOCK,
    SWITCH_TIMEOUT_S,
    EngineCounters,
    parse_counters,
)
from arc_harness.vllm_server import write_policy_file
from arc_serving_common.traces import TraceRequest, load_trace

# The first long prompts of a fresh engine are slower; no run pays for them.
WARM_UP_LENGTHS = (1_000, 500, 250)


class BatchEngineError(RuntimeError):
    """A run did not complete as required; the message says which and why."""


@dataclass(frozen=True, slots=True)
class BatchRun:
    """One policy's ``generate`` over the whole set on one engine."""

    policy: str
    max_num_seqs: int
    requests: int
    block_queries: float
    block_hits: float
    cached_tokens: int  # vLLM's own count: RequestOutput.num_cached_tokens, summed
    output_tokens: int
    preemptions: int  # vLLM's count over the run's requests (each re-admission is re-queried)
    wall_s: float
    cpu_s: float  # the engine's CPU time (every thread), which other load does not inflate
    load_average: float  # 1-minute load average at the run's end: latencies depend on it
    ttft_s: list[float]  # per prompt, in the set's order: arrival to first token
    e2e_s: list[float]  # arrival to last token

    @property
    def block_hit_rate(self) -> float | None:
        return self.block_hits / self.block_queries if self.block_queries else None


def read_counters(metrics_dir: Path, *, plugin: bool) -> EngineCounters:
    """The engine's counters as vLLM's API server would serve them from ``metrics_dir``."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(metrics_dir))
    return parse_counters(generate_latest(registry).decode(), plugin=plugin)


def prompts_of(requests: Sequence[TraceRequest], tokenizer: Path, seed: int) -> list[list[int]]:
    """Token ids of every request, built as the load test builds them from hash ids
    (``arc_loadtest.tokens``): requests sharing hash ids share those blocks' tokens exactly."""
    from arc_loadtest.tokens import TokenMapper, vocabulary_from_tokenizer

    mapper = TokenMapper(vocabulary_from_tokenizer(tokenizer), seed=seed, block_tokens=BLOCK_TOKENS)
    return [mapper.prompt(request.hash_ids, request.input_length) for request in requests]


class BatchEngine:
    """The offline engine and the policy file it watches (None: the stock engine).

    Invariant: after ``prepare(name)`` the engine runs ``name`` (``stock``: vLLM's own order)
    and its prefix cache, and the policy's state, are empty.
    """

    def __init__(self, llm: Any, metrics_dir: Path, policy_file: Path | None) -> None:
        self.llm = llm
        self.metrics_dir = metrics_dir
        self.policy_file = policy_file

    @property
    def plugin(self) -> bool:
        return self.policy_file is not None

    def counters(self) -> EngineCounters:
        return read_counters(self.metrics_dir, plugin=self.plugin)

    def generate(self, prompts: Sequence[list[int]], output_tokens: Sequence[int]) -> list[Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
                  for n in output_tokens]  # fmt: skip
        inputs = [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts]
        return list(self.llm.generate(inputs, params, use_tqdm=False))

    def warm_up(self) -> None:
        self.generate([[4 + i % 1000 for i in range(n)] for n in WARM_UP_LENGTHS], [2] * 3)

    def prepare(self, name: str) -> None:
        """Switch to ``name`` (the plugin polls its file before a scheduler step, so each
        check runs a one-token request), then empty the prefix cache."""
        if self.policy_file is not None:
            write_policy_file(self.policy_file, name)
            deadline = time.monotonic() + SWITCH_TIMEOUT_S
            while self.counters().active_policy != name:
                if time.monotonic() > deadline:
                    raise BatchEngineError(
                        f"the engine did not switch to {name!r} within {SWITCH_TIMEOUT_S:.0f}s"
                    )
                time.sleep(POLL_MS / 1000)
                self.generate([[4, 5, 6, 7]], [1])
        elif name != STOCK:
            raise BatchEngineError(f"the engine without the plugin runs {STOCK!r}, not {name!r}")
        if not self.llm.reset_prefix_cache():
            raise BatchEngineError("vLLM refused to reset its prefix cache (blocks still held)")

    def run(
        self,
        name: str,
        max_num_seqs: int,
        requests: Sequence[TraceRequest],
        prompts: Sequence[list[int]],
    ) -> BatchRun:
        """``prepare(name)``, then generate every prompt at once and count what happened."""
        self.prepare(name)
        before = self.counters()
        started, cpu_started = time.monotonic(), cpu_seconds()
        outputs = self.generate(prompts, [request.output_length for request in requests])
        wall_s, cpu_s = time.monotonic() - started, cpu_seconds() - cpu_started
        after = self.counters()
        for request, output in zip(requests, outputs, strict=True):
            produced = len(output.outputs[0].token_ids)
            if produced != request.output_length:
                raise BatchEngineError(
                    f"{name}: request {request.index} produced {produced} tokens, asked for "
                    f"{request.output_length}"
                )
        cached_tokens = sum(output.num_cached_tokens or 0 for output in outputs)
        if self.plugin:
            if after.active_policy != name:
                raise BatchEngineError(f"the engine reports {after.active_policy!r} after {name}")
            queries = after.block_queries - before.block_queries
            hits = after.block_hits - before.block_hits
        else:
            queries = float(sum(request.num_blocks for request in requests))
            hits = cached_tokens / BLOCK_TOKENS
        ttft, e2e = zip(*(latencies(output) for output in outputs), strict=True)
        return BatchRun(
            name, max_num_seqs, len(outputs), queries, hits, cached_tokens,
            sum(len(output.outputs[0].token_ids) for output in outputs),
            sum(output.metrics.num_preemptions for output in outputs), wall_s, cpu_s,
            os.getloadavg()[0],
            list(ttft), list(e2e),
        )  # fmt: skip


def cpu_seconds() -> float:
    """User and system CPU time of this process, every thread: the engine core and its model
    run here (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def latencies(output: Any) -> tuple[float, float]:
    """(time to first token, end-to-end time) of one finished request from vLLM's request
    metrics: both from its arrival, which is the ``generate`` call for every prompt."""
    stats = output.metrics
    if stats is None:
        raise BatchEngineError("vLLM returned no request metrics (is disable_log_stats off?)")
    # arrival_time is the front end's wall clock, the token times the engine's monotonic one.
    return stats.first_token_latency, stats.first_token_latency + (
        stats.last_token_ts - stats.first_token_ts
    )


@dataclass(frozen=True, slots=True)
class EngineResult:
    """What one engine process reports: its start-up time and its runs."""

    max_num_seqs: int
    startup_s: float
    runs: list[BatchRun]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m arc_dev.batch_engine", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", type=Path, required=True, help="model folder")
    parser.add_argument("--trace", type=Path, required=True, help="the set (Bailian JSONL)")
    parser.add_argument("--token-seed", type=int, default=0, help="seed of the hash-id tokens")
    parser.add_argument("--max-num-seqs", type=int, required=True, help="vLLM's batch limit")
    parser.add_argument("--blocks", type=int, required=True, help="KV blocks, null block included")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--policies", required=True, help=f"comma-separated, or {STOCK!r}")
    parser.add_argument("--metrics-dir", type=Path, required=True, help="empty folder")
    parser.add_argument("--result", type=Path, required=True, help="JSON written here")
    args = parser.parse_args(argv)
    if args.max_num_seqs < 1:
        parser.error(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Start the engine (the plugin's settings come from the environment), run every policy,
    write the result; exit status 1 with a message when a run fails."""
    args = parse_args(argv)
    from vllm import LLM

    from arc_harness.vllm_server import cpu_dtype
    from arc_serving_common.names import CONFIG_ENV

    policies = [name.strip() for name in args.policies.split(",")]
    requests = load_trace(args.trace, block_tokens=BLOCK_TOKENS)
    prompts = prompts_of(requests, args.model, args.token_seed)
    started = time.monotonic()
    llm = LLM(
        model=str(args.model), block_size=BLOCK_TOKENS, enable_prefix_caching=True,
        num_gpu_blocks_override=args.blocks, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, enforce_eager=True, dtype=cpu_dtype(),
        disable_log_stats=False, seed=0,
    )  # fmt: skip
    startup_s = time.monotonic() - started
    config = os.environ.get(CONFIG_ENV)
    engine = BatchEngine(llm, args.metrics_dir, Path(config) if config else None)
    engine.warm_up()
    try:
        runs = [engine.run(name, args.max_num_seqs, requests, prompts) for name in policies]
    except BatchEngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    result = EngineResult(args.max_num_seqs, startup_s, runs)
    args.result.write_text(json.dumps(asdict(result), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
