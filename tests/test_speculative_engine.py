"""Speculative decoding through the engine (issue 29): ``LLM(speculative_config=...)``.

Oracles: transformers' own greedy ``generate`` for the token-for-token tests (never the engine with
speculation off), and distributions computed from transformers' logits for the sampled test. An
oracle proposer (drafts read from transformers' continuation, one of them corrupted) makes every
acceptance length happen, so the KV cut-back and the hybrid models' state rollback are exercised
at each, not only where n-gram happens to hit.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from qwen_ops.engine.sampling import SamplingParams
from qwen_ops.engine.speculative import SpeculativeConfig
from qwen_ops.serving.llm import LLM

from checkpoints import make_moe_checkpoint, make_qwen3_5_checkpoint, make_qwen3_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers is the parity reference")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
NEW = 20


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "qwen3_5", "qwen3_next"])
def family(request, tmp_path_factory):
    """(name, checkpoint, transformers model) of each model family: dense, MoE, hybrid, hybrid MoE."""
    path = tmp_path_factory.mktemp(f"spec_{request.param}")
    if request.param == "qwen3":
        make_qwen3_checkpoint(path)
    elif request.param == "qwen3_5":
        make_qwen3_5_checkpoint(path)
    else:
        make_moe_checkpoint(path, request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


@torch.no_grad()
def hf_greedy(hf, prompt, n: int) -> list[int]:
    """transformers' greedy continuation, one full forward per token (no cache, no stopping)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def grounded_prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts that repeat a random phrase, so that prompt lookup finds drafts."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(2, 128) for _ in range(rng.randrange(3, 9))]
        out.append(phrase * rng.randrange(2, 4) + phrase[:rng.randrange(0, len(phrase))])
    return out


class OracleProposer:
    """Drafts the true continuation (``expected``: prompt -> transformers' greedy tokens) with the
    draft at a rotating position replaced by a wrong token (or none wrong), so acceptance lengths
    0..k all occur."""

    def __init__(self, expected: dict[tuple, list[int]], k: int):
        self.expected, self.k = expected, k
        self.calls = itertools.count()

    def propose(self, token_ids):
        for prompt, cont in self.expected.items():
            n = len(prompt)
            if tuple(token_ids[:n]) == prompt and len(token_ids) > n:
                done = len(token_ids) - n
                drafts = list(cont[done:done + self.k])
                bad = next(self.calls) % (self.k + 1)      # k: every draft right
                if bad < len(drafts):
                    drafts[bad] = (drafts[bad] + 1) % 128
                return drafts
        return []


def test_ngram_greedy_equals_transformers(family):
    """Every family: n-gram speculation's greedy tokens are transformers' own, and drafts were
    verified (how many a random model accepts varies; the oracle-proposer test below makes every
    acceptance length happen)."""
    _, path, hf = family
    prompts = grounded_prompts(1, 4)
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    llm = LLM(path, check_invariants=True, speculative_config=NGRAM)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == expected
    s = llm.stats()
    assert s["speculative_method"] == "ngram"
    assert s["spec_num_draft_tokens"] > 0, s
    assert s["spec_num_emitted_tokens"] == s["spec_num_drafts"] + s["spec_num_accepted_tokens"]
    assert s["spec_mean_accepted_length"] == pytest.approx(s["spec_num_emitted_tokens"] / s["spec_num_drafts"])
    assert s["free_blocks"] == s["total_blocks"]


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A dense draft with the tiny models' vocabulary and different weights (low acceptance)."""
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("spec_draft"), seed=1, layers=1)


def test_draft_model_greedy_equals_transformers(family, other_draft):
    """Every family with a draft model: the target itself as its draft (every greedy draft right,
    so runs of k + 1 tokens and the draft's pending token every step) where it has attention layers
    only, and an unrelated dense draft (mostly rejected): tokens are transformers' either way."""
    name, path, hf = family
    prompts = grounded_prompts(2, 3)
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    drafts = [other_draft] + ([path] if name in ("qwen3", "qwen3_moe") else [])
    for draft in drafts:
        llm = LLM(path, check_invariants=True, block_size=4,
                  speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in got] == expected, draft
        s = llm.stats()
        assert s["speculative_method"] == "draft_model" and s["spec_num_draft_tokens"] > 0, s
        if draft == path:
            assert s["spec_acceptance_rate"] > 0.95, s
        assert s["free_blocks"] == s["total_blocks"]


def test_every_acceptance_length_keeps_kv_and_state(family):
    """Drafts right up to a rotating position: acceptance lengths 0..k all occur (and the bonus
    token), in batches; the tokens stay transformers' (rejected KV rows are never read; hybrid
    models' conv and recurrent state end as if only the kept tokens were fed)."""
    _, path, hf = family
    k = 3
    prompts = [[rng_tok for rng_tok in random.Random(s).sample(range(2, 128), 6)] for s in range(3)]
    expected = {tuple(p): hf_greedy(hf, p, NEW) for p in prompts}
    llm = LLM(path, check_invariants=True, block_size=4)
    llm.scheduler.proposer = OracleProposer(expected, k)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == [expected[tuple(p)] for p in prompts]
    s = llm.stats()
    assert 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"], s
    assert s["spec_mean_accepted_length"] > 1.5, s


def test_stop_token_and_max_tokens_inside_a_verified_run(tmp_path):
    """Tokens emitted after a stop token (or past max_tokens) in the same verify step are dropped."""
    path = make_qwen3_checkpoint(tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [5, 9, 17, 33, 2, 70]
    cont = hf_greedy(hf, prompt, NEW)
    stop_at = next(i for i in range(3, NEW) if cont[i] not in cont[:i])     # a first occurrence, mid-run
    llm = LLM(path, check_invariants=True)
    llm.scheduler.proposer = OracleProposer({tuple(prompt): cont}, 6)
    llm.scheduler.proposer.calls = itertools.repeat(6)                       # every draft right
    out = llm.generate([prompt, prompt], [
        SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[cont[stop_at]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=stop_at - 1, ignore_eos=True)])
    assert out[0].outputs[0].token_ids == cont[:stop_at + 1] and out[0].outputs[0].finish_reason == "stop"
    assert out[1].outputs[0].token_ids == cont[:stop_at - 1] and out[1].outputs[0].finish_reason == "length"


def test_stop_string_inside_a_verified_run_drops_the_rest():
    """The embedded model (it has a tokenizer) with every draft right, so each step emits k + 1 = 7
    tokens: a stop string completed by a token in the middle of a run ends the text and the token
    ids there. Oracle: transformers' greedy tokens, decoded and cut at the string."""
    from qwen_ops.models.defaults import default_model_path

    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, check_invariants=True)
    prompt = "def fibonacci(n):"
    ids = llm.tokenizer.encode(prompt)
    cont = hf_greedy(hf, ids, 40)
    text = llm.tokenizer.decode(cont)
    # A token mid-run (not the 7th of a step: that would end a step anyway) whose text is new.
    j, stop = next((j, piece) for j in range(9, 36) if j % 7 != 0
                   for piece in [llm.tokenizer.decode(cont[:j + 1])[len(llm.tokenizer.decode(cont[:j])):]]
                   if len(piece.strip()) >= 2 and text.index(piece) == len(llm.tokenizer.decode(cont[:j])))
    llm.scheduler.proposer = OracleProposer({tuple(ids): cont}, 6)
    llm.scheduler.proposer.calls = itertools.repeat(6)                       # every draft right
    o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert o.text == text[:text.index(stop)] and o.finish_reason == "stop" and o.stop_reason == stop
    assert o.token_ids == cont[:j + 1]                 # nothing after the token that completed it
    assert llm.stats()["spec_num_accepted_tokens"] >= 6


def test_budget_counts_drafts(tmp_path):
    """A token budget of 3 leaves room for 2 drafts per decode of a lone request, 0 when two share
    the step; the invariant check (plan tokens == budget spent <= budget) runs every iteration."""
    path = make_qwen3_checkpoint(tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = grounded_prompts(5, 3)
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(path, check_invariants=True, max_num_batched_tokens=3,
              speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == expected
    s = llm.stats()
    assert s["spec_num_drafts"] > 0 and s["spec_num_draft_tokens"] <= 2 * s["spec_num_drafts"], s


def test_disable_by_batch_size(tmp_path):
    """No drafts in steps with at least disable_by_batch_size decodes; drafts again below it."""
    path = make_qwen3_checkpoint(tmp_path / "m")
    prompts = grounded_prompts(7, 3)
    cfg = dict(NGRAM, disable_by_batch_size=2)
    llm = LLM(path, check_invariants=True, speculative_config=cfg)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate(prompts, sp)                                   # three decodes a step: never drafts
    assert llm.stats()["spec_num_drafts"] == 0
    llm.generate(prompts[:1], sp)                               # one: drafts
    assert llm.stats()["spec_num_drafts"] > 0
    with pytest.raises(ValueError, match=r"speculative_config.disable_by_batch_size = 0, expected an int >= 1"):
        SpeculativeConfig.from_dict(dict(NGRAM, disable_by_batch_size=0))


def _top_k_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The distribution a row is sampled from, written out here from its definition (fp64)."""
    z = logits.double() / temperature
    kth = torch.topk(z, top_k).values[-1]
    z = torch.where(z >= kth, z, torch.tensor(-math.inf, dtype=torch.float64))
    return torch.softmax(z, dim=-1)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "mtp"])
def test_sampled_speculation_draws_from_the_target_distribution(tmp_path, method):
    """A model with an 8-token vocabulary, temperature 0.9 and top-k 6: the 2nd and 3rd tokens come
    from verify steps (n-gram drafts from the prompt, or a sampled draft model's with its own q);
    their joint over 4,000 seeded requests must match the distribution computed from transformers'
    logits (chi-square below the 0.1% critical value, total variation < 0.05). Seeded requests
    reproduce exactly. MTP: a Qwen3.5 hybrid with random mtp.* weights (test_speculative_mtp.py)."""
    vocab, temp, top_k, draws = 8, 0.9, 6, 4000
    if method == "mtp":
        from test_speculative_mtp import add_mtp

        path = make_qwen3_5_checkpoint(tmp_path / "m", vocab_size=vocab, eos_token_id=1)
        add_mtp(path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
        config = {"method": "mtp", "num_speculative_tokens": 2}
    else:
        path = make_qwen3_checkpoint(tmp_path / "m", vocab_size=vocab, eos_token_id=1)
        draft = make_qwen3_checkpoint(tmp_path / "d", vocab_size=vocab, eos_token_id=1, seed=3, layers=1)
        config = ({"method": "ngram", "num_speculative_tokens": 2} if method == "ngram" else
                  {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [2, 3, 4, 5, 6, 7, 0, 1, 2, 4, 6, 3, 5, 7, 1, 0]          # every token occurs: n-gram always drafts

    @torch.no_grad()
    def dist(prefix):
        return _top_k_probs(hf(torch.tensor([prefix])).logits[0, -1], temp, top_k)

    p1 = dist(prompt)
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)            # p(2nd = b, 3rd = c)
    for a in range(vocab):
        if p1[a] == 0:
            continue
        p2 = dist(prompt + [a])
        for b in range(vocab):
            if p2[b] > 0:
                joint[b] += p1[a] * p2[b] * dist(prompt + [a, b])
    llm = LLM(path, max_num_seqs=64, speculative_config=config)
    params = [SamplingParams(temperature=temp, top_k=top_k, max_tokens=3, seed=s, ignore_eos=True)
              for s in range(draws)]
    outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * draws, params)]
    s = llm.stats()
    assert s["spec_num_drafts"] >= 0.5 * draws and 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"], s
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for t in outs:
        assert len(t) == 3
        counts[t[1], t[2]] += 1
    keep = joint * draws >= 5                                         # chi-square's usual cell floor
    expected = joint * draws
    chi2 = float(((counts - expected)[keep] ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    critical = dof + 3.09 * math.sqrt(2 * dof) + 2                    # ~ the 0.1% point for dof in 20..64
    assert chi2 < critical, (chi2, dof)
    assert float(counts[~keep].sum()) <= 5 * int((~keep).sum()) + 20
    tv = 0.5 * float((counts / draws - joint).abs().sum())
    assert tv < 0.05, tv
    if method == "ngram":
        # The race keeps n-gram's drafts with the plain sampler's own noise: a seeded request's tokens
        # are those of plain sampling, in any batch (here 50 requests, not 4,000).
        plain = LLM(path, max_num_seqs=64)
        assert [o.outputs[0].token_ids for o in plain.generate([prompt] * 50, params[:50])] == outs[:50]
        again = [o.outputs[0].token_ids for o in llm.generate([prompt] * 50, params[:50])]
        assert again == outs[:50]


@pytest.mark.parametrize("config,match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, r"speculative_config.method = 'eagle', expected one of"),
    ({"method": "ngram"}, r"speculative_config.num_speculative_tokens is missing"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"speculative_config.num_speculative_tokens = 0, expected"),
    ({"method": "ngram", "num_speculative_tokens": 10 ** 9},
     r"speculative_config.num_speculative_tokens = 1000000000, expected at most 64"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, r"speculative_config.model = 'x' is not"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_max = 2 < prompt_lookup_min = 4"),
    ("ngram", r"speculative_config = 'ngram', expected a dict"),
])
def test_bad_speculative_config_names_the_field(config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(config)


def test_bad_draft_model_is_refused(tmp_path):
    target = make_qwen3_checkpoint(tmp_path / "t")
    small_vocab = make_qwen3_checkpoint(tmp_path / "v", vocab_size=64)
    with pytest.raises(ValueError, match=r"speculative_config.model = .* has vocab_size = 64, expected the target's 128"):
        LLM(target, speculative_config={"method": "draft_model", "model": str(small_vocab), "num_speculative_tokens": 2})
    hybrid = make_qwen3_5_checkpoint(tmp_path / "h")            # max_position_embeddings 256
    with pytest.raises(ValueError, match=r"supports max_position_embeddings = 256, expected at least max_model_len = 512"):
        LLM(target, speculative_config={"method": "draft_model", "model": str(hybrid), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config.model has linear-attention"):
        LLM(target, max_model_len=128,
            speculative_config={"method": "draft_model", "model": str(hybrid), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config.model = .*does-not-exist.* is not a checkpoint"):
        LLM(target, speculative_config={"method": "draft_model", "model": str(tmp_path / "does-not-exist"),
                                        "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config.model = None, expected the draft checkpoint"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2})


def test_bad_speculative_config_fails_before_the_load(tmp_path):
    with pytest.raises(ValueError, match=r"speculative_config.method = None"):
        LLM(tmp_path / "does-not-exist", speculative_config={"num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"tensor_parallel_size = 2: speculative decoding runs on one rank"):
        LLM(tmp_path / "does-not-exist", tensor_parallel_size=2, speculative_config=NGRAM)


def test_metrics_report_the_counts(tmp_path):
    """/metrics carries stats()' speculative counts under vLLM's spec_decode names."""
    from qwen_ops.serving.openai.metrics import ServerMetrics

    path = make_qwen3_checkpoint(tmp_path / "m")
    llm = LLM(path, speculative_config=NGRAM)
    llm.generate(grounded_prompts(3, 2), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    s = llm.stats()
    body = ServerMetrics(llm.stats, "m").render().decode()
    for name, key in (("spec_decode_num_drafts", "spec_num_drafts"),
                      ("spec_decode_num_draft_tokens", "spec_num_draft_tokens"),
                      ("spec_decode_num_accepted_tokens", "spec_num_accepted_tokens"),
                      ("spec_decode_num_emitted_tokens", "spec_num_emitted_tokens")):
        line = next(ln for ln in body.splitlines() if ln.startswith(f"qwen_ops:{name}_total{{"))
        assert float(line.split()[-1]) == s[key] > 0, (name, line)


def test_benchmark_fails_on_changed_tokens(monkeypatch):
    """bench_speculative's verdict: a speculative engine whose tokens differ from speculation off
    makes the run exit 1 (here its verification is broken to keep every draft)."""
    import importlib.util
    from pathlib import Path

    bench_dir = Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(bench_dir))
    spec = importlib.util.spec_from_file_location("qwen_ops_bench_speculative", bench_dir / "bench_speculative.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.check_identical([[1, 2], [3]], [[1, 2], [3]]) == []
    assert bench.check_identical([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == [1]
    assert bench.check_identical([[1]], [[1], [2]]) == [1]
    from qwen_ops.engine import sampler as S

    args = ["--repeats", "1", "--new-tokens", "12", "--prompts", "2", "--draft-layers", "0"]
    assert bench.main(args) == 0
    monkeypatch.setattr(S, "accept_picks", lambda picks, drafts: list(drafts) + [int(picks[-1])])
    assert bench.main(args) == 1


def test_compiled_verify_equals_transformers(tmp_path):
    """compile=True: decode and verify steps both run compiled (fullgraph, one graph per shape
    family: batch 1 and dynamic batches), and the tokens are still transformers'."""
    import torch._dynamo

    path = make_qwen3_checkpoint(tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = grounded_prompts(11, 3)
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    torch._dynamo.reset()
    llm = LLM(path, compile=True, speculative_config=dict(NGRAM, num_speculative_tokens=3))
    runner = llm.engine.runner
    seen = []
    real = runner.executors.run
    runner.executors.run = lambda step, executor: (step.kind != "verify" or seen.append(executor), real(step, executor))[1]
    got = [llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
           for p in prompts]
    got.append(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
               .outputs[0].token_ids)
    assert got == expected + expected[:1]
    assert seen and set(seen) == {"compiled"}, seen


def test_requests_with_processed_logits_do_not_draft(tmp_path):
    """A penalty's logits at draft i depend on drafts 1..i-1, so such requests decode one token a
    step: no drafts, and their tokens are the penalized greedy tokens of transformers."""
    path = make_qwen3_checkpoint(tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = grounded_prompts(4, 1)[0]
    llm = LLM(path, speculative_config=NGRAM)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                repetition_penalty=1.5))[0].outputs[0].token_ids
    ids = torch.tensor([prompt])
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10,
                       do_sample=False, repetition_penalty=1.5, pad_token_id=0)[0, len(prompt):].tolist()
    assert out == want and llm.stats()["spec_num_drafts"] == 0
