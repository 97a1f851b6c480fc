"""Session keys: which requests of a trace belong to one conversation.

A session-keyed router (the vLLM router's ``consistent_hash``, fed the ``X-Session-ID``
header) keeps one session on one replica, so the key must name a conversation, not a
prefix many conversations share. The load test sends this key and the simulator's
``consistent_hash`` hashes it, so both place the same requests together.

- A trace that links turns (Qwen-Bailian ``chat_id``/``parent_chat_id``): the root chat
  id of the conversation, following ``parent_chat_id`` back to the first turn, also past
  a parent the trace does not hold (a cut sample).
- A trace without links (Mooncake): a later turn's prompt is the earlier turn's prompt,
  its answer and a new question, so its full blocks start with all the earlier turn's
  full blocks. A request continues the conversation of the earlier request whose whole
  run of full blocks is the longest prefix of its own; with none it opens a
  conversation named by its own last full block (a chain key: it names the whole
  prefix), or by its first hash id when it has no full block. Two conversations that
  share an opening block (a system prompt) diverge after it and get different keys;
  they are joined only when an earlier request's whole prompt was that opening.
"""

from __future__ import annotations

from arc_serving_common.traces import TraceRequest


class SessionKeys:
    """Session keys for the requests of one trace, given in file order.

    Invariants: ``_roots`` maps every chat id seen to its conversation's root chat id;
    ``_ends`` maps the last full-block key of every unlinked request seen (with a full
    block) to that request's session key.
    """

    def __init__(self) -> None:
        self._roots: dict[int, int] = {}
        self._ends: dict[int, str] = {}

    def key(self, request: TraceRequest) -> str:
        """The session key of ``request``, the next request of the trace."""
        if request.chat_id is not None:
            parent = request.parent_id
            root = request.chat_id if parent is None else self._roots.get(parent, parent)
            self._roots[request.chat_id] = root
            return f"chat:{root}"
        keys = request.keys
        if not keys:
            return f"chain:{request.hash_ids[0]}"  # never empty: input_length >= 1
        ends = self._ends
        session = None
        for key in reversed(keys):
            session = ends.get(key)
            if session is not None:
                break
        if session is None:
            session = f"chain:{keys[-1]}"
        ends[keys[-1]] = session
        return session
