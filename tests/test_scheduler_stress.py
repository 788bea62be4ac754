"""Randomized stress of the scheduler through ``LLM``: every drawn configuration and workload ends
within the derived iteration bound, with greedy outputs equal to an unconstrained run, the
invariants checked at every step, and nothing left behind.

CI runs ``STRESS_DRAWS`` fixed-seed draws. A longer run on demand:

    QWEN_OPS_STRESS_DRAWS=2000 QWEN_OPS_STRESS_SEED=7 OMP_NUM_THREADS=1 \\
        python -m pytest tests/test_scheduler_stress.py -q -s

``-s`` shows a summary line: draws run, preemptions and swaps seen, and the longest run in
iterations against its bound.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest

from qwen_ops.engine.batch import RequestId
from qwen_ops.engine.batch import IterationPlan
from qwen_ops.serving.llm import LLM
from qwen_ops.engine.sampling import SamplingParams
from qwen_ops.engine.scheduler import SchedulerStuckError, iteration_bound

from checkpoints import make_qwen3_checkpoint, make_qwen3_5_checkpoint

STRESS_DRAWS = int(os.environ.get("QWEN_OPS_STRESS_DRAWS", "40"))
STRESS_SEED = int(os.environ.get("QWEN_OPS_STRESS_SEED", "0"))
MAX_MODEL_LENS = (24, 48, 96)
VOCAB = 128
EOS = 1


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3_stress"))


@pytest.fixture(scope="module")
def hybrid_ckpt(tmp_path_factory):
    return make_qwen3_5_checkpoint(tmp_path_factory.mktemp("qwen3_5_stress"))


@dataclass
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]
    arrive_at: list[int]             # iteration at which each request is added
    abort_at: list[int | None]       # iteration at which it is aborted (None: never)


def draw_config(rng: random.Random) -> dict:
    """From barely one sequence of KV to roomy; budgets down to one token an iteration."""
    max_model_len = rng.choice(MAX_MODEL_LENS)
    block_size = rng.choice([1, 2, 4, 8, 16])
    per_seq = -(-max_model_len // block_size)
    max_num_seqs = rng.randint(1, 8)
    num_kv_blocks = rng.choice([per_seq, per_seq + rng.randint(0, per_seq),
                                rng.randint(per_seq, per_seq * max_num_seqs + 1)])
    mode = rng.choice(["recompute", "swap"])
    block_bytes = 2 * 2 * block_size * 2 * 16 * 4           # k + v, 2 layers, 2 kv heads, head_dim 16, fp32
    swap_space = rng.choice([None, 0, block_bytes * rng.randint(1, 3 * per_seq) / (1 << 30)])   # GiB
    return dict(max_model_len=max_model_len, block_size=block_size, max_num_seqs=max_num_seqs,
                num_kv_blocks=num_kv_blocks, preemption_mode=mode, swap_space=swap_space,
                max_num_batched_tokens=rng.choice([1, 2, rng.randint(3, 16), rng.randint(16, 128)]),
                enable_prefix_caching=rng.random() < 0.8)


def draw_workload(rng: random.Random, max_model_len: int) -> Workload:
    n = rng.randint(1, 10)
    prompts, params, arrive, abort = [], [], [], []
    # Half the workloads share a prefix (a system prompt) among some requests, for prefix caching.
    shared = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, max_model_len - 2))] if rng.random() < 0.5 else []
    for _ in range(n):
        plen = min(max_model_len - 1, rng.choice([rng.randint(1, 6), rng.randint(1, max_model_len - 1)]))
        prompt = [rng.randrange(2, VOCAB) for _ in range(plen)]
        if shared and rng.random() < 0.7:
            prompt = (shared + prompt)[:max(len(shared) + 1, plen)][:max_model_len - 1]
        prompts.append(prompt)
        stops = rng.sample(range(2, VOCAB), rng.choice([0, 0, 1, 3]))
        params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), stop_token_ids=stops,
                                     ignore_eos=rng.random() < 0.7))
        arrive.append(rng.choice([0, 0, rng.randint(0, 30)]))
        abort.append(arrive[-1] + rng.randint(0, 20) if rng.random() < 0.15 else None)
    return Workload(prompts, params, arrive, abort)


def run_workload(llm: LLM, w: Workload) -> tuple[dict[int, object], set[int]]:
    """Add, step and abort as the workload says; returns each request's final output and the aborted ones."""
    ids: dict[int, str] = {}
    aborted: set[int] = set()
    outputs: dict[int, object] = {}
    it = 0
    while len(ids) < len(w.prompts) or llm.has_unfinished_requests():
        for i, t in enumerate(w.arrive_at):
            if i not in ids and (t <= it or not llm.has_unfinished_requests()):
                ids[i] = llm.add_request(w.prompts[i], w.params[i])
                outputs[i] = llm.scheduler.requests[RequestId(int(ids[i]))]   # kept: finished ones are dropped
        for i, t in enumerate(w.abort_at):
            if i in ids and t is not None and t <= it and i not in aborted:
                llm.abort(ids[i])
                aborted.add(i)
        if llm.has_unfinished_requests():
            llm.step()
        it += 1
    assert not llm.scheduler.requests, "finished and aborted requests must leave the scheduler"
    return outputs, aborted


class Reference:
    """Unconstrained runs (roomy cache, no preemption), one LLM per max_model_len."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.llms: dict[int, LLM] = {}

    def outputs(self, w: Workload, max_model_len: int) -> list[list[int]]:
        if max_model_len not in self.llms:
            self.llms[max_model_len] = LLM(self.ckpt, max_model_len=max_model_len, max_num_seqs=16, block_size=16,
                                           enable_prefix_caching=False)
        outs = self.llms[max_model_len].generate(w.prompts, w.params)
        return [o.outputs[0].token_ids for o in outs]


def check_draw(ckpt, ref: Reference, seed: int, summary: dict, speculative=None) -> None:
    """``speculative``: None, the dense checkpoint to draw drafts from (n-gram or that draft model),
    or "mtp" (the checkpoint's own MTP layer)."""
    rng = random.Random(seed)
    cfg = draw_config(rng)
    if speculative is not None:       # 1..6 drafts a step; the reference runs without them
        k = rng.randint(1, 6)
        if speculative == "mtp":
            cfg["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
        elif rng.random() < 0.5:
            cfg["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k,
                                         "prompt_lookup_min": 1, "prompt_lookup_max": rng.randint(1, 4)}
        else:
            cfg["speculative_config"] = {"method": "draft_model", "model": str(speculative),
                                         "num_speculative_tokens": k}
    w = draw_workload(rng, cfg["max_model_len"])
    where = f"seed {seed}: {cfg}"
    llm = LLM(ckpt, check_invariants=True, **cfg)
    got, aborted = run_workload(llm, w)
    expected = ref.outputs(w, cfg["max_model_len"])
    for i, req in got.items():
        if i in aborted:
            assert req.output_token_ids == expected[i][:len(req.output_token_ids)], f"{where}, request {i}"
        else:
            assert req.finished and req.output_token_ids == expected[i], f"{where}, request {i}"
    bound = iteration_bound([(len(p), sp.max_tokens) for p, sp in zip(w.prompts, w.params)],
                            cfg["max_num_batched_tokens"])
    s = llm.stats()
    assert s["num_iterations"] <= bound, where
    assert s["free_blocks"] == s["total_blocks"], where
    assert s["swap_bytes_used"] == 0 and s["num_swapped"] == s["num_running"] == s["num_waiting"] == 0, where
    summary["draws"] += 1
    summary["preemptions"] += s["num_preemptions"]
    summary["swaps"] += s["num_swaps_out"]
    summary["swap_full"] += s["num_swap_full_recomputes"]
    summary["prefix_hits"] += s["prefix_cache_hits"]
    summary["drafts"] += s["spec_num_draft_tokens"]
    summary["accepted"] += s["spec_num_accepted_tokens"]
    llm.engine.check_block_accounting()
    if s["num_iterations"] / bound > summary["worst"][0]:
        summary["worst"] = (s["num_iterations"] / bound, s["num_iterations"], bound, seed)


def _summary() -> dict:
    return {"draws": 0, "preemptions": 0, "swaps": 0, "swap_full": 0, "prefix_hits": 0, "drafts": 0, "accepted": 0,
            "worst": (0.0, 0, 0, None)}


def test_randomized_configs_and_workloads(ckpt):
    ref = Reference(ckpt)
    summary = _summary()
    for k in range(STRESS_DRAWS):
        check_draw(ckpt, ref, STRESS_SEED * 1_000_003 + k, summary)
    print(f"\nstress: {summary}")
    # The draws must really exercise preemption, swap and the full-swap fallback, or they prove little.
    assert summary["preemptions"] > 0 and summary["swaps"] > 0 and summary["swap_full"] > 0, summary
    assert summary["prefix_hits"] > 0, summary


def test_randomized_hybrid_model(hybrid_ckpt):
    """Swapped hybrid requests carry their per-slot conv and recurrent state with them."""
    ref = Reference(hybrid_ckpt)
    summary = _summary()
    for k in range(max(4, STRESS_DRAWS // 4)):
        check_draw(hybrid_ckpt, ref, 10_000 + STRESS_SEED * 1_000_003 + k, summary)
    print(f"\nstress (hybrid): {summary}")
    assert summary["preemptions"] > 0, summary


def test_randomized_with_speculation(ckpt, hybrid_ckpt):
    """Issue 29: speculation (n-gram, or the dense model as its own draft model: every greedy draft
    right) under the same draws (preemption, swap, prefix caching, budgets down to one token,
    aborts): outputs equal the plain reference's, the iteration bound and the invariants (the
    budget counts drafts) hold, and nothing is left behind; hybrid models roll back their
    linear-layer state where drafts were rejected."""
    for path, draws, offset in ((ckpt, max(8, STRESS_DRAWS // 2), 20_000), (hybrid_ckpt, max(4, STRESS_DRAWS // 4), 30_000)):
        ref = Reference(path)
        summary = _summary()
        for k in range(draws):
            check_draw(path, ref, offset + STRESS_SEED * 1_000_003 + k, summary, speculative=ckpt)
        print(f"\nstress (speculative, {path.name}): {summary}")
        assert summary["preemptions"] > 0 and summary["drafts"] > 0 and summary["accepted"] > 0, summary


def test_randomized_with_mtp(hybrid_ckpt, tmp_path_factory):
    """Speculation by the checkpoint's own MTP layer (random mtp.* weights: nearly every draft is
    rejected, the rollback and the MTP catch-up run every step) under the same draws: outputs equal
    the plain reference's (the same files, MTP not loaded), preemption and swap carry the MTP's KV
    and remembered rows with the request."""
    import shutil

    import torch
    import transformers
    from test_speculative_mtp import add_mtp

    path = tmp_path_factory.mktemp("qwen3_5_mtp_stress") / "ckpt"
    shutil.copytree(hybrid_ckpt, path)
    add_mtp(path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    ref = Reference(path)
    summary = _summary()
    for k in range(max(4, STRESS_DRAWS // 4)):
        check_draw(path, ref, 40_000 + STRESS_SEED * 1_000_003 + k, summary, speculative="mtp")
    print(f"\nstress (mtp): {summary}")
    assert summary["preemptions"] > 0 and summary["drafts"] > 0, summary


# ----------------------------------------------------------------- the two hangs of issue 14
def test_swap_under_kv_pressure_finishes_like_recompute(ckpt):
    """28 requests (prompts 3-120, outputs 4-100) in 24 blocks of 16: swap looped forever on main."""
    rng = random.Random(0)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 120))] for _ in range(28)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 100), ignore_eos=True) for _ in range(28)]
    results = {}
    for mode in ("recompute", "swap"):
        llm = LLM(ckpt, max_model_len=256, max_num_seqs=4, block_size=16, num_kv_blocks=24,
                  preemption_mode=mode, check_invariants=True)
        results[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        s = llm.stats()
        assert s["num_preemptions"] > 0 and s["free_blocks"] == s["total_blocks"]
        assert s["num_iterations"] <= iteration_bound([(len(p), 100) for p in prompts], 512)
    assert s["num_swaps_out"] > 0 and s["num_swaps_in"] == s["num_swaps_out"] and s["swap_bytes_used"] == 0
    assert results["swap"] == results["recompute"]


def test_bench_with_swap_finishes(ckpt):
    """``qwen-ops bench --num-kv-blocks 8 --max-model-len 128 --preemption-mode swap ...`` hung on main."""
    argv = ["bench", "--model", str(ckpt), "--num-kv-blocks", "8", "--max-model-len", "128",
            "--preemption-mode", "swap", "--prompt-len", "48", "--output-len", "40", "--num-requests", "8"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "qwen_ops.serving.cli", *argv], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    rows = dict(line.split("  ", 1) for line in out.stdout.splitlines() if "  " in line)
    swaps_out, swaps_in = (int(x) for x in rows["swaps out / in"].strip().split(" / "))
    assert swaps_out > 0 and swaps_in == swaps_out


def test_swapped_request_that_can_never_return_is_recomputed(ckpt):
    """A swapped request whose next step does not fit even an idle cache falls back to recompute;
    when even that cannot run, the scheduler raises instead of spinning."""
    prompt = list(range(2, 30))
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    expected = LLM(ckpt, max_model_len=32).generate([prompt], sp)[0].outputs[0].token_ids
    llm = LLM(ckpt, max_model_len=32, max_num_seqs=2, block_size=4, num_kv_blocks=8, preemption_mode="swap",
              enable_prefix_caching=False)   # a cached prefix would let the recompute fit
    sched, engine = llm.scheduler, llm.engine
    llm.add_request(prompt, sp)
    llm.step()                                     # the 28-token prompt: 7 of 8 blocks, first token
    (req,) = sched.requests.values()
    sched._preempt(req, IterationPlan.empty())     # swap it out by hand ...
    assert req.swapped is not None and sched.swap_bytes_used == req.swapped.nbytes > 0
    stolen = engine.allocator.allocate(2)          # ... and shrink the cache under it (6 blocks < 8 needed)
    with pytest.raises(SchedulerStuckError, match="needs 8 KV blocks"):
        llm.step()
    assert sched.num_swap_in_recomputes == 1 and sched.swap_bytes_used == 0 and req.swapped is None
    assert list(sched.waiting) == [req] and req.num_computed == 0
    engine.allocator.free(stolen)                  # room again: it recomputes and finishes unchanged
    while llm.has_unfinished_requests():
        llm.step()
    assert req.output_token_ids == expected and engine.num_free_blocks == engine.num_total_blocks
