"""The CUDA-graph executor's own logic, on the CPU: bucket choice, padding rows, output slicing,
growing and shrinking batches, replays that read only the static buffers.

A stand-in graph API replaces ``torch.cuda``: ``capture`` records the step (the runner's decode
step bound to its static buffers, exactly what a CUDA graph would record) and ``replay`` runs it
again into the same output tensor. What the stand-in cannot show (that a real graph allocates
nothing and launches the same kernels) is left to the GPU tests in ``test_cuda_graphs.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from qwen_ops.engine.batch import BatchedRequest
from qwen_ops.engine.runner import ModelRunner
from qwen_ops.models.loader import load_checkpoint

from checkpoints import make_qwen3_checkpoint

BUCKETS = [1, 2, 4, 8]
MAX_SLOTS, MAX_BLOCKS, BLOCK_SIZE = 8, 8, 4


class StandInGraph:
    def __init__(self, step):
        self.step = step
        self.out = step()                 # capture: the step runs once, its output is the graph's
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.out.copy_(self.step())       # the same static inputs, the same output tensor


class StandInGraphAPI:
    def __init__(self):
        self.graphs: list[StandInGraph] = []
        self.pools: list[object] = []
        self.warm_ups = 0

    def synchronize(self) -> None:
        pass

    def free_bytes(self) -> int:
        return 0

    def warm_up(self, step) -> None:
        self.warm_ups += 1
        step()

    def capture(self, step, pool):
        graph = StandInGraph(step)
        self.graphs.append(graph)
        pool = pool if pool is not None else object()
        self.pools.append(pool)
        return graph, graph.out, pool


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_checkpoint(make_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3_graph_executor"))).model


def make_runner(model, api=None) -> ModelRunner:
    runner = ModelRunner(model, num_blocks=MAX_SLOTS * MAX_BLOCKS, block_size=BLOCK_SIZE, max_slots=MAX_SLOTS,
                         max_blocks_per_slot=MAX_BLOCKS, dtype=torch.float32, device=torch.device("cpu"),
                         buckets=BUCKETS, cuda_graphs=api is not None, graph_api=api)
    for s in range(MAX_SLOTS):
        runner.set_block_row(s, list(range(s * MAX_BLOCKS, (s + 1) * MAX_BLOCKS))[::-1])   # scattered blocks
    return runner


class Pair:
    """The same sequences on a graph runner and on an eager runner; every step is compared."""

    def __init__(self, model):
        self.api = StandInGraphAPI()
        self.graphs, self.eager = make_runner(model, self.api), make_runner(model)
        self.lens: dict[int, int] = {}
        self.rng = random.Random(0)

    def prefill(self, slot: int, n: int) -> None:
        tokens = [self.rng.randrange(2, 128) for _ in range(n)]
        for runner in (self.graphs, self.eager):
            runner.execute([BatchedRequest(slot, tokens, 0)])
        self.lens[slot] = n

    def decode(self, slots: list[int]) -> torch.Tensor:
        chunks = [BatchedRequest(s, [self.rng.randrange(2, 128)], self.lens[s]) for s in slots]
        got = self.graphs.execute(chunks)
        want = self.eager.execute(chunks)
        assert got.shape == (len(slots), want.shape[1])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for s in slots:
            self.lens[s] += 1
        return got

    def replays(self) -> dict[int, int]:
        return {bucket: graph.replays for bucket, (graph, _) in self.graphs.executors.graphs.items()}


def test_every_bucket_is_captured_once_largest_first_in_one_pool(model):
    pair = Pair(model)
    pair.prefill(0, 5)
    pair.decode([0])
    assert [g.out.shape[0] for g in pair.api.graphs] == sorted(BUCKETS, reverse=True)
    assert len(set(map(id, pair.api.pools))) == 1 and pair.api.warm_ups == len(BUCKETS)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_bucket_choice_padding_and_slicing(model, n):
    pair = Pair(model)
    for s in range(n):
        pair.prefill(s, 3 + s)
    bucket = next(b for b in BUCKETS if b >= n)
    pair.graphs.inputs.buf_slots.fill_(5)                       # stale rows of an earlier, larger batch
    before = pair.replays()
    got = pair.decode(list(range(n)))
    after = pair.replays()
    assert {b for b in BUCKETS if after[b] != before.get(b, 0)} == {bucket}, "exactly the bucket's graph replays"
    assert pair.graphs.inputs.buf_slots[:bucket].tolist() == list(range(n)) + [-1] * (bucket - n), "padding rows"
    graph_out = pair.graphs.executors.graphs[bucket][1]
    assert got.data_ptr() != graph_out.data_ptr()       # a copy: the next replay overwrites the graph's
    torch.testing.assert_close(got, graph_out[:n].float())


def test_batches_grow_and_shrink(model):
    pair = Pair(model)
    for s in range(MAX_SLOTS):
        pair.prefill(s, 2 + (3 * s) % 7)
    for n in (3, 5, 2, 8, 1, 4, 7, 2):
        pair.decode(list(range(n)) if n % 2 else list(range(MAX_SLOTS - n, MAX_SLOTS)))
    assert len(pair.api.graphs) == len(BUCKETS), "no recapture while batches change"


def test_replay_reads_only_the_static_buffers(model):
    """After capture, the step's Python-side inputs are gone: new batches reach the graph only
    through the static buffers, and the buffers themselves are never reallocated."""
    pair = Pair(model)
    for s in range(4):
        pair.prefill(s, 4)
    pair.decode([0, 1])                                  # captures (on all-padding inputs), then replays
    runner = pair.graphs
    inputs = runner.inputs
    buffers = (inputs.buf_input_ids, inputs.buf_positions, inputs.buf_slots, inputs.buf_seq_lens,
               inputs.buf_query_start_loc, inputs.buf_logits_indices, runner.block_table)
    pointers = [t.data_ptr() for t in buffers]
    outputs = {b: out.data_ptr() for b, (_, out) in runner.executors.graphs.items()}
    for slots in ([2, 3], [0, 3], [1, 2, 3], [0]):       # other slots, positions and tokens each time
        pair.decode(slots)
    assert [t.data_ptr() for t in buffers] == pointers
    assert {b: out.data_ptr() for b, (_, out) in runner.executors.graphs.items()} == outputs
    assert len(pair.api.graphs) == len(BUCKETS)


def test_above_the_largest_bucket_runs_eager(model):
    api = StandInGraphAPI()
    runner = ModelRunner(model, num_blocks=16 * MAX_BLOCKS, block_size=BLOCK_SIZE, max_slots=16,
                         max_blocks_per_slot=MAX_BLOCKS, dtype=torch.float32, device=torch.device("cpu"),
                         buckets=BUCKETS, cuda_graphs=True, graph_api=api)
    chunks = [BatchedRequest(s, [5], 0) for s in range(9)]
    for s in range(9):
        runner.set_block_row(s, [s])
    assert runner.executor_for(chunks) != "cuda_graph"
    assert runner.executor_for(chunks[:8]) == "cuda_graph"
    runner.execute(chunks)
    assert api.graphs == []                              # nothing was captured for 9 sequences


def test_verify_steps_replay_their_own_graphs(model):
    """Speculative verify steps (decodes with 0..3 drafts, R = 4 rows a sequence) through the
    stand-in graphs: each bucket of B x R rows is captured once, beside the decode graphs, and the
    logits rows and the KV written equal the eager runner's generic path (exact-size chunks); rows
    a sequence does not fill, and sequences past the batch, write nothing (slot -1)."""
    pair = Pair(model)
    pair.graphs.set_verify_rows(4)
    for s in range(6):
        pair.prefill(s, 3 + s)
    rng = random.Random(1)
    for n in (1, 3, 6, 2):
        chunks = []
        for s in range(n):
            drafts = [rng.randrange(2, 128) for _ in range(rng.randrange(0, 4))]
            chunks.append(BatchedRequest(s, [rng.randrange(2, 128)] + drafts, pair.lens[s], is_prefill=False,
                                         draft_token_ids=tuple(drafts)))
        if not any(c.draft_token_ids for c in chunks):
            chunks[0] = BatchedRequest(0, list(chunks[0].token_ids) + [7], pair.lens[0], is_prefill=False,
                                       draft_token_ids=tuple(chunks[0].draft_token_ids) + (7,))
        assert pair.graphs.executor_for(chunks) == "cuda_graph" and pair.eager.executor_for(chunks) == "eager"
        got, want = pair.graphs.execute(chunks), pair.eager.execute(chunks)
        assert got.shape == want.shape == (sum(c.num_logit_rows for c in chunks), want.shape[1])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for (ka, va), (kb, vb) in zip(pair.graphs.kv_caches, pair.eager.kv_caches):
            torch.testing.assert_close(ka, kb, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-5)
        for c in chunks:                       # keep only the last token, as a full rejection would
            pair.lens[c.kv_cache_slot] += 1
    assert sorted(pair.graphs.executors.verify_graphs) == BUCKETS
    assert len(pair.api.graphs) == 2 * len(BUCKETS), "one capture per decode and per verify bucket"
