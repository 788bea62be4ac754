"""Issue 61 item 7: the core's optional paths end to end through ``LLM``, each against an oracle that
cannot share its code. The end-to-end suites never turn these on, so a bug in them was caught only by
their own unit suites.

- top-p on both CPU sampler paths (the C kernel ``host.sample_rows``; the torch ``_filter`` that rows
  with top-k or min-p take) against a float64 top-p of transformers' logits, over many seeds;
- the prefix cache: prompts sharing only their first token share no block (transformers' greedy tokens,
  caching on and off), and the hit counters equal the full shared blocks counted from the prompts;
- n-gram speculation with a stop token inside an accepted run of drafts, a peft LoRA adapter, and
  ``prompt_logprobs``, each against transformers (peft);
- beam search with a length penalty against transformers' ``generate(num_beams=...)`` where the two
  searches are one search, and every returned sequence's score recomputed from transformers' logits.

The served routes (``/v1/completions``, ``/v1/embeddings``) are in tests/test_core_oracles_served.py.
"""

from __future__ import annotations

import collections
import functools
import math
import random

import pytest
import torch

from qwen_ops import LLM, BeamSearchParams, LoRARequest, SamplingParams

from checkpoints import make_lora_adapter, make_qwen3_checkpoint
from oracles import TransformersGreedy
from qwen_tiny import hf_greedy, load_hf

VOCAB = 128                   # make_qwen3_checkpoint's
TEMPERATURE = 0.7
NUM_SAMPLES = 1000            # seeds seed .. seed + 999, one token each (n = 1000)
SIGMA_BOUND = 5.0             # a kept token's count may sit this many binomial deviations from n * q


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("core_oracles"))


@pytest.fixture(scope="module")
def oracle(ckpt):
    return TransformersGreedy(ckpt)


# ------------------------------------------------------------------------------------------------
# 1. top-p on each sampler path, against a float64 top-p of transformers' logits
# ------------------------------------------------------------------------------------------------

# path -> the sampling filters that send a row there (sampling.py ``sample``): top-p alone goes to the C
# kernel; top-k (64 of 128 tokens, not binding on the 4 kept) or a tiny min-p to the torch ``_filter``.
TOP_P_PATHS = {"c_kernel": {}, "torch_top_k": {"top_k": 64}, "torch_min_p": {"min_p": 1e-3}}


def top_p_oracle(logits: torch.Tensor, temperature: float, top_k: int = -1, min_p: float = 0.0,
                 crossing_rank: int = 3):
    """``(p, kept, q)``: a top-p and its kept set over transformers' ``logits`` [vocab] in float64, after
    temperature, min-p and top-k (vLLM's order), with ``q`` the kept tokens' renormalized probabilities.

    vLLM's top-p keeps the smallest most-likely-first set whose mass reaches p: the token that crosses
    p is kept. p is put in the middle of the ``crossing_rank``-th token's mass, so that token (not a
    rounding-sized sliver of it) is the one crossing; None where neighbours are too close to order."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if min_p > 0:
        probs = torch.where(probs < min_p * probs.max(), 0.0, probs)
    if top_k > 0:
        probs = torch.where(probs < probs.topk(top_k).values[-1], 0.0, probs)
    probs = probs / probs.sum()
    values, order = probs.sort(descending=True)
    c = crossing_rank
    if min(values[c - 1] - values[c], values[c] - values[c + 1]) < 1e-4:   # fp32 could order them otherwise
        return None
    before = values[:c].sum().item()
    p = before + 0.5 * values[c].item()
    kept = order[:c + 1].tolist()
    q = (values[:c + 1] / values[:c + 1].sum()).tolist()
    return p, kept, q


def assert_top_p_samples(tokens: list[int], kept: list[int], q: list[float]) -> None:
    """Every sample in the kept set, the crossing token (kept[-1]) drawn, each count near n * q."""
    n = len(tokens)
    counts = collections.Counter(tokens)
    assert set(counts) <= set(kept), f"sampled {sorted(set(counts) - set(kept))} outside the top-p set {kept}"
    assert counts[kept[-1]] > 0, f"the token crossing p ({kept[-1]}, q = {q[-1]:.3f}) was never sampled in {n}"
    for t, qt in zip(kept, q):
        bound = SIGMA_BOUND * math.sqrt(n * qt * (1 - qt)) + 1
        assert abs(counts[t] - n * qt) <= bound, (t, counts[t], n * qt, bound)


def pick_top_p_prompt(oracle, **filters):
    """The first of a few fixed random prompts whose top-p case is well posed (``top_p_oracle``) and whose
    crossing token holds at least a tenth of the kept mass (so 1,000 draws all missing it would be a bug)."""
    rng = random.Random(7)
    for _ in range(20):
        prompt = [rng.randrange(2, VOCAB) for _ in range(6)]
        case = top_p_oracle(oracle.logits(prompt), TEMPERATURE, **filters)
        if case is not None and case[2][-1] >= 0.1:
            return prompt, case
    raise AssertionError("no prompt with a well-separated, likely crossing token: the case is not exercised")


@pytest.mark.parametrize("path", list(TOP_P_PATHS))
def test_top_p_keeps_the_crossing_token_on_each_sampler_path(ckpt, oracle, path):
    """1,000 seeded draws of one token (``n``): all in transformers' float64 top-p set, the token that
    crosses p among them, each token near its renormalized share."""
    filters = TOP_P_PATHS[path]
    prompt, (p, kept, q) = pick_top_p_prompt(oracle, **filters)
    llm = LLM(str(ckpt), max_model_len=64, block_size=4)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=TEMPERATURE, top_p=p, seed=1234,
                                                   n=NUM_SAMPLES, **filters), use_tqdm=False)
    tokens = [c.token_ids[0] for c in out.outputs]
    assert len(tokens) == NUM_SAMPLES
    assert_top_p_samples(tokens, kept, q)


# ------------------------------------------------------------------------------------------------
# 2. the prefix cache: blocks are shared by their whole prefix, not by their first token
# ------------------------------------------------------------------------------------------------

BLOCK = 4
PREFIX_NEW = 6


def expected_hit_tokens(prompt: list[int], cached: list[list[int]]) -> int:
    """Tokens of ``prompt`` the cache can serve (counted here, not by the engine): its longest run of
    full blocks, at most (len - 1) // BLOCK of them (the last token is always computed), that is a
    whole-block prefix of a sequence in ``cached``."""
    prefixes = {tuple(seq[:k * BLOCK]) for seq in cached for k in range(1, len(seq) // BLOCK + 1)}
    n = 0
    while n + 1 <= (len(prompt) - 1) // BLOCK and tuple(prompt[:(n + 1) * BLOCK]) in prefixes:
        n += 1
    return n * BLOCK


def shared_first_token_prompts():
    """Two first-wave prompts sharing only their first token, and second-wave prompts that share whole
    blocks with one of them, or only the first token, or a block's tokens after a different parent."""
    rng = random.Random(3)
    fresh = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    first = 5
    a, b = [first] + fresh(13), [first] + fresh(13)
    assert a[:BLOCK] != b[:BLOCK]
    second = [
        a[:8] + fresh(5),                          # A's first two blocks
        b[:4] + fresh(6),                          # B's first block: the one a first-token key gives to A
        a[:12] + fresh(3),                         # A's three blocks
        b[:8] + fresh(1),                          # B's two blocks, the last token left to compute
        [first] + fresh(9),                        # the first token only
        [first] + fresh(3) + a[4:8] + fresh(4),    # A's second block after another first block
    ]
    return [a, b], second


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_cache_shares_whole_prefixes_only(ckpt, oracle, caching):
    first, second = shared_first_token_prompts()
    sp = SamplingParams(temperature=0.0, max_tokens=PREFIX_NEW, ignore_eos=True)
    llm = LLM(str(ckpt), max_model_len=64, block_size=BLOCK, enable_prefix_caching=caching, check_invariants=True)
    outs = llm.generate(first, sp, use_tqdm=False) + llm.generate(second, sp, use_tqdm=False)
    prompts = first + second
    assert [o.outputs[0].token_ids for o in outs] == [oracle(p, PREFIX_NEW) for p in prompts]
    # What the first wave left in the cache: each prompt and its tokens but the last (never fed back).
    written = [p + o.outputs[0].token_ids[:-1] for p, o in zip(first, outs)]
    want = [expected_hit_tokens(p, written) for p in second]
    # the second wave shares nothing among itself that the first wave did not hold: the count does not
    # depend on which of its requests the scheduler ran first
    assert want == [expected_hit_tokens(p, written + [q for q in second if q is not p]) for p in second]
    assert want == [8, 4, 12, 8, 0, 0]
    s = llm.stats()
    assert s["prefix_caching"] is caching
    assert s["prefix_cache_queries"] == (sum((len(p) - 1) // BLOCK * BLOCK for p in prompts) if caching else 0)
    assert s["prefix_cache_hits"] == (sum(want) if caching else 0)
    assert s["prefix_cache_collisions"] == 0      # SHA-256 keys of whole prefixes: no two prefixes share one
    assert s["free_blocks"] == s["total_blocks"]


# ------------------------------------------------------------------------------------------------
# 4. n-gram speculation with a stop token inside an accepted run, a peft LoRA, prompt_logprobs
# ------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SPEC_NEW = 16


def trajectory_prompts(oracle, n: int) -> list[list[int]]:
    """A random phrase repeated, then transformers' own 24 greedy tokens after it: the tiny model's
    continuations fall into loops, which the prompt already holds, so prompt lookup drafts tokens the
    output has not had yet, and the target accepts them."""
    rng = random.Random(5)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(3, 7))]
        seed = phrase * 3 + phrase[:2]
        out.append(seed + oracle(seed, 24))
    return out


def step_runs(llm, prompt: list[int], sp: SamplingParams) -> list[list[int]]:
    """The tokens each engine step gave the request (``LLM.stream``'s updates): a run of more than one
    token is a speculative step's accepted drafts and its bonus token."""
    return [list(o.new_token_ids) for o in llm.stream([prompt], sp)]


def test_ngram_speculation_stops_on_a_stop_token_inside_accepted_drafts(ckpt, oracle):
    """Greedy tokens with n-gram speculation are transformers'; a stop token id that transformers'
    continuation reaches in the middle of a step's accepted drafts ends the request right there."""
    llm = LLM(str(ckpt), max_model_len=128, block_size=4, speculative_config=NGRAM)
    free = SamplingParams(temperature=0.0, max_tokens=SPEC_NEW, ignore_eos=True)
    prompts = trajectory_prompts(oracle, 12)
    outs = llm.generate(prompts, free, use_tqdm=False)
    want = [oracle(p, SPEC_NEW) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.stats()["spec_num_accepted_tokens"] > 0
    # Stop ids from transformers' own continuation, first reached inside one step's run of tokens (not
    # its last): that step emits tokens past the stop, which the request must not keep.
    cases = []
    for p, cont in zip(prompts, want):
        at = 0
        for run in step_runs(llm, p, free):
            for j in range(at, at + len(run) - 1):
                if cont[j] not in cont[:j]:          # its first occurrence: the stop fires at j
                    cases.append((p, cont[j], cont[:j + 1]))
            at += len(run)
    assert len(cases) >= 3, "no stop token falls inside a speculative step: the case is not exercised"
    outs = llm.generate([p for p, _, _ in cases],
                        [SamplingParams(temperature=0.0, max_tokens=SPEC_NEW, ignore_eos=True, stop_token_ids=[t])
                         for _, t, _ in cases], use_tqdm=False)
    for (p, t, expect), o in zip(cases, outs):
        c = o.outputs[0]
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (expect, "stop", t), (p, t)
    s = llm.stats()
    assert s["free_blocks"] == s["total_blocks"]


LORA_NEW = 8


def test_lora_greedy_equals_peft_merged_model(ckpt, oracle, tmp_path):
    """A mixed batch (the base model, a LoRA, an rsLoRA) gives each request the greedy tokens of
    transformers' model with peft's adapter merged into its weights (``merge_and_unload``)."""
    peft = pytest.importorskip("peft")
    adapters = [make_lora_adapter(ckpt, tmp_path / "plain", 8, seed=1),
                make_lora_adapter(ckpt, tmp_path / "rslora", 4, seed=2, rslora=True)]
    merged = [peft.PeftModel.from_pretrained(load_hf(ckpt), str(a)).merge_and_unload().eval() for a in adapters]
    rng = random.Random(9)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(3, 12))] for _ in range(6)]
    picks = [0, None, 1, 0, 1, None]
    llm = LLM(str(ckpt), enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64, block_size=4)
    requests = [LoRARequest(f"adapter{i}", i + 1, str(a)) for i, a in enumerate(adapters)]
    sp = SamplingParams(temperature=0.0, max_tokens=LORA_NEW, ignore_eos=True)
    outs = llm.generate(prompts, sp, lora_request=[None if i is None else requests[i] for i in picks], use_tqdm=False)
    for p, i, o in zip(prompts, picks, outs):
        want = oracle(p, LORA_NEW) if i is None else hf_greedy(merged[i], p, LORA_NEW)
        assert o.outputs[0].token_ids == want, (p, i)
    # the adapters change the tokens: an ignored adapter would not pass
    assert any(hf_greedy(merged[i], p, LORA_NEW) != oracle(p, LORA_NEW) for p, i in zip(prompts, picks) if i == 0)
    assert any(hf_greedy(merged[i], p, LORA_NEW) != oracle(p, LORA_NEW) for p, i in zip(prompts, picks) if i == 1)


# fp32 logits against transformers' fp32 logits (summation order only), as tests/test_prompt_logprobs.py
LOGPROB_ATOL = 1e-4
PROMPT_TOP = 3


def test_prompt_logprobs_equal_transformers_log_softmax(ckpt, oracle):
    """``prompt_logprobs=3`` in a batch with requests that do not ask, chunked prefill (12 tokens a step)
    and a prefix the cache holds (the request that does not ask maps it; the one that asks scores it
    again): entry i is transformers' float64 log-softmax of position i - 1's logits at prompt token i,
    its rank, and the 3 most likely tokens."""
    llm = LLM(str(ckpt), max_model_len=64, block_size=4, max_num_batched_tokens=12)
    rng = random.Random(11)
    shared = [rng.randrange(2, VOCAB) for _ in range(9)]
    llm.generate([shared + [7]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)   # cached
    prompts = [shared + [rng.randrange(2, VOCAB) for _ in range(n)] for n in (5, 4)]
    prompts += [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (3, 5, 20, 2)]
    asks = [True, False, True, True, True, False]
    params = [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=PROMPT_TOP if a else None)
              for a in asks]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] > 0
    for p, a, o in zip(prompts, asks, outs):
        assert o.outputs[0].token_ids == oracle(p, 2)
        if not a:
            assert o.prompt_logprobs is None
            continue
        with torch.no_grad():
            want = torch.log_softmax(oracle.model(torch.tensor([p])).logits[0, :-1].double(), dim=-1)
        entries = o.prompt_logprobs
        assert entries[0] is None and len(entries) == len(p)
        for i in range(1, len(p)):
            row, tok, e = want[i - 1], p[i], entries[i]
            assert abs(e[tok].logprob - row[tok].item()) < LOGPROB_ATOL, (i, e[tok].logprob, row[tok].item())
            assert e[tok].rank == int((row > row[tok]).sum()) + 1
            top = row.topk(PROMPT_TOP).indices.tolist()
            assert set(top) <= set(e) and len(e) <= PROMPT_TOP + 1, (i, top, list(e))
            for t in top:
                assert abs(e[t].logprob - row[t].item()) < LOGPROB_ATOL


# ------------------------------------------------------------------------------------------------
# 5. beam search with a length penalty, against transformers' beam search
# ------------------------------------------------------------------------------------------------

EOS = 1                       # make_qwen3_checkpoint's eos_token_id
BEAM_WIDTH = 3
BEAM_TOKENS = 6
BEAM_PROMPT_LEN = 2
LENGTH_PENALTIES = (0.7, 1.5)


@pytest.fixture(scope="module")
def eos_ckpt(ckpt, tmp_path_factory):
    """The tiny checkpoint with its EOS row of the LM head tripled: EOS is likely after some prefixes and
    not others, so beams end at different lengths and the length penalty decides between them."""
    hf = load_hf(ckpt)
    with torch.no_grad():
        hf.lm_head.weight[EOS] *= 3.0
    path = tmp_path_factory.mktemp("core_oracles_eos")
    hf.save_pretrained(path)
    return path, hf


class BeamOracles:
    """Three beam searches over transformers' float32 model, none of them the engine's code:

    - ``hf(prompt, lp)``: transformers' ``generate(num_beams=3, length_penalty=lp)``. Its search is not
      vLLM's: its live beams are the best non-EOS ones (as vLLM's), but an EOS extension completes only
      when it is among the 3 best by raw log-probability, it divides by the generated length (with the
      EOS) where vLLM divides by all the tokens (the prompt's, without the EOS), and its last step
      completes the 3 best whatever they end in.
    - ``rule(prompt, lp, vllm=True)``: vLLM's ``LLM.beam_search`` in float64: each live beam's 2w most
      likely extensions; every one ending in EOS is complete; the w best others (by
      ``cum_logprob / len(tokens) ** lp``) live on; the answer is the w best of both.
    - ``rule(..., vllm=False)``: the rule qwen_ops/serving/beam_search.py documents: the w best of all the
      extensions, those ending in EOS complete, the others live on.
    """

    def __init__(self, hf):
        self.hf = hf

    @functools.lru_cache(maxsize=None)
    def logprobs(self, tokens: tuple) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(self.hf(torch.tensor([list(tokens)])).logits[0, -1].double(), dim=-1)

    def cum_logprob(self, tokens: list[int], prompt_len: int) -> float:
        return sum(self.logprobs(tuple(tokens[:i]))[tokens[i]].item() for i in range(prompt_len, len(tokens)))

    @staticmethod
    def score(tokens: list[int], cum: float, lp: float) -> float:
        return cum / (len(tokens) - (tokens[-1] == EOS)) ** lp

    def rule(self, prompt: list[int], lp: float, vllm: bool) -> list[list[int]]:
        key = lambda s: self.score(s[0], s[1], lp)  # noqa: E731
        live, done = [(list(prompt), 0.0)], []
        for _ in range(BEAM_TOKENS):
            cands = []
            for tokens, cum in live:
                lps = self.logprobs(tuple(tokens))
                cands += [(tokens + [t], cum + lps[t].item()) for t in lps.topk(2 * BEAM_WIDTH).indices.tolist()]
            if vllm:
                done += [c for c in cands if c[0][-1] == EOS]
                live = sorted([c for c in cands if c[0][-1] != EOS], key=key, reverse=True)[:BEAM_WIDTH]
            else:
                best = sorted(cands, key=key, reverse=True)[:BEAM_WIDTH]
                done += [c for c in best if c[0][-1] == EOS]
                live = [c for c in best if c[0][-1] != EOS]
            if not live:
                break
        return [s[0][len(prompt):] for s in sorted(done + live, key=key, reverse=True)[:BEAM_WIDTH]]

    def hf_best(self, prompt: list[int], lp: float) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=BEAM_WIDTH, do_sample=False,
                               max_new_tokens=BEAM_TOKENS, length_penalty=lp, early_stopping="never",
                               eos_token_id=EOS, pad_token_id=0)[0, len(prompt):].tolist()
        return out[:out.index(EOS) + 1] if EOS in out else out


def beam_candidates(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, VOCAB, (BEAM_PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def beam_cases(eos_ckpt):
    """``{(prompt, lp): (transformers' best, vLLM rule's best, the documented rule's best)}`` over 40
    fixed random prompts, for the tested penalties and for 1 (what an ignored penalty gives)."""
    oracles = BeamOracles(eos_ckpt[1])
    cases = {}
    for prompt in beam_candidates(40):
        for lp in LENGTH_PENALTIES + (1.0,):
            cases[tuple(prompt), lp] = (oracles.hf_best(prompt, lp), oracles.rule(prompt, lp, vllm=True)[0],
                                        oracles.rule(prompt, lp, vllm=False)[0])
    return oracles, cases


def test_beam_search_length_penalty_equals_transformers(eos_ckpt, beam_cases):
    """Where transformers' beam search, vLLM's rule and the documented rule find the same best sequence,
    the engine finds it too; among those, cases where the penalty changes the answer (against lp = 1)
    exist for each tested penalty. Every returned sequence's cum_logprob is transformers' (float64,
    teacher-forced), and the sequences come best first by vLLM's length-penalized score of those."""
    oracles, cases = beam_cases
    llm = LLM(str(eos_ckpt[0]), max_model_len=64, block_size=4)
    for lp in LENGTH_PENALTIES:
        agreed = [p for (p, l), (h, v, d) in cases.items() if l == lp and h == v == d]
        decisive = [p for p in agreed if cases[p, lp][0] != cases[p, 1.0][0]]
        assert decisive, f"length_penalty = {lp} changes no agreed best sequence: the case is not exercised"
        outs = llm.beam_search([{"prompt_token_ids": list(p)} for p in agreed],
                               BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=BEAM_TOKENS, length_penalty=lp))
        for p, out in zip(agreed, outs):
            assert out.sequences[0].tokens[len(p):] == cases[p, lp][0], (p, lp)
            scores = []
            for s in out.sequences:
                cum = oracles.cum_logprob(s.tokens, len(p))
                assert abs(s.cum_logprob - cum) < 1e-4, (p, lp, s.tokens)
                scores.append(oracles.score(s.tokens, cum, lp))
            assert all(a >= b - 1e-6 for a, b in zip(scores, scores[1:])), (p, lp, scores)


def test_beam_search_completes_every_eos_extension_as_vllm_and_transformers(eos_ckpt, beam_cases):
    """Where transformers' beam search and vLLM's rule agree on the best sequence, the engine finds it."""
    _, cases = beam_cases
    llm = LLM(str(eos_ckpt[0]), max_model_len=64, block_size=4)
    for lp in LENGTH_PENALTIES + (1.0,):
        agreed = [p for (p, l), (h, v, _) in cases.items() if l == lp and h == v]
        outs = llm.beam_search([{"prompt_token_ids": list(p)} for p in agreed],
                               BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=BEAM_TOKENS, length_penalty=lp))
        assert [o.sequences[0].tokens[len(p):] for p, o in zip(agreed, outs)] == [cases[p, lp][0] for p in agreed]
