"""An OpenAI-compatible HTTP server over ``AsyncLLM`` (``qwen-ops serve``), shaped like vLLM's.

``protocol`` parses and validates requests and builds response bodies, ``chat`` renders chat
templates, ``metrics`` holds one app's Prometheus registry, ``server`` is the FastAPI app
(``build_app``), ``run_server`` for the command, and ``ServerThread`` for tests and benchmarks.
Needs the ``serve`` extra (fastapi, uvicorn, prometheus_client, jinja2).
"""

from qwen_ops.serving.openai.server import ServerThread, build_app, default_served_model_name, run_server

__all__ = ["build_app", "run_server", "ServerThread", "default_served_model_name"]
