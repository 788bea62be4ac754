"""The seed module's unit tests (batch.rs), ported, plus chunked-prefill offsets."""

import pytest

from qwen_ops.serving.batch import (BatchedRequest, DecodeTask, IterationPlan, PrefillTask, RequestId, ScheduledBatch,
                            TokenBudget)


def test_batched_request():
    prefill = BatchedRequest.prefill(RequestId.new(), [1, 2, 3, 4], 0, [0, 1])
    assert prefill.is_prefill
    assert prefill.num_tokens() == 4
    assert prefill.seq_len == 4
    assert prefill.context_len == 0
    decode = BatchedRequest.decode(RequestId.new(), 5, 10, 1, [0, 1, 2], 10)
    assert not decode.is_prefill
    assert decode.num_tokens() == 1
    assert decode.context_len == 10
    assert decode.seq_len == 11


def test_prefill_chunk_continues_at_offset():
    chunk = BatchedRequest.prefill(RequestId.new(), [7, 8], 3, [5], position_offset=6)
    assert (chunk.position_offset, chunk.context_len, chunk.seq_len) == (6, 6, 8)


def test_request_ids_are_distinct_and_ordered():
    ids = {RequestId.new() for _ in range(100)}
    assert len(ids) == 100
    assert RequestId(1) < RequestId(2)


def test_scheduled_batch():
    batch = ScheduledBatch(1)
    batch.add(BatchedRequest.prefill(RequestId.new(), [1, 2, 3], 0, []))
    batch.add(BatchedRequest.decode(RequestId.new(), 4, 5, 1, [], 5))
    assert len(batch) == 2
    assert batch.has_prefill and batch.has_decode
    assert batch.total_tokens == 4
    prefill, decode = batch.split_by_type()
    assert len(prefill) == 1 and len(decode) == 1
    assert batch.max_seq_len == 6
    assert batch.collect_input_ids() == [[1, 2, 3], [4]]
    assert batch.collect_positions() == [0, 5]
    assert batch.collect_kv_slots() == [0, 1]


def test_merge_puts_prefill_first_and_stats():
    a, b, c = RequestId(1), RequestId(2), RequestId(3)
    batch = ScheduledBatch.merge_prefill_decode(
        [BatchedRequest.prefill(a, [1, 2], 0, [])],
        [BatchedRequest.decode(b, 3, 4, 1, [], 4), BatchedRequest.decode(c, 5, 9, 2, [], 9)], batch_id=7)
    assert batch.request_ids() == [a, b, c]
    s = batch.stats()
    assert (s.batch_id, s.total_requests, s.prefill_requests, s.decode_requests) == (7, 3, 1, 2)
    assert (s.total_tokens, s.prefill_tokens, s.decode_tokens, s.max_seq_len) == (4, 2, 2, 10)
    assert ScheduledBatch(0).is_empty()


def test_token_budget():
    budget = TokenBudget(100, 10, 105)
    assert budget.remaining_prefill() == 100
    assert budget.remaining_decode() == 10
    assert budget.try_allocate_prefill(50)
    assert budget.remaining_prefill() == 50
    assert budget.remaining_decode() == 10
    assert budget.try_allocate_prefill(50)
    assert not budget.try_allocate_prefill(1)
    for _ in range(5):
        assert budget.try_allocate_decode()
    assert not budget.try_allocate_decode()       # the total limit (105) binds before the decode limit
    assert budget.is_exhausted()
    budget.reset()
    assert budget.total_tokens() == 0 and not budget.is_exhausted()


@pytest.mark.parametrize("field", ["max_prefill_tokens", "max_decode_tokens", "max_total_tokens"])
def test_token_budget_rejects_bad_limits(field):
    kwargs = dict(max_prefill_tokens=8, max_decode_tokens=8, max_total_tokens=8)
    kwargs[field] = 0
    with pytest.raises(ValueError, match=field):
        TokenBudget(**kwargs)


def test_iteration_plan():
    plan = IterationPlan.empty()
    assert not plan.has_work()
    r1, r2 = RequestId(1), RequestId(2)
    plan.prefill_tasks.append(PrefillTask(r1, [1, 2, 3], 0, 0, [0]))
    plan.decode_tasks.append(DecodeTask(r2, 4, 10, 1, [1, 2], 10))
    assert plan.has_work()
    assert plan.total_requests() == 2
    assert plan.total_tokens() == 4
    batch = plan.to_scheduled_batch(5)
    assert batch.batch_id == 5 and len(batch) == 2 and batch.total_tokens == 4
    prefill, decode = batch.split_by_type()
    assert prefill[0].request_id == r1 and decode[0].request_id == r2
    assert decode[0].position_offset == 10 and decode[0].seq_len == 11
