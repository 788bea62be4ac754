"""The package layout is the architecture: one folder per layer, imports flowing one way
(serving -> engine -> models -> ops), and the public names importable from the top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "qwen_ops"
LAYERS = ["ops", "models", "engine", "serving"]          # lowest first


def _imports(path: Path) -> set[str]:
    """Every qwen_ops module a file imports, at any depth (lazy imports inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("qwen_ops"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qwen_ops"):
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


# vLLM's public module paths (issue 62): re-exports, so that vLLM code runs with only the import changed.
# They sit outside the layers (engine/arg_utils.py inside a layer's folder, where vLLM keeps it) and hold
# nothing but imports (test_vllm_paths_only_re_export).
VLLM_PATHS = sorted(
    [p for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    + [p for folder in ("lora", "entrypoints", "utils", "distributed", "v1") for p in (PACKAGE / folder).rglob("*.py")]
    + [PACKAGE / "engine" / "arg_utils.py", PACKAGE / "engine" / "llm_engine.py"])


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_import_only_downward(layer):
    allowed = set(LAYERS[:LAYERS.index(layer) + 1])
    bad = []
    for path in sorted(set((PACKAGE / layer).rglob("*.py")) - set(VLLM_PATHS)):
        for module in _imports(path):
            target = _layer(module)
            if target is not None and target not in allowed:
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    assert not bad, "\n".join(bad)


def test_no_module_outside_the_layers_but_vllms_paths():
    folders = set(LAYERS) | {"lora", "entrypoints", "utils", "distributed", "v1", "default_model", "__pycache__"}
    loose = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name not in folders)
    assert loose == [], f"packages outside ops/, models/, engine/, serving/ and vLLM's paths: {loose}"
    names = {str(p.relative_to(PACKAGE.parent)) for p in VLLM_PATHS}
    assert {"qwen_ops/sampling_params.py", "qwen_ops/lora/request.py", "qwen_ops/inputs.py", "qwen_ops/outputs.py",
            "qwen_ops/pooling_params.py", "qwen_ops/entrypoints/openai/api_server.py"} <= names


@pytest.mark.parametrize("path", VLLM_PATHS, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_vllm_paths_only_re_export(path):
    """A vLLM path holds a docstring, imports, ``__all__`` and (api_server) a ``__main__`` guard: no code
    of its own, and every name in ``__all__`` imports (from the module the layers define it in)."""
    import importlib

    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        ok = (isinstance(node, (ast.Import, ast.ImportFrom))
              or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
              or (isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__all__"])
              or (isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)))
        assert ok, f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}"
    module = importlib.import_module(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(
        ".__init__"))
    for name in getattr(module, "__all__", ()):
        home = getattr(getattr(module, name), "__module__", "")      # typing aliases (PromptType) have typing's
        assert home in ("typing", "qwen_ops_cli") or home.split(".")[1] in LAYERS, (name, home)


def test_public_names_from_the_top():
    import qwen_ops

    for name in qwen_ops.__all__:
        assert getattr(qwen_ops, name) is not None, name
    assert qwen_ops.LLM.__module__ == "qwen_ops.serving.offline"
    assert qwen_ops.QwenEngine.__module__ == "qwen_ops.engine.engine"


def test_every_kernel_source_ships_in_the_wheel():
    # The CPU kernels are compiled from their sources on first use, so an installed (non-editable)
    # package must carry every one: pyproject's package-data globs must cover them.
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    kernel_globs = globs["qwen_ops.ops.kernels"]
    sources = [p.name for p in (root / "qwen_ops" / "ops" / "kernels").iterdir() if p.suffix in (".c", ".cpp", ".h")]
    assert sources
    missing = [s for s in sources if not any(fnmatch.fnmatch(s, g) for g in kernel_globs)]
    assert not missing, f"not in pyproject's package-data for qwen_ops.ops.kernels: {missing}"
