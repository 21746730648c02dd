"""A conversation over linked chunks: the earlier turns ride inside the question.

A linked prompt's layout is fixed ([system prefix][chunks][question]) so that cached KV can be
reused; a follow-up's history has nowhere to go but the question. It is written as the model's
own chat template renders turns, cut after the template's prefix, so the prompt reads as a real
chat: the chunks and the first question in the first user turn, each answer in its own
assistant turn, the new question in a user turn of its own. (Earlier turns written as
"user: ..." lines or a "Conversation so far:" transcript were imitated by a small model: its
answers began with "user:" and repeated the last answer.) Only the last `history_turns`
exchanges are written, so a long chat never crowds the chunks out of the window.

A small model still copies its last answer now and then. `unless_repeated` holds a streamed
answer back while it spells the start of an earlier answer and, when it is one word for word,
shows the answer to the question asked alone instead. A heuristic: it catches exact repeats,
not paraphrases. Every chat front end (the LlamaIndex chat engine, `rag-kvcache chat`, the
server's chat completions) uses these two, so they answer a conversation alike.
"""

from __future__ import annotations

from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Generator,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any

from rag_kvcache.chat_text import ChatText, Piece
from rag_kvcache.config import whole_number
from rag_kvcache.errors import ConfigError
from rag_kvcache.prompt import PromptTemplate, check_messages

HISTORY_TURNS = 2  # earlier exchanges (question + answer) a follow-up's answer sees
INSTRUCTION_ROLES = ("system", "developer")  # a caller's instructions: they lead the question
TURN_ROLES = ("user", "assistant")

Message = Mapping[str, str]  # {"role": ..., "content": ...}, as chat templates take them


def chat_question(
    template: PromptTemplate,
    tokenizer: Any,
    system_prompt: str,
    messages: Sequence[Message],
    history_turns: int | None = HISTORY_TURNS,
) -> ChatText:
    """The question of a linked prompt that answers the last (user) message of a chat.

    System (or developer) messages are the caller's instructions: their text leads the
    question (the engine's own system prompt, whose KV is cached, stays first). Of the earlier
    turns, the last `history_turns` exchanges (None: all) are rendered as the chat template
    renders them. The messages' text is read as text (`ChatText`), the template's as written.
    """
    check_messages(messages)
    instructions = [m["content"].strip() for m in messages if m["role"] in INSTRUCTION_ROLES]
    turns = [{"role": m["role"], "content": m["content"].strip()} for m in messages]
    turns = [t for t in turns if t["role"] not in INSTRUCTION_ROLES]
    if unknown := {t["role"] for t in turns} - set(TURN_ROLES):
        raise ConfigError(f"unknown chat role(s) {sorted(unknown)}; expected user or assistant")
    if not turns or turns[-1]["role"] != "user":
        raise ConfigError("a chat must end with the user's message")
    *history, last = turns
    history = _shown(history, history_turns)
    pieces: list[Piece] = []
    for text in (i for i in instructions if i):
        pieces += [(text, True), ("\n\n", False)]
    pieces += _rendered(template, tokenizer, system_prompt, [*history, last]).pieces()
    return ChatText.from_pieces(pieces)


def _rendered(
    template: PromptTemplate, tokenizer: Any, system_prompt: str, turns: list[dict[str, str]]
) -> ChatText:
    """User/assistant turns (starting and ending with the user's) as the question's text."""
    if len(turns) == 1:
        return ChatText.from_pieces([(turns[0]["content"], True)])
    system = {"role": "system", "content": system_prompt}
    rendered = template.render_chat(tokenizer, [system, *turns])
    if rendered.startswith(template.prefix) and rendered.endswith(template.suffix):
        return rendered.cut(len(template.prefix), len(rendered) - len(template.suffix))
    # no chat template: the layout's own "Question: ...<suffix> answer" form
    pieces: list[Piece] = [(turns[0]["content"], True)]
    for turn in turns[1:]:
        glue = "\n\nQuestion: " if turn["role"] == "user" else f"{template.suffix} "
        pieces += [(glue, False), (turn["content"], True)]
    return ChatText.from_pieces(pieces)


def earlier_answers(
    history: Sequence[Message], history_turns: int | None = HISTORY_TURNS
) -> list[str]:
    """The answers among a chat's earlier messages (all but the question) that the question
    shows the model: those it may copy."""
    shown = _shown([m for m in history if m["role"] in TURN_ROLES], history_turns)
    return [text for m in shown if m["role"] == "assistant" and (text := m["content"].strip())]


def _shown(turns: list[Any], history_turns: int | None) -> list[Any]:
    """The earlier turns a question shows: those of the last `history_turns` exchanges (None:
    all), from a user turn on (the chunks' turn is a user turn)."""
    if history_turns is not None:  # (1.5 was taken, and showed one exchange)
        history_turns = whole_number("history_turns", history_turns, least=0)
        turns = turns[max(0, len(turns) - 2 * history_turns) :] if history_turns else []
    while turns and turns[0]["role"] != "user":
        turns = turns[1:]
    return turns


def unless_repeated(
    pieces: Iterator[str], earlier: Sequence[str], again: Callable[[], Iterator[str]]
) -> Generator[str, None, None]:
    """`pieces`, held back while they spell the start of an `earlier` answer; `again()`'s
    pieces instead if they spell all of one. Nothing held back is lost: a prefix of an earlier
    answer that turns out different is passed on whole."""
    held = ""
    for piece in pieces:
        held += piece
        if not any(text.startswith(held.strip()) for text in earlier):
            yield held
            yield from pieces
            return
    if held.strip() and held.strip() in earlier:
        yield from again()
    elif held:
        yield held


async def aunless_repeated(
    pieces: AsyncIterator[str], earlier: Sequence[str], again: Callable[[], AsyncIterator[str]]
) -> AsyncGenerator[str, None]:
    """`unless_repeated` of an async stream."""
    held = ""
    async for piece in pieces:
        held += piece
        if not any(text.startswith(held.strip()) for text in earlier):
            yield held
            async for rest in pieces:
                yield rest
            return
    if held.strip() and held.strip() in earlier:
        async for piece in again():
            yield piece
    elif held:
        yield held
