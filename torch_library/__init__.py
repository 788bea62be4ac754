"""The op schemas of ``torch.ops.qwen``, read from ``qwen.schema`` beside this file.

Installed as ``qwen_ops.torch_library``. ``SCHEMAS`` maps op name -> schema string
without the name, ready for ``torch.library.define("qwen::" + name, schema)``.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

NAMESPACE = "qwen"
SCHEMA_FILE = Path(__file__).with_name("qwen.schema")


def load_schemas(path: Path = SCHEMA_FILE) -> dict[str, str]:
    """Parse ``name(args) -> ret`` lines; ``#`` starts a comment."""
    schemas: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, paren, rest = line.partition("(")
        if not paren or not name.isidentifier():
            raise ValueError(f"{path}: bad schema line {raw!r}; expected 'name(args) -> ret'")
        if name in schemas:
            raise ValueError(f"{path}: op {name!r} is defined twice")
        schemas[name] = "(" + rest
    return schemas


SCHEMAS = MappingProxyType(load_schemas())
