"""Tensor parallelism on the CPU: throughput of tensor_parallel_size=2 against 1, and each rank's
resident weights, on a Qwen3-0.6B-shaped checkpoint with random weights (hidden 1024, 28 layers,
16/8 heads, fp32; made once by benchmarks/bench_realsize.py's ``make_checkpoint``).

Workload (the issue's): 32 requests of 64-token prompts, 32 new tokens each, greedy, one thread
per rank. Also the per-step cost of the transport: one ``broadcast_object_list`` of a decode
step's chunks, and one all-reduce of a [32, 1024] fp32 tensor, over gloo on loopback.

    OMP_NUM_THREADS=1 python benchmarks/bench_tp.py [--model DIR] [--requests 32] [--reps 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run(path: Path, tp: int, prompts, new_tokens: int, reps: int) -> dict:
    from qwen_ops import LLM, SamplingParams

    llm = LLM(path, tensor_parallel_size=tp, max_num_seqs=len(prompts), max_model_len=256)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)   # warm up
        times, tokens = [], None
        for _ in range(reps):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            times.append(time.perf_counter() - t0)
            tokens = [o.outputs[0].token_ids for o in outs]
        return {"tok_s": len(prompts) * new_tokens / statistics.median(times), "weights": weight_bytes(llm.engine.model),
                "tokens": tokens}
    finally:
        llm.shutdown()


def _transport_worker(rank: int, port: int, shm_name: str, n: int, out) -> None:
    """Time one decode step's message both ways: gloo broadcast_object_list, and a shared-memory
    handoff (rank 0 writes the pickled bytes and bumps a counter; rank 1 spins on it, then acks)."""
    import pickle
    from multiprocessing import shared_memory

    import torch
    import torch.distributed as dist

    from qwen_ops.engine.batch import BatchedRequest

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    msg = ("execute", [("row", s, list(range(8))) for s in range(4)],
           [BatchedRequest(s, [123], 64 + s, s) for s in range(32)])
    res = {}
    box = [msg if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    t0 = time.perf_counter()
    for _ in range(n):
        box = [msg if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
    res["broadcast_object_list_us"] = (time.perf_counter() - t0) / n * 1e6
    x = torch.randn(32, 1024)
    dist.all_reduce(x)
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x)
    res["all_reduce_32x1024_us"] = (time.perf_counter() - t0) / n * 1e6
    shm = shared_memory.SharedMemory(name=shm_name)
    seq = shm.buf.cast("q")          # [0] = message number, [1] = ack, [2] = length
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        if rank == 0:
            data = pickle.dumps(msg)
            shm.buf[64:64 + len(data)] = data
            seq[2] = len(data)
            seq[0] = i
            while seq[1] != i:
                pass
        else:
            while seq[0] != i:
                pass
            pickle.loads(bytes(shm.buf[64:64 + seq[2]]))
            seq[1] = i
    res["shared_memory_us"] = (time.perf_counter() - t0) / n * 1e6
    del seq
    shm.close()
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def measure_transport(n: int = 200) -> dict:
    import torch.multiprocessing as mp
    from multiprocessing import shared_memory

    from qwen_ops.engine.distributed import free_port

    shm = shared_memory.SharedMemory(create=True, size=1 << 20)
    shm.buf[:24] = bytes(24)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_transport_worker, args=(r, port, shm.name, n, out)) for r in range(2)]
    for p in procs:
        p.start()
    res = out.get(timeout=300)
    for p in procs:
        p.join(60)
    shm.close()
    shm.unlink()
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: the 0.6B-shaped one)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--transport-only", action="store_true", help="only the per-step transport costs")
    args = parser.parse_args(argv)
    t = measure_transport()
    print("per step, 2 ranks on loopback: " + ", ".join(f"{k} {v:.0f}" for k, v in t.items()))
    if args.transport_only:
        return 0
    if args.model is None:
        from bench_realsize import default_cache_dir, make_checkpoint

        args.model = make_checkpoint(default_cache_dir())
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 150000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    one = run(args.model, 1, prompts, args.new_tokens, args.reps)
    two = run(args.model, 2, prompts, args.new_tokens, args.reps)
    same = sum(a == b for a, b in zip(one["tokens"], two["tokens"]))
    print(f"tp=1: {one['tok_s']:.1f} tok/s, weights {one['weights'] / 2**20:.0f} MiB")
    print(f"tp=2: {two['tok_s']:.1f} tok/s, rank 0 weights {two['weights'] / 2**20:.0f} MiB "
          f"({two['weights'] / one['weights']:.1%} of tp=1)")
    print(f"throughput tp=2 / tp=1: {two['tok_s'] / one['tok_s']:.2f}x; same greedy tokens {same}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
