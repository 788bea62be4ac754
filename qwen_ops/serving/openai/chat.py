"""Chat templates: the checkpoint's own (``tokenizer_config.json`` ``chat_template``, or a
``chat_template.jinja`` file beside it), else ChatML as Qwen writes it, rendered by jinja2 in a
sandbox (a template is data from the checkpoint, not trusted code).

    <|im_start|>system\\nYou are...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence, Union

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


class ChatTemplateError(ValueError):
    """The template could not render these messages (a 400 naming ``messages``)."""


def _token_text(value: Any) -> Optional[str]:
    # tokenizer_config.json writes special tokens as a string or as {"content": "..."}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick(template: Union[str, list, None]) -> Optional[str]:
    # A list of named templates (transformers' format): take "default", else the first.
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template.strip() else None


class ChatTemplate:
    """One compiled template; ``render(messages)`` gives the prompt text."""

    def __init__(self, source: str = CHATML_TEMPLATE, *, bos_token: Optional[str] = None,
                 eos_token: Optional[str] = None, origin: str = "built-in ChatML"):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        # transformers' helpers, which checkpoint templates call.
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"the chat template ({origin}) does not compile: {e}") from e
        self.source = source
        self.origin = origin
        self._specials = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    @classmethod
    def for_checkpoint(cls, model_path: Union[str, Path, None]) -> "ChatTemplate":
        """The checkpoint's template if it has one, else ChatML."""
        config: dict = {}
        from qwen_ops.models.gguf import chat_template, gguf_of

        gguf = gguf_of(model_path)
        if gguf is not None:            # a GGUF file: tokenizer.chat_template and its BOS / EOS tokens
            source, bos, eos = chat_template(gguf)
            if source is not None:
                return cls(source, bos_token=bos, eos_token=eos, origin=f"{gguf.path} tokenizer.chat_template")
            return cls(bos_token=bos, eos_token=eos)
        if model_path is not None:
            path = Path(model_path)
            cfg_file = path / "tokenizer_config.json"
            if cfg_file.is_file():
                try:
                    config = json.loads(cfg_file.read_text(encoding="utf-8"))
                except (OSError, ValueError) as e:
                    raise ValueError(f"{cfg_file}: cannot read ({e})") from e
            source = _pick(config.get("chat_template"))
            jinja_file = path / "chat_template.jinja"
            if source is None and jinja_file.is_file():
                source, origin = jinja_file.read_text(encoding="utf-8"), str(jinja_file)
            else:
                origin = str(cfg_file)
            if source is not None:
                return cls(source, bos_token=_token_text(config.get("bos_token")),
                           eos_token=_token_text(config.get("eos_token")), origin=origin)
        return cls(bos_token=_token_text(config.get("bos_token")), eos_token=_token_text(config.get("eos_token")))

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
               tools: Optional[list] = None, **template_kwargs) -> str:
        """The prompt text of ``messages`` (and ``tools``: OpenAI's function objects, for templates
        that list them); ``template_kwargs`` (``chat_template_kwargs``, e.g. ``enable_thinking``)
        are more variables for the template, never replacing its own."""
        from jinja2 import TemplateError

        self.check_kwargs(template_kwargs)
        try:
            return self._template.render(**template_kwargs, messages=[_flat_tool_calls(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt, tools=tools or None,
                                         **self._specials)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template ({self.origin}) cannot render these messages: {e}") from e


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
        flat.append({"name": fn.get("name", ""), "arguments": args if isinstance(args, str) else json.dumps(args)})
    return {**message, "content": message.get("content") or "", "tool_calls": flat}


def _raise(message: str):
    raise ChatTemplateError(f"the chat template rejects these messages: {message}")
