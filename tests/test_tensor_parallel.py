"""Tensor parallelism on 2 CPU processes with gloo: the same greedy tokens and logits as one
process (dense, hybrid and MoE models; their greedy tokens also as transformers'), through the engine API and LLM.generate (preemption by recompute and by swap, prefix
caching on), a compiled step without graph breaks, the torchrun launch (one node and two
"nodes" on loopback), a killed worker, bad configurations, and no process left behind."""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from qwen_ops import LLM, SamplingParams
from qwen_ops.engine.distributed import TensorParallelError
from qwen_ops.engine.engine import QwenEngine
from qwen_ops.models.layers import forward_choices

from checkpoints import make_qwen3_5_checkpoint, make_qwen3_checkpoint
from oracles import TransformersGreedy

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallelism needs 2 CPUs here")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[3 + i + j for j in range(5 + 3 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("tp_qwen3"))          # 4 heads, 2 KV heads


@pytest.fixture(scope="module")
def qwen2_tied(tmp_path_factory):
    """Qwen2 (q/k/v biases), tied embeddings, one KV head (replicated on both ranks), and a
    vocabulary that does not split evenly (127: the last rank's rows are padded)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=127, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=1, bos_token_id=0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("tp_qwen2")
    model.save_pretrained(path)
    return Path(path)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_llm_generate_equals_one_process(qwen3, mode):
    kw = dict(max_model_len=64, block_size=4, max_num_seqs=4, num_kv_blocks=20, preemption_mode=mode,
              max_num_batched_tokens=16, check_invariants=True)
    want = _tokens(LLM(qwen3, **kw).generate(PROMPTS, GREEDY))
    assert want == [TransformersGreedy(qwen3)(p, GREEDY.max_tokens) for p in PROMPTS]    # the outside oracle
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True)
    want_sampled = _tokens(LLM(qwen3, **kw).generate(PROMPTS[:2], sampled))
    llm = LLM(qwen3, tensor_parallel_size=2, **kw)
    try:
        procs = list(llm.engine._tp_workers.procs)
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == want
        assert _tokens(llm.generate(PROMPTS[:2], sampled)) == want_sampled
        assert _tokens(llm.generate(PROMPTS[-1:], GREEDY)) == want[-1:]
        hits = llm.stats()["prefix_cache_hits"]
        assert _tokens(llm.generate(PROMPTS[-1:], GREEDY)) == want[-1:]      # again: prefix-cache hits
        s = llm.stats()
        assert s["num_preemptions"] > 0 and s["free_blocks"] == s["total_blocks"]
        assert s["prefix_cache_hits"] > hits
        if mode == "swap":
            assert s["num_swaps_out"] > 0
    finally:
        llm.shutdown()
    assert all(not p.is_alive() for p in procs)


def test_engine_api_logits(qwen2_tied):
    kw = dict(max_slots=2, max_seq_len=64, block_size=4)
    one = QwenEngine.from_pretrained(qwen2_tied, **kw)
    two = QwenEngine.from_pretrained(qwen2_tied, tensor_parallel_size=2, **kw)
    try:
        assert two.runner.kv_caches[0][0].shape[2] == 1, "one KV head per rank (replicated)"
        assert set(forward_choices(two.model).values()) == {"cpu"}, "the fast ops run the rank's slices"
        assert two.tp.workspace is not None, "ranks on one host meet in shared memory"
        prompt = list(range(3, 22))
        a, b = one.prefill(prompt, slot_id=1), two.prefill(prompt, slot_id=1)
        assert a.next_token == b.next_token
        rel = (a.logits - b.logits).abs().max() / a.logits.abs().max()
        assert rel < 1e-5, rel
        ta, tb = a.next_token, b.next_token
        chain = [tb]
        for _ in range(10):
            ra, rb = one.decode_step(ta, slot_id=1), two.decode_step(tb, slot_id=1)
            assert ra.next_token == rb.next_token
            assert (ra.logits - rb.logits).abs().max() / ra.logits.abs().max() < 1e-5
            ta, tb = ra.next_token, rb.next_token
            chain.append(tb)
        assert chain == TransformersGreedy(qwen2_tied)(prompt, 11)      # the outside oracle
        procs = list(two._tp_workers.procs)
    finally:
        two.shutdown()
    assert all(not p.is_alive() for p in procs)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """Hybrid: 3 Gated DeltaNet layers (2 key heads, 4 value heads) and one gated full-attention layer."""
    return make_qwen3_5_checkpoint(tmp_path_factory.mktemp("tp_qwen3_5"))


def test_hybrid_model_equals_one_process(qwen3_5):
    """Gated DeltaNet split by key head (its conv channels, gates and state with it): the engine
    API's logits within 1e-5 of one process, and LLM.generate's greedy tokens under preemption."""
    kw = dict(max_slots=2, max_seq_len=64, block_size=4)
    one = QwenEngine.from_pretrained(qwen3_5, **kw)
    two = QwenEngine.from_pretrained(qwen3_5, tensor_parallel_size=2, **kw)
    try:
        full, half = one.model.model.layers[0].linear_attn, two.model.model.layers[0].linear_attn
        assert (half.num_k_heads, half.num_v_heads) == (1, 2) and (full.num_k_heads, full.num_v_heads) == (2, 4)
        assert half.conv1d.weight.shape[0] * 2 == full.conv1d.weight.shape[0]
        conv_state, recurrent = two.runner.kv_caches[0]
        assert conv_state.shape[1] == half.conv1d.weight.shape[0] and recurrent.shape[1] == 2
        prompt = list(range(3, 25))
        want, got = _run_engine(one, prompt, 10), _run_engine(two, prompt, 10)
        for (ta, la), (tb, lb) in zip(want, got):
            assert ta == tb
            assert (la - lb).abs().max() / la.abs().max() < 1e-5
        assert [t for t, _ in got] == TransformersGreedy(qwen3_5)(prompt, 11)        # the outside oracle
        procs = list(two._tp_workers.procs)
    finally:
        two.shutdown()
    assert all(not p.is_alive() for p in procs)

    kw = dict(max_model_len=64, block_size=4, max_num_seqs=4, num_kv_blocks=20, max_num_batched_tokens=16,
              check_invariants=True)
    want = _tokens(LLM(qwen3_5, **kw).generate(PROMPTS, GREEDY))
    assert want == [TransformersGreedy(qwen3_5)(p, GREEDY.max_tokens) for p in PROMPTS]    # the outside oracle
    llm = LLM(qwen3_5, tensor_parallel_size=2, **kw)
    try:
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == want
        s = llm.stats()
        assert s["num_preemptions"] > 0 and s["free_blocks"] == s["total_blocks"]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("model_type,original_format", [("qwen3_moe", True), ("qwen3_moe", False),
                                                       ("qwen3_5_moe_text", True)])
def test_moe_model_equals_one_process(model_type, original_format, tmp_path):
    """Experts split by intermediate channel (from per-expert tensors, or the stacked layout), the
    shared expert like a dense MLP: logits within 1e-5 of one process, the same greedy tokens."""
    from checkpoints import make_moe_checkpoint

    path = make_moe_checkpoint(tmp_path, model_type, original_format=original_format)
    kw = dict(max_slots=2, max_seq_len=64, block_size=4)
    one = QwenEngine.from_pretrained(path, **kw)
    two = QwenEngine.from_pretrained(path, tensor_parallel_size=2, **kw)
    try:
        sparse = [i for i, layer in enumerate(one.model.model.layers) if hasattr(layer.mlp, "experts")]
        assert sparse
        full, half = one.model.model.layers[sparse[0]].mlp, two.model.model.layers[sparse[0]].mlp
        assert half.experts.gate_up_proj.shape[1] * 2 == full.experts.gate_up_proj.shape[1]
        assert half.experts.down_proj.shape[2] * 2 == full.experts.down_proj.shape[2]
        if full.shared_expert is not None:
            assert half.shared_expert.down_proj.in_features * 2 == full.shared_expert.down_proj.in_features
        prompt = list(range(3, 25))
        got = _run_engine(two, prompt, 8)
        for (ta, la), (tb, lb) in zip(_run_engine(one, prompt, 8), got):
            assert ta == tb
            assert (la - lb).abs().max() / la.abs().max() < 1e-5
        assert [t for t, _ in got] == TransformersGreedy(path)(prompt, 9)            # the outside oracle
    finally:
        two.shutdown()
    if model_type == "qwen3_5_moe_text":
        kw = dict(max_model_len=64, block_size=4, max_num_seqs=4, num_kv_blocks=20, max_num_batched_tokens=16)
        want = _tokens(LLM(path, **kw).generate(PROMPTS, GREEDY))
        llm = LLM(path, tensor_parallel_size=2, **kw)
        try:
            assert _tokens(llm.generate(PROMPTS, GREEDY)) == want
            assert llm.stats()["num_preemptions"] > 0
        finally:
            llm.shutdown()


def _run_engine(engine, prompt, steps):
    res = engine.prefill(prompt, slot_id=0)
    out = [(res.next_token, res.logits)]
    for _ in range(steps):
        res = engine.decode_step(out[-1][0], slot_id=0)
        out.append((res.next_token, res.logits))
    return out


@pytest.mark.parametrize("fixture", ["qwen3", "qwen2_tied"])
def test_native_executor_under_tp_matches_the_op_path(fixture, request):
    """The fast ops on each rank's slices (the all-reduce after each row-parallel packed product,
    the model's own torch code) against the op path under tensor parallelism (native_cpu=False) and
    one process, and it is the one that runs (rank 0's layers chose it)."""
    path = request.getfixturevalue(fixture)
    kw = dict(max_slots=2, max_seq_len=64, block_size=4)
    prompt = list(range(3, 24))
    one = QwenEngine.from_pretrained(path, **kw)
    want = _run_engine(one, prompt, 8)
    results = {}
    for native in (True, False):
        eng = QwenEngine.from_pretrained(path, tensor_parallel_size=2, native_cpu=native, **kw)
        try:
            assert set(forward_choices(eng.model).values()) == {"cpu" if native else "native"}
            results[native] = _run_engine(eng, prompt, 8)
        finally:
            eng.shutdown()
    for (ta, la), (tn, ln), (to, lo) in zip(want, results[True], results[False]):
        assert ta == tn == to
        scale = la.abs().max()
        assert (ln - la).abs().max() / scale < 1e-5 and (ln - lo).abs().max() / scale < 1e-5


def test_compiled_step_has_no_graph_breaks(qwen3):
    from torch._dynamo.utils import counters

    counters.clear()
    kw = dict(max_model_len=64, block_size=4, max_num_seqs=4)
    want = _tokens(LLM(qwen3, **kw).generate(PROMPTS[:3], GREEDY))
    llm = LLM(qwen3, tensor_parallel_size=2, compile=True, **kw)
    try:
        assert _tokens(llm.generate(PROMPTS[:3], GREEDY)) == want
    finally:
        llm.shutdown()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1


def test_killed_worker_is_a_clear_error(qwen3):
    llm = LLM(qwen3, tensor_parallel_size=2, max_model_len=64, block_size=4)
    try:
        (proc,) = llm.engine._tp_workers.procs
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="worker died"):
            llm.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - t0 < 30
    finally:
        llm.shutdown()


def test_deleting_the_llm_stops_its_workers(qwen3):
    llm = LLM(qwen3, tensor_parallel_size=2, max_model_len=64, block_size=4)
    procs = list(llm.engine._tp_workers.procs)
    del llm
    gc.collect()
    for p in procs:
        p.join(15)
    assert all(not p.is_alive() for p in procs)


def test_bad_configurations(qwen3, tmp_path):
    with pytest.raises(ValueError, match="does not divide num_attention_heads = 4"):
        LLM(qwen3, tensor_parallel_size=3)
    if (os.cpu_count() or 1) < 4:           # 4 divides the heads; more ranks than CPUs is refused
        with pytest.raises(ValueError, match="tensor_parallel_size = 4, but this machine has"):
            LLM(qwen3, tensor_parallel_size=4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"tp_port = {port} is already in use"):
            LLM(qwen3, tensor_parallel_size=2, tp_port=port)
    with pytest.raises(ValueError, match="tensor_parallel_size = 0"):
        LLM(qwen3, tensor_parallel_size=0)
    from qwen_ops.models.config import QwenConfig
    from qwen_ops.models.parallel import check_tp_config

    hybrid = QwenConfig.from_pretrained(make_qwen3_5_checkpoint(tmp_path / "hybrid"))
    with pytest.raises(ValueError, match="does not divide the linear-attention layers' linear_num_key_heads = 2"):
        check_tp_config(hybrid, 4)


SCRIPT = textwrap.dedent("""
    import atexit, json, os, signal, sys

    def threads_left():        # registered first, so it runs after qwen_ops's exit handler
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        with open(os.path.join(sys.argv[2], f"threads{os.environ['RANK']}.json"), "w") as f:
            json.dump(names, f)

    if os.path.isdir("/proc/self/task"):
        atexit.register(threads_left)
    from qwen_ops import LLM, SamplingParams
    llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=64, block_size=4)
    prompts = [[3 + i + j for j in range(5 + 3 * i)] for i in range(6)]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 3
                        + [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 3)
    tokens = [o.outputs[0].token_ids for o in outs]
    with open(os.path.join(sys.argv[2], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(tokens, f)
    if os.environ["RANK"] == "1" and len(sys.argv) > 3:      # a peer that dies after its work
        if sys.argv[3] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("rank 1 fails after generating")
""")


def _torchrun():
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, qwen3, nodes: int, *script_args: str, env: dict | None = None,
            grace_s: float = 30.0, limit_s: float = 240.0) -> tuple[list[int], str, float]:
    """Run SCRIPT under torchrun (``nodes`` launchers on loopback, 2 ranks in all): each
    launcher's exit code, their output, and the seconds until the last one exited. Once one
    launcher has failed, the others get ``grace_s`` before they are killed (exit code None):
    torchrun's agent would otherwise wait 300 s at its exit barrier for a failed node."""
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    port = _free_port()
    args = [str(script), str(qwen3), str(tmp_path), *script_args]
    if nodes == 1:
        cmds = [_torchrun() + ["--nproc-per-node=2", f"--master-port={port}", *args]]
    else:   # two "nodes" on loopback, one process each, through torchrun's c10d rendezvous
        cmds = [_torchrun() + ["--nnodes=2", "--nproc-per-node=1", f"--node-rank={r}", "--rdzv-backend=c10d",
                               f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=qwen-ops-test", *args]
                for r in range(nodes)]
    logs = [open(tmp_path / f"launcher{k}.log", "w+") for k in range(len(cmds))]
    t0 = time.monotonic()
    procs = [subprocess.Popen(c, env=env, stdout=log, stderr=subprocess.STDOUT) for c, log in zip(cmds, logs)]
    killed = set()
    try:
        failed_at = None
        while any(p.poll() is None for p in procs) and time.monotonic() - t0 < limit_s:
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                break
            time.sleep(0.1)
        elapsed = time.monotonic() - t0
    finally:
        for k, p in enumerate(procs):
            if p.poll() is None:
                killed.add(k)
                p.kill()
                p.wait()
    codes = [None if k in killed else p.returncode for k, p in enumerate(procs)]
    out = ""
    for k, log in enumerate(logs):
        log.seek(0)
        out += f"--- launcher {k} (exit code {codes[k]}) ---\n" + log.read()[-30000:]
        log.close()
    return codes, out, elapsed


@pytest.mark.parametrize("nodes", [1, 2])
def test_torchrun_launch(qwen3, tmp_path, nodes):
    """Every rank runs the same LLM(...) call; all ranks produce rank 0's tokens (the unseeded
    sampled ones included: rank 0's tokens are broadcast). No gloo thread outlives the exit
    handler: one that did could be ended by the interpreter's finalization in a noexcept
    destructor (SIGABRT, "terminate called without an active exception")."""
    codes, out, _ = _launch(tmp_path, qwen3, nodes)
    assert codes == [0] * nodes, out
    import json

    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0 == r1
    want = _tokens(LLM(qwen3, max_model_len=64, block_size=4).generate(PROMPTS[:3], GREEDY))
    assert r0[:3] == want
    for rank in range(2):
        if (tmp_path / f"threads{rank}.json").exists():
            names = json.loads((tmp_path / f"threads{rank}.json").read_text())
            assert not [n for n in names if "gloo" in n], f"rank {rank}'s threads at exit: {names}"


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_torchrun_peer_dies_at_exit(qwen3, tmp_path, how):
    """Rank 1 dies (SIGKILL) or raises after its work, on the other node: rank 0 cannot meet it
    at exit and says so, and both launchers fail within seconds instead of rank 0's launcher
    exiting 0 after torchrun's 300 s exit barrier."""
    codes, out, elapsed = _launch(tmp_path, qwen3, 2, how, env={"QWEN_OPS_TP_TIMEOUT_S": "20"})
    assert None not in codes, f"a launcher was still running {elapsed:.0f} s in, 30 s after the other failed:\n{out}"
    assert 0 not in codes, out
    assert "the other tensor-parallel ranks did not meet this one at exit" in out, out
    assert elapsed < 60, out


def test_shm_collectives_single_process():
    """The ops themselves, with one rank (the exchange with itself) and their validation."""
    from qwen_ops.ops.shm_collectives import workspace_bytes

    ws = torch.zeros(workspace_bytes(1, 1 << 12), dtype=torch.uint8)
    x = torch.randn(3, 5)
    for _ in range(3):                       # both parity halves
        torch.testing.assert_close(torch.ops.qwen.shm_all_reduce(x, ws, 0, 1), x)
        torch.testing.assert_close(torch.ops.qwen.shm_all_gather(x, ws, 0, 1), x)
    with pytest.raises(ValueError, match="rank = 1"):
        torch.ops.qwen.shm_all_reduce(x, ws, 1, 1)
    with pytest.raises(ValueError, match="workspace has dtype torch.float32"):
        torch.ops.qwen.shm_all_reduce(x, ws.float(), 0, 1)
    compiled = torch.compile(lambda a: torch.ops.qwen.shm_all_reduce(a * 2, ws, 0, 1) + 1, fullgraph=True)
    torch.testing.assert_close(compiled(x), x * 2 + 1)
