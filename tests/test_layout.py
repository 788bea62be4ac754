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


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_import_only_downward(layer):
    allowed = set(LAYERS[:LAYERS.index(layer) + 1])
    bad = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for module in _imports(path):
            target = _layer(module)
            if target is not None and target not in allowed:
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    assert not bad, "\n".join(bad)


def test_no_module_outside_the_layers():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"modules outside ops/, models/, engine/, serving/: {loose}"


def test_public_names_from_the_top():
    import qwen_ops

    for name in qwen_ops.__all__:
        assert getattr(qwen_ops, name) is not None, name
    assert qwen_ops.LLM.__module__ == "qwen_ops.serving.llm"
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
