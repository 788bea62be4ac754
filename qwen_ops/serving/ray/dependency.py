"""Ray, imported on first use: ``import qwen_ops`` (and this package) never needs it, and a caller
without it gets one error that says what to install instead of a bare ``ModuleNotFoundError``."""

from __future__ import annotations

INSTALL_HINT = 'pip install "qwen_ops[ray]"  (ray[serve,data])'


def import_ray():
    """The ``ray`` module, or an ImportError naming the extra to install."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"qwen_ops.serving.ray needs Ray, which is not installed: {INSTALL_HINT}") from e
    return ray


def import_serve():
    """``ray.serve`` (Ray's ``serve`` extra), or an ImportError naming the extra to install."""
    import_ray()
    try:
        from ray import serve
    except ImportError as e:
        raise ImportError(f"Ray Serve is not installed (or lacks its dependencies: {e}): {INSTALL_HINT}") from e
    return serve


def import_data():
    """``ray.data`` (Ray's ``data`` extra), or an ImportError naming the extra to install."""
    import_ray()
    try:
        import ray.data
    except ImportError as e:
        raise ImportError(f"Ray Data is not installed (or lacks its dependencies: {e}): {INSTALL_HINT}") from e
    return ray.data
