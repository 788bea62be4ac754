"""QwenTokenizer: a checkpoint's ``tokenizer.json`` through the ``tokenizers`` library, with the
interface vLLM users call on transformers' fast tokenizer (``LLM.get_tokenizer()``).

The tokenizer is optional: a checkpoint without ``tokenizer.json`` still runs on token ids,
:func:`load_tokenizer` then returns None and only code that needs text raises (see
``Checkpoint.require_tokenizer``). Defaults mirror ``transformers``' fast tokenizers:
``encode`` adds the tokenizer's special tokens (Qwen's add none), ``decode`` keeps them; the
special tokens, ``model_max_length``, ``padding_side`` and the chat template come from
``tokenizer_config.json`` (a GGUF file: its ``tokenizer.ggml.*`` ids and ``tokenizer.chat_template``),
as transformers reads them. transformers itself is not needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from qwen_ops.models.chat_template import (CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE,  # noqa: F401
                                           _gguf_config, read_tokenizer_config)

TOKENIZER_FILE = "tokenizer.json"
# transformers' named special tokens, in the order ``all_special_tokens`` lists them.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
VERY_LARGE_INTEGER = int(1e30)     # transformers' model_max_length when the config gives none
PADDING = (False, True, "do_not_pad", "longest", "max_length")
TRUNCATION = (None, False, True, "do_not_truncate", "longest_first", "only_first")


class BatchEncoding(dict):
    """What ``QwenTokenizer(...)`` returns (transformers' ``BatchEncoding``): a dict of ``input_ids``
    and ``attention_mask`` whose keys read as attributes too (``enc.input_ids``)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"BatchEncoding has no {name!r}; keys: {sorted(self)}") from None


class QwenTokenizer:
    """``tokenizers.Tokenizer`` with transformers' ``PreTrainedTokenizerFast`` interface.

    ``config``: the checkpoint's ``tokenizer_config.json`` (special tokens, ``model_max_length``,
    ``padding_side``, ``chat_template``); ``name_or_path``: what it was loaded from."""

    is_fast = True

    def __init__(self, tokenizer, path: Path, *, config: Optional[dict] = None,
                 name_or_path: Optional[str] = None, chat_template_origin: Optional[str] = None) -> None:
        from qwen_ops.models.chat_template import token_text

        self._tokenizer = tokenizer  # tokenizers.Tokenizer
        self.path = path
        config = dict(config or {})
        self.name_or_path = str(name_or_path if name_or_path is not None else Path(path).parent)
        self._special = {name: token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        extra = config.get("additional_special_tokens", config.get("extra_special_tokens")) or []
        if isinstance(extra, dict):                  # transformers 5's named extra tokens
            extra = list(extra.values())
        self._extra_special = [t for t in (token_text(e) for e in extra) if t is not None]
        self.model_max_length = int(config.get("model_max_length") or VERY_LARGE_INTEGER)
        self.padding_side = config.get("padding_side", "right")
        self.truncation_side = config.get("truncation_side", "right")
        self.chat_template = config.get("chat_template")     # a str, named templates, or None
        self._chat_template_origin = chat_template_origin or self.name_or_path
        self._compiled: dict[str, Any] = {}                  # template source -> ChatTemplate, this tokenizer's

    @classmethod
    def from_file(cls, path: str | Path, *, config: Optional[dict] = None,
                  name_or_path: Optional[str] = None) -> "QwenTokenizer":
        """``path`` (a ``tokenizer.json``), with ``config`` (None: the ``tokenizer_config.json`` beside it)."""
        from tokenizers import Tokenizer

        path = Path(path)
        try:
            backend = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ValueError(f"{path}: cannot read tokenizer ({e})") from e
        origin = None
        if config is None:
            config, origin = read_tokenizer_config(path.parent)
        return cls(backend, path, config=config, name_or_path=name_or_path, chat_template_origin=origin)

    # ------------------------------------------------------------------ the vocabulary
    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary, without added tokens (transformers'; ``len()`` counts them)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tokenizer.token_to_id(token)

    def convert_tokens_to_ids(self, tokens: Union[str, Sequence[str]]) -> Union[int, None, list]:
        """A token's id (the unknown token's when it has none, None without one); a list for a list."""
        if isinstance(tokens, str):
            tid = self._tokenizer.token_to_id(tokens)
            return self.unk_token_id if tid is None else tid
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False) -> Union[str, None, list]:
        if _is_int(ids):
            return self._tokenizer.id_to_token(int(ids))
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(i) for i in _ids(ids, "ids") if i not in skip]

    # ------------------------------------------------------------------ special tokens
    def __getattr__(self, name: str):
        # bos_token, eos_token, ... and their *_id: from the config, as transformers reads them.
        special = self.__dict__.get("_special")
        if special is not None and name in SPECIAL_TOKEN_NAMES:
            return special[name]
        if special is not None and name.endswith("_id") and name[:-3] in SPECIAL_TOKEN_NAMES:
            token = special[name[:-3]]
            return None if token is None else self.convert_tokens_to_ids(token)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: tok for name, tok in self._special.items() if tok is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens, then the extra ones (``additional_special_tokens``), each once."""
        return list(dict.fromkeys([t for t in self._special.values() if t is not None] + self._extra_special))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True, truncation: Union[bool, str, None] = None,
               max_length: Optional[int] = None) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text has type {type(text).__name__}, expected str")
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return self._truncate(ids, truncation, max_length)

    def __call__(self, text: Union[str, Sequence[str]], add_special_tokens: bool = True,
                 padding: Union[bool, str] = False, truncation: Union[bool, str, None] = None,
                 max_length: Optional[int] = None, return_tensors: Optional[str] = None,
                 return_attention_mask: Optional[bool] = None) -> BatchEncoding:
        """transformers' ``tokenizer(text)``: ``input_ids`` and ``attention_mask`` of one text (lists of
        ints) or of a list of texts (one list each); ``padding`` ``True``/``"longest"`` or
        ``"max_length"`` on ``padding_side`` with ``pad_token_id``; ``truncation`` to ``max_length``
        (default ``model_max_length``); ``return_tensors`` ``"pt"`` or ``"np"``."""
        single = isinstance(text, str)
        texts = [text] if single else text
        if isinstance(texts, (bytes, dict)) or not isinstance(texts, Sequence) or \
                not all(isinstance(t, str) for t in texts):
            raise TypeError(f"text = {text!r}, expected a str or a list of str")
        if padding not in PADDING:
            raise ValueError(f"padding = {padding!r}, expected one of {PADDING}")
        if return_tensors not in (None, "pt", "np"):
            raise ValueError(f"return_tensors = {return_tensors!r}, expected None, 'pt' or 'np'")
        ids = [self._truncate(e.ids, truncation, max_length)
               for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)]
        masks = [[1] * len(row) for row in ids]
        if padding in (True, "longest", "max_length"):
            ids, masks = self._pad(ids, masks, padding, max_length)
        out = BatchEncoding(input_ids=ids[0] if single and return_tensors is None else ids)
        if return_attention_mask is not False:
            out["attention_mask"] = masks[0] if single and return_tensors is None else masks
        if return_tensors is not None:
            if len({len(row) for row in ids}) > 1:
                raise ValueError(f"return_tensors = {return_tensors!r} needs rows of one length, got lengths "
                                 f"{sorted({len(r) for r in ids})}; expected padding=True")
            for key in list(out):
                out[key] = _tensor(out[key], return_tensors)
        return out

    def decode(self, token_ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: Optional[bool] = None) -> str:
        """The text of ``token_ids`` (an int, a list or a tensor). ``clean_up_tokenization_spaces`` is
        accepted and does nothing: transformers skips it for byte-level BPE, which Qwen's tokenizers are."""
        ids = [int(token_ids)] if _is_int(token_ids) else _ids(token_ids, "token_ids")
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: Optional[bool] = None) -> list[str]:
        if hasattr(sequences, "tolist"):
            sequences = sequences.tolist()
        return self._tokenizer.decode_batch([_ids(s, f"sequences[{i}]") for i, s in enumerate(sequences)],
                                            skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = False):
        """A ``tokenizers.decoders.DecodeStream``: ``step(self.backend, id)`` returns the text that
        id completes (or None while a multi-byte character is still partial)."""
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=skip_special_tokens)

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tokenizer

    @property
    def backend_tokenizer(self):
        """transformers' name for ``backend``."""
        return self._tokenizer

    # ------------------------------------------------------------------ chat
    def get_chat_template(self, chat_template: Optional[str] = None, tools: Optional[list] = None):
        """The ``ChatTemplate`` that renders: ``chat_template`` (a template, or the name of one of the
        checkpoint's named templates), else the checkpoint's, else ChatML (as ``LLM.chat``)."""
        from qwen_ops.models.chat_template import CHATML_TEMPLATE, ChatTemplate, pick_template

        origin = "chat_template argument"
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template = {chat_template!r}, expected a template str (or a template's name) or None")
        named = self.chat_template if isinstance(self.chat_template, (dict, list)) else None
        names = pick_names(named)
        if chat_template is not None and chat_template in names:
            source, origin = names[chat_template], f"{self._chat_template_origin} ({chat_template!r})"
        elif chat_template is not None:
            source = chat_template
        else:
            source, origin = pick_template(self.chat_template, tools), self._chat_template_origin
            if source is None:
                source, origin = CHATML_TEMPLATE, "built-in ChatML"
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = self._compiled[source] = ChatTemplate(source, bos_token=self.bos_token, eos_token=self.eos_token,
                                                             origin=origin)
        return compiled

    def apply_chat_template(self, conversation, tools: Optional[list] = None, documents: Optional[list] = None,
                            chat_template: Optional[str] = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            padding: Union[bool, str] = False, truncation: bool = False,
                            max_length: Optional[int] = None, return_tensors: Optional[str] = None,
                            return_dict: bool = False, **template_kwargs):
        """transformers' ``apply_chat_template`` (4.x defaults: ``return_dict=False``): one conversation
        (a list of ``{"role", "content"}`` dicts) or a list of them, rendered by ``get_chat_template``
        with ``tools``, ``documents`` and ``template_kwargs`` (e.g. ``enable_thinking=False``) as
        template variables. ``tokenize=False``: the text; else its ids without added special tokens
        (the template writes them), or with ``return_dict`` the ``BatchEncoding``."""
        from qwen_ops.models.chat_template import ChatTemplateError

        if isinstance(conversation, (str, bytes, dict)) or not isinstance(conversation, Sequence) or not conversation:
            raise ValueError(f"conversation = {conversation!r}, expected a non-empty list of {{'role', 'content'}} "
                             "dicts, or a list of such lists")
        batched = not isinstance(conversation[0], dict)
        conversations = list(conversation) if batched else [conversation]
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"tools = {tools!r}, expected a list of JSON-schema dicts (OpenAI's function tools) or None")
        if documents is not None:
            template_kwargs["documents"] = documents
        template = self.get_chat_template(chat_template, tools)
        texts = []
        for i, conv in enumerate(conversations):
            if isinstance(conv, (str, dict)) or not isinstance(conv, Sequence) or \
                    not all(isinstance(m, dict) for m in conv):
                raise ValueError(f"conversation[{i}] = {conv!r}, expected a list of {{'role', 'content'}} dicts")
            try:
                texts.append(template.render(conv, add_generation_prompt=add_generation_prompt, tools=tools,
                                             continue_final_message=continue_final_message, **template_kwargs))
            except ChatTemplateError as e:
                raise ValueError(f"conversation[{i}]: {e}" if batched else str(e)) from None
        if not tokenize:
            return texts if batched else texts[0]
        enc = self(texts if batched else texts[0], add_special_tokens=False, padding=padding,
                   truncation=truncation, max_length=max_length, return_tensors=return_tensors)
        return enc if return_dict else enc["input_ids"]

    # ------------------------------------------------------------------ helpers
    def _truncate(self, ids: list[int], truncation, max_length: Optional[int]) -> list[int]:
        if truncation not in TRUNCATION:
            raise ValueError(f"truncation = {truncation!r}, expected one of {TRUNCATION}")
        if truncation in (None, False, "do_not_truncate"):
            return ids
        limit = self.model_max_length if max_length is None else max_length
        if len(ids) <= limit:
            return ids
        return ids[len(ids) - limit:] if self.truncation_side == "left" else ids[:limit]

    def _pad(self, ids: list[list[int]], masks: list[list[int]], padding, max_length: Optional[int]):
        pad_id = self.pad_token_id
        if pad_id is None:
            raise ValueError(f"padding = {padding!r}, but the tokenizer has no pad_token (tokenizer_config.json); "
                             "expected padding=False or a checkpoint with a pad_token")
        width = max(map(len, ids), default=0)
        if padding == "max_length":
            width = self.model_max_length if max_length is None else max_length
        left = self.padding_side == "left"
        out_ids, out_masks = [], []
        for row, mask in zip(ids, masks):
            fill = max(0, width - len(row))
            out_ids.append([pad_id] * fill + row if left else row + [pad_id] * fill)
            out_masks.append([0] * fill + mask if left else mask + [0] * fill)
        return out_ids, out_masks

    def __repr__(self) -> str:
        return f"QwenTokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, len={len(self)})"


def pick_names(named) -> dict[str, str]:
    """transformers' named templates (a dict, or a list of ``{"name", "template"}``) as a dict."""
    if isinstance(named, list):
        return {t.get("name"): t.get("template") for t in named if isinstance(t, dict)}
    return dict(named) if isinstance(named, dict) else {}


def _is_int(x) -> bool:
    if hasattr(x, "dim") and hasattr(x, "item"):          # a 0-d tensor
        return x.dim() == 0
    return isinstance(x, int) and not isinstance(x, bool)


def _ids(x, name: str) -> list[int]:
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise ValueError(f"{name} = {x!r}, expected a list of token ids")
    out = []
    for j, t in enumerate(x):
        if not _is_int(t):
            raise ValueError(f"{name}[{j}] = {t!r}, expected a token id (an int)")
        out.append(int(t))
    return out


def _tensor(rows, kind: str):
    if kind == "pt":
        import torch

        return torch.tensor(rows, dtype=torch.long)
    import numpy as np

    return np.array(rows, dtype=np.int64)


def load_tokenizer(path: str | Path, name_or_path: Optional[str] = None) -> Optional[QwenTokenizer]:
    """The tokenizer of the checkpoint directory ``path``, or None when it has no tokenizer.json; of a
    GGUF file, built from its ``tokenizer.ggml.*`` metadata (``models/gguf.py``). ``name_or_path``:
    what the tokenizer reports it was loaded from (default ``path``)."""
    from qwen_ops.models.gguf import build_tokenizer, gguf_of

    gguf = gguf_of(path)
    if gguf is not None:
        backend = build_tokenizer(gguf)
        if backend is None:
            return None
        return QwenTokenizer(backend, gguf.path, config=_gguf_config(gguf),
                             chat_template_origin=f"{gguf.path} tokenizer.chat_template",
                             name_or_path=str(name_or_path if name_or_path is not None else Path(gguf.path).parent))
    file = Path(path) / TOKENIZER_FILE
    if not file.is_file():
        return None
    return QwenTokenizer.from_file(file, name_or_path=str(name_or_path if name_or_path is not None else path))
