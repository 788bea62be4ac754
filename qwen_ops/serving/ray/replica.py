"""What runs inside one Ray Serve replica of ``build_openai_app`` (serve.py): an ``AsyncLLM`` of its
own (one engine core, one KV cache) under this project's OpenAI app (``openai/server.py``'s
``build_app``), handed to Serve as an ASGI app.

Serve builds the app on the replica, after placing it (``serve.ingress`` with a builder function),
so the driver never loads the model. Two things are added around ``build_app``'s app, and nothing
changes inside it: every HTTP response names the replica that answered it and its node
(``x-qwen-ops-replica``: the replica's Ray actor id; ``x-qwen-ops-node``: the Ray node id it runs on),
so a client or a test can tell the replicas apart and see where Ray placed each; and the engine stops
when Serve stops the replica (the app's ASGI lifespan shutdown) instead of waiting for its process to
exit.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional, Sequence

REPLICA_HEADER = "x-qwen-ops-replica"
NODE_HEADER = "x-qwen-ops-node"


class QwenOpenAIServer:
    """The deployment class of ``build_openai_app``: Serve wraps it with the replica's ASGI app
    (``serve.ingress``), built by ``replica_app_builder``'s function once the replica runs.

    ``check_health`` is Serve's periodic probe: an engine whose loop (or core process) stopped
    fails it, so Serve replaces the replica instead of routing requests to a dead engine (one that
    Serve itself is stopping passes)."""

    def check_health(self) -> None:
        app = getattr(self, "app", None)        # the ASGI app Serve's ingress wrapper holds
        engine = getattr(app, "engine", None)
        if engine is not None and not app.stopping and not engine.is_running:
            raise RuntimeError(f"the replica's qwen_ops engine stopped: {engine.dead_reason!r}")


class ReplicaApp:
    """ASGI: ``app`` (the OpenAI app over ``engine``) with ``x-qwen-ops-replica: replica_id`` and
    ``x-qwen-ops-node: node_id`` on every HTTP response, and ``engine.shutdown()`` when the lifespan
    shuts down."""

    def __init__(self, app, engine, replica_id: str, node_id: str):
        self.app = app
        self.engine = engine
        self.replica_id = replica_id
        self.node_id = node_id
        self.stopping = False          # set once Serve shuts the app down: the engine's stop is expected
        self._headers = [(REPLICA_HEADER.encode(), replica_id.encode()), (NODE_HEADER.encode(), node_id.encode())]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            async def send_tagged(message):
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", ()), *self._headers]}
                await send(message)

            await self.app(scope, receive, send_tagged)
        elif scope["type"] == "lifespan":
            async def send_after_shutdown(message):
                # the app's own shutdown (its stats task) is done; the engine goes before Serve hears so
                if message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                    self.stopping = True
                    await asyncio.to_thread(self.engine.shutdown)
                await send(message)

            await self.app(scope, receive, send_after_shutdown)
        else:
            await self.app(scope, receive, send)


def replica_app_builder(engine_args, served_model_name: Sequence[str], *, engine_process: bool,
                        num_threads: Optional[int], app_kwargs: dict[str, Any]) -> Callable[[], ReplicaApp]:
    """The function Serve calls on each replica to build its ASGI app (a plain function, as
    ``serve.ingress`` needs to tell a builder from an app). ``engine_args`` and the rest travel to
    the replica inside it; the driver has checked them."""

    def build_replica_app() -> ReplicaApp:
        import ray

        from qwen_ops.serving.async_llm import AsyncLLM
        from qwen_ops.serving.openai.server import build_app

        engine = AsyncLLM.from_engine_args(engine_args, engine_process=engine_process,
                                           num_threads=num_threads if engine_process else None)
        try:
            app = build_app(engine, served_model_name=list(served_model_name), **app_kwargs)
        except BaseException:
            engine.shutdown()
            raise
        context = ray.get_runtime_context()
        return ReplicaApp(app, engine, context.get_actor_id(), context.get_node_id())

    return build_replica_app
