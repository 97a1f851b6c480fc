"""The vLLM router's ring hash for ``consistent_hash``: mcrouter's FurcHash over MurmurHash64A.

``fbi_hash(key)`` is the position of ``key`` on the router's hash ring (vllm-project/router,
``src/policies/consistent_hash.rs``): FurcHash of the key's UTF-8 bytes into 2**23 - 1
buckets, then MurmurHash64A of that bucket number's four little-endian bytes. The ring holds
``"{worker_url}:{i}"`` for i in 0..159 per worker, so the same session key lands on the same
worker as in the router only when the simulator is given the router's worker URLs.

This follows the router's Rust port, not mcrouter's C where they differ: when every bit from
the depth down to 1 is 0, the port goes on to bit 0 (and returns 1 if it is set) where the C
returns 0. With 2**23 - 1 buckets that concerns one key in 2**23.
"""

from __future__ import annotations

_MASK = (1 << 64) - 1
_M = 0xC6A4A7935BD1E995
_R = 47
_SEED = 4193360111
_FURC_SHIFT = 23
_FURC_MAX_TRIES = 32
_RING_BUCKETS = (1 << 23) - 1


def _mix(k: int) -> int:
    k = (k * _M) & _MASK
    k ^= k >> _R
    return (k * _M) & _MASK


def _finish(h: int) -> int:
    h ^= h >> _R
    h = (h * _M) & _MASK
    return h ^ (h >> _R)


def murmur_hash_64a(key: bytes, seed: int = _SEED) -> int:
    """MurmurHash64A of ``key``, as 64 unsigned bits."""
    h = (seed ^ (len(key) * _M)) & _MASK
    whole = len(key) - len(key) % 8
    for at in range(0, whole, 8):
        h ^= _mix(int.from_bytes(key[at : at + 8], "little"))
        h = (h * _M) & _MASK
    if whole < len(key):
        h ^= int.from_bytes(key[whole:], "little")
        h = (h * _M) & _MASK
    return _finish(h)


def _rehash(k: int) -> int:
    h = (_SEED ^ (8 * _M)) & _MASK
    h ^= _mix(k)
    h = (h * _M) & _MASK
    return _finish(h)


def furc_hash(key: bytes, buckets: int) -> int:
    """FurcHash of ``key`` into ``buckets`` buckets (0 for one bucket or after 32 tries)."""
    if buckets <= 1:
        return 0
    words: list[int] = []  # 64-bit words of the key's bit stream, generated on demand

    def bit(index: int) -> int:
        word = index >> 6
        while len(words) <= word:
            words.append(murmur_hash_64a(key) if not words else _rehash(words[-1]))
        return (words[word] >> (index & 63)) & 1

    depth = (buckets - 1).bit_length()
    position = depth
    for _ in range(_FURC_MAX_TRIES):
        while not bit(position):
            if depth == 0:
                return 0
            depth -= 1
            position = depth
        position += _FURC_SHIFT
        number = 1
        for _ in range(max(depth - 1, 0)):
            number = (number << 1) | bit(position)
            position += _FURC_SHIFT
        if number < buckets:
            return number
    return 0


def fbi_hash(key: str) -> int:
    """The key's position on the router's hash ring."""
    bucket = furc_hash(key.encode(), _RING_BUCKETS)
    return murmur_hash_64a(bucket.to_bytes(4, "little"))
