"""``make demo``: LRU, DBL and ARC side by side on a generated document-QA trace
and on the public Mooncake sample, across cache sizes, with plots.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from arc_evictor.generate import DocQAParams, docqa, write_generated
from arc_evictor.report import plot, table
from arc_evictor.simulate import sweep
from arc_evictor.traces import load_trace

REPO = Path(__file__).resolve().parent.parent
MOONCAKE_SAMPLE = REPO / "data" / "traces" / "mooncake_synthetic.jsonl"
POLICIES = ("lru", "dbl", "arc", "belady")
CAPACITY_SHARES = (0.05, 0.10, 0.20, 0.40)


def simulate_trace(path: Path, title: str, out: Path) -> None:
    requests = load_trace(path)
    distinct = len({key for request in requests for key in request.keys})
    capacities = [max(1, round(distinct * share)) for share in CAPACITY_SHARES]
    results = sweep(requests, POLICIES, capacities, sequential=True)
    print(
        f"\n== {title}: {len(requests):,} requests, {distinct:,} distinct blocks, sequential mode"
    )
    print("   capacities are 5%, 10%, 20% and 40% of the distinct blocks; belady is the bound")
    print(table(results))
    by_key = {(r.policy, r.capacity): r.block_hit_rate for r in results}
    gains = ", ".join(
        f"{share:.0%}: {100 * (by_key['arc', c] - by_key['lru', c]):+.1f}"
        for share, c in zip(CAPACITY_SHARES, capacities, strict=True)
    )
    print(f"ARC minus LRU block hit rate, points: {gains}")
    print(f"plot: {plot(results, out / (path.stem + '.png'), title)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="arc-evictor-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="output folder")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    docqa_path = args.out / "docqa.jsonl"
    params = DocQAParams()
    write_generated(docqa_path, docqa(params), "bailian")
    print(
        f"generated {docqa_path}: {params.documents} documents of ~{params.document_tokens} "
        f"tokens, ~{params.questions_per_document:g} questions each, Zipf exponent "
        f"{params.zipf_exponent}, seed {params.seed}"
    )
    simulate_trace(docqa_path, "document QA (generated)", args.out)
    simulate_trace(MOONCAKE_SAMPLE, "Mooncake synthetic sample", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
