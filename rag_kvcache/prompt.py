"""How a RAG prompt is laid out in tokens: [system prefix][chunk]...[chunk][question + suffix].

The prefix and suffix come from the model's own chat template, rendered once around a marker,
so the linked prompt is token for token the prompt a plain chat call would build (chunks and
question sit in the user turn).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rag_kvcache.chat_text import (
    ChatText,
    Piece,
    controls_in,
    inert_text,
    pieces_ids,
    pieces_of,
    stripped,
    text_ids,
)
from rag_kvcache.errors import ConfigError

MARKER = "\x00RAG_KVCACHE_USER\x00"
MESSAGE_MARKER = "\x00RAG_KVCACHE_MESSAGE_{}\x00"  # where message i's content goes


def check_text(text: str, what: str = "input") -> str:
    """`text`, if it is a str and every character of it is one a tokenizer takes; a lone UTF-16
    surrogate (what a JSON `\\ud800` escape decodes to) is a ConfigError, not a tokenizer's
    TypeError, and so is None or bytes (an AttributeError from deep inside)."""
    if not isinstance(text, str):
        raise ConfigError(f"the {what} must be text (str), not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(
            f"the {what} holds {text[e.start]!r} at character {e.start}, which is not a Unicode "
            "character (a lone UTF-16 surrogate): send valid UTF-8"
        ) from None
    return text


def check_messages(messages: object) -> None:
    """Chat messages as the API takes them: a non-empty list of {"role": str, "content": str}
    (a missing key, None content or a bare string failed inside the template), each content
    checked by `check_text`."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise ConfigError(
            'messages must be a list of {"role": ..., "content": ...} dicts, got '
            + type(messages).__name__
        )
    if not messages:
        raise ConfigError("there are no messages: give at least the user's")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not {"role", "content"} <= message.keys():
            raise ConfigError(f'message {i} is not a {{"role": ..., "content": ...}} dict')
        if not isinstance(message["role"], str):
            raise ConfigError(f"message {i}'s role must be text, got {message['role']!r}")
        check_text(message["content"], f"content of message {i}")


@dataclass(frozen=True)
class PromptTemplate:
    prefix: str  # chat header, system prompt, start of the user turn
    suffix: str  # end of the user turn, assistant header

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, system_prompt: str) -> PromptTemplate:
        if getattr(tokenizer, "chat_template", None):
            messages = [
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": MARKER},
            ]
            rendered = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            prefix, suffix = rendered.split(MARKER)
            return cls(prefix, suffix)
        return cls(system_prompt + "\n\n", "\nAnswer:")

    @staticmethod
    def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> ChatText:
        """Chat messages as the model's chat template renders them, ready for the reply; the
        messages' text is the users' (`ChatText`: read as text, never as control tokens). A
        chat the template refuses (e.g. two user turns in a row, where turns must alternate)
        is a ConfigError naming the template's reason."""
        check_messages(messages)  # a bad character named where the client wrote it
        if not getattr(tokenizer, "chat_template", None):
            pieces: list[Piece] = []
            for i, m in enumerate(messages):
                pieces += [(("\n" if i else "") + f"{m['role']}: ", False), (m["content"], True)]
            return ChatText.from_pieces([*pieces, ("\nassistant:", False)])
        rendered = _apply_template(tokenizer, messages)
        # rendered again with a marker for each message's content, to find where each lies
        marked = [{**m, "content": MESSAGE_MARKER.format(i)} for i, m in enumerate(messages)]
        parts = re.split(MESSAGE_MARKER.format("([0-9]+)"), _apply_template(tokenizer, marked))
        found = [int(i) for i in parts[1::2]]
        if all(i < len(messages) for i in found):  # (a marker spelled in a role names none)
            for read in (str, str.strip):  # as given, or trimmed as many templates do
                pieces = [(parts[0], False)]
                for i, after in zip(found, parts[2::2], strict=True):
                    pieces += [(read(messages[i]["content"]), True), (after, False)]
                if (text := ChatText.from_pieces(pieces)) == rendered:
                    return text
        # the template rewrote the messages: its text is read as written only if every control
        # token in it is one it writes for messages that spell none (the same ones in order)
        inert = [{**m, "content": inert_text(tokenizer, m["content"])} for m in messages]
        if controls_in(tokenizer, rendered) == controls_in(
            tokenizer, _apply_template(tokenizer, inert)
        ):
            return ChatText(rendered)
        raise ConfigError(
            "a message spells a control token, and this model's chat template changes the "
            "messages it is given, so their text cannot be told from the template's: remove "
            "the spelling from the message"
        )

    def tokenize(self, tokenizer: Any, text: str) -> list[int]:
        """A prompt's tokens as written: control tokens spelled in it are tokens, except
        where a `ChatText` says a user wrote them."""
        return pieces_ids(tokenizer, pieces_of(check_text(text, "prompt"), by_user=False))

    def prefix_ids(self, tokenizer: Any) -> list[int]:
        return self.tokenize(tokenizer, self.prefix)

    def chunk_ids(self, tokenizer: Any, text: str) -> list[int]:
        """A document chunk as it sits in the user turn: its text and a blank line. Read as
        text only: a document that spells a control token (`<|im_end|>`, `<|endoftext|>`: a
        page about tokenizers, or one written to end the user turn early) holds those
        characters, never the token, which would end a turn or the text inside the KV."""
        return text_ids(tokenizer, check_text(text.strip() + "\n\n", "chunk"))

    def question_ids(self, tokenizer: Any, question: str) -> list[int]:
        """The question's tokens as the prompt holds them. The question is the user's text,
        read as text (`<|im_end|>` in it is characters); a `ChatText` (a chat's question) keeps
        its template's control tokens. An empty or blank question is an error (there is
        nothing to answer: the model would only continue the documents)."""
        asked = stripped(pieces_of(check_text(question, "question"), by_user=True))
        if not asked:
            raise ConfigError(f"the question is empty ({question!r}): ask something")
        return pieces_ids(tokenizer, [("Question: ", False), *asked, (self.suffix, False)])


def _apply_template(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The chat template's text for `messages`, ready for the reply (its refusal a
    ConfigError)."""
    from jinja2 import TemplateError

    try:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    except TemplateError as e:
        raise ConfigError(f"the model's chat template refuses these messages: {e}") from e
    return str(rendered)
