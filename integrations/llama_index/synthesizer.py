"""KVCacheSynthesizer: answers from retrieved nodes by linking their cached KV.

LlamaIndex's synthesizers paste node text into a prompt, so every chunk is prefilled again on
every query. This one reads each node's `cache_id` (in retrieval order) and has the KVCacheLLM
link those chunks behind the engine's system prompt, then asks the question. Nodes without a
usable cache ID are encoded on the spot (and tagged), so no retrieved context is ever dropped.

`asynthesize` (what `aquery`, `achat` and `astream_chat` call) awaits the LLM's native async
methods, so many concurrent queries decode in the engine loop's one batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, Generator, Iterable, Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.synthesis import (
    SynthesizeEndEvent,
    SynthesizeStartEvent,
)
from llama_index.core.prompts import BasePromptTemplate, ChatPromptTemplate, PromptTemplate
from llama_index.core.response_synthesizers.base import BaseSynthesizer, QueryTextType
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.core.types import RESPONSE_TEXT_TYPE

from rag_kvcache.integrations.llama_index.llm import KVCacheLLM
from rag_kvcache.integrations.llama_index.recognition import tidy
from rag_kvcache.integrations.llama_index.transform import cache_ids_of, holds_text

dispatcher = get_dispatcher(__name__)

USAGE_KEY = "usage"  # Response.metadata[USAGE_KEY]: the LLM call's raw usage (see llm.usage)
QUERY_ONLY = PromptTemplate("{context_str}{query_str}")  # the chunks, then the bare query


def checked(template: BasePromptTemplate) -> BasePromptTemplate:
    """A QA template the synthesizer can use: one that asks the query."""
    if "query_str" not in template.template_vars:
        raise ValueError(
            f"a text_qa_template needs {{query_str}}; this one has {template.template_vars}"
        )
    return template


class KVCacheSynthesizer(BaseSynthesizer):
    """Link the nodes' cached chunks and answer the query with one KVCacheLLM call.

    `text_qa_template`: a LlamaIndex QA template ({context_str}, {query_str}). The chunks are
    linked before the question whatever the template says (their cached KV fixes the layout),
    so the question is the template with an empty context: its instructions and the query.
    The default asks the bare query. `get_prompts` / `update_prompts` read and replace it, as
    LlamaIndex's synthesizers do.

    `chat_history`: earlier turns, rendered into the question (see llm.chat_question); the chat
    engine sets it. `Response.metadata` holds each node's metadata by node id, as LlamaIndex's
    synthesizers do, plus `metadata["usage"]` (prompt/completion tokens, context and recomputed
    tokens, ttft_s, strategy, cache_ids); a streaming response fills it in once exhausted.
    """

    def __init__(
        self,
        llm: KVCacheLLM,
        strategy: str | None = None,
        streaming: bool = False,
        chat_history: Sequence[ChatMessage] | None = None,
        callback_manager: CallbackManager | None = None,
        text_qa_template: BasePromptTemplate | None = None,
    ):
        if not isinstance(llm, KVCacheLLM):
            raise TypeError(f"KVCacheSynthesizer needs a KVCacheLLM, got {type(llm).__name__}")
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._kv_llm = llm
        self._strategy = strategy
        self._chat_history = list(chat_history or [])
        self._text_qa_template = checked(text_qa_template or QUERY_ONLY)

    def _get_prompts(self) -> dict[str, Any]:
        return {"text_qa_template": self._text_qa_template}

    def _update_prompts(self, prompts: Any) -> None:
        if "text_qa_template" in prompts:
            self._text_qa_template = checked(prompts["text_qa_template"])

    def question(self, query: str) -> str:
        """What the LLM is asked after the linked chunks: the QA template, context empty."""
        template = self._text_qa_template
        if isinstance(template, ChatPromptTemplate):
            text = "\n\n".join(
                m.content or "" for m in template.format_messages(context_str="", query_str=query)
            )
        else:
            text = template.format(context_str="", query_str=query)
        return tidy(text)

    # ------------------------------------------------------------------ nodes -> answer

    def synthesize(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        if not nodes:  # LlamaIndex's behaviour: no context, no LLM call, "Empty Response"
            return super().synthesize(query, nodes, additional_source_nodes, **response_kwargs)
        bundle = QueryBundle(query_str=query) if isinstance(query, str) else query
        dispatcher.event(SynthesizeStartEvent(query=bundle))
        sources = list(nodes) + list(additional_source_nodes or [])
        metadata = self._get_metadata_for_response([n.node for n in sources]) or {}
        with self._callback_manager.event(
            CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: bundle.query_str}
        ) as cb_event:
            cache_ids = self._cache_ids(nodes)
            answer = self._answer(
                self.question(bundle.query_str), cache_ids, metadata, **response_kwargs
            )
            response: RESPONSE_TYPE
            if isinstance(answer, str):
                response = Response(answer, source_nodes=sources, metadata=metadata)
            else:
                response = StreamingResponse(answer, source_nodes=sources, metadata=metadata)
            cb_event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=bundle, response=response))
        return response

    async def asynthesize(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        """`synthesize` on the engine loop: a Response, or an AsyncStreamingResponse when
        streaming (what LlamaIndex's async chat engines expect)."""
        if not nodes:
            return await super().asynthesize(
                query, nodes, additional_source_nodes, **response_kwargs
            )
        bundle = QueryBundle(query_str=query) if isinstance(query, str) else query
        dispatcher.event(SynthesizeStartEvent(query=bundle))
        sources = list(nodes) + list(additional_source_nodes or [])
        metadata = self._get_metadata_for_response([n.node for n in sources]) or {}
        with self._callback_manager.event(
            CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: bundle.query_str}
        ) as cb_event:
            # a store lookup per node, and an encode for an untagged one: off the event loop
            cache_ids = await asyncio.to_thread(self._cache_ids, nodes)
            answer = await self._aanswer(
                self.question(bundle.query_str), cache_ids, metadata, **response_kwargs
            )
            response: RESPONSE_TYPE
            if isinstance(answer, str):
                response = Response(answer, source_nodes=sources, metadata=metadata)
            else:
                response = AsyncStreamingResponse(answer, source_nodes=sources, metadata=metadata)
            cb_event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=bundle, response=response))
        return response

    # ------------------------------------------------------------------ texts -> answer

    def get_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """Plain texts (the BaseSynthesizer contract): cached (if new) and linked in order."""
        chunks = [text for text in text_chunks if holds_text(text)]  # a blank one: none to link
        cache_ids = self._kv_llm.engine.generate_context_cache(chunks)
        return self._answer(self.question(query_str), cache_ids, {}, **response_kwargs)

    async def aget_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        engine = self._kv_llm.engine
        chunks = [text for text in text_chunks if holds_text(text)]  # a blank one: none to link
        cache_ids = await asyncio.to_thread(engine.generate_context_cache, chunks)
        return await self._aanswer(self.question(query_str), cache_ids, {}, **response_kwargs)

    # ------------------------------------------------------------------ internals

    def _cache_ids(self, nodes: Sequence[NodeWithScore]) -> list[str]:
        return cache_ids_of(self._kv_llm.engine, [n.node for n in nodes])

    def _answer(
        self, query: str, cache_ids: list[str], metadata: dict[str, Any], **kwargs: Any
    ) -> str | Generator[str, None, None]:
        """One linked LLM call; its usage goes into `metadata` (at the end, when streaming)."""
        kwargs = self._call_kwargs(cache_ids, kwargs)
        llm = self._kv_llm
        if self._chat_history:
            messages = self._messages(query)
            if not self._streaming:
                chat = llm.chat(messages, **kwargs)
                metadata[USAGE_KEY] = chat.raw
                return chat.message.content or ""
            chunks = ((r.delta or "", r.raw) for r in llm.stream_chat(messages, **kwargs))
            return _deltas(chunks, metadata)
        if not self._streaming:
            completion = llm.complete(query, **kwargs)
            metadata[USAGE_KEY] = completion.raw
            return completion.text
        pieces = ((r.delta or "", r.raw) for r in llm.stream_complete(query, **kwargs))
        return _deltas(pieces, metadata)

    async def _aanswer(
        self, query: str, cache_ids: list[str], metadata: dict[str, Any], **kwargs: Any
    ) -> str | AsyncGenerator[str, None]:
        """`_answer` through the LLM's async methods (a request of the engine loop)."""
        kwargs = self._call_kwargs(cache_ids, kwargs)
        llm = self._kv_llm
        if self._chat_history:
            messages = self._messages(query)
            if not self._streaming:
                chat = await llm.achat(messages, **kwargs)
                metadata[USAGE_KEY] = chat.raw
                return chat.message.content or ""
            chats = await llm.astream_chat(messages, **kwargs)
            return _adeltas(((r.delta or "", r.raw) async for r in chats), metadata)
        if not self._streaming:
            completion = await llm.acomplete(query, **kwargs)
            metadata[USAGE_KEY] = completion.raw
            return completion.text
        completions = await llm.astream_complete(query, **kwargs)
        return _adeltas(((r.delta or "", r.raw) async for r in completions), metadata)

    def _call_kwargs(self, cache_ids: list[str], kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = {"cache_ids": cache_ids, **kwargs}
        if self._strategy is not None:
            kwargs.setdefault("strategy", self._strategy)
        return kwargs

    def _messages(self, query: str) -> list[ChatMessage]:
        return [*self._chat_history, ChatMessage(role=MessageRole.USER, content=query)]


def _deltas(
    responses: Iterable[tuple[str, Any]], metadata: dict[str, Any]
) -> Generator[str, None, None]:
    """Text deltas of a streamed call; the usage of its final response lands in `metadata`."""
    for delta, raw in responses:
        if raw:
            metadata[USAGE_KEY] = raw
        if delta:
            yield delta


async def _adeltas(
    responses: AsyncIterable[tuple[str, Any]], metadata: dict[str, Any]
) -> AsyncGenerator[str, None]:
    """`_deltas` of an async streamed call."""
    async for delta, raw in responses:
        if raw:
            metadata[USAGE_KEY] = raw
        if delta:
            yield delta
