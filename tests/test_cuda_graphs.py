"""CUDA-graph decode and the Torch-TensorRT option. GPU-only; each test says why it skips."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from qwen_ops.engine.engine import QwenBatchedRequest, QwenEngine
from qwen_ops.engine.sampling import SamplingParams

from checkpoints import make_qwen3_checkpoint

needs_gpu = pytest.mark.gpu      # deselected without a CUDA GPU (conftest.py)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
BUCKETS = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3_graphs"))


def prompts(n):
    return [[(11 * i + 3 * j) % 120 + 2 for j in range(3 + i)] for i in range(n)]


def run(engine, reqs_prompts, slots=None):
    slots = slots or list(range(len(reqs_prompts)))
    reqs = [QwenBatchedRequest(i, p, s, GREEDY) for i, (p, s) in enumerate(zip(reqs_prompts, slots))]
    engine.batch_prefill(reqs)
    while not all(r.finished for r in reqs):
        engine.batch_decode_step(reqs)
    return [r.generated_tokens for r in reqs]


@pytest.fixture(scope="module")
def pair(ckpt):
    kw = dict(max_slots=8, max_seq_len=64, block_size=4, device="cuda", decode_buckets=BUCKETS)
    eager = QwenEngine.from_pretrained(ckpt, compile=False, cuda_graphs=False, **kw)
    graphs = QwenEngine.from_pretrained(ckpt, compile=True, cuda_graphs=True, **kw)
    return eager, graphs


@needs_gpu
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_replay_equals_eager_for_every_bucket(pair, n):
    eager, graphs = pair
    assert run(graphs, prompts(n)) == run(eager, prompts(n))
    assert set(graphs.runner.executors.graphs) == set(BUCKETS)


@needs_gpu
def test_batch_shrinks_and_grows(pair):
    eager, graphs = pair
    ps = prompts(6)
    expected = run(eager, ps)
    reqs = [QwenBatchedRequest(i, p, i, GREEDY) for i, p in enumerate(ps)]
    graphs.batch_prefill(reqs)
    for size in (6, 2, 5, 1, 6, 3, 6, 6):          # different subsets each step
        live = [r for r in reqs if not r.finished][:size]
        if live:
            graphs.batch_decode_step(live)
    while not all(r.finished for r in reqs):
        graphs.batch_decode_step(reqs)
    assert [r.generated_tokens for r in reqs] == expected


@needs_gpu
def test_slot_freed_and_reused_between_replays(pair):
    eager, graphs = pair
    ps = prompts(3)
    run(graphs, ps)
    graphs.free_slot(1)
    assert run(graphs, [ps[2]], slots=[1]) == run(eager, [ps[2]], slots=[1])


@needs_gpu
def test_capture_time_and_memory_reported(pair, capsys):
    _, graphs = pair
    run(graphs, prompts(2))
    assert graphs.runner.executors.capture_seconds > 0
    with capsys.disabled():
        print(f"\n[cuda graphs] buckets {BUCKETS}: capture {graphs.runner.executors.capture_seconds:.2f} s, "
              f"{graphs.runner.executors.capture_bytes / 2**20:.1f} MiB")


def test_cuda_graphs_need_a_cuda_device(ckpt):
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        QwenEngine.from_pretrained(ckpt, max_slots=2, max_seq_len=64, cuda_graphs=True)


def test_tensorrt_backend_errors_clearly_without_gpu_or_package(ckpt):
    if torch.cuda.is_available() and importlib.util.find_spec("torch_tensorrt") is not None:
        pytest.skip("torch_tensorrt and a GPU are present: covered by test_tensorrt_decode")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    match = "torch-tensorrt" if device == "cuda" else "compile_backend='tensorrt' needs a CUDA device"
    with pytest.raises((ValueError, RuntimeError), match=match):
        QwenEngine.from_pretrained(ckpt, max_slots=2, max_seq_len=64, device=device, compile_backend="tensorrt")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("torch_tensorrt") is None,
                    reason="needs a CUDA GPU and the torch-tensorrt package (extra [tensorrt])")
def test_tensorrt_decode(ckpt):
    kw = dict(max_slots=4, max_seq_len=64, block_size=4, device="cuda", cuda_graphs=False)
    eager = QwenEngine.from_pretrained(ckpt, compile=False, **kw)
    trt = QwenEngine.from_pretrained(ckpt, compile_backend="tensorrt", **kw)
    assert run(trt, prompts(3)) == run(eager, prompts(3))
