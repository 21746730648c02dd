"""KVCacheChatEngine: LlamaIndex's condense-plus-context chat, answered over linked KV.

Why CondensePlusContextChatEngine: it separates the two jobs a follow-up needs. (1) Retrieval
runs on a standalone question the LLM condenses from the history ("when was it lit?" -> "when
was the lighthouse lit?"), a plain, unlinked call. (2) The answer comes from a response
synthesizer, the one part replaced here: KVCacheSynthesizer links the retrieved nodes' cache IDs
and renders the chat history into the question (the linked prompt's layout is fixed, see
rag_kvcache.chat), as the model's chat template renders turns. So the system prompt is the
engine's, whose KV is cached; the base class's system and context prompts have no place and are
not accepted. The answer sees the last `history_turns` exchanges only (the memory keeps them
all), so a long chat never crowds the chunks out of the window. A follow-up answer that is an
earlier answer again, word for word (SmolLM2-135M copies its last turn), is answered again
without the history (FollowUpSynthesizer, with rag_kvcache.chat's guard). Memory, streaming
and async come unchanged from the base class.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks import CallbackManager
from llama_index.core.chat_engine import CondensePlusContextChatEngine
from llama_index.core.llms import LLM
from llama_index.core.memory import BaseMemory, Memory
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import PromptTemplate
from llama_index.core.response_synthesizers.base import QueryTextType
from llama_index.core.schema import NodeWithScore
from llama_index.core.settings import Settings

from rag_kvcache.chat import HISTORY_TURNS, aunless_repeated, earlier_answers, unless_repeated
from rag_kvcache.integrations.llama_index.llm import KVCacheLLM, message_text
from rag_kvcache.integrations.llama_index.synthesizer import KVCacheSynthesizer


class KVCacheChatEngine(CondensePlusContextChatEngine):
    """Chat over cached chunks: condense -> retrieve -> linked answer that sees the history.

    `skip_condense=True` retrieves on the latest message as is (one LLM call per turn, not two).
    `history_turns`: how many earlier exchanges the answer sees (0: none, each turn alone).
    """

    def __init__(
        self,
        retriever: BaseRetriever,
        llm: KVCacheLLM,
        memory: BaseMemory | None = None,
        chat_history: list[ChatMessage] | None = None,
        condense_prompt: str | PromptTemplate | None = None,
        skip_condense: bool = False,
        node_postprocessors: list[BaseNodePostprocessor] | None = None,
        callback_manager: CallbackManager | None = None,
        verbose: bool = False,
        history_turns: int = HISTORY_TURNS,
    ):
        if not isinstance(llm, KVCacheLLM):
            raise TypeError(f"KVCacheChatEngine needs a KVCacheLLM, got {type(llm).__name__}")
        if history_turns < 0:
            raise ValueError(f"history_turns must be >= 0, got {history_turns}")
        if memory is None:  # history fits the model's window, less room for the reply
            limit = llm.metadata.context_window - llm.metadata.num_output
            memory = Memory.from_defaults(chat_history=chat_history or [], token_limit=limit)
        super().__init__(
            retriever,
            llm,
            memory,
            condense_prompt=condense_prompt,
            skip_condense=skip_condense,
            node_postprocessors=node_postprocessors,
            callback_manager=callback_manager or Settings.callback_manager,
            verbose=verbose,
        )
        self._kv_llm = llm
        self._history_turns = history_turns

    @classmethod
    def from_defaults(  # type: ignore[override]  # no system/context prompts, on purpose
        cls, retriever: BaseRetriever, llm: LLM | None = None, **kwargs: Any
    ) -> KVCacheChatEngine:
        """As the constructor; llm is required (Settings.llm would not link cached KV)."""
        if not isinstance(llm, KVCacheLLM):
            raise TypeError("KVCacheChatEngine.from_defaults needs llm=KVCacheLLM(engine)")
        return cls(retriever, llm, **kwargs)

    def _get_response_synthesizer(  # type: ignore[override]  # a synthesizer, not CompactAndRefine
        self, chat_history: list[ChatMessage], streaming: bool = False
    ) -> KVCacheSynthesizer:
        recent = chat_history[max(0, len(chat_history) - 2 * self._history_turns) :]
        return FollowUpSynthesizer(
            self._kv_llm,
            streaming=streaming,
            chat_history=recent,
            callback_manager=self.callback_manager,
        )


class FollowUpSynthesizer(KVCacheSynthesizer):
    """A chat turn's synthesizer: an answer that is an earlier answer of the history again, word
    for word, is replaced by the answer to the question alone (no history). A streamed answer
    is held back while it spells the start of an earlier answer, so a repeat is never shown."""

    def __init__(self, llm: KVCacheLLM, **kwargs: Any):
        super().__init__(llm, **kwargs)
        self._alone = {k: v for k, v in kwargs.items() if k != "chat_history"}
        history = kwargs.get("chat_history") or []
        turns = [{"role": m.role.value, "content": message_text(m)} for m in history]
        self._earlier = earlier_answers(turns, None)  # the chat engine has cut the history

    def synthesize(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        response = super().synthesize(query, nodes, additional_source_nodes, **response_kwargs)
        if not self._earlier or not nodes:
            return response

        def again() -> RESPONSE_TYPE:
            alone = KVCacheSynthesizer(self._kv_llm, **self._alone)
            return alone.synthesize(query, nodes, additional_source_nodes, **response_kwargs)

        if isinstance(response, StreamingResponse):

            def retried() -> Iterator[str]:
                retry = again()
                assert isinstance(retry, StreamingResponse)
                yield from retry.response_gen
                if response.metadata is not None:  # the usage of the answer shown
                    response.metadata.update(retry.metadata or {})

            response.response_gen = unless_repeated(response.response_gen, self._earlier, retried)
            return response
        if isinstance(response, Response) and (response.response or "").strip() in self._earlier:
            return again()
        return response

    async def asynthesize(
        self,
        query: QueryTextType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        response = await super().asynthesize(
            query, nodes, additional_source_nodes, **response_kwargs
        )
        if not self._earlier or not nodes:
            return response

        async def again() -> RESPONSE_TYPE:
            alone = KVCacheSynthesizer(self._kv_llm, **self._alone)
            return await alone.asynthesize(query, nodes, additional_source_nodes, **response_kwargs)

        if isinstance(response, AsyncStreamingResponse):

            async def retried() -> AsyncIterator[str]:
                retry = await again()
                assert isinstance(retry, AsyncStreamingResponse)
                async for piece in retry.response_gen:
                    yield piece
                if response.metadata is not None:
                    response.metadata.update(retry.metadata or {})

            response.response_gen = aunless_repeated(response.response_gen, self._earlier, retried)
            return response
        if isinstance(response, Response) and (response.response or "").strip() in self._earlier:
            return await again()
        return response
