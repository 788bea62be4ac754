"""Start-up of a compiled engine: load, compile, first decode step; prints one JSON line.

    OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=/tmp/qc python benchmarks/startup.py [--model PATH]

Run it twice with the same ``TORCHINDUCTOR_CACHE_DIR``: the first start compiles cold, the second
finds Inductor's FX graph cache (on by default) and skips code generation.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> int:
    t0 = time.perf_counter()
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    import torch._dynamo

    from qwen_ops.models.defaults import default_model_path
    from qwen_ops.engine.engine import QwenEngine

    eng = QwenEngine.from_pretrained(args.model or default_model_path(), max_slots=4, max_seq_len=256,
                                     compile=True, decode_buckets=[1, 4])
    loaded = time.perf_counter()
    tok = eng.prefill([3, 4, 5, 6], slot_id=0).next_token
    eng.decode_step(tok, slot_id=0)                    # compiles the batch-1 graph
    eng.prefill([7, 8], slot_id=1)
    from qwen_ops.engine.batch import BatchedRequest
    eng.reserve(0, eng.slot_seq_len(0) + 1)
    eng.reserve(1, eng.slot_seq_len(1) + 1)
    eng.execute([BatchedRequest(0, [tok], eng.slot_seq_len(0)), BatchedRequest(1, [tok], eng.slot_seq_len(1))])  # bucket 4
    done = time.perf_counter()
    inductor = torch._dynamo.utils.counters["inductor"]
    print(json.dumps({"total_s": done - t0, "load_s": loaded - t0, "first_steps_s": done - loaded,
                      "fxgraph_cache_hit": inductor["fxgraph_cache_hit"],
                      "fxgraph_cache_miss": inductor["fxgraph_cache_miss"],
                      "unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
