"""A script that creates ``LLM(tensor_parallel_size=2)`` at its top level, without the
``if __name__ == "__main__":`` guard (engine/distributed.py): the spawned worker, importing the
script again, stops at once, and the script fails promptly with an error that names the guard
(it used to wait out the process group's timeout, then say only that the workers did not start).
The guarded script still runs, and its tokens equal one process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallelism needs 2 CPUs here")

# The embedded model (8 heads, 2 KV heads) split over 2 ranks; greedy, so the two runs compare.
BODY = """
from qwen_ops import LLM, SamplingParams
params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
tp = LLM(tensor_parallel_size=2).generate(["def f():"], params, use_tqdm=False)[0].outputs[0].token_ids
"""
# Far above the time a prompt failure takes, so that waiting out the group's timeout cannot pass.
TP_TIMEOUT_S = 120


def _run(tmp_path, source: str) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "script.py"
    script.write_text(source)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QWEN_OPS_TP_TIMEOUT_S": str(TP_TIMEOUT_S)}
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=TP_TIMEOUT_S - 30)
    return done, time.monotonic() - start


def test_a_script_without_the_main_guard_fails_at_once_naming_the_guard(tmp_path):
    done, elapsed = _run(tmp_path, BODY + "print('generated', tp)\n")
    assert done.returncode != 0 and "generated" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("qwen_ops.engine.distributed.TensorParallelError: tensor_parallel_size > 1 from the top "
                           f"level of {tmp_path / 'script.py'} (line 4)"), done.stderr[-3000:]
    assert 'if __name__ == "__main__":' in last
    # The driver sees it before spawning anything: no worker ran the script again.
    assert "qwen_ops: a tensor-parallel worker" not in done.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s"


def test_the_guard_error_comes_within_a_second_of_the_call(tmp_path):
    timed = ("import time\nfrom qwen_ops import LLM\nstart = time.monotonic()\ntry:\n"
             "    LLM(tensor_parallel_size=2)\nexcept Exception as e:\n"
             "    print('after', round(time.monotonic() - start, 3), type(e).__name__, str(e))\n")
    done, _ = _run(tmp_path, timed)
    line = next(x for x in done.stdout.splitlines() if x.startswith("after "))
    _, seconds, kind, message = line.split(" ", 3)
    assert kind == "TensorParallelError" and 'if __name__ == "__main__":' in message, line
    assert float(seconds) < 1.0, line


def test_a_guarded_script_runs_and_equals_one_process(tmp_path):
    guarded = "def main():\n" + textwrap.indent(BODY, "    ") + textwrap.indent(textwrap.dedent("""
        one = LLM().generate(["def f():"], params, use_tqdm=False)[0].outputs[0].token_ids
        import json
        print("tokens", json.dumps({"tp": list(tp), "one": list(one)}))
        """), "    ") + '\n\nif __name__ == "__main__":\n    main()\n'
    done, _ = _run(tmp_path, guarded)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("tokens "))
    tokens = json.loads(line[len("tokens "):])
    assert tokens["tp"] == tokens["one"] and len(tokens["one"]) == 6, line
