"""The CPU kernels built at install (qwen_ops/ops/kernels/cpu_build.py, setup.py): a build in the
package's prebuilt/ folder whose key matches this machine loads with no compile; any other falls back
to compiling into the cache. Installing into a fresh environment is too slow for the suite, so these
test the pieces; that ``pip install -e .`` into a new venv leaves a build in prebuilt/ and that the
first ``qwen-ops generate`` then compiles nothing was checked by hand (issue 62)."""

from __future__ import annotations

import fnmatch
import logging
import shutil
import tomllib
from pathlib import Path

import pytest
import torch

from qwen_ops.ops.kernels import cpu, cpu_build

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """An empty per-user cache and an empty prebuilt/ folder (the default search, no QWEN_OPS_CACHE_DIR),
    and this machine's real build (built or loaded once per process) to copy into them: ``(cache,
    prebuilt, built, name)``."""
    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")
    built = Path(cpu.library()._name)
    monkeypatch.delenv("QWEN_OPS_CACHE_DIR", raising=False)
    monkeypatch.delenv("QWEN_OPS_CPU_CFLAGS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(cpu_build, "PREBUILT_DIR", tmp_path / "prebuilt")
    (tmp_path / "prebuilt").mkdir()
    return tmp_path / "xdg" / "qwen_ops", tmp_path / "prebuilt", built, cpu.library_name(cpu._compiler(),
                                                                                          cpu._cxx_compiler())


def _argmax_works(lib) -> None:
    """The loaded library's kernel gives torch's argmax (it is a working build, not just a file)."""
    x = torch.randn(3, 50)
    out = torch.empty(3, dtype=torch.int64)
    lib.qwen_argmax_rows(x.data_ptr(), 3, 50, x.stride(0), out.data_ptr())
    assert torch.equal(out, x.argmax(dim=-1))


def _copy_instead_of_compiling(built: Path, calls: list):
    def fake_build(cc, cxx, out):
        calls.append(Path(out))
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(built, out)
    return fake_build


def test_a_prebuilt_library_with_this_machines_key_loads_and_nothing_compiles(installed, monkeypatch, caplog):
    cache, prebuilt, built, name = installed
    shutil.copy(built, prebuilt / name)
    monkeypatch.setattr(cpu, "_build", lambda cc, cxx, out: pytest.fail(f"compiled {out} although prebuilt/ has it"))
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        lib = cpu.library.__wrapped__()
    assert Path(lib._name) == prebuilt / name
    assert not caplog.records                      # no "compiling" line: the first use is silent
    assert not cache.exists()
    _argmax_works(lib)


def test_the_cache_is_searched_before_prebuilt(installed, monkeypatch):
    cache, prebuilt, built, name = installed
    cache.mkdir(parents=True)
    shutil.copy(built, cache / name)
    shutil.copy(built, prebuilt / name)
    monkeypatch.setattr(cpu, "_build", lambda cc, cxx, out: pytest.fail("compiled although both folders have it"))
    assert Path(cpu.library.__wrapped__()._name) == cache / name


def test_a_prebuilt_library_of_another_key_is_ignored_and_the_kernels_compile_into_the_cache(installed, monkeypatch,
                                                                                           caplog):
    """Another machine's build (here: built with other flags, so another key) is never loaded."""
    cache, prebuilt, built, name = installed
    shutil.copy(built, prebuilt / name)
    monkeypatch.setenv("QWEN_OPS_CPU_CFLAGS", "-DQWEN_OPS_OTHER_BUILD")      # another key, as another CPU would
    other = cpu.library_name(cpu._compiler(), cpu._cxx_compiler())
    assert other != name
    calls = []
    monkeypatch.setattr(cpu, "_build", _copy_instead_of_compiling(built, calls))
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        lib = cpu.library.__wrapped__()
    assert calls == [cache / other] and Path(lib._name) == cache / other
    assert "compiling the CPU kernels" in caplog.records[0].getMessage()
    _argmax_works(lib)


def test_an_explicit_cache_dir_is_the_only_folder_searched(installed, monkeypatch, tmp_path):
    """``QWEN_OPS_CACHE_DIR`` forces a build of its own (the build tests rely on it)."""
    cache, prebuilt, built, name = installed
    shutil.copy(built, prebuilt / name)
    monkeypatch.setenv("QWEN_OPS_CACHE_DIR", str(tmp_path / "own"))
    calls = []
    monkeypatch.setattr(cpu, "_build", _copy_instead_of_compiling(built, calls))
    assert Path(cpu.library.__wrapped__()._name) == tmp_path / "own" / name and calls == [tmp_path / "own" / name]


def test_a_prebuilt_file_that_does_not_load_is_rebuilt_into_the_cache(installed, monkeypatch):
    cache, prebuilt, built, name = installed
    (prebuilt / name).write_bytes(b"not a shared library")
    calls = []
    monkeypatch.setattr(cpu, "_build", _copy_instead_of_compiling(built, calls))
    assert Path(cpu.library.__wrapped__()._name) == cache / name and calls == [cache / name]


@pytest.mark.parametrize("change", ["torch", "cpu", "source", "compiler"])
def test_the_key_covers_what_the_build_depends_on(change, monkeypatch, tmp_path):
    cc, cxx = "/usr/bin/cc", "/usr/bin/c++"
    before = cpu_build.library_name(cc, cxx)
    if change == "torch":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    elif change == "cpu":
        monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : fpu sse2")
    elif change == "source":
        edited = tmp_path / "qwen_cpu_lora.c"
        edited.write_text(cpu_build.SOURCES[2].read_text() + "\n// edited\n")
        monkeypatch.setattr(cpu_build, "SOURCES", (*cpu_build.SOURCES[:2], edited, *cpu_build.SOURCES[3:]))
    else:
        cc = "/usr/bin/clang"
    assert cpu_build.library_name(cc, cxx) != before


def test_prebuild_builds_once_and_leaves_only_the_current_build(monkeypatch, tmp_path):
    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")
    monkeypatch.delenv("QWEN_OPS_CPU_CFLAGS", raising=False)
    calls = []
    monkeypatch.setattr(cpu_build, "build", lambda cc, cxx, out: (calls.append(out), Path(out).write_bytes(b"so")))
    (tmp_path / "qwen_cpu_0123456789abcdef.so").write_bytes(b"an earlier source's build")
    said = cpu_build.prebuild(tmp_path)
    name = cpu_build.library_name(cpu_build._compiler(), cpu_build._cxx_compiler())
    assert calls == [tmp_path / name] and said.startswith("qwen_ops: compiled the CPU kernels in ")
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    assert "already built" in cpu_build.prebuild(tmp_path) and len(calls) == 1


def test_prebuild_without_a_compiler_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_build, "_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C compiler found"):
        cpu_build.prebuild(tmp_path)
    assert not any(tmp_path.iterdir())


def test_wheels_carry_the_prebuilt_folder():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    kernels = ROOT / "qwen_ops" / "ops" / "kernels"
    relative = (cpu_build.PREBUILT_DIR / "qwen_cpu_0123456789abcdef.so").relative_to(kernels).as_posix()
    assert any(fnmatch.fnmatch(relative, g) for g in globs["qwen_ops.ops.kernels"]), relative
    assert "qwen_ops/ops/kernels/prebuilt/" in (ROOT / ".gitignore").read_text().splitlines()
