"""A naive single-file ARC simulator: the yardstick for ``arc-evictor simulate``'s whole run.

``python -m arc_dev.bench.reference TRACE CAPACITY`` reads a Qwen-Bailian trace (JSON lines,
16 tokens a hash id, keys chained per request), replays it one request at a time through
ARC (the paper's Figure 4, no pinning: a request's blocks are accessed tail first after its
hit is counted) on a dict and OrderedDicts, and prints the block hit rate. It validates
nothing and imports nothing of this repository, which is what makes it the yardstick; its
hit rate differs slightly from the simulator's, which pins a request's blocks.
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from collections.abc import Hashable

BLOCK_TOKENS = 16


class NaiveARC:
    """ARC over T1, T2 (resident) and B1, B2 (ghost), each an OrderedDict, LRU first."""

    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.p = 0.0
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self.t1 or key in self.t2

    def _replace(self, in_b2: bool) -> None:
        t1 = len(self.t1)
        if t1 and (t1 > self.p or (in_b2 and t1 == self.p)):
            key, _ = self.t1.popitem(last=False)
            self.b1[key] = None
        else:
            key, _ = self.t2.popitem(last=False)
            self.b2[key] = None

    def access(self, key: Hashable) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)
        elif key in self.b1:
            self.p = min(self.p + max(len(self.b2) / len(self.b1), 1.0), float(self.c))
            self._replace(False)
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(self.p - max(len(self.b1) / len(self.b2), 1.0), 0.0)
            self._replace(True)
            del self.b2[key]
            self.t2[key] = None
        else:
            if len(self.t1) + len(self.b1) == self.c:
                if len(self.t1) < self.c:
                    self.b1.popitem(last=False)
                    self._replace(False)
                else:
                    self.t1.popitem(last=False)
            else:
                total = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
                if total >= self.c:
                    if total == 2 * self.c:
                        self.b2.popitem(last=False)
                    self._replace(False)
            self.t1[key] = None


def main(argv: list[str]) -> int:
    path, capacity = argv[0], int(argv[1])
    arc = NaiveARC(capacity)
    chain: dict[tuple[int, int], int] = {}
    queries = hits = 0
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            request = json.loads(line)
            keys = []
            previous = -1
            for hash_id in request["hash_ids"][: request["input_length"] // BLOCK_TOKENS]:
                previous = chain.setdefault((previous, hash_id), len(chain))
                keys.append(previous)
            prefix = 0
            while prefix < len(keys) and keys[prefix] in arc:
                prefix += 1
            queries += len(keys)
            hits += prefix
            for key in reversed(keys):
                arc.access(key)
    print(f"block hit rate {hits / max(queries, 1):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
