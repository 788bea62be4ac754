"""Speculative decoding with the checkpoint's own MTP layer (issue 29, ``"method": "mtp"``).

Tiny Qwen3.5 (dense hybrid) and Qwen3-Next (hybrid MoE) checkpoints get random ``mtp.*`` weights
here, in the layout vLLM's ``qwen3_next_mtp`` reads. Oracles, none of them the engine:
- transformers' greedy continuation of the target (speculation must not change a token);
- an MTP written here from transformers' own modules (a one-layer model of the family whose layer
  and final norm are the MTP layer's, fed ``fc([norm(embed(next token)) | norm(target hidden)])``
  and recomputed from scratch at every step): every draft the engine's MTP proposes must be its
  argmax chain, so the MTP KV the engine keeps (caught up step by step, rewritten after
  rejections) is right at every position. A second run replaces the MTP's drafts by the true
  continuation with one corrupted (at a rotating place) so that every acceptance length happens.
"""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen_ops.engine.sampling import SamplingParams
from qwen_ops.serving.llm import LLM

from checkpoints import make_moe_checkpoint, make_qwen3_5_checkpoint
from test_speculative_engine import hf_greedy

transformers = pytest.importorskip("transformers", reason="transformers is the parity reference")


def _mtp_oracle_model(hf):
    """A one-layer model of the target's family (its layer: full attention, sparse exactly when the
    target's layer 0 is) with random weights: its layer and final norm are the MTP's."""
    cfg = copy.deepcopy(hf.config)
    cfg.num_hidden_layers = 1
    cfg.layer_types = ["full_attention"]
    if hasattr(cfg, "mlp_only_layers"):
        cfg.mlp_only_layers = []
    model = type(hf)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p))           # offset norms: 1 + weight
            else:
                p.normal_(0.0, 0.15)
    return model


def add_mtp(path, hf, seed: int = 0):
    """Write random ``mtp.*`` tensors into the checkpoint at ``path`` and its config's MTP count;
    returns the oracle's pieces (one-layer model, fc, the two pre-fc norms)."""
    torch.manual_seed(seed + 100)
    model = _mtp_oracle_model(hf)
    H = hf.config.hidden_size
    module = __import__(type(hf).__module__, fromlist=["x"])
    norm_cls = next(getattr(module, n) for n in dir(module) if n.endswith("RMSNorm") and "Gated" not in n)
    fc = torch.nn.Linear(2 * H, H, bias=False)
    torch.nn.init.normal_(fc.weight, 0.0, 0.15)
    norms = [norm_cls(H, eps=hf.config.rms_norm_eps) for _ in range(2)]
    for n in norms:
        torch.nn.init.normal_(n.weight, 0.0, 0.2)
    tensors = load_file(str(path / "model.safetensors"))
    for name, t in model.state_dict().items():
        if name.startswith("model.layers.0."):
            tensors["mtp.layers.0." + name.removeprefix("model.layers.0.")] = t.contiguous()
    tensors["mtp.norm.weight"] = model.model.norm.weight.detach().clone()
    tensors["mtp.fc.weight"] = fc.weight.detach().clone()
    tensors["mtp.pre_fc_norm_embedding.weight"] = norms[0].weight.detach().clone()
    tensors["mtp.pre_fc_norm_hidden.weight"] = norms[1].weight.detach().clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers" if config["model_type"] == "qwen3_next" else "mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return model, fc, norms


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def mtp_family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"mtp_{request.param}")
    if request.param == "qwen3_5":
        make_qwen3_5_checkpoint(path)
    else:
        make_moe_checkpoint(path, "qwen3_next")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    oracle = add_mtp(path, hf)
    return request.param, path, hf, oracle


@torch.no_grad()
def oracle_drafts(hf, oracle, context: list[int], k: int) -> list[int]:
    """The MTP's k greedy drafts after ``context`` (its last token is the one the target feeds),
    recomputed from scratch: rows p = 0..P-1 take (token p + 1, the target's hidden state at p)."""
    model, fc, (norm_e, norm_h) = oracle
    P = len(context) - 1
    hidden = list(hf.model(input_ids=torch.tensor([context[:P]])).last_hidden_state[0])
    embeds = list(hf.model.embed_tokens(torch.tensor(context[1:])))
    drafts = []
    for _ in range(k):
        x = fc(torch.cat((norm_e(torch.stack(embeds)), norm_h(torch.stack(hidden))), dim=-1))
        out = model.model(inputs_embeds=x[None]).last_hidden_state[0]
        tok = int(hf.lm_head(out[-1]).argmax())
        drafts.append(tok)
        embeds.append(hf.model.embed_tokens(torch.tensor(tok)))
        hidden.append(out[-1])
    return drafts


PROMPTS = [[5, 17, 2, 60, 33, 9, 41], [7, 7, 8, 1, 60, 2], [100, 3, 64, 12, 12, 90, 4, 4, 21, 30, 2]]
NEW = 14


def _spy(llm, truth=None, k=3):
    """Record every MTP proposal (position, drafts); with ``truth`` (prompt tuple -> continuation)
    replace the drafts by the true continuation with one corrupted at a rotating place (or none)."""
    mtp = llm.engine.runner.draft
    real, log, turn = mtp.propose, [], itertools.count()

    def propose(tasks):
        out = real(tasks)
        for i, t in enumerate(out):
            if not t.draft_token_ids:
                continue
            log.append((t.request_id, t.position_offset, list(t.draft_token_ids)))
            if truth is not None:
                seq = truth[t.request_id]
                done = t.position_offset + 1 - seq[0]
                good = list(seq[1][done:done + len(t.draft_token_ids)])
                good += [0] * (len(t.draft_token_ids) - len(good))
                bad = next(turn) % (k + 1)
                if bad < len(good):
                    good[bad] = (good[bad] + 1) % 128
                ctx = list(t.token_ids[:len(t.token_ids) - len(good)])
                out[i] = replace(t, token_ids=ctx + good, draft_token_ids=tuple(good), draft_probs=None)
        return out

    mtp.propose = propose
    return log


@pytest.mark.parametrize("forced", [False, True], ids=["mtp drafts", "forced acceptance"])
def test_mtp_greedy_equals_transformers_and_drafts_equal_the_oracle(mtp_family, forced):
    name, path, hf, oracle = mtp_family
    k = 3
    llm = LLM(str(path), max_num_seqs=4, max_model_len=64,
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    for prompt, cont in zip(PROMPTS, want):          # one request per call: the truth is this prompt's
        log = _spy(llm, _TruthByRequest(len(prompt), cont) if forced else None, k)
        try:
            got = llm.generate([prompt], params)[0].outputs[0].token_ids
        finally:
            del llm.engine.runner.draft.propose        # the class's again
        assert got == cont, (name, prompt)
        assert log, "no step drafted"
        seq = list(prompt) + cont
        for _, position, drafts in log:
            assert drafts == oracle_drafts(hf, oracle, seq[:position + 1], len(drafts)), (name, position)
    stats = llm.stats()
    assert stats["spec_num_draft_tokens"] > 0
    if forced:
        assert stats["spec_num_accepted_tokens"] > 0


class _TruthByRequest:
    """``truth[request_id]`` for _spy: (prompt length, continuation) whatever the request id."""

    def __init__(self, n: int, cont: list[int]):
        self.value = (n, cont)

    def __getitem__(self, _rid):
        return self.value


class _TruthByPrompt:
    """``truth[request_id]`` for _spy in a batch: the running request's (prompt length, continuation),
    looked up by its prompt; ``prompts`` remembers each request id's prompt for the checks after."""

    def __init__(self, llm, conts: dict):
        self.llm, self.conts, self.prompts = llm, conts, {}

    def __getitem__(self, rid):
        prompt = self.prompts.setdefault(rid, tuple(self.llm.scheduler.requests[rid].prompt_token_ids))
        return len(prompt), self.conts[prompt]


def test_mtp_drafts_equal_the_oracle_in_a_batch_with_rejections(mtp_family):
    """Three requests in one batch, drafts forced with one corrupted at a rotating place: a step that
    rejects one rolls the hybrid layers back and runs the kept rows again. Every MTP proposal still
    equals the oracle's, so each request's kept hidden rows are read from its own rows of the step's
    forward (not the rollback's re-run, whose rows start elsewhere)."""
    name, path, hf, oracle = mtp_family
    k = 3
    llm = LLM(str(path), max_num_seqs=4, max_model_len=64,
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    conts = {tuple(p): hf_greedy(hf, p, NEW) for p in PROMPTS}
    truth = _TruthByPrompt(llm, conts)
    log = _spy(llm, truth, k)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    finally:
        del llm.engine.runner.draft.propose
    assert [o.outputs[0].token_ids for o in outs] == [conts[tuple(p)] for p in PROMPTS], name
    batched = {rid for rid, _, _ in log}
    assert len(batched) == len(PROMPTS), "every request drafted"
    for rid, position, drafts in log:
        seq = list(truth.prompts[rid]) + conts[truth.prompts[rid]]
        assert drafts == oracle_drafts(hf, oracle, seq[:position + 1], len(drafts)), (name, rid, position)


def test_mtp_sampled_requests_are_reproducible(mtp_family):
    """Sampled drafts come from the MTP's q and are verified by rejection sampling (the statistical
    test of that rule: test_speculative_engine.py, for a draft model and MTP). A seeded request gives
    the same tokens run after run, alone and in a batch. (Between a batch and a run alone the
    tokens may differ: the step's decode budget, shared by the batch, decides how many drafts each
    request gets, and each draft draws from the request's noise.)"""
    _, path, _, _ = mtp_family
    llm = LLM(str(path), max_num_seqs=4, max_model_len=64,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    sp = SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    params = [sp, SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)]
    one, again = (llm.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids for _ in range(2))
    batch, batch_again = ([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] for _ in range(2))
    assert one == again and batch == batch_again
    assert llm.stats()["spec_num_draft_tokens"] > 0


def test_mtp_errors(tmp_path):
    from checkpoints import make_qwen3_checkpoint

    dense = make_qwen3_checkpoint(tmp_path / "dense")
    with pytest.raises(ValueError, match=r"speculative 'mtp' needs a Qwen3-Next or Qwen3.5 checkpoint"):
        LLM(str(dense), speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    hybrid = make_qwen3_5_checkpoint(tmp_path / "hybrid")        # no mtp_num_hidden_layers, no mtp.* weights
    with pytest.raises(ValueError, match=r"with 0 MTP layers"):
        LLM(str(hybrid), speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    config = json.loads((hybrid / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1                          # claimed, but the files hold none
    (hybrid / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing tensor 'mtp.fc.weight'"):
        LLM(str(hybrid), speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config.model = .* is not a 'mtp' setting"):
        LLM(str(hybrid), speculative_config={"method": "mtp", "num_speculative_tokens": 2, "model": "x"})
