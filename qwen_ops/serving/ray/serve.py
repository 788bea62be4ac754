"""The OpenAI-compatible server as a Ray Serve application: replicas placed by Ray, each with an
engine of its own (vLLM's ``ray.serve.llm.build_openai_app`` in shape).

    import ray
    from ray import serve
    from qwen_ops.serving.ray import build_openai_app

    ray.init()
    app = build_openai_app({"model": None, "max_model_len": 512}, num_replicas=2)
    serve.run(app, route_prefix="/")       # http://127.0.0.1:8000/v1/completions, /v1/chat/completions, ...

    python -m qwen_ops.serving.ray.serve [MODEL] --num-replicas 2     # the same from the command line

A replica is one Ray actor (``ray_actor_options``, by default one CPU) running ``build_app``'s
FastAPI app over an ``AsyncLLM`` (replica.py): the engine core is a process of its own beside the
actor (``engine_process=True``, as ``qwen-ops serve``) or a thread in it. Serve's proxy routes each
HTTP request to a replica; a replica's KV cache and prefix cache are its own, so the routing is
Serve's (its power-of-two-choices on queue length), not the prefix-aware balancer of
``--data-parallel-size`` (balancer.py). Replicas are counted by ``num_replicas`` or scaled by Serve
between the bounds of an ``autoscaling_config`` (Serve's dict: ``min_replicas``, ``max_replicas``,
``target_ongoing_requests``, ...), never both.

Every argument is checked here, on the driver, before anything is deployed; the model loads only on
the replicas.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from qwen_ops.serving.engine_args import EngineArgs
from qwen_ops.serving.ray.dependency import import_ray, import_serve
from qwen_ops.serving.ray.replica import QwenOpenAIServer, replica_app_builder

DEFAULT_RAY_ACTOR_OPTIONS = {"num_cpus": 1}
DEFAULT_DEPLOYMENT_NAME = "QwenOpsOpenAI"
# build_app's keywords that a replica cannot take from here: the name is an argument of its own, and
# static LoRA adapters are parsed with asyncio.run, which cannot run inside the replica's event loop
_APP_KWARGS_REFUSED = {"served_model_name": "pass served_model_name= itself",
                       "lora_modules": "static LoRA adapters are not served on Ray yet; load them at run time "
                                       "(allow_runtime_lora_updating=True, /v1/load_lora_adapter)"}


def build_openai_app(engine_args: Union[EngineArgs, Mapping, None] = None, **options: Any):
    """A Ray Serve ``Application`` serving the OpenAI routes: ``openai_deployment(engine_args,
    **options).bind()``, ready for ``serve.run(app)`` (or a Serve config's ``import_path``)."""
    return openai_deployment(engine_args, **options).bind()


def openai_deployment(engine_args: Union[EngineArgs, Mapping, None] = None, *,
                      served_model_name: Union[str, Sequence[str], None] = None,
                      num_replicas: Optional[int] = None, autoscaling_config: Optional[Mapping] = None,
                      ray_actor_options: Optional[Mapping] = None, max_replicas_per_node: Optional[int] = None,
                      max_ongoing_requests: Optional[int] = None, engine_process: bool = True,
                      num_threads: Optional[int] = None, app_kwargs: Optional[Mapping] = None,
                      name: str = DEFAULT_DEPLOYMENT_NAME):
    """The Serve ``Deployment`` behind ``build_openai_app`` (unbound, so its options can be read).

    ``engine_args``: an ``EngineArgs`` or a dict of its keywords (``{"model": path, "max_model_len":
    512}``); None is the embedded model with the defaults. ``served_model_name``: the name(s)
    requests use (None: ``engine_args.served_model_name``, else the checkpoint's name).
    ``num_replicas`` (default 1) or ``autoscaling_config`` (Serve's ``AutoscalingConfig`` fields).
    ``ray_actor_options``: each replica's Ray resources (default ``{"num_cpus": 1}``).
    ``max_replicas_per_node``: Serve's cap (1 spreads the replicas over distinct nodes).
    ``max_ongoing_requests``: Serve's cap on requests a replica holds at once (None: Serve's default).
    ``engine_process``: the engine core in a process of its own (the default) or on a thread of the
    replica; ``num_threads``: that process's torch threads (None: the replica's, which Ray sets to its
    ``num_cpus``). ``app_kwargs``: more keywords of ``build_app`` (``api_key``, ``reasoning_parser``,
    ``max_waiting``, ...). ``name``: the deployment's name."""
    serve = import_serve()
    engine_args = _engine_args(engine_args)
    names = _served_names(served_model_name, engine_args)
    deployment_options = _deployment_options(num_replicas, autoscaling_config, ray_actor_options,
                                             max_replicas_per_node, max_ongoing_requests)
    if not isinstance(engine_process, bool):
        raise ValueError(f"engine_process = {engine_process!r}, expected True or False")
    _check_positive_int("num_threads", num_threads)
    if num_threads is not None and not engine_process:
        raise ValueError(f"num_threads = {num_threads} with engine_process = False; it sets the engine process's "
                         "threads, expected engine_process = True or num_threads = None")
    app_kwargs = _app_kwargs(app_kwargs)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name = {name!r}, expected a non-empty str (the deployment's name)")
    builder = replica_app_builder(engine_args, names, engine_process=engine_process, num_threads=num_threads,
                                  app_kwargs=app_kwargs)
    return serve.deployment(serve.ingress(builder)(QwenOpenAIServer), name=name, **deployment_options)


def _engine_args(engine_args) -> EngineArgs:
    """``engine_args`` as a checked ``EngineArgs`` whose local model path is absolute (a replica's
    working directory is not the driver's)."""
    if engine_args is None:
        engine_args = EngineArgs()
    elif isinstance(engine_args, Mapping):
        try:
            engine_args = EngineArgs(**dict(engine_args))
        except TypeError as e:
            raise ValueError(f"engine_args = {dict(engine_args)!r}: {e}; expected EngineArgs' keywords") from None
    elif not isinstance(engine_args, EngineArgs):
        raise ValueError(f"engine_args = {engine_args!r}, expected an EngineArgs, a dict of its keywords or None")
    if engine_args.data_parallel_size != 1:
        raise ValueError(f"engine_args.data_parallel_size = {engine_args.data_parallel_size}, but a replica is one "
                         "engine; expected 1 (scale with num_replicas or autoscaling_config instead)")
    engine_args.validate()
    model = engine_args.model
    if model is not None and Path(model).exists():
        engine_args = EngineArgs(str(Path(model).resolve()), **engine_args.llm_kwargs())
    return engine_args


def _served_names(served_model_name, engine_args: EngineArgs) -> list[str]:
    from qwen_ops.serving.openai.server import default_served_model_name

    if served_model_name is None:
        served_model_name = engine_args.served_model_name or default_served_model_name(engine_args.model)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"served_model_name = {served_model_name!r}, expected a non-empty str or list of them")
    return names


def _deployment_options(num_replicas, autoscaling_config, ray_actor_options, max_replicas_per_node,
                        max_ongoing_requests) -> dict[str, Any]:
    """``serve.deployment``'s keywords, each checked: one of ``num_replicas`` and ``autoscaling_config``."""
    if num_replicas is not None and autoscaling_config is not None:
        raise ValueError(f"num_replicas = {num_replicas!r} and autoscaling_config = {autoscaling_config!r}; "
                         "expected one of them (a fixed count, or the bounds Serve scales between)")
    options: dict[str, Any] = {}
    if autoscaling_config is not None:
        options["autoscaling_config"] = _autoscaling_config(autoscaling_config)
    else:
        _check_positive_int("num_replicas", num_replicas)
        options["num_replicas"] = 1 if num_replicas is None else num_replicas
    if ray_actor_options is None:
        ray_actor_options = DEFAULT_RAY_ACTOR_OPTIONS
    if not isinstance(ray_actor_options, Mapping):
        raise ValueError(f"ray_actor_options = {ray_actor_options!r}, expected a dict such as {{'num_cpus': 1}}")
    options["ray_actor_options"] = dict(ray_actor_options)
    _check_positive_int("max_replicas_per_node", max_replicas_per_node)
    if max_replicas_per_node is not None:
        options["max_replicas_per_node"] = max_replicas_per_node
    _check_positive_int("max_ongoing_requests", max_ongoing_requests)
    if max_ongoing_requests is not None:
        options["max_ongoing_requests"] = max_ongoing_requests
    return options


def _autoscaling_config(config) -> dict[str, Any]:
    """``config`` checked by Serve's own ``AutoscalingConfig`` (its bounds and their order), with an
    unknown key refused (Serve would drop it silently); returned as the dict given."""
    from ray.serve.config import AutoscalingConfig

    if isinstance(config, AutoscalingConfig):
        config = config.dict(exclude_unset=True) if hasattr(config, "dict") else config.model_dump(exclude_unset=True)
    if not isinstance(config, Mapping):
        raise ValueError(f"autoscaling_config = {config!r}, expected a dict such as "
                         "{'min_replicas': 1, 'max_replicas': 2}")
    known = set(getattr(AutoscalingConfig, "model_fields", None) or AutoscalingConfig.__fields__)
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"autoscaling_config = {dict(config)!r} has unknown key(s) {unknown}; expected some of "
                         f"{sorted(known)}")
    try:
        AutoscalingConfig(**config)
    except (TypeError, ValueError) as e:           # pydantic's ValidationError is a ValueError
        raise ValueError(f"autoscaling_config = {dict(config)!r} is not a valid Ray Serve autoscaling config: "
                         f"{e}") from None
    return dict(config)


def _app_kwargs(app_kwargs) -> dict[str, Any]:
    """``build_app``'s further keywords, checked by name here (their values on the replica, by
    ``build_app`` itself, which fails the replica's start with its own ValueError)."""
    from qwen_ops.serving.openai.server import build_app

    if app_kwargs is None:
        return {}
    if not isinstance(app_kwargs, Mapping):
        raise ValueError(f"app_kwargs = {app_kwargs!r}, expected a dict of build_app's keywords or None")
    accepted = {p.name for p in inspect.signature(build_app).parameters.values() if p.kind == p.KEYWORD_ONLY}
    for key in app_kwargs:
        if key in _APP_KWARGS_REFUSED:
            raise ValueError(f"app_kwargs[{key!r}]: {_APP_KWARGS_REFUSED[key]}")
        if key not in accepted:
            raise ValueError(f"app_kwargs[{key!r}] is not a keyword of build_app; expected some of "
                             f"{sorted(accepted - set(_APP_KWARGS_REFUSED))}")
    return dict(app_kwargs)


def _check_positive_int(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} = {value!r}, expected an int >= 1 or None")


# ---------------------------------------------------------------------- command line
def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e}); expected an object") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is a JSON {type(value).__name__}, expected an object")
    return value


def make_parser() -> argparse.ArgumentParser:
    """``python -m qwen_ops.serving.ray.serve``'s flags: Ray's and Serve's, then the engine's (``qwen-ops serve``'s)."""
    parser = argparse.ArgumentParser(prog="python -m qwen_ops.serving.ray.serve",
                                     description="Serve the OpenAI API from qwen_ops replicas placed by Ray Serve.")
    ray_group = parser.add_argument_group("Ray")
    ray_group.add_argument("--address", default=None,
                           help="the Ray cluster to join ('auto', 'ray://host:10001'); default: a local one")
    ray_group.add_argument("--host", default="127.0.0.1", help="Serve's HTTP proxy address (default 127.0.0.1)")
    ray_group.add_argument("--port", type=int, default=8000, help="Serve's HTTP proxy port (default 8000)")
    ray_group.add_argument("--num-replicas", type=int, default=None, help="a fixed replica count (default 1)")
    ray_group.add_argument("--autoscaling-config", type=_json_dict, default=None,
                           help="Serve's autoscaling config as JSON, e.g. '{\"min_replicas\": 1, \"max_replicas\": 2}'")
    ray_group.add_argument("--ray-actor-options", type=_json_dict, default=None,
                           help="each replica's Ray resources as JSON (default '{\"num_cpus\": 1}')")
    ray_group.add_argument("--max-replicas-per-node", type=int, default=None)
    ray_group.add_argument("--no-engine-process", dest="engine_process", action="store_false",
                           help="run each replica's engine on a thread of the replica, not a process of its own")
    ray_group.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    EngineArgs.add_cli_args(parser, positional_model=True)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Deploy ``build_openai_app`` from flags and serve until interrupted."""
    args = make_parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port = {args.port}, expected 0..65535")
    engine_args = EngineArgs.from_cli_args(args)
    app = build_openai_app(engine_args, num_replicas=args.num_replicas, autoscaling_config=args.autoscaling_config,
                           ray_actor_options=args.ray_actor_options, max_replicas_per_node=args.max_replicas_per_node,
                           engine_process=args.engine_process,
                           app_kwargs=None if args.api_key is None else {"api_key": args.api_key})
    ray = import_ray()
    serve = import_serve()
    ray.init(address=args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    print(f"qwen-ops on Ray Serve: http://{args.host}:{args.port}/v1 (Ctrl-C stops it)", file=sys.stderr, flush=True)
    try:
        serve.run(app, route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
