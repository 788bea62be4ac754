"""The ``qwen-ops`` command: ``generate`` streams a completion, ``bench`` measures serving,
``serve`` runs the OpenAI-compatible HTTP server (the ``serve`` extra).

    qwen-ops generate "def fibonacci(n):"            # the embedded default model
    qwen-ops generate --model /path/to/Qwen3-0.6B --max-tokens 64 "Hello"
    qwen-ops bench --num-requests 32 --prompt-len 64 --output-len 64
    qwen-ops serve /path/to/Qwen3-0.6B --port 8000 --api-key token-abc123

An error prints one line, ``error: ...``, on stderr and exits non-zero; ``--debug`` (or
``QWEN_OPS_DEBUG=1``) lets the exception through with its traceback instead.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Optional, Sequence


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (Hugging Face layout); "
                   "default: the embedded model")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default: float32)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="most tokens per request (default: the model's limit, at most 4096)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (default: sized from memory)")
    p.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    p.add_argument("--swap-space", type=int, default=None,
                   help="bytes of host memory for swapped KV (default: a quarter of RAM, at most 4 GiB)")


def _llm(args: argparse.Namespace):
    from qwen_ops.serving.llm import LLM

    return LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
               max_model_len=args.max_model_len, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
               preemption_mode=args.preemption_mode, swap_space=args.swap_space)


def _generate(args: argparse.Namespace) -> int:
    from qwen_ops.engine.sampling import SamplingParams

    llm = _llm(args)
    if llm.tokenizer is None:
        print("error: this checkpoint has no tokenizer.json, so text prompts cannot be encoded", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    updates = llm.stream([args.prompt], params)    # a bad prompt raises here, before any output
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    first: Optional[float] = None
    shown = ""
    n_tokens = 0
    for update in updates:
        first = first or time.perf_counter()
        text = update.outputs[0].text
        out.write(text[len(shown):])
        out.flush()
        shown = text
        n_tokens = len(update.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    rate = n_tokens / elapsed if elapsed > 0 else float("inf")
    print(f"\n\n[{n_tokens} tokens in {elapsed:.2f} s: {rate:.1f} tokens/s; "
          f"first token after {1000 * ((first or start) - start):.0f} ms]")
    return 0


def _progress(done: int, total: int, width: int = 30) -> None:
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests")
    sys.stderr.flush()


def _percentiles(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return f"{1000 * qs[49]:.1f} / {1000 * qs[89]:.1f} / {1000 * qs[98]:.1f}"


def _check_at_least_one(args: argparse.Namespace, *flags: str) -> None:
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value < 1:
            raise ValueError(f"{flag} = {value}, expected >= 1")


def _bench(args: argparse.Namespace) -> int:
    from qwen_ops.engine.sampling import SamplingParams

    _check_at_least_one(args, "--num-requests", "--prompt-len", "--output-len")
    llm = _llm(args)
    rng = random.Random(args.seed)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    first_token: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    done = 0
    # LLM.stream validates every prompt (e.g. one too long for --max-model-len) here and raises
    # ValueError, which main() reports before any other output.
    updates = llm.stream(prompts, params)
    _progress(0, args.num_requests)
    for update in updates:
        now = time.perf_counter()
        rid = update.request_id
        if update.new_token_ids:
            first_token.setdefault(rid, now - start)
            token_times.setdefault(rid, []).extend([now] * len(update.new_token_ids))
        if update.finished:
            done += 1
            _progress(done, args.num_requests)
    elapsed = time.perf_counter() - start
    sys.stderr.write("\n")
    total_out = sum(len(t) for t in token_times.values())
    if total_out == 0:
        raise RuntimeError(f"no tokens were generated for {args.num_requests} requests, "
                           "so there is no throughput to report")
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    stats = llm.stats()
    rows = [
        ("requests", f"{args.num_requests} x ({args.prompt_len} prompt + {args.output_len} output tokens)"),
        ("wall time", f"{elapsed:.2f} s"),
        ("output throughput", f"{total_out / elapsed:.1f} tokens/s"),
        ("total throughput", f"{(total_out + args.num_requests * args.prompt_len) / elapsed:.1f} tokens/s"),
        ("TTFT p50/p90/p99", _percentiles(list(first_token.values())) + " ms"),
        ("ITL p50/p90/p99", _percentiles(itl) + " ms"),
        ("preemptions", str(stats["num_preemptions"])),
        ("swaps out / in", f"{stats['num_swaps_out']} / {stats['num_swaps_in']}"),
        ("recomputes: swap full", str(stats["num_swap_full_recomputes"])),
        ("mean batch size", f"{stats['mean_batch_size']:.1f}"),
        ("iterations", str(stats["num_iterations"])),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    try:
        from qwen_ops.serving.openai.server import run_server
    except ImportError as e:
        raise RuntimeError(f"qwen-ops serve needs the serve extra (pip install 'qwen_ops[serve]'): {e}") from e
    return run_server(args)


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                       description="Serve MODEL over OpenAI's /v1/completions, /v1/chat/completions and "
                                   "/v1/models, with /health and /metrics (Prometheus).")
    s.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory (Hugging Face layout); default: the embedded model")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000; 0 = any free port)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (also: QWEN_OPS_API_KEY)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model name(s) clients use (default: the checkpoint directory's name, or "
                        "qwen-ops-default for the embedded model)")
    s.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default: float32)")
    s.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    s.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="most tokens per request (default: the model's limit, at most 4096)")
    s.add_argument("--compile", action="store_true", default=None,
                   help="compile the decode step (default: on for CUDA, off on the CPU)")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core in a process of its own, apart from the HTTP server's event loop "
                        "(default; --no-engine-process: a thread of the server's process)")
    s.add_argument("--max-waiting-requests", type=int, default=None,
                   help="requests allowed to wait for a slot before new ones get 503 (default: no limit)")
    s.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="largest request body accepted, larger gets 413 (default: 4 MiB)")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    s.set_defaults(func=_serve)


_DEBUG_HELP = "on an error, raise it with its traceback instead of printing one line (also: QWEN_OPS_DEBUG=1)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen-ops", description="Slot-indexed Qwen inference on torch.ops.qwen.*")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream a completion of a prompt",
                       description="Stream a completion of PROMPT, then print tokens/s.")
    g.add_argument("prompt", help="text to continue")
    _add_model_args(g)
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    g.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    g.set_defaults(func=_generate)
    b = sub.add_parser("bench", help="serve synthetic requests and print latency/throughput",
                       description="Run N synthetic greedy requests through the scheduler and print a table.")
    _add_model_args(b)
    b.add_argument("--num-requests", type=int, default=32)
    b.add_argument("--prompt-len", type=int, default=64)
    b.add_argument("--output-len", type=int, default=64)
    b.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    b.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    b.set_defaults(func=_bench)
    _add_serve_parser(sub)
    return parser


def _debug_env() -> bool:
    # The same switch as qwen_ops.ops.backend.debug_checks_enabled, read without importing torch.
    return os.environ.get("QWEN_OPS_DEBUG", "0") not in ("", "0")


def _one_line(e: BaseException) -> str:
    text = " ".join(part.strip() for part in str(e).splitlines() if part.strip())
    if isinstance(e, (ValueError, FileNotFoundError, RuntimeError)) and text:
        return text
    # Anything else is unexpected here: name the type and point at --debug.
    return f"{type(e).__name__}{': ' + text if text else ''} (--debug shows the traceback)"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug or _debug_env():
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2 if isinstance(e, (ValueError, FileNotFoundError)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
