"""The ``qwen-ops`` commands: ``generate`` streams a completion, ``chat`` streams a model's answers
to a conversation, ``bench`` measures serving,
``serve`` runs the OpenAI-compatible HTTP server (the ``serve`` extra), ``perplexity`` scores a
text as llama.cpp's ``llama-perplexity`` (``serving/perplexity.py``). The parser and ``main``
are in the top-level ``qwen_ops_cli`` (importable without torch, so ``--help`` is instant), with
the usage examples and the error convention; ``main`` calls each command here as ``_<name>(args)``.
This module never imports ``qwen_ops_cli`` (``qwen_ops/serving/cli.py`` is the ``python -m`` entry).
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import threading
import time
from typing import Optional, Sequence


def _llm(args: argparse.Namespace):
    """The command's ``LLM``, from its engine flags (``EngineArgs.add_cli_args``)."""
    from qwen_ops.serving.engine_args import EngineArgs
    from qwen_ops.serving.llm import LLM

    return LLM.from_engine_args(EngineArgs.from_cli_args(args))


def _generate(args: argparse.Namespace) -> int:
    """Stream the continuation of the prompt. A prompt ending in whitespace is healed
    (``serving/token_healing.py``): its last token is generated again, among the tokens that start
    with its text, then the rest; what is printed is the prompt and its continuation either way."""
    from qwen_ops.engine.sampling import SamplingParams
    from qwen_ops.serving.token_healing import heal

    llm = _llm(args)
    if llm.tokenizer is None:
        print("error: this checkpoint has no tokenizer.json, so text prompts cannot be encoded", file=sys.stderr)
        return 2

    def params(max_tokens: int, **kwargs) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.sampling_seed, ignore_eos=args.ignore_eos, **kwargs)

    start = time.perf_counter()
    prompt = args.prompt
    healing = (heal(llm.tokenizer, llm.tokenizer.encode(args.prompt))
               if args.max_tokens >= 1 and getattr(args, "token_healing", True) else None)
    shown_first, n_first = "", 0
    if healing is not None:
        (out1,) = llm.generate([{"prompt_token_ids": healing.prompt_ids}],
                               params(1, allowed_token_ids=healing.first_token_ids), use_tqdm=False)
        first_id = out1.outputs[0].token_ids[0]
        prompt = {"prompt_token_ids": healing.prompt_ids + [first_id]}
        shown_first, n_first = llm.tokenizer.decode([first_id])[len(healing.tail):], 1
    updates = llm.stream([prompt], params(args.max_tokens - n_first)) if args.max_tokens > n_first else iter(())
    out = sys.stdout
    out.write(args.prompt + shown_first)
    out.flush()
    first: Optional[float] = time.perf_counter() if n_first else None
    shown = ""
    n_tokens = 0
    finish_reason = "length" if n_first and args.max_tokens == 1 else None
    for update in updates:
        first = first or time.perf_counter()
        text = update.outputs[0].text
        out.write(text[len(shown):])
        out.flush()
        shown = text
        n_tokens, finish_reason = len(update.outputs[0].token_ids), update.outputs[0].finish_reason
    n_tokens += n_first
    elapsed = time.perf_counter() - start
    rate = n_tokens / elapsed if elapsed > 0 else float("inf")
    note = "; the model ended the text" if finish_reason == "stop" else ""
    print(f"\n\n[{n_tokens} tokens in {elapsed:.2f} s: {rate:.1f} tokens/s; "
          f"first token after {1000 * ((first or start) - start):.0f} ms{note}]")
    return 0


class _StopOnCtrlC:
    """While entered, Ctrl-C (SIGINT) sets ``stopped`` instead of raising ``KeyboardInterrupt``, so the
    caller stops its stream between engine steps (closing it aborts the request) rather than in the
    middle of one; a second Ctrl-C raises as usual. Only the main thread receives signals, so
    elsewhere this changes nothing."""

    def __init__(self) -> None:
        self.stopped = False
        self._previous = None

    def _handler(self, signum, frame) -> None:
        if self.stopped:
            raise KeyboardInterrupt
        self.stopped = True

    def __enter__(self) -> "_StopOnCtrlC":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _chat_turn(llm, messages: list[dict], params) -> Optional[str]:
    """Stream the answer to ``messages`` to stdout as it is generated, then a newline, and the speed
    line to stderr. Returns the answer, or None when Ctrl-C stopped it (the request is aborted).

    The prompt is ``LLM.chat``'s (the model's chat template, ``LLM._chat_prompts``), streamed by
    ``LLM.stream``; a conversation too long for --max-model-len raises ValueError before any output."""
    (prompt,) = llm._chat_prompts(messages)
    start = time.perf_counter()
    updates = llm.stream([prompt], params)
    out = sys.stdout
    first: Optional[float] = None
    text = ""
    n_tokens = 0
    finish_reason = None
    with _StopOnCtrlC() as ctrl_c:
        for update in updates:
            first = first or time.perf_counter()
            completion = update.outputs[0]
            out.write(completion.text[len(text):])     # the text only grows: write what is new
            out.flush()
            text, n_tokens, finish_reason = completion.text, len(completion.token_ids), completion.finish_reason
            if ctrl_c.stopped:
                updates.close()                         # aborts the request, frees its KV blocks
                break
    out.write("\n")
    out.flush()
    elapsed = time.perf_counter() - start
    rate = n_tokens / elapsed if elapsed > 0 else float("inf")
    note = ("; stopped by Ctrl-C" if ctrl_c.stopped else
            "; stopped at --max-tokens" if finish_reason == "length" else "")
    print(f"[{n_tokens} tokens in {elapsed:.2f} s: {rate:.1f} tokens/s; "
          f"first token after {1000 * ((first or start) - start):.0f} ms{note}]", file=sys.stderr)
    return None if ctrl_c.stopped else text


CHAT_COMMANDS = ("/exit", "/quit", "/reset")


def _read_line(tty: bool) -> Optional[str]:
    """The next line of stdin without its newline; None at the end (EOF, or Ctrl-C at the prompt)."""
    if not tty:
        line = sys.stdin.readline()
        return line.rstrip("\r\n") if line else None
    try:
        return input("> ")
    except (EOFError, KeyboardInterrupt):
        print()
        return None


def _chat(args: argparse.Namespace) -> int:
    from qwen_ops.engine.sampling import SamplingParams

    if args.message is not None and args.message_flag is not None:
        raise ValueError(f"MESSAGE = {args.message!r} and --message = {args.message_flag!r}; expected one of them")
    message = args.message if args.message is not None else args.message_flag
    _check_at_least_one(args, "--max-tokens")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.sampling_seed)
    llm = _llm(args)
    if llm.tokenizer is None:
        raise ValueError(f"{llm.model_path} has no tokenizer.json, so chat messages cannot be encoded")
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    if message is not None:                     # one turn
        return 0 if _chat_turn(llm, system + [{"role": "user", "content": message}], params) is not None else 130
    tty = sys.stdin.isatty()
    if tty:
        print("Chatting with the model: /reset clears the conversation, /exit or Ctrl-D ends it, Ctrl-C stops "
              "an answer.", file=sys.stderr)
    history: list[dict] = []                    # user and assistant turns, in order (the system prompt apart)
    while (line := _read_line(tty)) is not None:
        command = line.strip()
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            history = []
            print("[conversation cleared]", file=sys.stderr)
            continue
        if command.startswith("/") and " " not in command:
            print(f"unknown command {command}; expected one of {', '.join(CHAT_COMMANDS)}", file=sys.stderr)
            continue
        if not command:
            continue
        user = {"role": "user", "content": line}
        try:
            answer = _chat_turn(llm, system + history + [user], params)
        except ValueError as e:                 # e.g. the conversation outgrew --max-model-len
            print(f"error: {e} (/reset starts a new conversation)", file=sys.stderr)
            continue
        if answer is None:
            # A stopped answer is not a reply: the turn is left out, as if it had not been asked.
            print("[answer stopped; this turn is left out of the conversation]", file=sys.stderr)
            continue
        history += [user, {"role": "assistant", "content": answer}]
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


# The synthetic prompts are built in Python before the first step: bound how many.
MAX_BENCH_REQUESTS = 100_000


def _check_at_least_one(args: argparse.Namespace, *flags: str) -> None:
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value < 1:
            raise ValueError(f"{flag} = {value}, expected >= 1")


def _bench(args: argparse.Namespace) -> int:
    from qwen_ops.engine.sampling import SamplingParams

    _check_at_least_one(args, "--num-requests", "--prompt-len", "--output-len")
    if args.num_requests > MAX_BENCH_REQUESTS:
        raise ValueError(f"--num-requests = {args.num_requests}, expected at most {MAX_BENCH_REQUESTS}")
    llm = _llm(args)
    max_len = llm.scheduler.config.max_model_len
    if args.prompt_len >= max_len:     # said before building prompts of that length (as prepare_requests says it)
        raise ValueError(f"prompts[0] has {args.prompt_len} tokens; max_model_len = {max_len} leaves no room "
                         "to generate")
    rng = random.Random(args.prompt_seed)
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


def _perplexity_text(args: argparse.Namespace) -> tuple[str, str]:
    """The text to score and how to name it in messages (``--file PATH`` or ``--text pydoc``)."""
    from pathlib import Path

    from qwen_ops.serving.perplexity import pydoc_topics_text

    if args.text == "pydoc":
        # Python's help topics: held-out real English with code, on every machine with Python.
        return pydoc_topics_text(), "--text pydoc"
    name = f"--file {args.file}"
    try:
        return Path(args.file).read_text(encoding="utf-8"), name
    except FileNotFoundError:
        raise FileNotFoundError(f"{name}: no such file") from None
    except (IsADirectoryError, UnicodeDecodeError) as e:
        raise ValueError(f"{name}: expected a UTF-8 text file ({e})") from None


def _perplexity(args: argparse.Namespace) -> int:
    import json

    from qwen_ops.serving.perplexity import perplexity, text_token_ids

    if args.ctx_size < 3:
        raise ValueError(f"--ctx-size = {args.ctx_size}, expected >= 3 (each chunk scores its tokens "
                         "ctx-size/2 + 1 .. ctx-size - 1)")
    if args.max_chunks is not None:
        _check_at_least_one(args, "--max-chunks")
    text, source = _perplexity_text(args)      # before the (slow) load: a missing file fails at once
    llm = _llm(args)
    if llm.tokenizer is None:
        raise ValueError(f"{llm.model_path} has no tokenizer.json, so {source} cannot be tokenized")
    ids, bos = text_token_ids(llm.tokenizer, text)
    if len(ids) < args.ctx_size:
        raise ValueError(f"{source} tokenizes to {len(ids)} tokens, but --ctx-size {args.ctx_size} needs at "
                         f"least {args.ctx_size} (one chunk)")
    num_chunks = len(ids) // args.ctx_size
    if args.max_chunks is not None:
        num_chunks = min(num_chunks, args.max_chunks)
    batch = llm.scheduler.config.max_num_seqs
    print(f"perplexity: {source}: {len(ids)} tokens (BOS {'id ' + str(bos) if bos is not None else 'none'}); "
          f"calculating perplexity over {num_chunks} chunks, n_ctx={args.ctx_size}, {batch} chunks a pass",
          file=sys.stderr)
    start = time.perf_counter()

    def on_chunk(i: int, running_ppl: float) -> None:
        if i == 0:       # the first pass (one generate call) is done: llama.cpp's timing line
            per_pass = time.perf_counter() - start
            eta = per_pass * (-(-num_chunks // batch) - 1)
            print(f"perplexity: {per_pass:.2f} seconds per pass - ETA {eta / 60:.2f} minutes", file=sys.stderr)
        sys.stdout.write(f"[{i + 1}]{running_ppl:.4f},")
        sys.stdout.flush()

    result = perplexity(llm, ids, args.ctx_size, batch, max_chunks=args.max_chunks, bos_token_id=bos,
                        on_chunk=on_chunk)
    print()
    print(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_error:.5f}")
    print(f"perplexity: {result.num_tokens} tokens scored in {result.seconds:.2f} s "
          f"({result.num_chunks * args.ctx_size / max(result.seconds, 1e-9):.1f} tokens/s through the model)",
          file=sys.stderr)
    if args.json:
        record = {"model": str(llm.model_path), "text": source, "num_text_tokens": len(ids), "dtype": args.dtype,
                  "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype, **result.as_dict()}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    return 0
