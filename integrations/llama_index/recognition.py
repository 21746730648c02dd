"""Linking the retrieved chunks inside a prompt that LlamaIndex built.

A LlamaIndex user's first program sets `Settings.llm = KVCacheLLM(engine)` and calls
`index.as_query_engine()`: LlamaIndex's own synthesizer then pastes the retrieved nodes' text
into its prompt template and hands the LLM one string (or chat messages), with no cache IDs.
Answered as it comes, that prompt is a plain prefill of every chunk: the cache does nothing.

So the plugin watches retrieval, as LlamaIndex's instrumentation lets any handler do: every
`RetrievalEndEvent` records its nodes (their text as a prompt shows it, and their cache ID if
tagged). When a plain LLM call arrives, `find` locates those nodes' text in the prompt; the
call is then answered by linking those chunks, in the order the prompt has them, with the rest
of the prompt (the template's instructions and the query) as the question. Nodes without a
cache ID (an index built without KVCacheTransform) are encoded on first use, as the plugin's
own synthesizer does. `KVCacheLLM(link_retrieved=False)` answers prompts as given.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.schema import BaseNode, MetadataMode

from rag_kvcache.integrations.llama_index.transform import node_text

REMEMBERED = 1024  # most recently retrieved nodes looked for in prompts
SHORTEST = 40  # characters: shorter node texts could match by chance


@dataclass(frozen=True)
class Placed:
    """A retrieved node found in a prompt: where its text starts and ends."""

    start: int
    end: int
    node: BaseNode


class RetrievedNodes(BaseEventHandler):
    """The nodes LlamaIndex retrievers returned lately (a bounded memory, newest kept), keyed
    by their text as prompts show it. One per process, on the root dispatcher (`watch`)."""

    _nodes: OrderedDict[str, BaseNode] = PrivateAttr(default_factory=OrderedDict)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @classmethod
    def class_name(cls) -> str:
        return "RetrievedNodes"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, RetrievalEndEvent):
            self.remember([n.node for n in event.nodes])

    def remember(self, nodes: list[BaseNode]) -> None:
        with self._lock:
            for node in nodes:
                # as LlamaIndex's synthesizers write it (metadata lines, then text), and bare
                for text in (node.get_content(MetadataMode.LLM), node_text(node)):
                    if len(text.strip()) >= SHORTEST:
                        self._nodes[text.strip()] = node
                        self._nodes.move_to_end(text.strip())
            while len(self._nodes) > REMEMBERED:
                self._nodes.popitem(last=False)

    def find(self, prompt: str) -> list[Placed]:
        """The remembered nodes whose text is in `prompt`, in prompt order, not overlapping
        (where texts overlap, the longer one: a node's text with its metadata lines wins
        over the bare text inside it)."""
        with self._lock:
            known = list(self._nodes.items())
        hits = []
        for text, node in known:
            at = prompt.find(text)
            if at >= 0:
                hits.append(Placed(at, at + len(text), node))
        hits.sort(key=lambda p: (p.start, -(p.end - p.start)))
        placed: list[Placed] = []
        for hit in hits:
            if placed and hit.start < placed[-1].end:
                continue
            placed.append(hit)
        return placed


def without(prompt: str, placed: list[Placed]) -> str:
    """`prompt` with the placed nodes' text cut out (and the blank lines they leave)."""
    pieces, at = [], 0
    for p in placed:
        pieces.append(prompt[at : p.start])
        at = p.end
    pieces.append(prompt[at:])
    return tidy("".join(pieces))


def tidy(text: str) -> str:
    """Text a context was cut out of: runs of blank lines made one, the ends stripped."""
    return re.sub(r"\n\s*\n(\s*\n)+", "\n\n", text).strip()


_watcher: RetrievedNodes | None = None
_watch_lock = threading.Lock()


def watch() -> RetrievedNodes:
    """The process's RetrievedNodes, added to LlamaIndex's root dispatcher on first use."""
    global _watcher
    with _watch_lock:
        if _watcher is None:
            _watcher = RetrievedNodes()
            get_dispatcher().add_event_handler(_watcher)
        return _watcher
