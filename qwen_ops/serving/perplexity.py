"""Perplexity of a text, as llama.cpp's ``llama-perplexity`` computes it, scored through the engine.

The text's tokens are cut into consecutive ``n_ctx``-token chunks (the tail that fills no chunk is
dropped). Each chunk runs as one prompt of its own, from position 0, and only its second half counts:
the tokens at positions ``n_ctx/2 + 1 .. n_ctx - 1``, each predicted from every earlier token of the
chunk (``n_ctx - n_ctx/2 - 1`` tokens a chunk: 255 of 512). That is llama.cpp's loop exactly: its
logits rows ``first = n_ctx/2 .. n_ctx - 2`` score the next token, so the token at ``n_ctx/2`` itself
is not scored. PPL = exp(mean NLL); its error, llama.cpp's, is the standard error of the mean NLL
carried through exp: ``PPL * sqrt((mean(nll^2) - mean(nll)^2) / (count - 1))``. One difference:
llama.cpp refuses a text of fewer than ``2 * n_ctx`` tokens; here one chunk, ``n_ctx`` tokens, is enough.

BOS, as llama.cpp (``tools/perplexity/perplexity.cpp``, ``perplexity()``): when the vocabulary adds
a BOS token (``llama_vocab_get_add_bos``), the whole text is tokenized once with it in front, and then
the first token of every chunk is *replaced* by BOS for the forward pass (not inserted: a chunk stays
``n_ctx`` tokens and the text token at its position 0 is simply not seen). Here "adds a BOS" is read
off the tokenizer itself (:func:`tokenizer_bos_id`: its ``encode`` puts a token in front that the
text does not give). Qwen's tokenizers add none, nor do llama.cpp's Qwen vocabularies (``add_bos``
defaults to false and the ``qwen2`` pre-tokenizer leaves it so, unless a GGUF's
``tokenizer.ggml.add_bos_token`` sets it), so for Qwen both score the plain chunks.

Scores come from the engine's ``prompt_logprobs`` (fp32 log-softmax of each prompt row), many chunks
per ``LLM.generate`` call, every chunk a request that also generates its one token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from qwen_ops.engine.sampling import SamplingParams


@dataclass(frozen=True)
class PerplexityResult:
    """``ppl`` = exp(``nll``); ``ppl_error``: llama.cpp's +/- (nan with fewer than 2 scored tokens).
    ``num_tokens``: tokens scored (``num_chunks * (n_ctx - n_ctx // 2 - 1)``); ``running_ppl[i]``: the
    perplexity over chunks 0..i (llama.cpp's ``[i+1]x.xxxx`` values); ``seconds``: wall time scoring."""
    ppl: float
    ppl_error: float
    nll: float
    num_tokens: int
    num_chunks: int
    n_ctx: int
    bos_token_id: Optional[int]
    seconds: float
    running_ppl: tuple[float, ...]

    def as_dict(self) -> dict:
        return {"ppl": self.ppl, "ppl_error": self.ppl_error, "nll": self.nll, "num_tokens": self.num_tokens,
                "num_chunks": self.num_chunks, "n_ctx": self.n_ctx, "bos_token_id": self.bos_token_id,
                "seconds": self.seconds, "running_ppl": list(self.running_ppl)}


def tokenizer_bos_id(tokenizer) -> Optional[int]:
    """The BOS id ``tokenizer.encode`` puts in front of a text (llama.cpp's ``add_bos``), else None.

    Probed by encoding one text with and without special tokens: a BOS is a leading extra token."""
    if tokenizer is None:
        return None
    probe = "The"
    plain = tokenizer.encode(probe, add_special_tokens=False)
    special = tokenizer.encode(probe, add_special_tokens=True)
    if len(special) > len(plain) and special[1:1 + len(plain)] == plain:
        return special[0]
    return None


def text_token_ids(tokenizer, text: str) -> tuple[list[int], Optional[int]]:
    """``text``'s token ids as llama.cpp tokenizes a perplexity text (BOS first when the tokenizer adds
    one; no EOS, which llama.cpp refuses), and that BOS id (None: none)."""
    bos = tokenizer_bos_id(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ([bos] + ids if bos is not None else ids), bos


def pydoc_topics_text() -> str:
    """The Python help topics (``pydoc_data.topics``, shipped with every Python): real English prose with
    code in it, about 465,000 characters, and held out of the embedded model's training data
    (``qwen_ops/default_model/manifest.tsv`` lists no ``pydoc_data`` file)."""
    import pydoc_data.topics as t

    return "\n\n".join(t.topics[k] for k in sorted(t.topics))


def perplexity(llm, token_ids: Sequence[int], n_ctx: int = 512, batch_size: Optional[int] = None, *,
               max_chunks: Optional[int] = None, bos_token_id: Union[int, None, str] = "auto",
               on_chunk: Optional[Callable[[int, float], None]] = None) -> PerplexityResult:
    """Perplexity of ``token_ids`` (a text's tokens, BOS first where the tokenizer adds one: see
    :func:`text_token_ids`) under ``llm`` (a ``qwen_ops.LLM``), llama-perplexity's way (module docstring).

    ``batch_size``: chunks per ``generate`` call (default: ``max_num_seqs``, as many as the engine runs
    at once). ``max_chunks``: score at most this many (llama.cpp's ``--chunks``). ``bos_token_id``:
    the token that replaces each chunk's first one; ``"auto"``: :func:`tokenizer_bos_id` of
    ``llm.tokenizer``; None: no replacement. ``on_chunk(i, running_ppl)`` is called after chunk ``i``
    (0-based) is scored, in order.
    """
    max_model_len = llm.scheduler.config.max_model_len
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 3:
        raise ValueError(f"n_ctx = {n_ctx!r}, expected an int >= 3 (a chunk scores its tokens n_ctx/2 + 1 .. "
                         "n_ctx - 1)")
    if n_ctx >= max_model_len:
        raise ValueError(f"n_ctx = {n_ctx}, but max_model_len = {max_model_len}: each chunk is a prompt that "
                         f"generates one token, so expected n_ctx <= {max_model_len - 1} (or a larger max_model_len)")
    if batch_size is None:
        batch_size = llm.scheduler.config.max_num_seqs
    for name, value in (("batch_size", batch_size), ("max_chunks", max_chunks)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} = {value!r}, expected an int >= 1" + (" or None" if name == "max_chunks" else ""))
    if bos_token_id == "auto":
        bos_token_id = tokenizer_bos_id(llm.tokenizer)
    elif bos_token_id is not None and (isinstance(bos_token_id, bool) or not isinstance(bos_token_id, int)):
        raise ValueError(f"bos_token_id = {bos_token_id!r}, expected a token id, None or 'auto'")
    token_ids = list(token_ids)
    num_chunks = len(token_ids) // n_ctx
    if num_chunks == 0:
        raise ValueError(f"token_ids has {len(token_ids)} tokens, but n_ctx = {n_ctx} needs at least {n_ctx} "
                         "(one chunk)")
    if max_chunks is not None:
        num_chunks = min(num_chunks, max_chunks)

    chunks = []
    for c in range(num_chunks):
        chunk = token_ids[c * n_ctx:(c + 1) * n_ctx]
        if bos_token_id is not None:
            chunk[0] = bos_token_id
        chunks.append(chunk)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    first = n_ctx // 2
    nll_sum = nll2_sum = 0.0
    count = 0
    running: list[float] = []
    start = time.perf_counter()
    for b in range(0, num_chunks, batch_size):
        outs = llm.generate(chunks[b:b + batch_size], params, use_tqdm=False)
        for out, chunk in zip(outs, chunks[b:b + batch_size]):
            # prompt_logprobs[j]: {chunk[j]: Logprob} given chunk[:j] (entry 0 is None).
            for j in range(first + 1, n_ctx):
                nll = -out.prompt_logprobs[j][chunk[j]].logprob
                nll_sum += nll
                nll2_sum += nll * nll
            count += n_ctx - first - 1
            running.append(math.exp(nll_sum / count))
            if on_chunk is not None:
                on_chunk(len(running) - 1, running[-1])
    seconds = time.perf_counter() - start

    mean = nll_sum / count
    ppl = math.exp(mean)
    variance = nll2_sum / count - mean * mean          # llama.cpp's: the population variance of the NLLs
    if count < 2:
        error = math.nan
    else:
        error = ppl * math.sqrt(variance / (count - 1)) if variance > 0 else 0.0
    return PerplexityResult(ppl=ppl, ppl_error=error, nll=mean, num_tokens=count, num_chunks=num_chunks,
                            n_ctx=n_ctx, bos_token_id=bos_token_id, seconds=seconds, running_ppl=tuple(running))
