"""KVCacheLLM: the engine's model as a LlamaIndex LLM.

Called like any LlamaIndex LLM it generates from the prompt (chat messages through the model's
own chat template). Called with `cache_ids=[...]` it instead answers the prompt as a question
over those cached chunks, linking their stored KV rather than prefilling their text. A prompt
that holds the text of nodes a LlamaIndex retriever just returned (what LlamaIndex's own
synthesizers build, e.g. `Settings.llm = KVCacheLLM(engine)` with `index.as_query_engine()`)
is answered by linking those nodes' chunks, the rest of the prompt as the question
(`recognition.py`; `link_retrieved=False` turns it off). Usage
counts travel in `response.raw` (flat, and OpenAI-style under "usage" for LlamaIndex's
TokenCountingHandler); link and first-token facts go out as instrumentation events.

The async methods (`acomplete`, `astream_complete`, `achat`, `astream_chat`) are native: each
call is a request of the engine loop (`RagKVCache.agenerate` / `astream`, and `acomplete` /
`astream_complete` for a plain prompt), so concurrent calls from many query and chat engines
decode in one batch and share linked prefixes, and the event loop never waits on the model.
Cancelling a call (or closing its stream) aborts its request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

from llama_index.core.base.llms.generic_utils import (
    astream_completion_response_to_chat_response,
    completion_response_to_chat_response,
    stream_completion_response_to_chat_response,
)
from llama_index.core.base.llms.types import (
    CachePoint,
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
)
from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from rag_kvcache.answer import Answer, AnswerStream
from rag_kvcache.engine import RagKVCache
from rag_kvcache.integrations.llama_index.events import FirstTokenEvent, KVLinkEvent
from rag_kvcache.integrations.llama_index.pickling import pickled
from rag_kvcache.integrations.llama_index.recognition import RetrievedNodes, watch, without
from rag_kvcache.integrations.llama_index.transform import cache_ids_of
from rag_kvcache.serving.batch import batchable
from rag_kvcache.serving.loop import AsyncTokenStream
from rag_kvcache.strategy import PREFILL, Strategy

dispatcher = get_dispatcher(__name__)


def strategy_name(strategy: str | Strategy) -> str:
    """The canonical spelling the engine reports (e.g. "legolink:2"); raises StrategyError on
    an unknown name."""
    return str(Strategy.parse(strategy))


def message_text(message: ChatMessage) -> str:
    """A message's text. One that holds anything else (an image, audio, a document) is a
    ValueError: the model reads text only, and answering the text alone would answer another
    question than the one asked."""
    for block in message.blocks:
        if not isinstance(block, TextBlock | CachePoint):  # a cache point holds nothing
            raise ValueError(
                f"a {message.role.value} message holds {type(block).__name__} content: this "
                "LLM reads text only"
            )
    return message.content or ""


def chat_question(
    messages: Sequence[ChatMessage], engine: RagKVCache, history_turns: int | None = None
) -> str:
    """Chat turns as the question of a linked prompt (`RagKVCache.chat_question`): earlier
    turns as the model's chat template renders them, system messages leading as instructions.
    `history_turns`: the last exchanges kept (None: all the messages given; the chat engine
    has cut them already)."""
    if not messages:
        raise ValueError("a linked chat needs at least one message")
    turns = [{"role": m.role.value, "content": message_text(m)} for m in messages]
    return engine.chat_question(turns, history_turns)


def usage(
    answer: Answer, cache_ids: Sequence[str] | None, question: str | None = None
) -> dict[str, Any]:
    """What a call cost, for `response.raw` (with the question asked, for a linked call)."""
    counts = {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": len(answer.token_ids),
        "total_tokens": answer.prompt_tokens + len(answer.token_ids),
    }
    return {
        **counts,
        "usage": dict(counts),  # where TokenCountingHandler looks
        "context_tokens": answer.context_tokens,
        "recomputed_tokens": answer.recomputed_tokens,
        "ttft_s": answer.ttft_s,
        "decode_tokens_per_s": answer.decode_tokens_per_s,
        "total_s": answer.total_s,
        "strategy": str(answer.strategy),
        "cache_ids": list(cache_ids or []),
        "token_ids": list(answer.token_ids),  # the answer's tokens, for exact comparisons
        **({"question": question} if cache_ids is not None else {}),
    }


class Trimmer:
    """Re-chunks streamed text so the pieces join to the stripped whole, as `Answer.text` is:
    leading whitespace dropped, trailing whitespace held until more text follows."""

    def __init__(self) -> None:
        self.held, self.started = "", False

    def add(self, piece: str) -> str:
        """The text to pass on now ("" for none)."""
        if not self.started:
            piece = piece.lstrip()
            self.started = bool(piece)
        body = self.held + piece
        text = body.rstrip()
        self.held = body[len(text) :]
        return text


def trimmed(pieces: Iterable[str]) -> Iterator[str]:
    """Streamed text pieces, trimmed (see `Trimmer`)."""
    trimmer = Trimmer()
    for piece in pieces:
        if text := trimmer.add(piece):
            yield text


class KVCacheLLM(CustomLLM):
    """A LlamaIndex LLM over a RagKVCache engine; pass `cache_ids=[...]` to link cached chunks.

    Extra keyword arguments of complete / stream_complete / chat / stream_chat:
    `cache_ids` (link these chunks, in order), `strategy` (link strategy for this call),
    `max_new_tokens`, `temperature`, `top_p`, `seed`. Others are ignored, as LlamaIndex LLMs
    do. Without `cache_ids`, a prompt holding retrieved nodes' text links them
    (`link_retrieved`).

    It pickles as its engine's configuration: unpickling opens an engine on it (the same
    model, the same durable store), for LlamaIndex pieces that copy or ship their LLM.
    """

    strategy: str | None = Field(
        default=None,
        description="Link strategy for linked calls: full, naive, legolink:k, legolink0, "
        "cacheblend:r, or prefill (plain baseline). None: the engine's default.",
    )
    max_new_tokens: int | None = Field(
        default=None, description="Answer length cap; None: the engine's generation config."
    )
    temperature: float | None = Field(
        default=None,
        description="Sampling temperature (0: greedy); None: the engine's generation config.",
    )
    top_p: float | None = Field(
        default=None, description="Nucleus sampling mass; None: the engine's generation config."
    )
    seed: int | None = Field(
        default=None, description="Sampling seed; None: the engine's generation config."
    )
    link_retrieved: bool = Field(
        default=True,
        description="Link the chunks of retrieved nodes found in a prompt (one that "
        "LlamaIndex's own synthesizers built) instead of prefilling their text.",
    )
    _engine: RagKVCache = PrivateAttr()
    _retrieved: RetrievedNodes | None = PrivateAttr(default=None)

    def __init__(
        self,
        engine: RagKVCache,
        strategy: str | None = None,
        max_new_tokens: int | None = None,
        **kwargs: Any,
    ):
        if strategy is not None:  # a bad name fails here, not at the first question
            strategy = strategy_name(strategy)
        window = engine.lm.max_context
        if max_new_tokens is not None and not 1 <= max_new_tokens < window:
            raise ValueError(  # LlamaIndex leaves the prompt the window less the output
                f"max_new_tokens must be >= 1 and below the model's window of {window}, got "
                f"{max_new_tokens}"
            )
        # as given, before pydantic makes a True 1 (as a per-call value is refused, too)
        sampling = {name: kwargs.get(name) for name in ("temperature", "top_p", "seed")}
        engine.generation_config(max_new_tokens, **sampling)
        unknown = sorted(set(kwargs) - set(type(self).model_fields))
        if unknown:  # pydantic would drop them silently
            where = (
                " (the model is the engine's: EngineConfig.model)"
                if "model" in str(unknown)
                else ""
            )
            raise TypeError(f"KVCacheLLM got unknown arguments: {', '.join(unknown)}{where}")
        super().__init__(strategy=strategy, max_new_tokens=max_new_tokens, **kwargs)
        engine.generation_config(None, self.temperature, self.top_p, self.seed)  # checked now
        self._engine = engine
        if self.link_retrieved:
            self._retrieved = watch()
        # Defaults that know the model: its chat template, for chats and for bare prompts
        # (an instruct model answers a bare prompt best as a user turn). formatted=True or
        # your own callables bypass them.
        if kwargs.get("messages_to_prompt") is None:
            self.messages_to_prompt = self._render_chat
        if kwargs.get("completion_to_prompt") is None:
            self.completion_to_prompt = self._render_user_turn

    @classmethod
    def class_name(cls) -> str:
        return "KVCacheLLM"

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # our default prompt callables are bound to self: their repr would recurse
        for name, value in super().__repr_args__():
            if getattr(value, "__self__", None) is not self:
                yield name, value

    def __copy__(self) -> KVCacheLLM:
        """A copy over the same engine, whose default prompt callables are its own: bound to
        the original, they read the original's `system_prompt`, not the copy's."""
        copied = super().__copy__()
        for name, default in (("messages_to_prompt", "_render_chat"), ("completion_to_prompt",
                              "_render_user_turn")):  # fmt: skip
            if getattr(getattr(self, name), "__self__", None) is self:
                setattr(copied, name, getattr(copied, default))
        return copied

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> KVCacheLLM:
        """A deep copy over the same engine (a model and a store, never copied: they hold
        locks and threads, which failed the copy) and the process's retrieval watcher. The
        default prompt callables come bound to the copy (pydantic copies through `memo`)."""
        memo = {} if memo is None else memo
        for shared in (self._engine, self._retrieved):
            memo[id(shared)] = shared
        return super().__deepcopy__(memo)

    def __getstate__(self) -> dict[Any, Any]:
        # pydantic's own state, not LlamaIndex's (which test-pickles every attribute and
        # drops what fails, the engine included)
        state = BaseModel.__getstate__(self)
        fields = dict(state["__dict__"])
        for name in ("messages_to_prompt", "completion_to_prompt"):
            if getattr(fields[name], "__self__", None) is self:  # our defaults: set again
                fields[name] = None
        private = dict(state["__pydantic_private__"])
        private["_engine"] = pickled(private["_engine"])  # unpickled: the reopened engine
        private["_retrieved"] = None
        return {**state, "__dict__": fields, "__pydantic_private__": private}

    def __setstate__(self, state: dict[Any, Any]) -> None:
        BaseModel.__setstate__(self, state)
        if self.messages_to_prompt is None:
            self.messages_to_prompt = self._render_chat
        if self.completion_to_prompt is None:
            self.completion_to_prompt = self._render_user_turn
        if self.link_retrieved:
            self._retrieved = watch()

    @property
    def engine(self) -> RagKVCache:
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        lm = self._engine.lm
        return LLMMetadata(
            context_window=lm.max_context,
            num_output=self.max_new_tokens or self._engine.config.generation.max_new_tokens,
            is_chat_model=True,
            model_name=lm.name,
        )

    # ------------------------------------------------------------------ LlamaIndex LLM API

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        *_, last = self._generate(prompt, formatted, kwargs)
        return CompletionResponse(text=last.text, raw=last.raw)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        return self._generate(prompt, formatted, kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        *_, last = self._generate(self._chat_prompt(messages, kwargs), True, kwargs)
        return completion_response_to_chat_response(last)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        responses = self._generate(self._chat_prompt(messages, kwargs), True, kwargs)
        return stream_completion_response_to_chat_response(responses)

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        prompt = await asyncio.to_thread(self._link_found, prompt, kwargs)
        last = await _last(self._agenerate(prompt, formatted, kwargs))
        return CompletionResponse(text=last.text, raw=last.raw)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        prompt = await asyncio.to_thread(self._link_found, prompt, kwargs)
        return self._agenerate(prompt, formatted, kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt = await asyncio.to_thread(self._chat_prompt, messages, kwargs)
        last = await _last(self._agenerate(prompt, True, kwargs))
        return completion_response_to_chat_response(last)

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        prompt = await asyncio.to_thread(self._chat_prompt, messages, kwargs)
        responses = self._agenerate(prompt, True, kwargs)
        return astream_completion_response_to_chat_response(responses)

    # ------------------------------------------------------------------ internals

    def _render_chat(self, messages: Sequence[ChatMessage]) -> str:
        turns = [{"role": m.role.value, "content": message_text(m)} for m in messages]
        return self._engine.chat_prompt(turns)

    def _render_user_turn(self, prompt: str) -> str:
        turns = [ChatMessage(role=MessageRole.USER, content=prompt)]
        if self.system_prompt:
            turns.insert(0, ChatMessage(role=MessageRole.SYSTEM, content=self.system_prompt))
        return self._render_chat(turns)

    def _chat_prompt(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> str:
        """A chat's prompt: the question of a linked prompt, or the whole rendered chat.
        Retrieved nodes found in the messages are linked: their text leaves the messages,
        and system messages (a LlamaIndex template's instructions) lead the question."""
        if kwargs.get("cache_ids") is not None:
            return chat_question(self._with_system_prompt(messages, messages), self._engine)
        if self._retrieved is not None:
            texts = [message_text(m) for m in messages]
            found = [(m, text, self._retrieved.find(text)) for m, text in zip(messages, texts)]
            nodes = [p.node for *_, placed in found for p in placed]
            if nodes:
                kwargs["cache_ids"] = cache_ids_of(self._engine, nodes)
                rest = [
                    ChatMessage(role=m.role, content=without(text, placed))
                    for m, text, placed in found
                ]
                return chat_question(self._with_system_prompt(rest, messages), self._engine)
        assert self.messages_to_prompt is not None  # set in __init__ or by the caller
        return self.messages_to_prompt(messages)

    def _link_found(self, prompt: str, kwargs: dict[str, Any]) -> str:
        """A plain prompt holding retrieved nodes: link them (`cache_ids` set in `kwargs`)
        and return the rest of the prompt, the question; else the prompt as it is."""
        if not isinstance(prompt, str):  # None or bytes were answered as an empty prompt
            raise TypeError(f"a prompt is text (str), not {type(prompt).__name__}")
        if kwargs.get("cache_ids") is not None or self._retrieved is None:
            return prompt
        placed = self._retrieved.find(prompt)
        if not placed:
            return prompt
        kwargs["cache_ids"] = cache_ids_of(self._engine, [p.node for p in placed])
        return without(prompt, placed)

    def _generate(
        self, prompt: str, formatted: bool, kwargs: dict[str, Any]
    ) -> CompletionResponseGen:
        """Start the engine; one response per new piece of text, then a final one (empty delta,
        whole text) carrying the usage in `raw`."""
        prompt = self._link_found(prompt, kwargs)
        cache_ids, strategy, max_new_tokens = self._call_args(kwargs)
        if cache_ids is None:
            text = prompt if formatted else self._as_prompt(prompt)
            run = self._engine.complete(
                text, max_new_tokens=max_new_tokens, stream=True, **self._sampling(kwargs)
            )
        else:
            prompt = self._linked_question(prompt, formatted)
            run = self._engine.generate(
                prompt,
                cache_ids,
                strategy=strategy,
                max_new_tokens=max_new_tokens,
                stream=True,
                **self._sampling(kwargs),
            )
        assert isinstance(run, AnswerStream)
        return self._responses(run, cache_ids, str(strategy), prompt)

    def _agenerate(
        self, prompt: str, formatted: bool, kwargs: dict[str, Any]
    ) -> CompletionResponseAsyncGen:
        """`_generate` on the engine loop: the request is submitted when iteration starts.
        Bad arguments (an unknown strategy) raise here, as in the sync calls. The caller has
        linked the retrieved nodes in the prompt in a worker thread (`_link_found` or
        `_chat_prompt`): a node not cached yet is encoded there, a forward pass that must not
        stall the event loop."""
        cache_ids, strategy, max_new_tokens = self._call_args(kwargs)
        if cache_ids is None:
            text = prompt if formatted else self._as_prompt(prompt)
            stream = self._engine.astream_complete(
                text, max_new_tokens=max_new_tokens, **self._sampling(kwargs)
            )
        elif batchable(strategy):
            prompt = self._linked_question(prompt, formatted)
            stream = self._engine.astream(
                prompt,
                cache_ids,
                strategy=strategy,
                max_new_tokens=max_new_tokens,
                **self._sampling(kwargs),
            )
        else:
            # The batch decoder refuses this strategy (calibrated link tokens: the prefix tree
            # does not keep them yet; cacheblend's whole-context selection). Refusing would
            # break async callers
            # whose sync calls work, so it keeps its exact sync answer path, each step in a
            # worker thread: the event loop runs on, but this request shares no batch.
            return _in_thread(self._generate(prompt, formatted, kwargs))
        return self._aresponses(stream, cache_ids, str(strategy), prompt)

    def _linked_question(self, prompt: str, formatted: bool) -> str:
        """A linked call's question: this LLM's `system_prompt` leads it, as a plain prompt's
        turn and a chat's system messages lead theirs (a prompt LlamaIndex `formatted` holds
        it already). It was dropped from linked calls only."""
        if formatted or not self.system_prompt:
            return prompt
        return f"{self.system_prompt}\n\n{prompt}"

    def _with_system_prompt(
        self, messages: Sequence[ChatMessage], given: Sequence[ChatMessage]
    ) -> list[ChatMessage]:
        """A linked chat's `messages`, this LLM's `system_prompt` first as a system message
        unless the caller's messages (`given`, before any node's text was cut out of them)
        hold it already: LlamaIndex's `predict` inserts it so."""
        system = self.system_prompt
        if not system or any(
            m.role == MessageRole.SYSTEM and message_text(m) == system for m in given
        ):
            return list(messages)
        return [ChatMessage(role=MessageRole.SYSTEM, content=system), *messages]

    def _call_args(self, kwargs: dict[str, Any]) -> tuple[list[str] | None, Strategy, int | None]:
        """(cache IDs or None for a plain prompt, strategy, max_new_tokens) of one call."""
        max_new_tokens = kwargs.get("max_new_tokens")
        if max_new_tokens is None:  # 0 is the engine's to refuse, not a default
            max_new_tokens = self.max_new_tokens
        # parsed on every call: a bad name on a plain prompt was silently ignored
        given = kwargs.get("strategy")
        if given is None:  # "" is a name, and a bad one: not "not given"
            given = self.strategy if self.strategy is not None else self._engine.config.strategy
        strategy = Strategy.parse(given)
        cache_ids = kwargs.get("cache_ids")
        if cache_ids is None:
            return None, PREFILL, max_new_tokens
        if isinstance(cache_ids, str | bytes):  # would be read one character at a time
            raise TypeError("cache_ids is a list of cache IDs, not one string")
        return list(cache_ids), strategy, max_new_tokens

    def _sampling(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """temperature / top_p / seed of one call: its own, else this LLM's (None: the
        engine's generation config)."""
        return {
            name: kwargs[name] if kwargs.get(name) is not None else getattr(self, name)
            for name in ("temperature", "top_p", "seed")
        }

    def _as_prompt(self, prompt: str) -> str:
        assert self.completion_to_prompt is not None  # set in __init__ or by the caller
        return self.completion_to_prompt(prompt)

    def _responses(
        self, run: AnswerStream, cache_ids: list[str] | None, strategy: str, question: str
    ) -> CompletionResponseGen:
        start = time.perf_counter()  # runs at the first next(), when the engine starts too
        text = ""
        for delta in trimmed(run):
            if not text:
                ttft = time.perf_counter() - start
                dispatcher.event(FirstTokenEvent(ttft_s=ttft, strategy=strategy))
            text += delta
            yield CompletionResponse(text=text, delta=delta)
        assert run.answer is not None
        yield _final(run.answer, bool(text), cache_ids, strategy, question)

    async def _aresponses(
        self,
        stream: AsyncTokenStream[Answer],
        cache_ids: list[str] | None,
        strategy: str,
        question: str,
    ) -> CompletionResponseAsyncGen:
        """`_responses` of an engine-loop request; leaving early (aclose, a cancelled task)
        aborts the request."""
        start = time.perf_counter()
        text, trimmer = "", Trimmer()
        try:
            async for piece in stream:
                if not (delta := trimmer.add(piece)):
                    continue
                if not text:
                    ttft = time.perf_counter() - start
                    dispatcher.event(FirstTokenEvent(ttft_s=ttft, strategy=strategy))
                text += delta
                yield CompletionResponse(text=text, delta=delta)
        finally:
            await stream.aclose()  # a no-op once finished; else the request is aborted
        assert stream.result is not None
        yield _final(stream.result, bool(text), cache_ids, strategy, question)


def _final(
    answer: Answer, streamed: bool, cache_ids: list[str] | None, strategy: str, question: str
) -> CompletionResponse:
    """The last response of a call (empty delta, whole text, usage in `raw`), after its
    events: the link, and the first token if no text was streamed (the model ended at once:
    the first token was end-of-text)."""
    if not streamed:
        dispatcher.event(FirstTokenEvent(ttft_s=answer.ttft_s, strategy=strategy))
    if cache_ids is not None:
        dispatcher.event(
            KVLinkEvent(
                cache_ids=cache_ids,
                strategy=str(answer.strategy),
                prompt_tokens=answer.prompt_tokens,
                context_tokens=answer.context_tokens,
                recomputed_tokens=answer.recomputed_tokens,
            )
        )
    return CompletionResponse(text=answer.text, delta="", raw=usage(answer, cache_ids, question))


async def _last(responses: CompletionResponseAsyncGen) -> CompletionResponse:
    """Run a call to its end; its final response (whole text, usage)."""
    last = None
    async for response in responses:
        last = response
    assert last is not None  # the final response always comes
    return last


async def _in_thread(responses: CompletionResponseGen) -> CompletionResponseAsyncGen:
    """A sync stream of responses as an async one, each step run in a worker thread."""
    end = object()
    while (response := await asyncio.to_thread(next, responses, end)) is not end:
        yield cast(CompletionResponse, response)
