"""Token healing of a prompt that ends in whitespace, for ``qwen-ops generate`` (text continuation).

A byte-level BPE merges a newline with the indentation after it (``"\\n    "`` is one token), so in
training a lone ``"\\n"`` token is followed by a line at column 0 or by the end of the text. A prompt
ending in ``"\\n"`` (``"def f():\\n"``) ends on a token the model only saw there, and it often answers
with the end-of-sequence token first: an empty completion, which transformers' ``generate`` gives too
(so does vLLM; ``LLM.generate`` keeps that behaviour). Healing (guidance's token healing; transformers'
``token_healing`` is a variant) drops that last token and lets the model choose the first token among those whose text
starts with it (``"\\n"``, ``"\\n    "``, ...), so the continuation is the one the text would have had.
Only whitespace tails are healed: a word at the end (``"hi"``) may be meant whole.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence


class Healing(NamedTuple):
    prompt_ids: list[int]                 # the prompt without its last token
    tail: str                             # that token's text, which the first new token starts with
    first_token_ids: tuple[int, ...]      # the tokens whose text starts with it (the dropped one included)


def heal(tokenizer, prompt_ids: Sequence[int]) -> Optional[Healing]:
    """The healed prompt when its last token is whitespace that longer tokens extend, else None (also for
    a one-token prompt, which would leave nothing). ``tokenizer`` is a ``QwenTokenizer``."""
    if len(prompt_ids) < 2:
        return None
    tail = tokenizer.decode([prompt_ids[-1]])
    if not tail or not tail.isspace():
        return None
    texts = tokenizer.backend.decode_batch([[i] for i in range(tokenizer.vocab_size)], skip_special_tokens=True)
    first = tuple(i for i, text in enumerate(texts) if text.startswith(tail))
    if len(first) < 2:
        return None
    return Healing(list(prompt_ids[:-1]), tail, first)
