"""vLLM's ``/v1/chat/completions/batch``: one request, several conversations (``messages`` is a list of
message lists), one choice per conversation, indexed 0..N-1 in request order, and one usage for all.
The rest of the body is the chat request's, shared by every conversation; as vLLM's, no streaming,
tools, beam search or ``n`` > 1.

Each conversation goes through the chat route's own preparation (``_Serving.prepare_chat``: template,
tokens, sampling parameters, structured output) and becomes one engine request; all are submitted
before any is awaited, so they share the engine's steps.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from qwen_ops.serving.openai import protocol as P

ROUTE = "/v1/chat/completions/batch"
MAX_CONVERSATIONS = P.MAX_PROMPTS          # conversations in one request, as prompts in one completions request


class BatchChatRoutes:
    """The batch route over ``serving`` (the server's ``_Serving``)."""

    def __init__(self, serving):
        self.s = serving

    def prepare(self, body: bytes) -> list:
        """One ``_Prepared`` chat request per conversation; a 400 naming the field (a conversation's
        own errors name it: ``messages[2][0].role``)."""
        req = P.parse_request(P.ChatCompletionRequest, body)
        convs = req.messages
        if not isinstance(convs, list) or not convs or not all(isinstance(c, list) for c in convs):
            raise P.bad_request(f"messages = {P._show(convs)}, expected a non-empty array of conversations (each "
                                f"an array of message objects); {ROUTE} answers one choice per conversation",
                                "messages")
        if len(convs) > MAX_CONVERSATIONS:
            raise P.bad_request(f"messages has {len(convs)} conversations, expected at most {MAX_CONVERSATIONS} "
                                "per request", "messages")
        for field, given in (("stream", req.stream), ("use_beam_search", req.use_beam_search),
                             ("tools", req.tools is not None), ("tool_choice", req.tool_choice not in (None, "none"))):
            if given:
                raise P.bad_request(f"{field} is not supported by {ROUTE} (as vLLM's: no streaming, tools or beam "
                                    f"search); leave it out, or use /v1/chat/completions", field)
        if req.n != 1:
            raise P.bad_request(f"n = {req.n}, expected 1: {ROUTE} answers one choice per conversation", "n")
        preps = []
        for i, conv in enumerate(convs):
            try:
                preps.append(self.s.prepare_chat(req.model_copy(update={"messages": conv})))
            except P.APIError as e:
                if e.param is None or not e.param.startswith("messages"):
                    raise
                where = f"messages[{i}]"
                message = (e.message.replace("messages", where, 1) if e.message.startswith("messages")
                           else f"{where}: {e.message}")
                raise P.bad_request(message, where + e.param[len("messages"):]) from None
        return preps

    async def create(self, request: Request, body: bytes) -> Response:
        s = self.s
        deadline = s.deadline()
        s.check_engine()
        preps = await s.prepare(self.prepare, body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        launched = await asyncio.gather(*(s.launch(p, f"{rid}_{i}", "messages", deadline)
                                          for i, p in enumerate(preps)), return_exceptions=True)
        failed = [g for g in launched if isinstance(g, BaseException)]
        if failed:
            for g in launched:
                if not isinstance(g, BaseException):
                    g.close()
            raise failed[0]
        got = await s.final_outputs(request, launched, deadline)
        if got is None:
            return Response(status_code=499)
        outs = [out for (out,) in got]              # one engine request per conversation
        choices: list[dict[str, Any]] = [s.chat_choice(p, out.outputs[0], i)
                                         for i, (p, out) in enumerate(zip(preps, outs))]
        prompt_tokens = sum(len(p.prompts[0]) for p in preps)
        generated = sum(len(out.outputs[0].token_ids) for out in outs)
        model = s.model_of(preps[0])
        return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                             "choices": choices, "usage": P.usage(prompt_tokens, generated)})
