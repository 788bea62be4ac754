"""The embedded default model through qwen_ops equals transformers: logits, greedy tokens, text."""

from __future__ import annotations

import pytest
import torch

import qwen_ops
from qwen_ops.models.defaults import default_model_path

transformers = pytest.importorskip("transformers", reason="transformers is the parity reference")

PROMPTS = ["def fibonacci(n):", "import os\n\nclass Path:\n    def __init__(self", "for i in range(10):\n"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf():
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path())
    return model, tokenizer


def test_prefill_logits_match(hf):
    model, tokenizer = hf
    eng = qwen_ops.QwenEngine.from_pretrained(None, max_slots=1, max_seq_len=256)
    for prompt in PROMPTS:
        ids = eng.tokenizer.encode(prompt)
        assert ids == tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            ref = model(torch.tensor([ids])).logits[0, -1]
        ours = eng.prefill(ids).logits
        torch.testing.assert_close(ours, ref, rtol=0, atol=2e-4)


def test_greedy_text_matches(hf):
    model, tokenizer = hf
    llm = qwen_ops.LLM(max_num_seqs=4, max_model_len=256)
    outs = llm.generate(PROMPTS, qwen_ops.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.inference_mode():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        assert out.outputs[0].token_ids == ref.tolist()
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)
        assert out.prompt_token_ids == ids[0].tolist()
