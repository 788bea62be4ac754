"""The router's consistent-hash ring (qwen_ops/serving/hash_ring.py): pure Python. The oracle is a
plain dict of key -> member taken with every member up, compared with the ring's answers after
members go down and come back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from qwen_ops.serving import hash_ring
from qwen_ops.serving.hash_ring import HashRing, ring_hash

RING_FILE = Path(hash_ring.__file__)

MEMBERS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000", "http://10.0.0.4:8000"]
KEYS = [f"user-{i}" for i in range(2000)]


def test_only_the_dead_members_keys_move_and_they_come_back():
    ring = HashRing(MEMBERS)
    everyone = set(range(len(MEMBERS)))
    before = {key: ring.lookup(key) for key in KEYS}
    assert {key: ring.lookup(key, everyone) for key in KEYS} == before
    for dead in range(len(MEMBERS)):
        live = everyone - {dead}
        after = {key: ring.lookup(key, live) for key in KEYS}
        moved = {key for key in KEYS if after[key] != before[key]}
        assert moved == {key for key in KEYS if before[key] == dead}     # exactly the dead member's keys
        assert dead not in after.values()
        # its keys spread over the others (virtual nodes), not all onto one neighbour
        assert len({after[key] for key in moved}) == len(MEMBERS) - 1
    # two down: a key moves only if its member is one of them
    after = {key: ring.lookup(key, {0, 3}) for key in KEYS}
    assert all(after[k] == before[k] for k in KEYS if before[k] in (0, 3))
    assert set(after.values()) == {0, 3}


def test_keys_spread_evenly_over_members():
    ring = HashRing(MEMBERS)
    counts = [0] * len(MEMBERS)
    for key in KEYS:
        counts[ring.lookup(key)] += 1
    share = len(KEYS) / len(MEMBERS)
    assert all(0.7 * share < c < 1.3 * share for c in counts), counts


def test_the_ring_is_the_same_in_every_process():
    # Python's hash() is salted per process; the ring's is not: a restarted router keeps every session.
    here = [HashRing(MEMBERS).lookup(key) for key in KEYS[:50]]
    code = ("import importlib.util\n"                 # the file alone: no torch to load for this
            f"spec = importlib.util.spec_from_file_location('ring', {str(RING_FILE)!r})\n"
            "ring = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(ring)\n"
            f"print([ring.HashRing({MEMBERS!r}).lookup(k) for k in {KEYS[:50]!r}])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PYTHONHASHSEED": "random"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(here)
    assert ring_hash("a") == ring_hash("a") != ring_hash("b")


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match=r"vnodes = 0, expected an int >= 1"):
        HashRing(MEMBERS, vnodes=0)
    with pytest.raises(ValueError, match=r"members = \[\], expected at least one"):
        HashRing([])
    with pytest.raises(ValueError, match=r"has duplicates"):
        HashRing(["a", "a"])
    with pytest.raises(LookupError, match=r"no live member"):
        HashRing(MEMBERS).lookup("k", live=set())
