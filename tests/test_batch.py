"""The scheduled-item vocabulary of the seed (batch.rs): BatchedRequest, IterationPlan, TokenBudget,
RequestId; chunked-prefill offsets."""

import pytest

from qwen_ops.engine.batch import BatchedRequest, IterationPlan, RequestId, TokenBudget


def test_batched_request():
    prefill = BatchedRequest(0, [1, 2, 3, 4], 0, RequestId(1))
    assert prefill.is_prefill and len(prefill.token_ids) == 4
    assert (prefill.position_offset, prefill.seq_len) == (0, 4)
    decode = BatchedRequest(1, [5], 10, RequestId(2), is_prefill=False)
    assert not decode.is_prefill and len(decode.token_ids) == 1
    assert (decode.position_offset, decode.seq_len) == (10, 11)


def test_prefill_chunk_continues_at_offset():
    chunk = BatchedRequest(3, [7, 8], 6)
    assert (chunk.position_offset, chunk.seq_len) == (6, 8)


def test_request_ids_are_ordered():
    assert RequestId(1) < RequestId(2) and str(RequestId(7)) == "7"


def test_token_budget():
    budget = TokenBudget(100, 10, 105)
    assert budget.remaining_prefill() == 100
    assert budget.remaining_decode() == 10
    budget.allocate_prefill(50)
    assert budget.remaining_prefill() == 50
    assert budget.remaining_decode() == 10
    budget.allocate_prefill(50)
    with pytest.raises(ValueError, match="tokens = 1, but only 0 prefill tokens remain"):
        budget.allocate_prefill(1)
    for _ in range(5):
        budget.allocate_decode()
    with pytest.raises(ValueError, match="no decode tokens remain"):
        budget.allocate_decode()                  # the total limit (105) binds before the decode limit
    assert budget.total_tokens() == 105


@pytest.mark.parametrize("field", ["max_prefill_tokens", "max_decode_tokens", "max_total_tokens"])
def test_token_budget_rejects_bad_limits(field):
    kwargs = dict(max_prefill_tokens=8, max_decode_tokens=8, max_total_tokens=8)
    kwargs[field] = 0
    with pytest.raises(ValueError, match=field):
        TokenBudget(**kwargs)


def test_iteration_plan_merges_prefill_first():
    plan = IterationPlan.empty()
    assert not plan.has_work()
    r1, r2, r3 = RequestId(1), RequestId(2), RequestId(3)
    plan.decode_tasks.append(BatchedRequest(1, [4], 10, r2, is_prefill=False))
    plan.prefill_tasks.append(BatchedRequest(0, [1, 2, 3], 0, r1))
    plan.decode_tasks.append(BatchedRequest(2, [9], 4, r3, is_prefill=False))
    assert plan.has_work() and plan.total_requests() == 3 and plan.total_tokens() == 5
    rows = plan.tasks()                           # the rows of the step's one forward pass
    assert [r.request_id for r in rows] == [r1, r2, r3]
    assert [r.is_prefill for r in rows] == [True, False, False]
