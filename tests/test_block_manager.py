"""The KV-cache manager (engine/block_manager.py) as the one owner of blocks: its accounting, and
that a step's device writes happen in the runner, from the block ids the plan carries, in one
message per step under tensor parallelism."""

from __future__ import annotations

import pytest
import torch

from qwen_ops.engine.batch import IterationPlan
from qwen_ops.engine.block_manager import KVCacheManager
from qwen_ops.engine.sampling import SamplingParams
from qwen_ops.serving.llm import LLM

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_reserve_commit_and_swap_bookkeeping():
    kv = KVCacheManager(num_blocks=6, block_size=4, max_slots=2, prefix_caching=True,
                        host_bytes=lambda n: 100 * n)
    slot = kv.allocate_slot("a")
    assert kv.begin(slot, list(range(9))) == 0          # nothing cached yet
    assert kv.reserve(slot, 9) and len(kv.slots[slot].block_ids) == 3
    kv.commit(slot, list(range(9)))
    assert kv.slots[slot].num_tokens == 9 and kv.pool.num_cached == 2   # two full blocks registered
    saved, copy = kv.swap_out(slot, "a")
    assert (saved.num_tokens, saved.nbytes, kv.swap_bytes_used) == (9, 300, 300)
    assert len(copy.block_ids) == 3 and kv.slots[slot].block_ids == []
    kv.free_slot(slot)
    back = kv.allocate_slot("a")
    copy_in = kv.swap_in(back, saved, 10, "a")
    assert copy_in is not None and copy_in.handle == saved.handle and kv.swap_bytes_used == 0
    assert kv.slots[back].num_tokens == 9
    kv.check()
    other = kv.allocate_slot("b")
    assert not kv.reserve(other, 4 * 6)                  # too few free: no change
    assert kv.slots[other].block_ids == []


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4, max_model_len=64, check_invariants=True)


def test_scheduling_writes_nothing_to_the_device(llm, monkeypatch):
    runner = llm.engine.runner
    writes = []
    real = runner.set_block_row
    monkeypatch.setattr(runner, "set_block_row", lambda slot, blocks: (writes.append(slot), real(slot, blocks)))
    llm.add_request([5, 6, 7, 8, 9] * 5, GREEDY)
    table = runner.block_table.clone()
    plan = llm.scheduler.schedule()
    assert writes == [] and torch.equal(runner.block_table, table), "schedule() touched the device"
    (task,) = plan.tasks()
    assert list(task.block_table) == llm.engine.kv.slots[task.kv_cache_slot].block_ids
    out = runner.call("step", plan)                      # the runner writes the row it carries
    assert writes == [task.kv_cache_slot]
    llm.scheduler.update(plan, out)
    while llm.has_unfinished_requests():
        llm.step()


class _RecordingWorkers:
    """Stands in for the TP workers: records what rank 0 sends."""

    def __init__(self):
        self.messages = []

    def broadcast(self, message):
        self.messages.append(message)


def test_tensor_parallel_sends_one_message_per_step(llm, monkeypatch):
    workers = _RecordingWorkers()
    monkeypatch.setattr(llm.engine.runner, "workers", workers)
    seeded = SamplingParams(max_tokens=3, temperature=0.8, seed=3, ignore_eos=True)
    before = llm.stats()["num_iterations"]
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], seeded)
    steps = llm.stats()["num_iterations"] - before
    assert [m[0] for m in workers.messages] == ["step"] * steps
    for _, (plan,) in workers.messages:
        assert isinstance(plan, IterationPlan)
        assert all(t.sampling is None and t.generator is None and t.block_table for t in plan.tasks())
