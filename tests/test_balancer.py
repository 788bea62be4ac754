"""The data-parallel routing policy (qwen_ops/serving/balancer.py) on a fake replica set: pure
Python, no engine. The oracle is a plain count written here: which prompts went where, and the
tokens each replica was sent minus what came back."""

from __future__ import annotations

import random

import pytest

from qwen_ops.serving.balancer import Balancer, prefix_block_keys

BLOCK = 16


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(length)]


def test_keys_are_chained_and_block_aligned():
    a = prompt(0, 40)                                   # two full blocks, one partial
    b = a[:16] + [a[16] + 1] + a[17:]                   # differs in block 1 only
    ka, kb = prefix_block_keys(a, BLOCK), prefix_block_keys(b, BLOCK)
    assert len(ka) == 2 and ka[0] == kb[0] and ka[1] != kb[1]
    # the same block after a different prefix has a different key (the chain)
    c = prompt(1, 16) + a[16:32]
    assert prefix_block_keys(c, BLOCK)[1] != ka[1]
    assert prefix_block_keys(a[:15], BLOCK) == []


def test_ties_go_to_lowest_index_then_spread_by_load():
    bal = Balancer(3, block_size=BLOCK)
    picks = [bal.assign(prompt(i, 10), max_new_tokens=5).replica for i in range(3)]
    assert picks == [0, 1, 2]                           # equal cost: each new request goes to the emptiest
    assert bal.loads() == [15, 15, 15]


def test_load_counts_prompt_and_remaining_tokens():
    bal = Balancer(2, block_size=BLOCK)
    t0 = bal.assign(prompt(0, 100), max_new_tokens=50, n=2)
    assert (t0.replica, bal.load(0)) == (0, 100 + 2 * 50)
    bal.update(t0, generated=30)                        # prefilled; 30 of its 100 tokens out
    assert bal.load(0) == 70
    bal.update(t0, generated=20)                        # a stale (smaller) count changes nothing
    assert bal.load(0) == 70
    t1 = bal.assign(prompt(1, 10), max_new_tokens=10)
    assert t1.replica == 1                              # 20 < 70
    bal.release(t0)
    bal.release(t0)                                     # idempotent
    assert bal.loads() == [0, 20]


def test_affinity_sends_a_shared_prefix_to_the_replica_that_served_it():
    bal = Balancer(2, block_size=BLOCK)
    first = [bal.assign(prompt(i, 64), max_new_tokens=8) for i in range(4)]
    assert [t.replica for t in first] == [0, 1, 0, 1]
    for t in first:
        bal.release(t)
    # a second turn: the first turn's prompt plus more; the replica loads are equal again
    for i, t in enumerate(first):
        follow = bal.assign(prompt(i, 64) + prompt(100 + i, 30), max_new_tokens=8)
        assert follow.replica == t.replica
        assert follow.matched_blocks == 4
        assert follow.prefill_tokens == 94 - 64        # the held blocks are not counted as load
        bal.release(follow)


def test_longest_prefix_wins_over_a_shorter_one():
    bal = Balancer(2, block_size=BLOCK)
    base = prompt(0, 64)
    a = bal.assign(base[:16] + prompt(1, 48), max_new_tokens=1)   # replica 0 holds block 0 of base
    b = bal.assign(base, max_new_tokens=1)                           # replica 0 again: it holds 1 block
    assert (a.replica, b.replica) == (0, 0)
    bal.release(a)
    bal.release(b)
    c = bal.assign(prompt(5, 40), max_new_tokens=1)                  # no prefix: least loaded, replica 0
    bal.release(c)
    # force replica 1 to hold base's first 3 blocks only by sending there while 0 is busy
    busy = bal.assign(prompt(6, 5000), max_new_tokens=0)
    assert busy.replica == 0
    d = bal.assign(base[:48] + prompt(7, 16), max_new_tokens=1)
    assert d.replica == 1 and d.matched_blocks == 0                  # overloaded 0 was skipped
    bal.release(busy)
    bal.release(d)
    e = bal.assign(base + prompt(8, 16), max_new_tokens=1)
    assert (e.replica, e.matched_blocks) == (0, 4)                   # 4 blocks on 0 beat 3 on 1


def test_overload_falls_back_to_the_least_loaded_replica():
    bal = Balancer(2, block_size=BLOCK, margin_tokens=100)
    shared = prompt(0, 32)
    t = bal.assign(shared, max_new_tokens=0)
    assert t.replica == 0
    heavy = bal.assign(shared + prompt(1, 200), max_new_tokens=0)   # affinity: 0, within the margin
    assert heavy.replica == 0 and bal.loads() == [32 + 200, 0]
    spill = bal.assign(shared + prompt(2, 20), max_new_tokens=0)    # 232 - 0 > 100: least loaded
    assert spill.replica == 1 and spill.matched_blocks == 0
    # within the margin, affinity holds even against a lighter replica
    bal.release(heavy)
    assert bal.loads() == [32, 20 + 32]
    again = bal.assign(shared + prompt(3, 20), max_new_tokens=0)
    assert (again.replica, again.matched_blocks) == (0, 2)         # both hold it: the lighter wins


def test_the_prefix_memory_is_bounded():
    bal = Balancer(1, block_size=BLOCK, cache_blocks=4)
    old = prompt(0, 64)
    bal.release(bal.assign(old, max_new_tokens=1))
    bal.release(bal.assign(prompt(1, 64), max_new_tokens=1))        # pushes old's 4 keys out
    assert bal.matched_blocks(0, prefix_block_keys(old, BLOCK)) == 0
    assert bal.matched_blocks(0, prefix_block_keys(prompt(1, 64), BLOCK)) == 4


@pytest.mark.parametrize("name,kwargs", [("num_replicas", {"num_replicas": 0}),
                                         ("block_size", {"num_replicas": 2, "block_size": 0}),
                                         ("cache_blocks", {"num_replicas": 2, "cache_blocks": True}),
                                         ("margin_tokens", {"num_replicas": 2, "margin_tokens": -1})])
def test_bad_arguments_name_themselves(name, kwargs):
    with pytest.raises(ValueError, match=name):
        Balancer(**kwargs)
    bal = Balancer(2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        bal.assign([1, 2], max_new_tokens=-1)
    with pytest.raises(ValueError, match="n = 0"):
        bal.assign([1, 2], max_new_tokens=1, n=0)


def test_a_replica_marked_down_takes_nothing_and_forgets_its_prefixes():
    bal = Balancer(2, block_size=BLOCK)
    shared = prompt(7, 64)
    t = bal.assign(shared, max_new_tokens=4)
    assert t.replica == 0 and bal.matched_blocks(0, prefix_block_keys(shared, BLOCK)) == 4
    bal.mark_down(0)
    assert not bal.is_up(0)
    assert [bal.assign(prompt(i, 8), max_new_tokens=1).replica for i in range(3)] == [1, 1, 1]
    bal.release(t)                                      # its ticket still leaves the dead replica's load
    assert bal.load(0) == 0
    bal.mark_up(0)                                      # restarted: empty, so no affinity for the old prefix
    again = bal.assign(shared + [1, 2], max_new_tokens=4)
    assert again.matched_blocks == 0 and again.replica == 0        # the least loaded now
    bal.mark_down(0)
    bal.mark_down(1)
    with pytest.raises(LookupError, match="no replica is up"):
        bal.assign(shared, max_new_tokens=1)


def test_exclude_skips_the_replicas_a_request_failed_on():
    bal = Balancer(3, block_size=BLOCK)
    assert bal.assign(prompt(0, 8), max_new_tokens=1, exclude=[0]).replica == 1
    assert bal.assign(prompt(1, 8), max_new_tokens=1, exclude=[1, 2]).replica == 0
    with pytest.raises(LookupError, match=r"excluding \[0, 1, 2\]"):
        bal.assign(prompt(2, 8), max_new_tokens=1, exclude=[0, 1, 2])


def test_policies_round_robin_and_least_load_ignore_prefixes():
    shared = prompt(3, 64)
    rr = Balancer(2, block_size=BLOCK, policy="round_robin")
    heavy = rr.assign(shared, max_new_tokens=1000)      # replica 0 now carries far more load
    assert [rr.assign(shared, max_new_tokens=1).replica for _ in range(4)] == [1, 0, 1, 0]
    assert heavy.replica == 0
    ll = Balancer(2, block_size=BLOCK, policy="least_load")
    ll.assign(shared, max_new_tokens=100)               # on 0
    assert ll.assign(shared, max_new_tokens=1).replica == 1          # cache_aware would pick 0 (within margin)
    ca = Balancer(2, block_size=BLOCK)
    ca.assign(shared, max_new_tokens=100)
    assert ca.assign(shared, max_new_tokens=1).replica == 0
    with pytest.raises(ValueError, match=r"policy = 'random', expected one of 'cache_aware', 'least_load'"):
        Balancer(2, policy="random")
