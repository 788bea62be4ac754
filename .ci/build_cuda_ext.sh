#!/usr/bin/env bash
# CI step: compile and link csrc/ (the optional CUDA extension qwen_ops._qwen_C) against a CUDA
# build of torch on a machine without a GPU, import it, and run tests/test_cuda_ext.py with it.
#
# It makes its own venv (torch 2.14.1, the CUDA 13.0 build, matching nvcc 13.0), builds a wheel of
# a copy of the checkout (so no extension built for this torch lands in the checkout, where the
# main CPU venv would find it), installs it, and runs the tests from outside the source tree so
# they import the installed package. QWEN_OPS_REQUIRE_CUDA_EXT=1 makes a missing extension a test
# failure instead of a skip.
#
# Environment: CUDA_HOME (default /usr/local/cuda), QWEN_OPS_CUDA_VENV (venv to create or reuse;
# default a fresh one under $TMPDIR), TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS (default 2).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/qwen_ops_cuda_ci.XXXXXX")"
VENV="${QWEN_OPS_CUDA_VENV:-$WORK/venv}"
TORCH_SPEC="torch==2.14.1"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-2}"
export QWEN_OPS_BUILD_CUDA=1
export OMP_NUM_THREADS=1
export PIP_DISABLE_PIP_VERSION_CHECK=1

t0=$(date +%s)
phase() { echo "[build_cuda_ext] $1 ($(( $(date +%s) - t0 )) s elapsed)"; }
fail() { echo "[build_cuda_ext] FAILED: $1" >&2; exit 1; }

[ -x "$CUDA_HOME/bin/nvcc" ] || fail "no nvcc at $CUDA_HOME/bin/nvcc (set CUDA_HOME to a CUDA 13.0 toolkit)"
export PATH="$CUDA_HOME/bin:$PATH"
"$CUDA_HOME/bin/nvcc" --version | tail -n 1

phase "venv at $VENV with $TORCH_SPEC"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC" numpy ninja pytest "setuptools>=77" wheel \
  || fail "pip could not install $TORCH_SPEC and the build tools"
"$VENV/bin/python" -c "import torch; assert torch.version.cuda, torch.__version__; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"

phase "copy the checkout"
mkdir -p "$WORK/src"
tar -C "$ROOT" --exclude=./.git --exclude=./build --exclude='*.so' --exclude='*.egg-info' \
  --exclude=__pycache__ --exclude=./venv --exclude=./.venv -cf - . | tar -C "$WORK/src" -xf -

phase "build and install the wheel (QWEN_OPS_BUILD_CUDA=1, arch $TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
b0=$(date +%s)
if ! "$VENV/bin/python" -m pip install -v --no-build-isolation --no-deps "$WORK/src" > "$WORK/build.log" 2>&1; then
  tail -n 80 "$WORK/build.log" >&2
  fail "the extension did not build (full log: $WORK/build.log)"
fi
echo "[build_cuda_ext] build took $(( $(date +%s) - b0 )) s"

phase "import the installed extension"
cd "$WORK"  # outside the source tree: import the installed package, not the copy
"$VENV/bin/python" - <<'EOF'
import torch
import qwen_ops
import qwen_ops._qwen_C as ext
from qwen_ops.ops.kernels import cuda as cuda_kernels

assert "site-packages" in qwen_ops.__file__, qwen_ops.__file__
print("loaded", ext.__file__)
for name in ("kv_write", "slot_attention", "causal_conv1d", "gated_delta_rule"):
    print(" ", getattr(torch.ops._qwen_C, name).default._schema)
print("cuda backend:", cuda_kernels.why_unavailable() or "available")
EOF

phase "tests/test_cuda_ext.py with the extension (the emulator tests run in the main test suite)"
QWEN_OPS_REQUIRE_CUDA_EXT=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts="" \
  -k "not emulated" "$WORK/src/tests/test_cuda_ext.py"

phase "done"
rm -rf "$WORK"  # the copy, the log and (unless QWEN_OPS_CUDA_VENV named another) the 5 GB venv
