"""The ``qwen-ops`` command line: its parser and ``main``, importable without torch.

``qwen-ops --help`` (and every parse error) is answered from here before torch is imported: the
engine's flags come from ``qwen_ops/serving/engine_args.py`` (``EngineArgs.add_cli_args``), which
imports without torch, read from its file without running the package's root (``_engine_args_module``). The commands themselves live in
``qwen_ops.serving.commands``; they check the engine's arguments with ``EngineArgs.validate``,
the same check and the same words as ``LLM(...)``. ``router`` never loads torch at all
(``_router_module``).

    qwen-ops generate "def fibonacci(n):"            # the embedded default model
    qwen-ops generate --model /path/to/Qwen3-0.6B --max-tokens 64 "Hello"
    qwen-ops chat model.Q4_1.gguf "What is the capital of France?"   # one answer, streamed
    qwen-ops chat /path/to/Qwen3-0.6B --system "Be brief."            # a conversation on stdin
    qwen-ops bench --num-requests 32 --prompt-len 64 --output-len 64
    qwen-ops serve /path/to/Qwen3-0.6B --port 8000 --api-key token-abc123
    qwen-ops perplexity /path/to/Qwen3-0.6B --file wiki.test.raw --ctx-size 512
    qwen-ops router --worker http://127.0.0.1:8001 --worker http://127.0.0.1:8002 --port 8000

An error prints one line, ``error: ...``, on stderr and exits non-zero; ``--debug`` (or
``QWEN_OPS_DEBUG=1``) lets the exception through with its traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence



def _engine_args_module():
    """``qwen_ops/serving/engine_args.py`` (torch-free) loaded from its file under a name of its own,
    without running the package's ``__init__`` (which registers the custom ops, and so imports
    torch): ``--help`` and every parse error stay instant. The commands use the package's module."""
    import importlib.util

    name = "qwen_ops_cli._engine_args"
    if name not in sys.modules:
        package = importlib.util.find_spec("qwen_ops")          # found, not run
        path = os.path.join(package.submodule_search_locations[0], "serving", "engine_args.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module                              # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


_ENGINE_ARGS = _engine_args_module()
EngineArgs, json_object = _ENGINE_ARGS.EngineArgs, _ENGINE_ARGS.json_object


def _lora_module(text: str) -> dict:
    """One ``--lora-modules`` value, vLLM's two forms: ``name=path``, or a JSON object
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (base_model_name optional)."""
    if text.lstrip().startswith("{"):
        value = json_object(text, 'name=path or \'{"name": "sql", "path": "/adapters/sql"}\'')
        unknown = sorted(set(value) - {"name", "path", "base_model_name"})
        if unknown:
            raise argparse.ArgumentTypeError(f"{text!r} has key {unknown[0]!r}; expected name, path and "
                                             "optionally base_model_name")
        module = {"name": value.get("name"), "path": value.get("path"), "base_model_name": value.get("base_model_name")}
    else:
        name, eq, path = text.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"{text!r} has no '='; expected name=path or a JSON object")
        module = {"name": name.strip(), "path": path.strip(), "base_model_name": None}
    for key in ("name", "path"):
        if not isinstance(module[key], str) or not module[key]:
            raise argparse.ArgumentTypeError(f"{text!r} has {key} = {module[key]!r}; expected a non-empty string")
    if module["base_model_name"] is not None and not isinstance(module["base_model_name"], str):
        raise argparse.ArgumentTypeError(f"{text!r} has base_model_name = {module['base_model_name']!r}; "
                                         "expected a string")
    return module


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                       description="Serve MODEL over OpenAI's /v1/completions, /v1/chat/completions and "
                                   "/v1/models (with --runner pooling: /v1/embeddings, /v1/score, /rerank), "
                                   "with /health and /metrics (Prometheus).")
    # --reasoning-parser: the server's own flag below (vLLM's engine argument of that name)
    EngineArgs.add_cli_args(s, positional_model=True, exclude=("reasoning_parser",))
    # A grammar that compiles for long would hold its request's slot: bounded by default when served.
    s.set_defaults(max_grammar_compile_seconds=5.0)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000; 0 = any free port)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (also: QWEN_OPS_API_KEY, then vLLM's "
                        "VLLM_API_KEY); an empty or blank key is an error. To serve without authentication, leave "
                        "out --api-key and both variables")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model name(s) clients use (default: the checkpoint directory's name, or "
                        "qwen-ops-default for the embedded model)")
    s.add_argument("--reasoning-parser", choices=("qwen3",), default=None,
                   help="split chat replies into reasoning_content and content (qwen3: <think>...</think>)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let tool_choice 'auto' (the default with tools) parse tool calls from replies; needs "
                        "--tool-call-parser (vLLM's flags; without them such a request is a 400)")
    s.add_argument("--tool-call-parser", choices=("hermes",), default=None,
                   help="the format of tool calls in replies: hermes (<tool_call>{...}</tool_call>, Qwen's)")
    s.add_argument("--lora-modules", type=_lora_module, nargs="+", default=None, metavar="NAME=PATH",
                   help="adapters to serve: name=path, or vLLM's JSON '{\"name\": \"sql\", \"path\": \"/p\", "
                        "\"base_model_name\": \"...\"}'; a request whose model is NAME runs with it "
                        "(needs --enable-lora). "
                        "With VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, /v1/load_lora_adapter and "
                        "/v1/unload_lora_adapter change them at run time")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core in a process of its own, apart from the HTTP server's event loop "
                        "(default; --no-engine-process: a thread of the server's process)")
    s.add_argument("--threads-per-replica", type=int, default=None, metavar="N",
                   help="torch threads of each engine core with --data-parallel-size > 1, each replica pinned to "
                        "cores of its own where there are enough (default: the usable cores divided among them)")
    s.add_argument("--data-parallel-policy", choices=("cache_aware", "least_load", "round_robin"),
                   default="cache_aware",
                   help="with --data-parallel-size > 1, which replica takes a request: the one holding the longest "
                        "cached prefix of its prompt unless it is loaded well beyond the others (cache_aware, the "
                        "default), the least loaded in tokens, or each in turn")
    s.add_argument("--replica-hang-timeout", type=float, default=None, metavar="S",
                   help="with --data-parallel-size > 1: a replica that has work and finishes no iteration for S "
                        "seconds is killed and restarted, its unstarted requests sent to another (default 60)")
    s.add_argument("--max-waiting-requests", type=int, default=None,
                   help="completions (n per prompt) allowed to wait for a slot before new requests get 503 "
                        "(default: no limit)")
    s.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="largest request body accepted, larger gets 413 (default: 4 MiB)")
    s.add_argument("--engine-heartbeat-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="/health answers 503 while the engine has requests and has finished no iteration for "
                        "this long, e.g. a stopped or hung engine process (default: 60)")
    s.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="abort a request still running after this long and answer 504 (in-band for a started "
                        "stream); its KV blocks are freed (default: no timeout)")
    s.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="SECONDS",
                   help="close a connection that sends no request for this long, after a response or since it "
                        "opened (uvicorn's option, also guarding never-used connections; default: 5)")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    s.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no line per HTTP request (vLLM's flag; behind qwen-ops router, which asks /health and "
                        "/metrics every second)")
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    s.set_defaults(func="serve")


def _add_chat_parser(sub) -> None:
    c = sub.add_parser("chat", help="chat with an instruct model, its answers streamed",
                       description="Chat with MODEL, each prompt rendered by the model's chat template (as LLM.chat "
                                   "renders it) and each answer streamed to stdout as it is generated, then its "
                                   "speed on stderr. With MESSAGE: one answer. Without: a conversation read from "
                                   "stdin, a line a turn ('> ' prompts on a terminal); the model sees the whole "
                                   "conversation. /reset clears it, /exit, /quit or end of input ends it. Ctrl-C "
                                   "stops an answer (the request is aborted) and that turn is left out of the "
                                   "conversation.")
    EngineArgs.add_cli_args(c, positional_model=True, exclude=("seed",))
    c.add_argument("message", nargs="?", default=None,
                   help="one message to answer, then exit (default: a conversation on stdin); one positional "
                        "argument is MODEL, so for the embedded model use --message")
    c.add_argument("--message", "-m", dest="message_flag", default=None, metavar="TEXT",
                   help="the same as MESSAGE, e.g. with the embedded model: qwen-ops chat -m 'Hello'")
    c.add_argument("--system", default=None, metavar="TEXT", help="a system prompt, first in every conversation "
                   "(default: none, so the chat template's own default if it has one)")
    c.add_argument("--max-tokens", type=int, default=256, help="most tokens of an answer (default 256)")
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    c.add_argument("--top-k", type=int, default=-1)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--seed", type=int, default=None, dest="sampling_seed", metavar="SEED",
                   help="seed of the answers' sampling")
    c.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    c.set_defaults(func="chat")


# The router's policies (qwen_ops/serving/router.py's POLICIES, which tests/test_router.py checks this against):
# named here so that --help lists them without loading the router's module.
ROUTER_POLICIES = ("cache_aware", "least_load", "round_robin", "consistent_hash")


def _add_router_parser(sub) -> None:
    r = sub.add_parser("router", help="one OpenAI-compatible endpoint in front of worker servers",
                       description="Forward OpenAI-compatible requests to worker servers (qwen-ops serve, or any "
                                   "OpenAI-compatible server) by a routing policy, with health checks and retries "
                                   "of requests that failed before their first byte. Serves /health and /metrics "
                                   "of its own; everything else goes to a worker. Loads no model and no torch.")
    r.add_argument("--worker", action="append", required=True, metavar="URL",
                   help="a worker's root URL, e.g. http://127.0.0.1:8001; give --worker once per worker")
    r.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    r.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000; 0 = any free port)")
    r.add_argument("--policy", choices=ROUTER_POLICIES, default="cache_aware",
                   help="cache_aware (default): the worker holding the longest prefix of the prompt text unless "
                        "it is much busier; least_load: the fewest tokens in flight; round_robin: each in turn; "
                        "consistent_hash: sticky sessions by a session key (--session-header, or the body's user)")
    r.add_argument("--health-interval", type=float, default=1.0, metavar="SECONDS",
                   help="ask each worker's /health this often; a failed check takes it out until one passes "
                        "(default: 1)")
    r.add_argument("--max-retries", type=int, default=2, metavar="N",
                   help="other workers to try a request on when its worker fails before the first byte of the "
                        "answer (no connection, lost, or a 503; default: 2)")
    r.add_argument("--session-header", action="append", default=None, metavar="NAME",
                   help="the header holding the session key of consistent_hash, first found wins; give it once "
                        "per header (default: X-Session-ID, then X-User-ID; then the body's user field)")
    r.add_argument("--no-worker-metrics", action="store_true",
                   help="do not read each worker's /metrics (running and waiting requests) after its health check; "
                        "load is then only what this router sent")
    r.add_argument("--uvicorn-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    r.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    r.set_defaults(func="router")


def _router_module():
    """``qwen_ops.serving.router`` imported without running the package's ``__init__`` (which registers
    the custom ops, and so imports torch): where ``qwen_ops`` is not imported yet, it and
    ``qwen_ops.serving`` enter ``sys.modules`` as bare packages (their folders as search paths, their
    ``__init__`` not run), so the router and the torch-free modules it imports (the balancer, the hash
    ring) load from their files under their own names. Only ``qwen-ops router``'s process does this;
    it imports nothing else of the package."""
    import importlib
    import importlib.util

    if "qwen_ops" not in sys.modules:
        package = importlib.util.find_spec("qwen_ops")          # found, not run
        folder = package.submodule_search_locations[0]
        for name, path in (("qwen_ops", folder), ("qwen_ops.serving", os.path.join(folder, "serving"))):
            spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                          submodule_search_locations=[path])
            sys.modules[name] = importlib.util.module_from_spec(spec)
    return importlib.import_module("qwen_ops.serving.router")


def _add_perplexity_parser(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a text, as llama.cpp's llama-perplexity",
                       description="Perplexity of a text under MODEL, as llama.cpp's llama-perplexity computes it: "
                                   "consecutive --ctx-size chunks, the second half of each scored (a BOS first in "
                                   "every chunk where the tokenizer adds one). Prints the running value after each "
                                   "chunk, then 'Final estimate: PPL = x +/- y'.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", "-f", default=None, metavar="TEXT", help="the text file (UTF-8) to score")
    source.add_argument("--text", choices=("pydoc",), default=None,
                        help="a built-in text instead of --file: pydoc, Python's help topics "
                             "(pydoc_data.topics, shipped with Python; English prose with code)")
    p.add_argument("--ctx-size", "-c", type=int, default=512, help="tokens per chunk (default: 512)")
    p.add_argument("--max-chunks", type=int, default=None,
                   help="score at most this many chunks, as llama.cpp's --chunks (default: all)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the result as JSON to OUT")
    EngineArgs.add_cli_args(p, positional_model=True)
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    p.set_defaults(func="perplexity")


_DEBUG_HELP = "on an error, raise it with its traceback instead of printing one line (also: QWEN_OPS_DEBUG=1)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen-ops", description="Slot-indexed Qwen inference on torch.ops.qwen.*")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    parser.add_argument("--version", action="version", version=f"qwen-ops {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream a completion of a prompt",
                       description="Stream a completion of PROMPT, then print tokens/s.")
    g.add_argument("prompt", help="text to continue")
    EngineArgs.add_cli_args(g, exclude=("seed",))
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, dest="sampling_seed", metavar="SEED",
                   help="seed of the request's sampling")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    g.add_argument("--token-healing", action=argparse.BooleanOptionalAction, default=True,
                   help="a prompt ending in whitespace (a newline, indentation) has its last token generated again "
                        "among the tokens that start with its text, so a small model does not end the text at once "
                        "(default: on; --no-token-healing sends the prompt as it is, as LLM.generate does)")
    g.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    g.set_defaults(func="generate")
    _add_chat_parser(sub)
    b = sub.add_parser("bench", help="serve synthetic requests and print latency/throughput",
                       description="Run N synthetic greedy requests through the scheduler and print a table.")
    EngineArgs.add_cli_args(b, exclude=("seed",))
    b.add_argument("--num-requests", type=int, default=32)
    b.add_argument("--prompt-len", type=int, default=64)
    b.add_argument("--output-len", type=int, default=64)
    b.add_argument("--seed", type=int, default=0, dest="prompt_seed", metavar="SEED",
                   help="seed of the synthetic prompts")
    b.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    b.set_defaults(func="bench")
    _add_serve_parser(sub)
    _add_perplexity_parser(sub)
    _add_router_parser(sub)
    return parser


def _version() -> str:
    # The installed distribution's version, read without importing torch (or the package).
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("qwen_ops")
    except PackageNotFoundError:
        return "unknown (not installed)"


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
        if args.func == "router":                  # a light process: the router's modules only, no torch
            return _router_module().run_router(args)
        # Only now torch and the package load: --help and argument errors never wait for them.
        from qwen_ops.serving import commands

        return getattr(commands, "_" + args.func)(args)
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
