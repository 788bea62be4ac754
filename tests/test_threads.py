"""A CPU engine runs one intra-op thread unless the user chose (engine/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qwen_ops.engine.threads import THREADS_ENV, cpu_threads_setting

# Builds the embedded model's LLM in a fresh interpreter and prints torch's thread count after.
PROBE = ("import torch, qwen_ops; before = torch.get_num_threads(); qwen_ops.LLM(max_model_len=64); "
         "print(before, torch.get_num_threads())")


# Every variable that sets a thread count torch reads (a leftover from another test must not decide).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", THREADS_ENV)


def _threads_after_llm(**env_changes) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    env.update(env_changes)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = out.stdout.split()
    return int(before), int(after)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="torch's default is already one thread on one core")
def test_the_default_is_one_thread_not_one_per_core():
    before, after = _threads_after_llm()
    assert before == torch_default_threads() and before > 1      # torch's own default, one per core
    assert after == 1


def test_an_explicit_choice_is_kept():
    assert _threads_after_llm(**{THREADS_ENV: "2"})[1] == 2
    assert _threads_after_llm(OMP_NUM_THREADS="2")[1] == 2       # torch read it; the engine leaves it


@pytest.mark.parametrize("value", ["0", "-1", "two", ""])
def test_a_bad_setting_is_named(monkeypatch, value):
    monkeypatch.setenv(THREADS_ENV, value)
    with pytest.raises(ValueError, match=rf"^{THREADS_ENV} = '{value}', expected an int >= 1$"):
        cpu_threads_setting()


def torch_default_threads() -> int:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, timeout=120)
    return int(out.stdout)
