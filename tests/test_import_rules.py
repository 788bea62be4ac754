"""The layer rules and no import circles (issue 43 item 3), read from the source with ``ast``.

Every import statement counts, at module level or inside a function (a lazy import that only hides
a circle is still one). Layers, imports flowing one way: serving -> engine -> models -> ops, and
inside ops, the op layer (registry, backend, host) -> kernels. The model calls ops and the ops
layer's public functions (``qwen_ops.ops.host`` for packing weights), never a kernel module; the
engine never imports kernels; kernels know nothing of backend choice or registration.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "qwen_ops"
EXTRA = {"qwen_ops_cli": ROOT / "qwen_ops_cli.py"}       # the torch-free command line, outside the package


def _modules() -> dict[str, Path]:
    mods = dict(EXTRA)
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _targets(mods: dict[str, Path], module: str, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if mods[module].name == "__init__.py" else module.split(".")[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    out = []
    for name in names:
        if name.startswith("qwen_ops.torch_library"):     # the schema table, a leaf outside qwen_ops/
            continue
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name:
            out.append(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of this package it imports, anywhere in its source."""
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module].update(t for t in _targets(mods, module, node) if t != module)
        graph.setdefault(module, set())
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _layer(module: str) -> str:
    if module.startswith("qwen_ops.ops.kernels"):
        return "kernels"
    for name in ("serving", "engine", "models", "ops"):
        if module.startswith(f"qwen_ops.{name}"):
            return name
    return "top"


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_the_checker_sees_a_lazy_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_lower_layers_never_import_the_package_top():
    """``qwen_ops/__init__`` names every layer's public names (loading each on first use), so a
    module of ops, models or engine importing ``qwen_ops`` itself would depend on the layers above
    it through it (test_layout.py checks the layers' order)."""
    bad = [f"{m} -> qwen_ops" for m, targets in import_graph().items()
           if _layer(m) in ("kernels", "ops", "models", "engine") and "qwen_ops" in targets]
    assert bad == []


def test_models_and_engine_never_import_kernels_and_kernels_never_import_the_op_layer():
    bad = []
    for module, targets in import_graph().items():
        layer = _layer(module)
        for target in targets:
            if layer in ("models", "engine", "serving") and _layer(target) == "kernels":
                bad.append(f"{module} -> {target}")
            if layer == "kernels" and _layer(target) != "kernels":
                bad.append(f"{module} -> {target}")
    assert bad == []


# ----------------------------------------------------------------------------- what an import loads (issue 61)
def _run(code: str, timeout: int = 120) -> str:
    """``code`` in a fresh interpreter (this process has imported everything); its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_the_reference_kernels_load_no_engine_and_no_serving():
    loaded = _run("import sys, qwen_ops.ops.kernels.reference\n"
                  "print(sorted(m for m in sys.modules if m.startswith(('qwen_ops.serving', 'qwen_ops.engine', "
                  "'qwen_ops.models'))))")
    assert loaded == "[]"


def test_the_command_line_parses_without_torch():
    """``qwen-ops --help`` answers before torch loads: the parser reads ``serving/engine_args.py`` from
    its file (the package's root registers the ops, so it imports torch), and its flags are the
    package's ``EngineArgs`` fields."""
    out = _run("import sys, qwen_ops_cli\n"
               "parser = qwen_ops_cli.build_parser()\n"
               "print('torch' in sys.modules, sorted(m for m in sys.modules if m.startswith('qwen_ops.')))")
    assert out == "False []"


def test_the_root_registers_the_ops_and_loads_no_engine():
    out = _run("import sys, torch, qwen_ops\n"
               "print(hasattr(torch.ops.qwen, 'kv_write'), "
               "sorted(m for m in sys.modules if m.startswith(('qwen_ops.serving', 'qwen_ops.engine'))))")
    assert out == "True []"


def test_the_lazy_root_keeps_its_public_names():
    out = _run("import sys, qwen_ops\n"
               "assert 'qwen_ops.serving.llm' not in sys.modules\n"
               "from qwen_ops import LLM, SamplingParams\n"
               "import torch\n"
               "print(LLM.__module__, SamplingParams.__module__, qwen_ops.QwenEngine.__name__, "
               "set(qwen_ops.__all__) <= set(dir(qwen_ops)), hasattr(torch.ops.qwen, 'kv_write'))")
    assert out == "qwen_ops.serving.offline qwen_ops.engine.sampling QwenEngine True True"


def test_llm_chat_needs_no_fastapi():
    """``LLM.chat`` renders with ``serving/openai/chat.py``: the package ``serving.openai`` must not
    pull the server (fastapi, uvicorn: the serve extra) in with it."""
    out = _run("import sys\nsys.modules['fastapi'] = sys.modules['uvicorn'] = None      # not installed\n"
               "from qwen_ops import LLM, SamplingParams\n"
               "llm = LLM(max_model_len=128, max_num_seqs=1)\n"
               "out = llm.chat([{'role': 'user', 'content': 'Hello'}], SamplingParams(max_tokens=3, temperature=0,"
               " ignore_eos=True), use_tqdm=False)\n"
               "print(len(out[0].outputs[0].token_ids), 'qwen_ops.serving.openai.server' in sys.modules)",
               timeout=300)
    assert out == "3 False"
