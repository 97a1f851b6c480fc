"""Names several products agree on (docs/architecture.md, "Contracts").

The vLLM plugin owns the policies and the metrics; the operator validates a ServingPolicy's
``policy`` and reads the pods' metrics by these names without importing the plugin (whose
package registers a vLLM entry point the operator image must not carry).
"""

from __future__ import annotations

import json

# Lower-case eviction policy names, in the order the plugin's registry lists them.
POLICY_NAMES: tuple[str, ...] = ("lru", "dbl", "arc", "s3fifo", "sieve", "trio")

# The plugin's Prometheus metrics, as served on vLLM's /metrics (counters end in _total).
METRIC_NAMES: tuple[str, ...] = (
    "arc_evictor_policy_info",
    "arc_evictor_block_queries_total",
    "arc_evictor_block_hits_total",
    "arc_evictor_ghost_hits_total",
    "arc_evictor_evictions_total",
    "arc_evictor_resident_blocks",
    "arc_evictor_ghost_blocks",
    "arc_evictor_target_recency_blocks",
    "arc_evictor_policy_switches_total",
)

# The plugin's settings, read from the serving pod's environment (docs/architecture.md,
# "Plugin settings"), and the variable vLLM reads its API key from when --api-key is absent.
POLICY_ENV = "ARC_EVICTOR_POLICY"
CONFIG_ENV = "ARC_EVICTOR_CONFIG"
POLL_MS_ENV = "ARC_EVICTOR_POLL_MS"
API_KEY_ENV = "VLLM_API_KEY"
# The policy file's one key: the file is ``{"policy": NAME}``, nothing else.
POLICY_FILE_KEY = "policy"
# The vLLM router's kv_aware temperature a fleet runs with unless told otherwise: the operator
# passes it to the router, and the fleet demo and its prediction use it (docs/routing.md).
KV_AWARE_ROUTER_TEMPERATURE = 1.0
# The vLLM router's bound on kv_aware's session affinity TTL, in whole seconds from 1: the
# operator checks routing.args against it, the simulator its --session-affinity-ttl.
MAX_SESSION_AFFINITY_TTL_S = 31_536_000


def policy_file_text(policy: str) -> str:
    """The policy file's whole content (``CONFIG_ENV`` points at it): ``{"policy": NAME}``."""
    return json.dumps({POLICY_FILE_KEY: policy}) + "\n"
