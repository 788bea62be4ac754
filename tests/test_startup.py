"""The second start-up of a compiled engine reuses Inductor's FX graph cache (no recompilation)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from checkpoints import make_qwen3_checkpoint

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "startup.py"


def start(ckpt: Path, cache: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(SCRIPT), "--model", str(ckpt)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_startup_hits_the_fx_graph_cache(tmp_path):
    ckpt = make_qwen3_checkpoint(tmp_path / "ckpt")
    cold = start(ckpt, tmp_path / "inductor")
    warm = start(ckpt, tmp_path / "inductor")
    assert cold["unique_graphs"] == warm["unique_graphs"] == 2          # batch 1 and the dynamic bucket graph
    assert cold["fxgraph_cache_miss"] == 2 and cold["fxgraph_cache_hit"] == 0
    assert warm["fxgraph_cache_hit"] == 2 and warm["fxgraph_cache_miss"] == 0
