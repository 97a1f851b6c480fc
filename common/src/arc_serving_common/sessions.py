"""Session keys: which requests of a trace belong to one conversation.

A session-keyed router (the vLLM router's ``consistent_hash``, and ``kv_aware`` with
session affinity, fed the ``X-Session-ID`` header) keeps one session on one replica, so
the key must name a conversation, not a prefix many conversations share. The load test
sends this key and the simulator's routers read the same one, so both place the same
requests together.

- A trace that links turns (Qwen-Bailian ``chat_id``/``parent_chat_id``): ``chat:<root>``,
  the root chat id of the conversation, following ``parent_chat_id`` back to the first
  turn, also past a parent the trace does not hold (a cut sample).
- A trace without links (Mooncake): a later turn's prompt is the earlier turn's prompt,
  its answer and a new question, so its full blocks start with all of the earlier turn's
  full blocks. The full blocks of the whole trace form a prefix tree (a chain key names
  its whole prefix, so it is a node of that tree). A node is an **opening** when the trace
  continues it with more than one different next block: several conversations share it
  (a system prompt, a document) and part there, which no single conversation does, since
  each turn of one conversation goes on where the previous turn went. The rule:

      A request continues the conversation of the latest earlier request whose full
      blocks end at the deepest node of its own path that ends any earlier request,
      unless that node is an opening. Otherwise it opens a conversation,
      ``line:<n>`` after its own line in the file.

  So a shared opening never joins the conversations that pass through it, whatever the
  order of the requests and however short the request that first ended there: whether a
  node is an opening is known from the whole trace before any key is given (one pass over
  the blocks), and keys are then given in file order from earlier requests only (a second
  pass that stops, per request, at its deepest earlier end), linear in the trace's blocks.

  What the blocks cannot tell: a first turn whose full blocks end at an opening (a
  question shorter than what fills the opening's last block, or one asked word for word in
  several conversations) shares nothing with its later turns that other conversations do
  not share too, so those later turns open a conversation of their own; and requests that
  end at the same node that is no opening (identical prompts, or a turn that added less
  than a block) are one conversation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from arc_serving_common.traces import TraceRequest

# A trace whose largest session holds more than this share of its requests is not a set of
# conversations a session-keyed router can spread (``crowded_session_warning``).
CROWDED_SESSION_SHARE = 0.25


def session_keys(requests: Sequence[TraceRequest]) -> list[str]:
    """The session key of each of ``requests`` (one whole trace, in file order)."""
    openings = _openings(requests)
    roots: dict[int, int] = {}  # every chat id seen -> its conversation's root chat id
    ends: dict[int, str] = {}  # last full-block key of every unlinked request seen -> its key
    names = []
    for request in requests:
        if request.chat_id is not None:
            parent = request.parent_id
            root = request.chat_id if parent is None else roots.get(parent, parent)
            roots[request.chat_id] = root
            names.append(f"chat:{root}")
            continue
        keys = request.keys
        session = None
        for key in reversed(keys):
            session = ends.get(key)
            if session is not None:
                if key in openings:
                    session = None
                break
        if session is None:
            session = f"line:{request.line}"
        if keys:
            ends[keys[-1]] = session
        names.append(session)
    return names


def _openings(requests: Sequence[TraceRequest]) -> set[int]:
    """The full-block keys of unlinked requests that the trace continues in more than one
    way (the module's openings)."""
    next_block: dict[int, int] = {}
    openings: set[int] = set()
    for request in requests:
        if request.chat_id is not None:
            continue
        keys = request.keys
        for depth in range(len(keys) - 1):
            node = keys[depth]
            if next_block.setdefault(node, keys[depth + 1]) != keys[depth + 1]:
                openings.add(node)
    return openings


def crowded_session_warning(keys: Sequence[str], trace: str) -> str | None:
    """A warning naming ``trace`` when one key holds more than ``CROWDED_SESSION_SHARE`` of
    its requests (a session-keyed router would send them all to one replica), else None."""
    if not keys:
        return None
    key, count = Counter(keys).most_common(1)[0]
    if count <= CROWDED_SESSION_SHARE * len(keys):
        return None
    return (
        f"{trace}: session {key} holds {count:,} of the trace's {len(keys):,} requests "
        f"({count / len(keys):.0%}); a router that keeps a session on one replica "
        "(consistent_hash, kv_aware with session affinity) sends them all to one"
    )
