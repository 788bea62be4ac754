"""A consistent-hash ring: sticky sessions for the router (``qwen-ops router --policy consistent_hash``).

    ring = HashRing(["http://a:8001", "http://b:8002"])
    ring.lookup("user-42")                          # the same member for the same key, every time
    ring.lookup("user-42", live={0})                # its member is down: the next live one on the ring

Each member owns ``vnodes`` points on a ring of 64-bit hashes (its name and the point's number,
hashed); a key belongs to the member of the first point at or after the key's hash, going round.
A member that is down is skipped, so only the keys it owned move (each to the next live point after
it, spread over the other members by the virtual nodes), and they move back when it is up again.

The hash is BLAKE2b, not Python's ``hash()`` (salted per process): a key lands on the same member
across router restarts and in every router in front of the same workers.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Collection, Optional, Sequence

__all__ = ["HashRing", "ring_hash"]

DEFAULT_VNODES = 160      # points per member: the spread of keys over members is within a few percent


def ring_hash(text: str) -> int:
    """A stable 64-bit hash of ``text`` (the same in every process)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


class HashRing:
    """The ring over ``members`` (names, e.g. worker URLs), ``vnodes`` points each. Lookups answer the
    member's index in ``members``."""

    def __init__(self, members: Sequence[str], vnodes: int = DEFAULT_VNODES):
        if isinstance(vnodes, bool) or not isinstance(vnodes, int) or vnodes < 1:
            raise ValueError(f"vnodes = {vnodes!r}, expected an int >= 1")
        if not members:
            raise ValueError("members = [], expected at least one member")
        if len(set(members)) != len(members):
            raise ValueError(f"members = {list(members)!r} has duplicates, expected distinct names")
        self.members = list(members)
        points = sorted((ring_hash(f"{name}#{v}"), i) for i, name in enumerate(self.members) for v in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [i for _, i in points]

    def lookup(self, key: str, live: Optional[Collection[int]] = None) -> int:
        """The index of the member that owns ``key``: the first point at or after its hash whose
        member is in ``live`` (default: every member). ``LookupError`` when ``live`` is empty."""
        if live is not None and not any(0 <= i < len(self.members) for i in live):
            raise LookupError(f"no live member (live = {sorted(live)!r}) to own key {key!r}")
        start = bisect.bisect_left(self._hashes, ring_hash(key))
        n = len(self._owners)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if live is None or owner in live:
                return owner
        raise AssertionError("unreachable: a live member owns points on the ring")
