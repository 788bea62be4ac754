"""The engine core's child process (``python -m qwen_ops.serving.core_process FD``, started by
``engine_core.ProcessCore``): it builds an ``LLM`` from the arguments the parent sends, then serves
the pipe with that LLM's ``EngineCore`` until it closes or says shutdown. ``add_lora`` parses on
the core's LoRA thread and replies from there (sends share one lock); ``remove_lora`` runs between
steps. Its own module, so that
``engine_core`` (which ``llm`` imports) never imports ``llm``."""

from __future__ import annotations

import os
import signal
import sys
import threading
from multiprocessing.connection import Connection

from qwen_ops.serving.outputs import RequestDelta


def pooling_info(llm) -> dict:
    """What a client of ``llm``'s core needs to make pooling requests (``AsyncLLM``): the runner,
    the checkpoint's pooling, the embedding size and the classifier head as nested lists of fp32
    values ``[labels][hidden]`` (None: an embedding model). Plain data, not a tensor: it crosses to
    the parent through the socketpair, and a pickled tensor goes as a shared-memory handle that the
    parent's connection cannot fetch (multiprocessing's resource sharer refuses it)."""
    head = llm.classifier
    return {"runner": llm.runner, "pooler": llm.pooler, "hidden_size": int(llm.engine.config.hidden_size),
            "classifier": None if head is None else head.float().tolist()}


def core_main(conn) -> None:
    """The child: read its arguments, load the model, then serve the pipe until it closes or
    says shutdown."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    from qwen_ops.serving.llm import LLM

    try:
        _, model, llm_kwargs, num_threads, cpus = conn.recv()
        if cpus is not None and hasattr(os, "sched_setaffinity"):     # a data-parallel replica's own cores
            os.sched_setaffinity(0, cpus)
        torch.set_num_threads(num_threads)
        llm = LLM(model, **llm_kwargs)
    except BaseException as e:              # noqa: BLE001 - reported to the parent, which raises it
        try:
            conn.send(("failed", e))
        except Exception:                   # an exception that does not pickle
            conn.send(("failed", RuntimeError(f"{type(e).__name__}: {e}")))
        return
    core = llm.core
    send_lock = threading.Lock()

    def send(msg) -> None:
        with send_lock:
            conn.send(msg)

    def reply(call_id: int, fn=None, arg=None, done=None) -> None:
        """``("reply", call_id, error kind, value)`` of ``fn(arg)`` or of the future ``done``:
        kind None (value: the result), "bad" (a ValueError: the caller's), "error" (anything else)."""
        try:
            msg = ("reply", call_id, None, done.result() if done is not None else fn(arg))
        except ValueError as e:
            msg = ("reply", call_id, "bad", str(e))
        except Exception as e:              # noqa: BLE001 - reported to the parent
            msg = ("reply", call_id, "error", f"{type(e).__name__}: {e}")
        try:
            send(msg)
        except (OSError, ValueError):       # the parent is gone
            pass

    try:
        send(("ready", {"vocab_size": int(llm.engine.vocab_size),
                             "max_model_len": int(llm.scheduler.config.max_model_len),
                             "model_path": str(llm.model_path), "tokenizer_path": str(llm.tokenizer_path),
                             "weights": getattr(llm.engine.model, "gguf_summary", None),
                             "stats": core.stats(),
                             "eos_token_ids": list(llm.engine.eos_token_ids),
                             "sampling_overrides": llm.sampling_overrides,
                             "max_loras": None if llm.engine.lora is None else llm.engine.lora.config.max_loras,
                             **pooling_info(llm)}))
        while True:
            if not core.runnable():
                conn.poll(core.idle_timeout())              # idle: sleep until a message (or a grammar)
            out: list[RequestDelta] = []
            handled = False
            while conn.poll():
                msg = conn.recv()
                handled = True
                if msg[0] == "add":
                    err = core.add(*msg[1:])
                    if err is not None:
                        out.append(err)
                elif msg[0] == "pool":
                    err = core.add_pooling(*msg[1:])
                    if err is not None:
                        out.append(err)
                elif msg[0] == "abort":
                    core.abort(msg[1])
                elif msg[0] == "add_lora":           # parsed off this loop; the reply comes from that thread
                    call_id = msg[1]
                    core.add_lora_async(msg[2]).add_done_callback(lambda f, c=call_id: reply(c, done=f))
                elif msg[0] == "remove_lora":
                    reply(msg[1], core.remove_lora, msg[2])
                elif msg[0] == "shutdown":
                    return
            if core.runnable():
                out.extend(core.step_deltas())
            elif not handled:
                continue
            send(("out", out, core.stats(), core.num_added))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return                                              # the parent is gone
    finally:
        core.close()
        llm.shutdown()
        conn.close()


if __name__ == "__main__":           # the child: python -m qwen_ops.serving.core_process FD
    core_main(Connection(int(sys.argv[1])))
