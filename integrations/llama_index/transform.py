"""KVCacheTransform: the ingestion step that KV-encodes every node once and tags it with its
cache ID, so retrieval can hand the LLM cache IDs instead of text to prefill."""

from __future__ import annotations

import hashlib
import uuid
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent
from tqdm.auto import tqdm

from rag_kvcache.engine import RagKVCache
from rag_kvcache.errors import InvalidNameError, shown_name
from rag_kvcache.storage.layout import RULES, is_name

CACHE_ID_KEY = "cache_id"
TAGGED_TEXT_KEY = "cache_id_text"  # a hash of the cache ID with the text it was given for


def node_text(node: BaseNode) -> str:
    """What gets encoded: the node as LlamaIndex shows it to an LLM (its LLM-visible metadata
    lines, e.g. a file path, then its text), so a linked answer reads what LlamaIndex's own
    synthesizers would have shown. The cache ID is hidden from that view, so a node maps to
    the same cache ID before and after it is tagged, whoever encodes it."""
    return node.get_content(metadata_mode=MetadataMode.LLM)


def attach_cache_id(node: BaseNode, cache_id: str) -> BaseNode:
    """Record `cache_id` in the node's metadata, with a hash of it and the text it was given
    for (`tag_hash`: a node whose text is replaced later, e.g. by a sentence window, is no
    longer that chunk, nor is a node given another chunk's ID), both hidden from embedding and
    from LLM prompts (hashes: they would only add noise to the vector and tokens to a
    prompt)."""
    for key in (CACHE_ID_KEY, TAGGED_TEXT_KEY):
        for excluded in (node.excluded_embed_metadata_keys, node.excluded_llm_metadata_keys):
            if key not in excluded:
                excluded.append(key)
    node.metadata[CACHE_ID_KEY] = cache_id
    node.metadata[TAGGED_TEXT_KEY] = tag_hash(cache_id, node_text(node))
    return node


def tag_hash(cache_id: str, text: str) -> str:
    """The hash binding a cache ID to the text it was given for. Of the text alone, another
    valid ID copied into the node's metadata (a node built from another's, a hand edit) was
    trusted, and the model read that chunk instead of the text the node shows."""
    pair = f"{cache_id}\n{text}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(pair, digest_size=16).hexdigest()


def tagged_id(engine: RagKVCache, node: BaseNode) -> str | None:
    """The node's cache ID, if it still names this node's text in this engine's store: not
    when the text changed since it was tagged, or the chunk is gone (expired, another store or
    model), or the tag is not an ID at all."""
    cache_id = node.metadata.get(CACHE_ID_KEY)
    if not isinstance(cache_id, str):
        return None
    if node.metadata.get(TAGGED_TEXT_KEY) != tag_hash(cache_id, node_text(node)):
        return None
    try:
        return cache_id if engine.store.contains(cache_id) else None
    except InvalidNameError:
        return None


def has_text(node: BaseNode) -> bool:
    """Whether the node holds something to encode: a blank page's node (SentenceSplitter makes
    one from an empty document) has nothing to link, and is left out rather than failing the
    run or the answer it is part of."""
    return holds_text(node_text(node))


def holds_text(text: str) -> bool:
    """Whether a chunk's text is more than whitespace and NUL: the engine drops NUL (some
    PDFs' text holds it), and a text of NULs alone then failed as an empty chunk."""
    return bool(text.replace("\x00", "").strip())


def cache_ids_of(engine: RagKVCache, nodes: Sequence[BaseNode]) -> list[str]:
    """The cache IDs of the nodes that hold text (`has_text`), in order. Nodes without a
    usable one (`tagged_id`) are encoded from their text now and (re)tagged; IDs are content
    hashes, so an expired chunk gets its old ID back, and a chunk already cached costs only
    its tokenizing."""
    nodes = [node for node in nodes if has_text(node)]
    todo = [node for node in nodes if tagged_id(engine, node) is None]
    if todo:
        new_ids = engine.generate_context_cache([node_text(node) for node in todo])
        for node, cache_id in zip(todo, new_ids, strict=True):
            attach_cache_id(node, cache_id)
    return [str(node.metadata[CACHE_ID_KEY]) for node in nodes]


class KVCacheTransform(TransformComponent):
    """Encode each node's text into the engine's KV store (already cached ones are skipped) and
    write its cache ID into `node.metadata["cache_id"]`. Put it after the node parser in an
    IngestionPipeline. Runs in this process only: the engine holds a model, so `num_workers > 1`
    (which pickles transforms) is not supported.

    `index_documents=True` also records each source document's chunks in the engine's own
    corpus and FAISS index (`engine.ingest_document`, durable store needed), so KVCacheRetriever
    finds them. A document is named by its LlamaIndex id (`node.ref_doc_id`) and replaced as a
    whole, so pass all of a document's nodes in one run.
    """

    model: str = Field(
        default="",
        description="Fingerprint of the model whose KV the cache IDs name.",
    )
    index_documents: bool = Field(
        default=False,
        description="Also record the nodes' documents in the engine's retrieval index.",
    )
    show_progress: bool = Field(default=False, description="Show a bar of chunks encoded.")
    _engine: RagKVCache = PrivateAttr()

    def __init__(
        self,
        engine: RagKVCache,
        index_documents: bool = False,
        show_progress: bool = False,
        **kwargs: Any,
    ):
        kwargs.update(
            model=engine.lm.fingerprint,
            index_documents=index_documents,
            show_progress=show_progress,
        )
        super().__init__(**kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "KVCacheTransform"

    def __getstate__(self) -> dict[Any, Any]:
        """Refused: worker processes (`pipeline.run(num_workers=N)`) would get the step
        without its engine, which holds the model and the store."""
        raise TypeError(
            "KVCacheTransform runs in the process that holds its engine: run the pipeline "
            "with num_workers=1 (the engine's model already uses every core)"
        )

    def to_dict(self, **kwargs: Any) -> dict[str, Any]:
        """With a fresh nonce: an IngestionPipeline keys its cache by this dict and the nodes,
        and on a hit it hands back the nodes without calling the step, so the store would
        never get them (an edit reverted would serve the edit; a new store would stay empty).
        The step's work is that side effect: it always runs, and chunks already cached cost
        only their tokenizing."""
        return {**super().to_dict(**kwargs), "run": uuid.uuid4().hex}

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        """Every node with text encoded and tagged; blank ones (`has_text`) passed on untagged,
        with a warning: one blank page failed the whole run, after the documents before it
        were written."""
        if blank := sum(not has_text(node) for node in nodes):
            warnings.warn(
                f"{blank} node(s) hold no text (a blank page?): passed on without a cache ID",
                UserWarning,
                stacklevel=2,
            )
        show = self.show_progress or bool(kwargs.get("show_progress", False))
        with tqdm(
            total=len(nodes) - blank, desc="KV-encoding chunks", unit="chunk", disable=not show
        ) as bar:
            if self.index_documents:
                tagged = self._ingest_documents(nodes, bar.update)
            else:
                encoded = [node for node in nodes if has_text(node)]
                texts = [node_text(node) for node in encoded]
                ids = self._engine.generate_context_cache(texts, on_encoded=bar.update)
                tagged = list(zip(encoded, ids, strict=True))
        for node, cache_id in tagged:
            attach_cache_id(node, cache_id)
        return nodes

    def _ingest_documents(
        self, nodes: Sequence[BaseNode], on_encoded: Callable[[int], None]
    ) -> list[tuple[BaseNode, str]]:
        """One engine.ingest_document per source document, of its nodes with text; each such
        node with its cache ID. A document whose nodes all hold no text (a page emptied since
        the last run) is removed: its earlier chunks would still be retrieved."""
        positions: dict[str, list[int]] = {}
        for i, node in enumerate(nodes):
            positions.setdefault(node.ref_doc_id or node.node_id, []).append(i)
        named_at_random = [
            nodes[where[0]].metadata["file_path"]
            for source, where in positions.items()
            if "file_path" in nodes[where[0]].metadata and _is_uuid(source)
        ]
        if named_at_random:
            warnings.warn(
                f"{len(named_at_random)} documents from files (e.g. {named_at_random[0]}) have "
                "random IDs, so every run adds them again as new documents: read them with "
                "SimpleDirectoryReader(..., filename_as_id=True) (and give the pipeline a "
                "docstore to skip unchanged files)",
                UserWarning,
                stacklevel=3,
            )
        for source in positions:  # all checked before any is written: one bad name failed
            if not is_name("document source", source):  # the run after the documents before
                raise InvalidNameError(  # it were written (and a docstore then skips them)
                    f"document id {shown_name(source)} cannot name a document in the store "
                    f"(expected {RULES['document source'].allowed}): give the document "
                    "another id_"
                )
        tagged: list[tuple[BaseNode, str]] = []
        for source, where in positions.items():
            kept = [nodes[i] for i in where if has_text(nodes[i])]
            if not kept:
                self._engine.remove_document(source)
                continue
            chunks = [node_text(node) for node in kept]
            ingested = self._engine.ingest_document(source, chunks, on_encoded=on_encoded)
            tagged += zip(kept, ingested.cache_ids, strict=True)
        return tagged


def _is_uuid(name: str) -> bool:
    """Whether a document ID is a random one (LlamaIndex's default), not a stable name."""
    try:
        uuid.UUID(name)
    except ValueError:
        return False
    return True
