"""Instrumentation events for what LlamaIndex's own LLM events cannot say: which cached chunks
were linked, how many of their tokens had to be recomputed, and when the first token came.

Subscribe with a `BaseEventHandler` on `llama_index.core.instrumentation.get_dispatcher()`.
"""

from __future__ import annotations

from llama_index.core.instrumentation.events import BaseEvent


class KVLinkEvent(BaseEvent):
    """A linked generation finished: the chunks it linked and what linking cost.

    Sent when the answer is complete (the counts come with it), also for streamed answers.
    """

    cache_ids: list[str]
    strategy: str
    prompt_tokens: int  # system prefix + chunks + question
    context_tokens: int  # system prefix + chunks, all served from the KV store
    recomputed_tokens: int  # context tokens recomputed while linking (all of them for "full")

    @classmethod
    def class_name(cls) -> str:
        return "KVLinkEvent"


class FirstTokenEvent(BaseEvent):
    """The first answer token exists: `ttft_s` after the request started (plain or linked).

    Streamed answers send it as the first piece arrives, so its timestamp is the real one.
    """

    ttft_s: float
    strategy: str  # a link strategy, or "prefill" for plain prompts

    @classmethod
    def class_name(cls) -> str:
        return "FirstTokenEvent"
