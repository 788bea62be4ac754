"""Issue 44 item 1: lm-evaluation-harness scores the served model through ``local-completions``
(echo + logprobs, the way people evaluate a served model), and its own transformers backend
(``hf``) scores the same checkpoint: every per-choice log-likelihood of a local multiple-choice
task, and every document's rolling log-likelihood, agree within 1e-3, and so does the accuracy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the oracle (the test extra has it)")

from qwen_ops.models.defaults import default_model_path  # noqa: E402

from server_fixture import SERVED_NAME, make_engine, running_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "benchmarks" / "lm_eval_tasks"      # the README's lm_eval command uses these too
N_ITEMS, N_DOCS = 24, 3


def evaluate(model: str, model_args: str, tasks_dir: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=["qwen_ops_mc", "qwen_ops_rolling"],
                           task_manager=TaskManager(include_path=tasks_dir), log_samples=True, batch_size=1,
                           device="cpu")


def per_request(results: dict, task: str) -> list[float]:
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    out = []
    for s in samples:
        for r in s["resps"]:
            value = r[0]
            out.append(float(value[0] if isinstance(value, (list, tuple)) else value))
    return out


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_lm_eval_local_completions_matches_its_transformers_backend(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.chdir(ROOT)                    # the task files name their data from the repository root
    tasks_dir = str(TASKS)
    path = str(default_model_path())
    want = evaluate("hf", f"pretrained={path},dtype=float32", tasks_dir)
    engine = make_engine()
    try:
        with running_server(engine) as srv:
            got = evaluate("local-completions",
                           f"model={SERVED_NAME},base_url={srv.base_url}/completions,tokenizer={path},"
                           "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1,"
                           "max_length=512", tasks_dir)
    finally:
        engine.shutdown()
    for task, n in (("qwen_ops_mc", 4 * N_ITEMS), ("qwen_ops_rolling", N_DOCS)):
        a, b = per_request(got, task), per_request(want, task)
        assert len(a) == len(b) == n
        worst = max(abs(x - y) for x, y in zip(a, b))
        assert worst < 1e-3, (task, worst)
    assert got["results"]["qwen_ops_mc"]["acc,none"] == want["results"]["qwen_ops_mc"]["acc,none"]
    acc = got["results"]["qwen_ops_mc"]["acc,none"]
    print(f"lm-eval acc {acc:.3f} (both backends)")
    assert acc > 0.5        # the embedded model knows some Python: the items are not noise
