"""KVCacheChatEngine: LlamaIndex's condense-plus-context chat, answered over linked KV.

Why CondensePlusContextChatEngine: it separates the two jobs a follow-up needs. (1) Retrieval
runs on a standalone question the LLM condenses from the history ("when was it lit?" -> "when
was the lighthouse lit?"), a plain, unlinked call. (2) The answer comes from a response
synthesizer, the one part replaced here: KVCacheSynthesizer links the retrieved nodes' cache IDs
and renders the chat history into the question (the linked prompt's layout is fixed, see
llm.chat_question). So the system prompt is the engine's, whose KV is cached; the base class's
system and context prompts have no place and are not accepted. Memory, streaming and async
come unchanged from the base class.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.callbacks import CallbackManager
from llama_index.core.chat_engine import CondensePlusContextChatEngine
from llama_index.core.llms import LLM
from llama_index.core.memory import BaseMemory, Memory
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import PromptTemplate
from llama_index.core.settings import Settings

from rag_kvcache.integrations.llama_index.llm import KVCacheLLM
from rag_kvcache.integrations.llama_index.synthesizer import KVCacheSynthesizer


class KVCacheChatEngine(CondensePlusContextChatEngine):
    """Chat over cached chunks: condense -> retrieve -> linked answer that sees the history.

    `skip_condense=True` retrieves on the latest message as is (one LLM call per turn, not two).
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
    ):
        if not isinstance(llm, KVCacheLLM):
            raise TypeError(f"KVCacheChatEngine needs a KVCacheLLM, got {type(llm).__name__}")
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
        return KVCacheSynthesizer(
            self._kv_llm,
            streaming=streaming,
            chat_history=chat_history,
            callback_manager=self.callback_manager,
        )
