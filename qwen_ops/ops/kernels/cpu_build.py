"""The build of the ``cpu`` backend's shared library, and where a built one is found.

``qwen_cpu.c`` (the arithmetic) is compiled with the system C compiler (``$CC``, else
``cc``/``gcc``/``clang``) and linked with ``qwen_cpu_ops.cpp`` (the fast ops' dispatcher kernels;
``$CXX``, else ``c++``/``g++``/``clang++``, against torch's headers) into one shared library named by
a key of everything the build depends on: the sources, the compilers, the flags, torch's version and
the CPU's feature flags (the C part is built with ``-march=native``). A library of the same key is
the same build, wherever it was made, so it is looked for, in order, in:

1. the per-user cache (``$XDG_CACHE_HOME/qwen_ops``, else ``~/.cache/qwen_ops``);
2. the package's ``prebuilt/`` folder, which ``pip install`` fills (setup.py runs ``prebuild`` with
   the target environment's own torch), so that the first use compiles nothing;

and built into the cache when neither has it (another CPU, compiler or torch than at install).
``$QWEN_OPS_CACHE_DIR`` names the one folder to look in and build into instead of both (the tests
use it to force a fresh build).

This module imports torch and the standard library only: setup.py loads it by its path, before the
package's dependencies are installed. ``cpu.py`` loads and calls the library.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

SOURCE = Path(__file__).with_name("qwen_cpu.c")
CXX_SOURCE = Path(__file__).with_name("qwen_cpu_ops.cpp")
# qwen_cpu.c, the files it includes and the C++ kernels: all of them key the build
SOURCES = (SOURCE, SOURCE.with_name("qwen_cpu_flash.c"), SOURCE.with_name("qwen_cpu_lora.c"), CXX_SOURCE)
C_FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-fPIC")
CXX_FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared")
# Filled at install (setup.py); git-ignored, and carried by wheels (pyproject's package-data).
PREBUILT_DIR = Path(__file__).with_name("prebuilt")


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cxx_compiler() -> Optional[str]:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    if os.environ.get("QWEN_OPS_CACHE_DIR"):
        return Path(os.environ["QWEN_OPS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qwen_ops"


def search_dirs() -> list[Path]:
    """Where a built library is looked for, in order (the module doc): the cache, then the package's
    prebuilt folder, unless ``$QWEN_OPS_CACHE_DIR`` names the only folder."""
    if os.environ.get("QWEN_OPS_CACHE_DIR"):
        return [cache_dir()]
    return [cache_dir(), PREBUILT_DIR]


def _extra_flags() -> list[str]:
    """``$QWEN_OPS_CPU_CFLAGS``, appended to the compile flags (e.g. ``-mno-avx512f`` to build the
    portable loops instead of the AVX-512 paths; the tests do)."""
    return os.environ.get("QWEN_OPS_CPU_CFLAGS", "").split()


def _torch_flags() -> list[str]:
    """Compile and link flags of the C++ part against this torch (its headers and libraries)."""
    root = Path(torch.__file__).parent
    return [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-I{root / 'include'}",
            f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}"]


def check_toolchain(cc: Optional[str], cxx: Optional[str]) -> None:
    """Raise RuntimeError, saying what is missing, unless both compilers and torch's headers are here."""
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install cc/gcc/clang)")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install c++/g++/clang++)")
    if not (Path(torch.__file__).parent / "include" / "torch" / "library.h").is_file():
        raise RuntimeError(f"torch {torch.__version__} has no C++ headers here (torch/include/torch/library.h)")


def library_name(cc: str, cxx: str) -> str:
    """The file name of the build with these compilers on this machine: ``qwen_cpu_<key>.so``."""
    key = hashlib.sha256("\0".join([*(p.read_text() for p in SOURCES), cc, cxx, " ".join(C_FLAGS + CXX_FLAGS),
                                    " ".join(_extra_flags()), _cpu_flags(), platform.machine(), torch.__version__]
                                   ).encode()).hexdigest()[:16]
    return f"qwen_cpu_{key}.so"


def build(cc: str, cxx: str, out: Path, source: Path = SOURCE, cxx_source: Path = CXX_SOURCE) -> None:
    """The one build of the CPU kernels: ``source`` (the arithmetic) compiled with the C compiler,
    linked with ``cxx_source`` (the fast ops' dispatcher kernels, against torch's headers) into one
    shared library. Compiled to a temporary name, then renamed: concurrent builders never load a
    half-written file.

    With OpenMP where the compiler has it (the products then split across torch's intra-op
    threads; GCC's libgomp.so.1 is the one torch itself loaded, so both share one thread pool),
    else without (single-threaded products)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    # some compilers (or CPUs) reject -march=native; some compilers have no OpenMP runtime
    for arch, openmp in ((["-march=native"], ["-fopenmp"]), (["-march=native"], []), ([], ["-fopenmp"]), ([], [])):
        fd, obj = tempfile.mkstemp(suffix=".o", dir=out.parent)
        os.close(fd)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        steps = ([cc, "-c", *C_FLAGS, *arch, *openmp, *_extra_flags(), str(source), "-o", obj],
                 [cxx, *CXX_FLAGS, str(cxx_source), obj, "-o", tmp, *openmp, *_torch_flags(), "-lm"])
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                errors.append(f"{' '.join(cmd)}:\n{proc.stderr.strip()[-4000:]}")
                break
        else:
            os.unlink(obj)
            os.replace(tmp, out)
            return
        os.unlink(obj)
        os.unlink(tmp)
    raise RuntimeError("compiling the qwen_ops CPU kernels failed:\n" + "\n".join(errors))


def prebuild(dest: Path = PREBUILT_DIR) -> str:
    """Build the library for this machine into ``dest`` (setup.py calls this at install), unless a build
    of the same key is already there; one line saying what happened. Raises RuntimeError where it
    cannot build (no compiler, no torch headers, a compile error)."""
    cc, cxx = _compiler(), _cxx_compiler()
    check_toolchain(cc, cxx)
    out = Path(dest) / library_name(cc, cxx)
    if out.exists():
        return f"qwen_ops: the CPU kernels for this machine are already built ({out})"
    start = time.perf_counter()
    build(cc, cxx, out)
    for stale in Path(dest).glob("qwen_cpu_*.so"):     # earlier sources' builds: a wheel carries one
        if stale != out:
            stale.unlink()
    return f"qwen_ops: compiled the CPU kernels in {time.perf_counter() - start:.0f} s into {out}"
