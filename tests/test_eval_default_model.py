"""Smoke test of ``benchmarks/eval_default_model.py``: its metrics on hand-made cases, and one
short run on the embedded model (one held-out file, two functions, a few tokens)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the eval loads models with transformers (test-only dependency)")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "eval_default_model.py"
_spec = importlib.util.spec_from_file_location("eval_default_model", SCRIPT)
ev = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ev  # its dataclass looks the module up while it is created
_spec.loader.exec_module(ev)

PROMPT = 'def add(a, b):\n    """Return a + b."""'
METHOD_PROMPT = '    def add(self, b):\n        """Return self + b."""'


def test_distinct_ngram_ratio_on_known_sequences():
    assert ev.distinct_ngram_ratio([1, 2, 3, 4, 5, 6]) == 1.0          # 3 of 3 distinct
    # [1,2,1,2,1,2,1,2]: 5 4-grams, two distinct ((1,2,1,2), (2,1,2,1))
    assert ev.distinct_ngram_ratio([1, 2] * 4) == pytest.approx(2 / 5)
    assert ev.distinct_ngram_ratio([7] * 10) == pytest.approx(1 / 7)
    assert ev.distinct_ngram_ratio([1, 2, 3]) == 1.0                   # no 4-gram at all
    assert ev.distinct_ngram_ratio(list("abcabc"), n=3) == pytest.approx(3 / 4)


def test_cut_at_function_end():
    completion = "\n    return a + b\n\ndef other():\n    pass"
    kept, ended = ev.cut_at_function_end(completion, 0)
    assert (kept, ended) == ("\n    return a + b\n", True)
    kept, ended = ev.cut_at_function_end("\n    x = 1\n    return (x +", 0)
    assert (kept, ended) == ("\n    x = 1", False)                    # partial last line dropped


def test_completion_parses():
    assert ev.completion_parses(PROMPT, "\n    return a + b\n\ndef g(:\n", 0)   # cut before the bad def
    assert not ev.completion_parses(PROMPT, "\n    return (a +\n    b]\n", 0)
    assert not ev.completion_parses(PROMPT, "\n    return a + (b, c, d, e, f", 0)  # only a cut-off line
    assert ev.completion_parses(METHOD_PROMPT, "\n        return self.x + b\n\n    def sub(self):", 4)
    assert not ev.completion_parses(METHOD_PROMPT, "\n        return self.x +\n    def sub(self):", 4)


def test_function_prompts_take_def_and_docstring():
    text = ('import os\n\nclass A:\n    def f(self, x):\n        """Doc é.\n\n        More."""  # c\n'
            '        return x\n\n    def g(self):\n        """Only a docstring."""\n\n'
            'def h(y): "one line"; return y\n')
    prompts = ev.function_prompts(text, "m.py")
    assert [p.name for p in prompts] == ["m.py:f"]                     # g has no body, h is one line
    assert prompts[0].prompt == '    def f(self, x):\n        """Doc é.\n\n        More."""'
    assert prompts[0].indent == 4


def test_file_loss_is_the_summed_cross_entropy():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=16)).eval()
    ids = torch.randint(1, 32, (9,)).tolist()
    full = torch.tensor([[0] + ids])
    with torch.no_grad():
        expected = model(input_ids=full, labels=full).loss.item() * len(ids)
    assert ev.file_loss(model, ids, 0, window=64) == pytest.approx(expected, rel=1e-5)
    # Windows of 4: each window sees only its own tokens, so the total differs but stays finite.
    assert math.isfinite(ev.file_loss(model, ids, 0, window=4))


def test_main_runs_on_the_embedded_model(tmp_path, capsys):
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("# one small file\ngenericpath.py\n")
    ev.main(["--heldout-list", str(heldout), "--functions", "2", "--new-tokens", "6", "--show", "0"])
    out = capsys.readouterr().out
    assert "2 functions, 6 greedy tokens each" in out
    row = [line for line in out.splitlines() if line.startswith("| ") and "default_model" in line]
    assert len(row) == 1
    nats_per_token, nats_per_char = (float(c) for c in row[0].split("|")[4:6])
    assert 0 < nats_per_char < nats_per_token < math.log(4096)
