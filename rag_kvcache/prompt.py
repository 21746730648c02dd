"""How a RAG prompt is laid out in tokens: [system prefix][chunk]...[chunk][question + suffix].

The prefix and suffix come from the model's own chat template, rendered once around a marker,
so the linked prompt is token for token the prompt a plain chat call would build (chunks and
question sit in the user turn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rag_kvcache.errors import ConfigError

MARKER = "\x00RAG_KVCACHE_USER\x00"


def check_text(text: str) -> str:
    """`text`, if every character of it is one a tokenizer takes; a lone UTF-16 surrogate (what
    a JSON `\\ud800` escape decodes to) is a ConfigError, not a tokenizer's TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(
            f"the text holds {text[e.start]!r} at character {e.start}, which is not a Unicode "
            "character (a lone UTF-16 surrogate): send valid UTF-8"
        ) from None
    return text


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
    def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
        """Chat messages as the model's chat template renders them, ready for the reply. A
        chat the template refuses (e.g. two user turns in a row, where turns must alternate) is
        a ConfigError naming the template's reason."""
        for message in messages:  # a bad character named where the client wrote it
            check_text(message["content"])
        if getattr(tokenizer, "chat_template", None):
            from jinja2 import TemplateError

            try:
                rendered = tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True
                )
            except TemplateError as e:
                raise ConfigError(f"the model's chat template refuses these messages: {e}") from e
            return str(rendered)
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join(lines) + "\nassistant:"

    def tokenize(self, tokenizer: Any, text: str) -> list[int]:
        return list(tokenizer(check_text(text), add_special_tokens=False)["input_ids"])

    def prefix_ids(self, tokenizer: Any) -> list[int]:
        return self.tokenize(tokenizer, self.prefix)

    def chunk_ids(self, tokenizer: Any, text: str) -> list[int]:
        """A document chunk as it sits in the user turn: its text and a blank line. Read as
        text only: a document that spells a control token (`<|im_end|>`, `<|endoftext|>`: a
        page about tokenizers, or one written to end the user turn early) holds those
        characters, never the token, which would end a turn or the text inside the KV."""
        text = check_text(text.strip() + "\n\n")
        ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return list(ids)

    def question_ids(self, tokenizer: Any, question: str) -> list[int]:
        """The question's tokens as the prompt holds them; an empty or blank question is an
        error (there is nothing to answer: the model would only continue the documents)."""
        if not isinstance(question, str):
            raise ConfigError(f"the question must be text (str), not {type(question).__name__}")
        if not question.strip():
            raise ConfigError(f"the question is empty ({question!r}): ask something")
        return self.tokenize(tokenizer, "Question: " + question.strip() + self.suffix)
