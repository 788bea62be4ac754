"""Token healing of a whitespace tail (qwen_ops/serving/token_healing.py) in ``qwen-ops generate``.

The embedded model answers many prompts that end in ``"\\n"`` with end-of-sequence first (transformers
does too: the oracle), so the command printed nothing after the prompt. Healed, it prints the
continuation transformers gives for the prompt without its last token, with the first new token
chosen among those whose text starts with ``"\\n"`` (computed here from transformers' own tokenizer).
``LLM.generate`` keeps vLLM's behaviour (no healing)."""

from __future__ import annotations

import pytest
import torch

from qwen_ops import LLM, SamplingParams
from qwen_ops.models.defaults import default_model_path
from qwen_ops.models.tokenizer import load_tokenizer
from qwen_ops.serving.token_healing import heal
from qwen_ops_cli import main

# The next line is indented, and in training "\n" merges with indentation: a lone "\n" never precedes it.
PROMPT = "class Stack:\n    def push(self, item):\n"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return transformers.AutoTokenizer.from_pretrained(path), model


def _greedy(model, ids: list[int], n: int, first_allowed=None) -> list[int]:
    out = []
    for step in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1]
        if step == 0 and first_allowed is not None:
            logits = logits.masked_fill(~first_allowed, float("-inf"))
        out.append(int(logits.argmax()))
    return out


def test_the_cause_the_model_ends_the_text_after_a_lone_newline(hf):
    """Not our bug: transformers' greedy token after the prompt is end-of-sequence, and LLM.generate
    (vLLM's semantics) returns that empty completion."""
    tok, model = hf
    ids = tok(PROMPT).input_ids
    assert _greedy(model, ids, 1) == [tok.eos_token_id]
    (out,) = LLM().generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].text == "" and out.outputs[0].finish_reason == "stop"


def test_generate_heals_the_newline_and_prints_transformers_continuation(hf, capsys):
    tok, model = hf
    ids = tok(PROMPT).input_ids
    texts = [tok.decode([i], skip_special_tokens=True) for i in range(len(tok))]
    starts_with_newline = torch.tensor([t.startswith("\n") for t in texts])
    expected = _greedy(model, ids[:-1], MAX_TOKENS, starts_with_newline)
    assert main(["generate", PROMPT, "--max-tokens", str(MAX_TOKENS)]) == 0
    printed, stats = capsys.readouterr().out.rsplit("\n\n[", 1)
    assert printed == PROMPT[:-1] + tok.decode(expected)
    assert printed.startswith(PROMPT + "        ")          # the method's body, indented
    assert stats.startswith(f"{MAX_TOKENS} tokens in ")


def test_no_token_healing_sends_the_prompt_as_it_is(hf, capsys):
    """``--no-token-healing``: the prompt as LLM.generate sends it, so transformers' end-of-sequence first."""
    assert main(["generate", PROMPT, "--max-tokens", str(MAX_TOKENS), "--no-token-healing"]) == 0
    printed, stats = capsys.readouterr().out.rsplit("\n\n[", 1)
    assert printed == PROMPT and "the model ended the text" in stats         # EOS first, nothing printed


def test_only_a_whitespace_tail_that_longer_tokens_extend_is_healed():
    tokenizer = load_tokenizer(default_model_path())
    newline = tokenizer.encode("\n")
    assert len(newline) == 1
    healed = heal(tokenizer, tokenizer.encode("x = 1\n"))
    assert healed.prompt_ids == tokenizer.encode("x = 1") and healed.tail == "\n"
    assert newline[0] in healed.first_token_ids and tokenizer.encode("\n    ")[0] in healed.first_token_ids
    assert all(tokenizer.decode([i]).startswith("\n") for i in healed.first_token_ids)
    for prompt in ("def fibonacci(n):", "hi", "\n"):         # a word may be meant whole; one token leaves nothing
        assert heal(tokenizer, tokenizer.encode(prompt)) is None, prompt
