"""The pooling runner (issue 46): ``LLM(runner="pooling")``, ``LLM.embed``, ``LLM.score``.

Oracle: transformers' decoder (``Qwen3ForCausalLM(...).model`` / ``Qwen3Model``), whose
``last_hidden_state`` is after the final norm: its last row L2-normalized (Qwen3-Embedding's
pooling), its mean over rows, its first row, run on each prompt alone. Our side runs batches of
mixed lengths through chunked prefill, prefix-cache hits and preemption.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import qwen_ops
from qwen_ops import LLM, PoolingParams
from tests.checkpoints import make_qwen3_checkpoint

COSINE_DISTANCE_FP32 = 1e-6      # the bound, fp32
MEAN_ATOL_FP32 = 1e-5            # an unnormalized mean of hidden states (values of order 1)
# Mixed lengths: one token, inside a block, across chunks (max_num_batched_tokens below), near max_model_len.
PROMPT_LENS = (1, 3, 7, 16, 17, 40, 63, 120)
SMALL = dict(max_model_len=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 128, (n,), generator=g).tolist()


def write_sentence_transformers(path: Path, mode: str, normalize: bool) -> None:
    """modules.json and 1_Pooling/config.json as sentence-transformers saves them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {"pooling_mode_cls_token": mode == "cls", "pooling_mode_mean_tokens": mode == "mean",
             "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
             "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": mode == "last"}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags,
                                                                "include_prompt": True}))


@pytest.fixture(scope="module")
def causal_ckpt(tmp_path_factory) -> Path:
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("embed") / "causal", max_position_embeddings=256)


@pytest.fixture(scope="module")
def hf_decoder(causal_ckpt):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(causal_ckpt, dtype=torch.float32,
                                            attn_implementation="eager").model.eval()


def hidden_states(decoder, ids: list[int]) -> torch.Tensor:
    """transformers' final-norm hidden states [len, hidden] of one prompt."""
    with torch.no_grad():
        return decoder(torch.tensor([ids])).last_hidden_state[0].float()


def cosine_distance(a, b) -> float:
    return 1.0 - torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float64),
                                                       torch.as_tensor(b, dtype=torch.float64), dim=0).item()


def assert_last_token(decoder, ids: list[int], embedding: list[float]) -> None:
    ref = torch.nn.functional.normalize(hidden_states(decoder, ids)[-1], dim=0)
    assert len(embedding) == ref.numel()
    assert cosine_distance(embedding, ref) < COSINE_DISTANCE_FP32
    assert abs(torch.tensor(embedding).norm().item() - 1.0) < 1e-5


@pytest.fixture(scope="module")
def embed_llm(causal_ckpt):
    return LLM(str(causal_ckpt), runner="pooling", **SMALL)


def test_last_token_matches_transformers_chunked_mixed_batch(embed_llm, hf_decoder):
    prompts = [prompt(n, seed=n) for n in PROMPT_LENS]
    outs = embed_llm.embed(prompts, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    for ids, out in zip(prompts, outs):
        assert_last_token(hf_decoder, ids, out.outputs.embedding)
    # chunked: the longest prompts took several steps of max_num_batched_tokens
    assert embed_llm.stats()["num_iterations"] >= sum(PROMPT_LENS) // SMALL["max_num_batched_tokens"]


def test_prefix_cache_hits_share_a_long_prefix(embed_llm, hf_decoder):
    shared = prompt(48, seed=100)
    first, second = shared + prompt(5, seed=101), shared + prompt(9, seed=102)
    hits = embed_llm.stats()["prefix_cache_hits"]
    (a,) = embed_llm.embed([first], use_tqdm=False)
    (b,) = embed_llm.embed([second], use_tqdm=False)
    assert embed_llm.stats()["prefix_cache_hits"] >= hits + 48       # the shared blocks were mapped
    assert_last_token(hf_decoder, first, a.outputs.embedding)
    assert_last_token(hf_decoder, second, b.outputs.embedding)


def test_dimensions_truncate_then_normalize(embed_llm, hf_decoder):
    ids = prompt(30, seed=7)
    (out,) = embed_llm.embed([ids], PoolingParams(dimensions=24), use_tqdm=False)
    ref = torch.nn.functional.normalize(hidden_states(hf_decoder, ids)[-1][:24], dim=0)
    assert len(out.outputs.embedding) == 24
    assert cosine_distance(out.outputs.embedding, ref) < COSINE_DISTANCE_FP32
    (raw,) = embed_llm.embed([ids], PoolingParams(normalize=False), use_tqdm=False)
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), hidden_states(hf_decoder, ids)[-1],
                               atol=MEAN_ATOL_FP32, rtol=0)


def test_blocks_are_free_after_many_requests(embed_llm):
    kv = embed_llm.engine.kv
    prompts = [prompt(1 + i % 37, seed=1000 + i) for i in range(1000)]
    outs = embed_llm.embed(prompts, use_tqdm=False)
    assert len(outs) == 1000
    assert kv.num_free_blocks == kv.num_total_blocks
    assert not embed_llm.has_unfinished_requests()


def test_score_is_cosine_of_embeddings(embed_llm, hf_decoder):
    q, docs = prompt(12, seed=1), [prompt(n, seed=2 + n) for n in (5, 20, 33)]

    def ref(a, b):
        ea, eb = (hidden_states(hf_decoder, x)[-1] for x in (a, b))
        return torch.nn.functional.cosine_similarity(ea, eb, dim=0).item()

    one_to_n = embed_llm.score({"prompt_token_ids": q}, [{"prompt_token_ids": d} for d in docs], use_tqdm=False)
    assert [o.outputs.score for o in one_to_n] == pytest.approx([ref(q, d) for d in docs], abs=1e-5)
    pairwise = embed_llm.score([{"prompt_token_ids": d} for d in docs], [{"prompt_token_ids": d} for d in docs[::-1]],
                               use_tqdm=False)
    assert [o.outputs.score for o in pairwise] == pytest.approx([ref(a, b) for a, b in zip(docs, docs[::-1])],
                                                                abs=1e-5)
    (one,) = embed_llm.score({"prompt_token_ids": q}, {"prompt_token_ids": q}, use_tqdm=False)
    assert one.outputs.score == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="text_1 has 2 items and text_2 3"):
        embed_llm.score([{"prompt_token_ids": q}] * 2, [{"prompt_token_ids": d} for d in docs])


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_sentence_transformers_pooling_modes(causal_ckpt, hf_decoder, tmp_path, mode):
    """mean and CLS pooling (no Normalize module: raw values), chunked, with a shared prefix."""
    import shutil

    path = tmp_path / "st"
    shutil.copytree(causal_ckpt, path)
    write_sentence_transformers(path, mode, normalize=False)
    llm = LLM(str(path), **SMALL)                     # chosen by modules.json: runner "auto"
    assert llm.runner == "pooling" and llm.pooler.pooling_type == mode
    shared = prompt(40, seed=50)
    prompts = [shared + prompt(n, seed=60 + n) for n in (1, 9, 30)] + [prompt(n, seed=n) for n in PROMPT_LENS]
    outs = llm.embed(prompts[:1], use_tqdm=False) + llm.embed(prompts[1:], use_tqdm=False)
    for ids, out in zip(prompts, outs):
        h = hidden_states(hf_decoder, ids)
        ref = h.mean(0) if mode == "mean" else h[0]
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=MEAN_ATOL_FP32, rtol=0)
    assert llm.stats()["prefix_cache_hits"] == 0      # these read rows a cached prefix would skip


def test_mean_pooling_in_a_cache_of_one_sequence(causal_ckpt, hf_decoder, tmp_path):
    """The smallest cache allowed (one max_model_len sequence), every scheduler invariant checked
    each iteration. (Prefill-only requests never preempt each other: only the last request admitted
    in an iteration can be part-way through its prompt.)"""
    import shutil

    path = tmp_path / "st"
    shutil.copytree(causal_ckpt, path)
    write_sentence_transformers(path, "mean", normalize=True)
    llm = LLM(str(path), max_model_len=128, block_size=4, num_kv_blocks=32, max_num_batched_tokens=48,
              check_invariants=True)
    prompts = [prompt(n, seed=200 + n) for n in (100, 5, 128, 120, 3, 64)]
    outs = llm.embed(prompts, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        ref = torch.nn.functional.normalize(hidden_states(hf_decoder, ids).mean(0), dim=0)
        assert cosine_distance(out.outputs.embedding, ref) < COSINE_DISTANCE_FP32
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_total_blocks


def test_bare_qwen3model_checkpoint_is_chosen_as_pooling(tmp_path):
    """A checkpoint saved as transformers' Qwen3Model (no ``model.`` prefix, no lm_head) with the
    sentence-transformers files of Qwen3-Embedding: pooling is chosen without being asked."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(3)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False)
    decoder = Qwen3Model(cfg)
    with torch.no_grad():
        for p in decoder.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    decoder.eval().save_pretrained(tmp_path / "bare")
    path = tmp_path / "bare"
    write_sentence_transformers(path, "last", normalize=True)
    llm = LLM(str(path), **SMALL)
    assert llm.runner == "pooling" and llm.engine.model.lm_head is None
    prompts = [prompt(n, seed=n) for n in PROMPT_LENS]
    for ids, out in zip(prompts, llm.embed(prompts, use_tqdm=False)):
        assert_last_token(decoder, ids, out.outputs.embedding)


def test_bad_arguments_name_the_argument(causal_ckpt, embed_llm):
    with pytest.raises(ValueError, match=r"runner = 'embedding', expected one of 'auto', 'generate', 'pooling'"):
        LLM(str(causal_ckpt), runner="embedding")
    with pytest.raises(ValueError, match=r"task = 'classify', expected one of"):
        LLM(str(causal_ckpt), task="classify")
    with pytest.raises(ValueError, match=r"runner = 'generate' and task = 'embed' disagree"):
        LLM(str(causal_ckpt), runner="generate", task="embed")
    with pytest.raises(ValueError, match=r"dimensions = 0, expected an int >= 1"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match=r"pooling_params\[0\].dimensions = 65, but the model's embeddings have 64"):
        embed_llm.embed([[3, 4]], PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[1\]\[0\] = 500, expected a token id in \[0, 128\)"):
        embed_llm.embed([[3, 4], [500]], use_tqdm=False)
    with pytest.raises(ValueError, match="runner = 'pooling'.*expected LLM\\(..., runner='generate'\\)"):
        embed_llm.generate([[3, 4]], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling runner"):     # AsyncLLM's way in, past LLM._prepare
        embed_llm.core.add_requests([(None, [3, 4], qwen_ops.SamplingParams())])
    assert not embed_llm.has_unfinished_requests()


def test_pooling_engine_refuses_the_slot_api_before_reserving(embed_llm):
    """The seed's slot API is generation's: a pooling engine refuses each entry with a message naming
    it, and no KV block or slot is taken (the check used to come after prefill reserved blocks)."""
    from qwen_ops.engine.engine import QwenBatchedRequest

    engine, kv = embed_llm.engine, embed_llm.engine.kv
    free, slots = kv.num_free_blocks, [s.active for s in kv.slots]
    calls = {"allocate_slot": lambda: engine.allocate_slot("r"), "allocate_batch_slots": lambda: engine.allocate_batch_slots(2),
             "prefill": lambda: engine.prefill(prompt(20, seed=7), slot_id=0),
             "decode_step": lambda: engine.decode_step(5, slot_id=0),
             "batch_prefill": lambda: engine.batch_prefill([QwenBatchedRequest("r", prompt(9, seed=8), slot_id=0)])}
    for name, call in calls.items():
        with pytest.raises(ValueError, match="pooling runner; the slot API"):
            call()
        assert kv.num_free_blocks == free, f"{name} reserved blocks before refusing"
        assert [s.active for s in kv.slots] == slots, f"{name} took a slot before refusing"
    assert embed_llm.embed([prompt(5, seed=9)], use_tqdm=False)[0].outputs.embedding   # still serves


def test_task_embed_is_the_pooling_runner_and_generate_refuses_embed(causal_ckpt):
    assert LLM(str(causal_ckpt), task="embed", **SMALL).runner == "pooling"
    gen = LLM(str(causal_ckpt), **SMALL)
    assert gen.runner == "generate"
    with pytest.raises(ValueError, match="runner = 'generate'; embed and score need"):
        gen.embed([[3, 4]])


def test_pooling_params_exported():
    assert qwen_ops.PoolingParams is PoolingParams


# ---------------------------------------------------------------------------- Qwen3-Reranker
RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                      "is_original_qwen3_reranker": True}


def yes_share(causal_lm, ids: list[int], no: int, yes: int) -> float:
    """transformers' causal-LM logits at the last position: softmax over (no, yes), yes's share."""
    with torch.no_grad():
        logits = causal_lm(torch.tensor([ids])).logits[0, -1].double()
    return torch.softmax(logits[[no, yes]], dim=0)[1].item()


def test_reranker_scores_yes_against_no_by_token_ids(causal_ckpt):
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(causal_ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    overrides = dict(RERANKER_OVERRIDES, classifier_from_token=[5, 9])      # ids: this checkpoint has no tokenizer
    llm = LLM(str(causal_ckpt), hf_overrides=overrides, **SMALL)
    assert llm.runner == "pooling"
    query = prompt(20, seed=8)
    docs = [prompt(n, seed=30 + n) for n in (1, 6, 25, 50)]
    outs = llm.score({"prompt_token_ids": query}, [{"prompt_token_ids": d} for d in docs], use_tqdm=False)
    for d, out in zip(docs, outs):
        assert out.prompt_token_ids == query + d
        assert out.outputs.score == pytest.approx(yes_share(hf, query + d, 5, 9), abs=1e-5)
    with pytest.raises(ValueError, match="reranker"):
        llm.embed([query], use_tqdm=False)


def test_reranker_prompt_and_tokens_from_the_tokenizer():
    """The embedded default model (it has a tokenizer) as a stand-in Qwen3-Reranker: "no"/"yes" looked
    up by the tokenizer, the model card's prompt from ``qwen3_reranker_inputs``."""
    from transformers import AutoModelForCausalLM

    from qwen_ops.models.defaults import default_model_path

    llm = LLM(None, hf_overrides=RERANKER_OVERRIDES, max_model_len=512)
    tok = llm.get_tokenizer()
    no, yes = tok.token_to_id("no"), tok.token_to_id("yes")
    text_1, text_2 = qwen_ops.qwen3_reranker_inputs("What is the capital of China?",
                                                    ["The capital of China is Beijing.", "Gravity pulls."])
    assert text_1.startswith("<|im_start|>system\nJudge whether the Document") and "<Query>: What is" in text_1
    assert text_2[0].startswith("<Document>: The capital") and text_2[0].endswith("<think>\n\n</think>\n\n")
    outs = llm.score(text_1, text_2, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    for doc, out in zip(text_2, outs):
        ids = tok.encode(text_1) + tok.encode(doc)
        assert out.prompt_token_ids == ids
        assert out.outputs.score == pytest.approx(yes_share(hf, ids, no, yes), abs=1e-5)


def test_reranker_overrides_are_checked(causal_ckpt):
    # (other keys are config.json overrides since issue 62, vLLM's context extension: tests/test_vllm_engine_args.py)
    with pytest.raises(ValueError, match=r"hf_overrides\['classifier_from_token'\] = None, expected two tokens"):
        LLM(str(causal_ckpt), hf_overrides={"architectures": ["Qwen3ForSequenceClassification"]})
    with pytest.raises(ValueError, match=r"hf_overrides\['classifier_from_token'\] = \['yes'\], expected two tokens"):
        LLM(str(causal_ckpt), hf_overrides=dict(RERANKER_OVERRIDES, classifier_from_token=["yes"]))
    with pytest.raises(ValueError, match=r"hf_overrides\['classifier_from_token'\]\[0\] = 'no' is not a token"):
        LLM(str(causal_ckpt), hf_overrides=RERANKER_OVERRIDES, **SMALL)    # no tokenizer to look it up


def test_bf16_embeddings_as_close_to_fp32_as_transformers_bf16(causal_ckpt, hf_decoder):
    """bf16 (the real-size dtype), chunked: no further from the fp32 oracle than transformers' own
    bf16 run is, up to 2x (flash-attention's bound)."""
    from transformers import Qwen3ForCausalLM

    hf_bf16 = Qwen3ForCausalLM.from_pretrained(causal_ckpt, dtype=torch.bfloat16,
                                               attn_implementation="eager").model.eval()
    llm = LLM(str(causal_ckpt), runner="pooling", dtype="bfloat16", **SMALL)
    prompts = [prompt(n, seed=n) for n in PROMPT_LENS]
    for ids, out in zip(prompts, llm.embed(prompts, use_tqdm=False)):
        ref = hidden_states(hf_decoder, ids)[-1]
        theirs = cosine_distance(hidden_states(hf_bf16, ids)[-1], ref)
        assert cosine_distance(out.outputs.embedding, ref) <= 2 * theirs + 1e-5


# ---------------------------------------------------------------------------- sequence classifiers
def make_sequence_classifier(path: Path, num_labels: int):
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(num_labels)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False, num_labels=num_labels, pad_token_id=0)
    model = Qwen3ForSequenceClassification(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.eval().save_pretrained(path)
    return model


def hf_class_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def test_sequence_classifier_classify(tmp_path):
    hf = make_sequence_classifier(tmp_path / "cls3", num_labels=3)
    llm = LLM(str(tmp_path / "cls3"), **SMALL)              # chosen by architectures
    assert llm.runner == "pooling" and llm.classifier.shape == (3, 64) and llm.engine.model.lm_head is None
    prompts = [prompt(n, seed=n) for n in PROMPT_LENS]
    for ids, out in zip(prompts, llm.classify(prompts, use_tqdm=False)):
        ref = torch.softmax(hf_class_logits(hf, ids), dim=0)
        assert out.outputs.probs == pytest.approx(ref.tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="num_labels = 3; expected a one-label classifier"):
        llm.score({"prompt_token_ids": [3]}, {"prompt_token_ids": [4]})
    with pytest.raises(ValueError, match="expected an embedding model for embed"):
        llm.embed([[3, 4]])


def test_one_label_sequence_classifier_scores_joined_pairs(tmp_path, embed_llm):
    hf = make_sequence_classifier(tmp_path / "cls1", num_labels=1)
    llm = LLM(str(tmp_path / "cls1"), **SMALL)
    query, docs = prompt(10, seed=4), [prompt(n, seed=40 + n) for n in (2, 17, 44)]
    outs = llm.score({"prompt_token_ids": query}, [{"prompt_token_ids": d} for d in docs], use_tqdm=False)
    for d, out in zip(docs, outs):
        assert out.outputs.score == pytest.approx(torch.sigmoid(hf_class_logits(hf, query + d))[0].item(), abs=1e-5)
    with pytest.raises(ValueError, match="classify needs a classifier"):
        embed_llm.classify([[3, 4]])
