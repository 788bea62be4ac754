"""QwenTokenizer: a checkpoint's ``tokenizer.json`` through the ``tokenizers`` library.

The tokenizer is optional: a checkpoint without ``tokenizer.json`` still runs on token ids,
:func:`load_tokenizer` then returns None and only code that needs text raises (see
``Checkpoint.require_tokenizer``). Defaults mirror ``transformers``' fast tokenizers:
``encode`` adds the tokenizer's special tokens (Qwen's add none), ``decode`` keeps them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

TOKENIZER_FILE = "tokenizer.json"


class QwenTokenizer:
    """Thin wrapper around ``tokenizers.Tokenizer``: text <-> list of token ids."""

    def __init__(self, tokenizer, path: Path) -> None:
        self._tokenizer = tokenizer  # tokenizers.Tokenizer
        self.path = path

    @classmethod
    def from_file(cls, path: str | Path) -> "QwenTokenizer":
        from tokenizers import Tokenizer

        path = Path(path)
        try:
            return cls(Tokenizer.from_file(str(path)), path)
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ValueError(f"{path}: cannot read tokenizer ({e})") from e

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text has type {type(text).__name__}, expected str")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = False):
        """A ``tokenizers.decoders.DecodeStream``: ``step(self.backend, id)`` returns the text that
        id completes (or None while a multi-byte character is still partial)."""
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=skip_special_tokens)

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tokenizer

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tokenizer.token_to_id(token)

    def __repr__(self) -> str:
        return f"QwenTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def load_tokenizer(path: str | Path) -> Optional[QwenTokenizer]:
    """The tokenizer of the checkpoint directory ``path``, or None when it has no tokenizer.json; of a
    GGUF file, built from its ``tokenizer.ggml.*`` metadata (``models/gguf.py``)."""
    from qwen_ops.models.gguf import build_tokenizer, gguf_of

    gguf = gguf_of(path)
    if gguf is not None:
        backend = build_tokenizer(gguf)
        return None if backend is None else QwenTokenizer(backend, gguf.path)
    file = Path(path) / TOKENIZER_FILE
    return QwenTokenizer.from_file(file) if file.is_file() else None
