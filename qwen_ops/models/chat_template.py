"""Chat templates: the checkpoint's own (``tokenizer_config.json`` ``chat_template``, a
``chat_template.jinja`` file beside it, or a GGUF file's ``tokenizer.chat_template``), else ChatML as
Qwen writes it, rendered by jinja2 in a sandbox (a template is data from the checkpoint, not trusted
code). One renderer for ``QwenTokenizer.apply_chat_template``, ``LLM.chat`` and the server.

    <|im_start|>system\\nYou are...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n

It renders as transformers' ``apply_chat_template`` does: the same jinja environment (trimmed
blocks, ``loopcontrols``, a ``{% generation %}`` tag, ``tojson`` without HTML escaping), messages
with ``None`` values dropped and reasoning under both ``reasoning_content`` and ``thinking``, and
``continue_final_message`` cutting the prompt right after the final message's text.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence, Union

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# ChatML with tools in the hermes convention Qwen's models use: the functions as JSON lines
# between <tools> tags in a system turn, calls as {"name", "arguments"} JSON between <tool_call>
# tags, results as a user turn between <tool_response> tags. Without tools or tool turns it
# renders exactly plain ChatML.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nTo call a function, answer with a JSON object holding its name and arguments '"
    " + 'between <tool_call> and </tool_call> tags, one call per pair. The functions:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '\\n<tool_call>\\n{\"name\": ' + (call['name'] | tojson) + ', \"arguments\": ' + call['arguments']"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Appended to the final message's text with continue_final_message: the prompt ends where it is
# rendered. Its trailing space tells whether the template trimmed the message's end.
CONTINUE_MARK = "\x00CONTINUE_FINAL_MESSAGE\x00 "
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")   # the first is what templates read


class ChatTemplateError(ValueError):
    """The template could not render these messages (a 400 naming ``messages``)."""


def token_text(value: Any) -> Optional[str]:
    """A special token as ``tokenizer_config.json`` writes it: a string, or ``{"content": "..."}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def pick_template(template: Union[str, list, dict, None], tools: Optional[list] = None) -> Optional[str]:
    """One template source from transformers' formats: a str, or named templates (a list of
    ``{"name", "template"}`` or a dict): ``"tool_use"`` when there are tools and it exists, else
    ``"default"``, else the first."""
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        named = template
        template = (named.get("tool_use") if tools else None) or named.get("default") or \
            next(iter(named.values()), None)
    return template if isinstance(template, str) and template.strip() else None


def _environment():
    """transformers' sandboxed jinja environment for chat templates (made per template: no shared state)."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        # ``{% generation %}...{% endgeneration %}`` marks assistant text for transformers' masks;
        # rendering it is rendering its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """One compiled template; ``render(messages)`` gives the prompt text."""

    def __init__(self, source: str = CHATML_TEMPLATE, *, bos_token: Optional[str] = None,
                 eos_token: Optional[str] = None, origin: str = "built-in ChatML"):
        from jinja2 import TemplateError

        try:
            self._template = _environment().from_string(source)
        except TemplateError as e:
            raise ValueError(f"the chat template ({origin}) does not compile: {e}") from e
        self.source = source
        self.origin = origin
        self._specials = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    @classmethod
    def for_checkpoint(cls, model_path: Union[str, Path, None]) -> "ChatTemplate":
        """The checkpoint's template if it has one, else ChatML (with its BOS and EOS either way)."""
        config, origin = read_tokenizer_config(model_path) if model_path is not None else ({}, "")
        bos, eos = token_text(config.get("bos_token")), token_text(config.get("eos_token"))
        source = pick_template(config.get("chat_template"))
        if source is None:
            return cls(bos_token=bos, eos_token=eos)
        return cls(source, bos_token=bos, eos_token=eos, origin=origin)

    def reserved(self) -> frozenset[str]:
        """The variables ``render`` itself passes to the template: ``chat_template_kwargs`` may not set them."""
        return frozenset({"messages", "add_generation_prompt", "tools", *self._specials})

    def check_kwargs(self, template_kwargs: Optional[dict]) -> None:
        """A ChatTemplateError naming ``chat_template_kwargs`` and its keys that ``render`` sets itself
        (``reserved``). Callers that unpack the kwargs into ``render`` beside ``add_generation_prompt=``
        / ``tools=`` call it first: Python would refuse the duplicated keyword with a TypeError."""
        clash = self.reserved().intersection(template_kwargs or ())
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs may not set {sorted(clash)}: the template's own "
                                    f"variables ({', '.join(sorted(self.reserved()))})")

    def render(self, messages: Sequence[dict], /, *, add_generation_prompt: bool = True,
               tools: Optional[list] = None, continue_final_message: bool = False, **template_kwargs) -> str:
        """The prompt text of ``messages`` (and ``tools``: OpenAI's function objects, for templates
        that list them); ``template_kwargs`` (``chat_template_kwargs``, e.g. ``enable_thinking``)
        are more variables for the template, never replacing its own. ``continue_final_message``:
        the prompt ends with the final message's text, open for the model to continue it."""
        from jinja2 import TemplateError

        self.check_kwargs(template_kwargs)
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("add_generation_prompt = True and continue_final_message = True; expected at "
                                    "most one: continue the final message, or start a new assistant turn")
        messages = [_template_message(m) for m in messages]
        tail = None
        if continue_final_message:
            tail = _mark_final_text(messages)
        try:
            text = self._template.render(**template_kwargs, messages=messages,
                                         add_generation_prompt=add_generation_prompt, tools=tools or None,
                                         **self._specials)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template ({self.origin}) cannot render these messages: {e}") from e
        return text if tail is None else _cut_at_mark(text, tail, self.origin)


def _template_message(message: Any) -> Any:
    """A message as templates read it (transformers' normalization): ``None`` values dropped,
    reasoning under every name templates use, OpenAI ``tool_calls`` flattened (``_flat_tool_calls``)."""
    if not isinstance(message, dict):
        return message
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in REASONING_KEYS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return _flat_tool_calls(out)


def _mark_final_text(messages: list) -> str:
    """Append ``CONTINUE_MARK`` to the final message's text (its ``content`` str, or its last text
    part); returns that text, which the rendered prompt must show."""
    if not messages or not isinstance(messages[-1], dict):
        raise ChatTemplateError("continue_final_message = True, but there is no final message to continue")
    final = dict(messages[-1])
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + CONTINUE_MARK
        text = content
    elif isinstance(content, list):
        parts = list(content)
        for i in range(len(parts) - 1, -1, -1):
            if isinstance(parts[i], dict) and isinstance(parts[i].get("text"), str):
                text = parts[i]["text"]
                parts[i] = {**parts[i], "text": text + CONTINUE_MARK}
                break
        else:
            raise ChatTemplateError("continue_final_message = True, but the final message has no text part")
        final["content"] = parts
    else:
        raise ChatTemplateError(f"continue_final_message = True, but the final message's content = {content!r}; "
                                "expected text to continue")
    messages[-1] = final
    return text


def _cut_at_mark(text: str, final_text: str, origin: str) -> str:
    at = text.rfind(CONTINUE_MARK.rstrip())
    if at < 0 or final_text.strip() not in text:
        raise ChatTemplateError(f"continue_final_message = True, but the chat template ({origin}) does not show the "
                                "final message's text as it is, so the prompt cannot end inside it")
    if text.startswith(CONTINUE_MARK, at):
        return text[:at]
    return text[:at].rstrip()          # the template trimmed the message's end: so does the prompt


def _flat_tool_calls(message: dict) -> dict:
    """An assistant message's OpenAI ``tool_calls`` (``{"function": {"name", "arguments"}}``, the
    arguments a JSON string or an object) as the template reads them: ``{"name", "arguments": JSON}``."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not calls or not isinstance(calls, list):
        return message
    flat = []
    for call in calls:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        args = fn.get("arguments", "{}")
        flat.append({"name": fn.get("name", ""),
                     "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)})
    return {**message, "content": message.get("content") or "", "tool_calls": flat}


def _raise(message: str):
    raise ChatTemplateError(f"the chat template rejects these messages: {message}")


def read_tokenizer_config(path) -> tuple[dict, str]:
    """``(config, origin of its chat_template)``: a checkpoint directory's ``tokenizer_config.json``
    (its ``chat_template``, else ``chat_template.jinja``'s), or a GGUF file's tokenizer metadata in
    the same keys (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, ``chat_template``)."""
    from qwen_ops.models.gguf import gguf_of

    gguf = gguf_of(path)
    if gguf is not None:
        return _gguf_config(gguf), f"{gguf.path} tokenizer.chat_template"
    folder = Path(path)
    cfg_file = folder / TOKENIZER_CONFIG_FILE
    config: dict = {}
    if cfg_file.is_file():
        try:
            config = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"{cfg_file}: cannot read ({e})") from e
        if not isinstance(config, dict):
            raise ValueError(f"{cfg_file} holds a {type(config).__name__}, expected a JSON object")
    origin = str(cfg_file)
    jinja_file = folder / CHAT_TEMPLATE_FILE
    if pick_template(config.get("chat_template")) is None and jinja_file.is_file():
        config = {**config, "chat_template": jinja_file.read_text(encoding="utf-8")}
        origin = str(jinja_file)
    return config, origin


def _gguf_config(file) -> dict:
    tokens = file.meta("tokenizer.ggml.tokens") or []      # read once: a vocabulary of strings

    def token(key: str) -> Optional[str]:
        i = file.meta(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    template = file.meta("tokenizer.chat_template")
    return {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
            "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
            "chat_template": template if isinstance(template, str) else None}
