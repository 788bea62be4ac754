"""Which data-parallel replica takes a request: by load counted in tokens, and by cached prefix.

    balancer = Balancer(num_replicas=2, block_size=16, cache_blocks=1024)
    ticket = balancer.assign(prompt_ids, max_new_tokens=64)      # ticket.replica: where it goes
    balancer.update(ticket, generated=5)                          # as outputs come back
    balancer.release(ticket)                                      # finished, failed or aborted

Load is tracked here, from what was sent and what came back (never from a replica's stats, which
are one step old at best): a replica's load is the sum over its unfinished requests of the prompt
tokens it still has to prefill (those its prefix cache does not hold, as far as this balancer
knows) plus the tokens it may still generate (``max_new_tokens`` x ``n`` less those returned).

Prefix affinity: each replica keeps a bounded LRU set of the chained hashes of the full
``block_size``-token blocks of the prompts sent to it (block ``i``'s key hashes block ``i - 1``'s
key and its tokens, as the KV cache's keys do, so a key names the whole prefix up to it). A
request goes to the replica holding the longest run of its leading keys, unless that replica's
load exceeds the least-loaded replica's by more than ``margin_tokens``; then, and when no replica
holds any block, to the least-loaded one. Ties go to the lower load, then the lower index.

The set is a guess at what the replica's cache holds (it may have evicted blocks since): a wrong
guess costs a recompute there, never a wrong answer. Its size is the replica's KV capacity in
blocks (``cache_blocks``), so it forgets about as fast as the cache can.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["POLICIES", "Balancer", "Ticket", "prefix_block_keys"]

DEFAULT_MARGIN_TOKENS = 2048
POLICIES = ("cache_aware", "least_load", "round_robin")


def prefix_block_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained key of each full ``block_size``-token block of ``token_ids`` (the last partial
    block has none): key ``i`` = hash(key ``i - 1``, block ``i``'s tokens)."""
    keys, parent = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        keys.append(parent)
    return keys


@dataclass
class Ticket:
    """One request's share of its replica's load (``Balancer.assign``'s receipt)."""

    replica: int
    prefill_tokens: int          # prompt tokens the replica must compute (0 once an output came back)
    max_decode_tokens: int       # tokens it may generate, all completions together
    matched_blocks: int          # leading prompt blocks the chosen replica was believed to hold
    generated: int = 0           # tokens returned so far
    released: bool = field(default=False)

    @property
    def load(self) -> int:
        return 0 if self.released else self.prefill_tokens + max(0, self.max_decode_tokens - self.generated)


class Balancer:
    """The routing policy over ``num_replicas`` replicas (module docstring). Not thread-safe: the
    server calls it from its one event loop."""

    def __init__(self, num_replicas: int, *, block_size: int = 16, cache_blocks: int = 4096,
                 margin_tokens: int = DEFAULT_MARGIN_TOKENS, prefix_affinity: bool = True,
                 policy: str = "cache_aware"):
        for name, value, low in (("num_replicas", num_replicas, 1), ("block_size", block_size, 1),
                                 ("cache_blocks", cache_blocks, 1), ("margin_tokens", margin_tokens, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} = {value!r}, expected an int >= {low}")
        if not isinstance(prefix_affinity, bool):
            raise ValueError(f"prefix_affinity = {prefix_affinity!r}, expected True or False")
        if policy not in POLICIES:
            raise ValueError(f"policy = {policy!r}, expected one of {', '.join(map(repr, POLICIES))}")
        # cache_aware: prefix affinity within the margin, else the least loaded (the module docstring);
        # least_load: the least loaded only; round_robin: in turn, whatever the load (a baseline to measure by)
        self.policy = policy
        self._turn = 0
        self.num_replicas = num_replicas
        self.prefix_affinity = prefix_affinity     # False: the replicas cache no prefixes; load alone decides
        self.block_size = block_size
        self.cache_blocks = cache_blocks
        self.margin_tokens = margin_tokens
        self._load = [0] * num_replicas
        self._cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._up = [True] * num_replicas
        self._external = [0] * num_replicas        # load a replica reports beyond what was sent through here
        self.num_assigned = [0] * num_replicas
        self.num_affinity = 0        # requests sent where a prefix was held (not the least-loaded fallback)

    def load(self, replica: int) -> int:
        """Tokens ``replica`` still has to prefill or may still generate, by this balancer's count,
        plus what it reported of work sent to it by others (``set_external_load``)."""
        return self._load[replica] + self._external[replica]

    def loads(self) -> list[int]:
        return [self.load(r) for r in range(self.num_replicas)]

    def set_external_load(self, replica: int, tokens: int) -> None:
        """Work on ``replica`` that did not go through this balancer (another router, a direct
        client), in tokens, as read from the replica itself; it weighs in every choice until the
        next reading. (Its own tickets still count separately, so they are never counted twice
        as long as the reading leaves them out.)"""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens = {tokens!r}, expected an int >= 0")
        self._external[replica] = tokens

    def is_up(self, replica: int) -> bool:
        return self._up[replica]

    def mark_down(self, replica: int) -> None:
        """``replica`` takes no new requests (dead, hung or restarting) and its cache is forgotten:
        a restarted replica starts empty. Its tickets leave its load as they are released."""
        self._up[replica] = False
        self._cached[replica].clear()
        self._external[replica] = 0

    def mark_up(self, replica: int) -> None:
        self._up[replica] = True

    def matched_blocks(self, replica: int, keys: Sequence[int]) -> int:
        """How many leading ``keys`` ``replica`` is believed to hold."""
        cached, n = self._cached[replica], 0
        for key in keys:
            if key not in cached:
                break
            n += 1
        return n

    def choose(self, keys: Sequence[int], exclude: Sequence[int] = ()) -> tuple[int, int]:
        """The replica for a prompt with block ``keys``, and how many of them it holds: one that is
        up and not in ``exclude``. ``LookupError`` when there is none."""
        live = [r for r in range(self.num_replicas) if self._up[r] and r not in exclude]
        if not live:
            raise LookupError(f"no replica is up (of {self.num_replicas}"
                              + (f", excluding {sorted(exclude)}" if exclude else "") + ")")
        if self.policy == "round_robin":
            self._turn += 1
            r = live[(self._turn - 1) % len(live)]
            return r, self.matched_blocks(r, keys)
        matched = {r: self.matched_blocks(r, keys) for r in live}
        load = {r: self.load(r) for r in live}
        least = min(live, key=lambda r: (load[r], r))
        best = min(live, key=lambda r: (-matched[r], load[r], r))
        if (self.policy == "cache_aware" and matched[best] > 0
                and load[best] - load[least] <= self.margin_tokens):
            return best, matched[best]
        return least, matched[least]

    def assign(self, prompt_ids: Sequence[int], max_new_tokens: int, n: int = 1,
               exclude: Sequence[int] = ()) -> Ticket:
        """Pick the replica (up, not in ``exclude``) for a prompt that may generate ``max_new_tokens``
        tokens in each of its ``n`` completions; count its load there and remember its blocks there.
        ``LookupError`` when no replica is up."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens = {max_new_tokens!r}, expected an int >= 0")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n = {n!r}, expected an int >= 1")
        keys = prefix_block_keys(prompt_ids, self.block_size) if self.prefix_affinity else []
        replica, matched = self.choose(keys, exclude)
        if matched:
            self.num_affinity += 1
        ticket = Ticket(replica, len(prompt_ids) - matched * self.block_size, max_new_tokens * n, matched)
        self._load[replica] += ticket.load
        self.num_assigned[replica] += 1
        cached = self._cached[replica]
        for key in keys:
            cached[key] = None
            cached.move_to_end(key)
        while len(cached) > self.cache_blocks:
            cached.popitem(last=False)
        return ticket

    def update(self, ticket: Ticket, generated: int) -> None:
        """An output came back: the prompt is prefilled and ``generated`` tokens (all completions
        together, so far) are out."""
        if ticket.released:
            return
        before = ticket.load
        ticket.prefill_tokens = 0
        ticket.generated = max(ticket.generated, generated)
        self._load[ticket.replica] -= before - ticket.load

    def release(self, ticket: Ticket) -> None:
        """The request finished (or failed, or was aborted): its remaining load leaves its replica."""
        if not ticket.released:
            self._load[ticket.replica] -= ticket.load
            ticket.released = True
