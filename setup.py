"""Build script. Pure Python by default; the CUDA extension in csrc/ is optional.

QWEN_OPS_BUILD_CUDA=auto (default): build csrc/ only when a CUDA toolkit is found
  AND the installed torch is a CUDA build. Never decided on torch.cuda.is_available(),
  so it works on GPU-less build machines.
QWEN_OPS_BUILD_CUDA=1: build it or fail.   QWEN_OPS_BUILD_CUDA=0: never build it.

torch is imported only when the extension may be built; use
`pip install --no-build-isolation .` for that, so the build sees the installed torch.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _cuda_toolkit_home() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and Path(home, "bin", "nvcc").exists():
        return home
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return "/usr/local/cuda"
    nvcc = shutil.which("nvcc")
    return str(Path(nvcc).resolve().parent.parent) if nvcc else None


def _cuda_extensions() -> tuple[list, dict]:
    mode = os.environ.get("QWEN_OPS_BUILD_CUDA", "auto").strip().lower()
    if mode not in {"auto", "0", "1"}:
        raise SystemExit(f"QWEN_OPS_BUILD_CUDA={mode!r}; expected auto, 0 or 1")
    if mode == "0":
        return [], {}
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cu"))
    sources += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))
    try:
        import torch
    except ImportError:
        if mode == "1":
            raise SystemExit("QWEN_OPS_BUILD_CUDA=1 needs torch importable at build time; "
                             "install torch first and build with --no-build-isolation")
        return [], {}
    toolkit = _cuda_toolkit_home()
    reasons = []
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} is not a CUDA build")
    if toolkit is None:
        reasons.append("no CUDA toolkit (nvcc) found; set CUDA_HOME")
    if not sources:
        reasons.append("csrc/ has no sources")
    if reasons:
        if mode == "1":
            raise SystemExit("QWEN_OPS_BUILD_CUDA=1 but " + "; ".join(reasons))
        return [], {}
    os.environ.setdefault("CUDA_HOME", toolkit)
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    # cuBLAS/cuSPARSE headers needed by ATen/cuda/CUDAContext.h ship in the wheel's nvidia/ tree.
    include_dirs = [str(ROOT / "csrc")]
    import site
    for base in site.getsitepackages():
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cublas/include",
                    "nvidia/cusparse/include"):
            if Path(base, sub).is_dir():
                include_dirs.append(str(Path(base, sub)))
    ext = CUDAExtension(
        name="qwen_ops._qwen_C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": ["-O3", "-std=c++17"],
                            "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"]},
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _cuda_extensions()
# torch_library/ sits at the top level of the repo and installs as qwen_ops.torch_library.
packages = find_packages(include=["qwen_ops", "qwen_ops.*"]) + ["qwen_ops.torch_library"]
setup(packages=packages, ext_modules=ext_modules, cmdclass=cmdclass)
