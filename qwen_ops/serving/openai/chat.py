"""Chat templates for the server: the renderer lives in ``models/chat_template.py`` (the tokenizer's
``apply_chat_template`` uses it too, and models/ may not import serving/); these are its names."""

from qwen_ops.models.chat_template import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError

__all__ = ["CHATML_TEMPLATE", "ChatTemplate", "ChatTemplateError"]
