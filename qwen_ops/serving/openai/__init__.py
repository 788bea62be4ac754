"""An OpenAI-compatible HTTP server over ``AsyncLLM`` (``qwen-ops serve``), shaped like vLLM's.

``protocol`` parses and validates requests and builds response bodies, ``chat`` renders chat
templates, ``metrics`` holds one app's Prometheus registry, ``server`` is the FastAPI app
(``build_app``), ``run_server`` for the command, and ``ServerThread`` for tests and benchmarks.
Needs the ``serve`` extra (fastapi, uvicorn, prometheus_client, jinja2).
"""

__all__ = ["build_app", "run_server", "ServerThread", "default_served_model_name"]


def __getattr__(name: str):
    # The server's names on first use: ``chat`` (the chat templates, which offline ``LLM.chat`` and
    # ``qwen-ops chat`` use) is importable after a plain install, without the serve extra's fastapi.
    if name in __all__:
        from qwen_ops.serving.openai import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
