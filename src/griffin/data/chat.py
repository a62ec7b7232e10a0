"""Chat messages to prompt tokens: the tokenizer's Jinja chat template when it has one (``chat_template`` of a
``tokenizer_config.json``, or a ``chat_template.jinja`` file, beside the tokenizer or the checkpoint), else the plain
template :data:`PLAIN_TEMPLATE` (docs/serving.md). Serving renders prompts with it, fine-tuning whole conversations
(:meth:`ChatTemplate.conversation`: the tokens and which of them are the assistant's replies).

Each message is rendered and tokenized on its own, so a conversation's tokens are a prefix of the next turn's: the
token count after each message is a boundary where the server keeps the state in its prefix cache (Section 5: the
whole history is a fixed-size snapshot)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from griffin.data.tokenizer import Tokenizer

# Every message as <|role|>, newline, content, <|end|>, newline; the reply is generated after "<|assistant|>\n" and
# stops at "<|end|>". Plain text: any tokenizer, the byte-level one included, can encode it.
PLAIN_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PLAIN_STOP = ("<|end|>",)
TEMPLATE_FILE = "chat_template.jinja"  # a template stored in a directory, beside a tokenizer or checkpoint


def find_chat_template(*directories: str | Path | None) -> str | None:
    """The Jinja chat template stored in the first of ``directories`` that holds one (``chat_template.jinja``, or
    ``chat_template`` in ``tokenizer_config.json``), else None."""
    for directory in directories:
        if directory is None:
            continue
        path = Path(directory)
        if path.is_file():
            path = path.parent
        jinja = path / TEMPLATE_FILE
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        config = path / "tokenizer_config.json"
        if config.is_file():
            template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(template, list):  # named templates: the default one
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                template = named.get("default") or next(iter(named.values()), None)
            if isinstance(template, str) and template:
                return template
    return None


def message_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"unsupported message content part {part!r}: only text parts are served")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


class ChatTemplate:
    """Renders messages with a Jinja template (sandboxed, as transformers does) into prompt tokens and the token
    counts after each message. ``template`` None: :data:`PLAIN_TEMPLATE`, whose ``<|end|>`` is a default stop (also when
    its source is given, as a fine-tune's checkpoint stores it)."""

    def __init__(self, tokenizer: Tokenizer, template: str | None = None, add_bos: bool = True) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        env.globals["raise_exception"] = raise_exception
        self.plain = template is None or template == PLAIN_TEMPLATE
        self.source = PLAIN_TEMPLATE if template is None else template
        self.template = env.from_string(self.source)
        self.tokenizer = tokenizer
        self.bos = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
        self.stop = PLAIN_STOP if self.plain else ()

    def render_text(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                    bos_token="", eos_token="")

    def conversation(self, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[bool]]:
        """The tokens of a whole conversation, as :meth:`__call__` gives a prompt, and for each token whether it is
        part of an assistant reply: the reply's text and what the template closes it with (``<|end|>``,
        ``<end_of_turn>``), not the header before it, which is the generation prompt a served request ends with.
        Each reply is cut from the rendering as the text between the generation prompt after the messages before
        it and the rendering through it; a template whose renderings do not extend one another that way is a
        ValueError (its replies cannot be found)."""
        clean = [{"role": m["role"], "content": message_text(m.get("content"))} for m in messages]
        ids, reply, done = list(self.bos), [False] * len(self.bos), ""

        def add(text: str, is_reply: bool, what: str) -> None:
            nonlocal done
            if not text.startswith(done):
                raise ValueError(f"the chat template does not render {what} as a continuation of the messages before "
                                 "it, so its tokens cannot be found: use another template, or train on all tokens")
            tokens = self.tokenizer.encode(text[len(done):])
            ids.extend(tokens)
            reply.extend([is_reply] * len(tokens))
            done = text

        for k, message in enumerate(clean):
            assistant = message["role"] == "assistant"
            if assistant:
                add(self.render_text(clean[:k], True), False, f"the generation prompt before message {k}")
            add(self.render_text(clean[: k + 1], False), assistant, f"message {k} ({message['role']})")
        return ids, reply

    def __call__(self, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """Prompt tokens for ``messages`` (with the generation prompt), and the token count after each message."""
        if not messages:
            raise ValueError("messages is empty: give at least one message")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string 'role'")
            clean.append({"role": m["role"], "content": message_text(m.get("content"))})
        texts = [self.render_text(clean[: k + 1], False) for k in range(len(clean))]
        texts.append(self.render_text(clean, True))
        ids, boundaries, done = list(self.bos), [], ""
        if all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False)) and texts[0]:
            for text in texts:
                ids += self.tokenizer.encode(text[len(done) :])
                boundaries.append(len(ids))
                done = text
            boundaries.pop()  # the end of the prompt is a boundary anyway
        else:  # a template whose prefixes are not prefixes of the whole: one piece, no boundary
            ids += self.tokenizer.encode(texts[-1])
        return ids, [b for b in boundaries if 0 < b < len(ids)]
