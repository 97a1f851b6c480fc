"""Helpers of the serving fault tests: a real vLLM server's model and trace, and its metrics."""

from __future__ import annotations

from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from arc_harness.vllm_server import VllmServer
from arc_serving_common.traces import write_trace
from arc_simulator.generate import DocQAParams, docqa, to_records

BLOCK_TOKENS = 32  # vLLM's CPU block size must be a multiple of 32


def docqa_trace(path: Path, *, count: int, spacing_s: float, seed: int = 0) -> Path:
    """A document-QA trace (Bailian form) of ``count`` small requests ``spacing_s`` apart.

    Six documents of about 200 tokens under Zipf popularity: prefixes repeat, so the cache
    holds blocks that a switch could lose, and the pool (64 blocks) has to evict.
    """
    params = DocQAParams(
        documents=6,
        document_tokens=200,
        questions_per_document=count / 6,
        question_tokens=16,
        output_tokens=3,
        seed=seed,
    )
    records = list(to_records(docqa(params), "bailian", BLOCK_TOKENS))
    for number, record in enumerate(records):
        record["timestamp"] = round(spacing_s * number, 3)  # a steady, even load
    write_trace(path, records)
    return path


def metric_sum(server: VllmServer, name: str) -> float:
    """The sum of every series of metric ``name`` on the server's /metrics."""
    response = requests.get(f"{server.base_url}/metrics", timeout=10)
    response.raise_for_status()
    return sum(
        sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == name
    )
