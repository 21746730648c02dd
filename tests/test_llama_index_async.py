"""The LlamaIndex plugin's async paths, on the engine loop: concurrent `aquery` / `achat` calls
of real LlamaIndex query and chat engines decode in one batch and answer exactly what their
sync calls answer; async streams join to the sync text; a cancelled query lets go of the
prefix tree. A tiny random-weight model (greedy, so exact equalities hold) and all-MiniLM-L6-v2
for retrieval."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response
from llama_index.core.schema import TextNode

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.integrations.llama_index import (
    KVCacheLLM,
    KVCacheTransform,
    MiniLMEmbedding,
    as_chat_engine,
    as_query_engine,
)
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.serving.prefix_tree import PrefixTree
from rag_kvcache.strategy import Strategy

MAX_NEW = 8
TEXTS = [
    "The Hallam Point lighthouse was designed by the engineer Mara Quell.",
    "It was first lit in 1788 and its lamp burned whale oil until 1861.",
    "Velmora's harbor has three basins; the deepest, North Basin, is 14 meters deep.",
    "The town of Velmora holds a kite festival every April on Brindle Hill.",
    "The rowing league has six crews; the oldest was founded in 1901.",
]
QUESTIONS = [
    "Who designed the Hallam Point lighthouse?",
    "When was the lighthouse first lit?",
    "How deep is North Basin?",
    "When is the kite festival?",
    "How many crews does the rowing league have?",
]


@pytest.fixture(scope="module")
def embed_model() -> MiniLMEmbedding:
    return MiniLMEmbedding()


@pytest.fixture
def engine(tiny64: LoadedModel) -> Iterator[RagKVCache]:
    config = EngineConfig(generation=GenerationConfig(max_new_tokens=MAX_NEW))
    engine = RagKVCache(config, lm=tiny64)
    yield engine
    engine.close()


@pytest.fixture
def index(engine: RagKVCache, embed_model: MiniLMEmbedding) -> VectorStoreIndex:
    nodes = KVCacheTransform(engine)([TextNode(text=t) for t in TEXTS])
    return VectorStoreIndex(nodes, embed_model=embed_model)


def refs(tree: PrefixTree) -> int:
    return sum(node.refs for node in tree.nodes())


def steps(engine: RagKVCache) -> int:
    """Batched decode forwards the engine loop has run."""
    return engine.serving_loop().decoder.steps


def test_concurrent_aqueries_equal_sequential_queries_in_fewer_decode_steps(engine, index):
    query_engine = as_query_engine(engine, index=index, similarity_top_k=2, strategy="legolink:2")
    alone = [query_engine.query(q) for q in QUESTIONS]
    assert steps(engine) == 0  # the sync path does not use the loop

    async def together() -> list[Any]:
        return await asyncio.gather(*(query_engine.aquery(q) for q in QUESTIONS))

    answers = asyncio.run(together())
    tokens = 0
    for answer, sync in zip(answers, alone, strict=True):
        assert isinstance(answer, Response) and isinstance(sync, Response)
        assert answer.response == sync.response
        mine, theirs = answer.metadata["usage"], sync.metadata["usage"]
        assert mine["token_ids"] == theirs["token_ids"] and mine["token_ids"]
        assert mine["cache_ids"] == theirs["cache_ids"] and len(mine["cache_ids"]) == 2
        assert mine["prompt_tokens"] == theirs["prompt_tokens"]
        assert [n.node.node_id for n in answer.source_nodes] == [
            n.node.node_id for n in sync.source_nodes
        ]
        tokens += len(mine["token_ids"])
    # one batch: each step decoded several queries at once (the first token of each comes
    # from its link, the rest from shared steps)
    assert 0 < steps(engine) < tokens - len(QUESTIONS)
    assert refs(engine.prefix_tree) == 0

    # streamed, concurrently: AsyncStreamingResponse whose pieces make the same answers
    streaming = as_query_engine(
        engine, index=index, similarity_top_k=2, strategy="legolink:2", streaming=True
    )

    async def streamed() -> list[tuple[str, dict[str, Any]]]:
        async def one(question: str) -> tuple[str, dict[str, Any]]:
            response = await streaming.aquery(question)
            assert isinstance(response, AsyncStreamingResponse)
            text = "".join([piece async for piece in response.async_response_gen()])
            assert response.metadata is not None
            return text, response.metadata["usage"]

        return await asyncio.gather(*(one(q) for q in QUESTIONS))

    for (text, usage), sync in zip(asyncio.run(streamed()), alone, strict=True):
        assert text == sync.response and usage["token_ids"] == sync.metadata["usage"]["token_ids"]
    assert refs(engine.prefix_tree) == 0


def test_async_llm_streams_join_to_the_sync_text(engine, index):
    """acomplete / astream_complete / achat / astream_chat, plain and linked, run on the
    loop and answer what the sync calls answer; stream responses carry the delta and the
    cumulative text, as LlamaIndex's streaming types do."""
    llm = KVCacheLLM(engine)
    cache_ids = [n.node.metadata["cache_id"] for n in index.as_retriever().retrieve(QUESTIONS[0])]
    prompt = "Who designed the lighthouse?"
    messages = [
        ChatMessage(role=MessageRole.SYSTEM, content="You answer in one word."),
        ChatMessage(role=MessageRole.USER, content="Name a primary color."),
    ]
    linked_messages = [ChatMessage(role=MessageRole.USER, content=prompt)]

    async def run() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, calls in {
            "plain": (llm.acomplete(prompt), llm.astream_complete(prompt)),
            "linked": (
                llm.acomplete(prompt, cache_ids=cache_ids),
                llm.astream_complete(prompt, cache_ids=cache_ids),
            ),
            "chat": (llm.achat(messages), llm.astream_chat(messages)),
            "linked chat": (
                llm.achat(linked_messages, cache_ids=cache_ids),
                llm.astream_chat(linked_messages, cache_ids=cache_ids),
            ),
        }.items():
            done, stream = await asyncio.gather(*calls)  # both in the batch at once
            out[name] = (done, [r async for r in stream])
        return out

    before = steps(engine)
    results = asyncio.run(run())
    assert steps(engine) > before
    sync = {
        "plain": llm.complete(prompt),
        "linked": llm.complete(prompt, cache_ids=cache_ids),
        "chat": llm.chat(messages),
        "linked chat": llm.chat(linked_messages, cache_ids=cache_ids),
    }
    for name, (done, responses) in results.items():
        expected = sync[name]
        text = getattr(expected, "text", None) or expected.message.content
        assert text, name
        got = getattr(done, "text", None) or done.message.content
        assert got == text, name
        assert done.raw["token_ids"] == expected.raw["token_ids"], name
        deltas = [r.delta for r in responses]
        assert "".join(deltas) == text and len(deltas) > 2, name
        joined = ""
        for response in responses:  # each response's text is everything so far
            joined += response.delta
            cumulative = getattr(response, "text", None) or response.message.content
            assert cumulative == joined, name
        assert responses[-1].delta == "" and responses[-1].raw["token_ids"] == done.raw["token_ids"]
    assert results["plain"][0].raw["context_tokens"] == 0
    assert results["linked"][0].raw["cache_ids"] == cache_ids
    assert refs(engine.prefix_tree) == 0


def test_strategies_the_batch_refuses_keep_the_sync_answer_off_the_event_loop(engine, index):
    """cacheblend is not batched (it selects over the whole context): its async calls take
    the sync path in a worker thread, so they answer exactly as before and never reach the
    loop's decoder."""
    blend = "cacheblend:0.3"
    llm = KVCacheLLM(engine, strategy=blend)
    cache_ids = [n.node.metadata["cache_id"] for n in index.as_retriever().retrieve(QUESTIONS[2])]
    sync = llm.complete(QUESTIONS[2], cache_ids=cache_ids)

    async def run() -> tuple[Any, list[Any]]:
        stream = await llm.astream_complete(QUESTIONS[2], cache_ids=cache_ids)
        return await llm.acomplete(QUESTIONS[2], cache_ids=cache_ids), [r async for r in stream]

    done, responses = asyncio.run(run())
    assert done.text == sync.text and done.raw["token_ids"] == sync.raw["token_ids"]
    assert done.raw["strategy"] == str(Strategy.parse(blend))
    assert "".join(r.delta for r in responses) == sync.text
    assert engine._loop is None  # the engine loop never started


def test_ape_is_batched_on_the_event_loop_and_answers_as_its_sync_twin(engine, index):
    """APE's scale rides in the prefix tree: concurrent async calls share the loop's batch
    and give exactly the sync answers, which APE really changes."""
    ape = "legolink:2+ape:2,0.5"
    llm = KVCacheLLM(engine, strategy=ape)
    retriever = index.as_retriever()
    asked = [(q, [n.node.metadata["cache_id"] for n in retriever.retrieve(q)]) for q in QUESTIONS]
    sync = [llm.complete(q, cache_ids=ids) for q, ids in asked]
    plain = KVCacheLLM(engine, strategy="legolink:2")
    linked = [plain.complete(q, cache_ids=ids) for q, ids in asked]
    assert [s.raw["token_ids"] for s in sync] != [p.raw["token_ids"] for p in linked]

    async def together() -> list[Any]:
        return list(await asyncio.gather(*(llm.acomplete(q, cache_ids=ids) for q, ids in asked)))

    before = steps(engine)
    answers = asyncio.run(together())
    assert [a.raw["token_ids"] for a in answers] == [s.raw["token_ids"] for s in sync]
    assert all(a.raw["strategy"] == str(Strategy.parse(ape)) for a in answers)
    assert 0 < steps(engine) - before < len(QUESTIONS) * MAX_NEW  # decoded together
    assert refs(engine.prefix_tree) == 0


def test_concurrent_chat_engines_share_a_batch_and_answer_as_their_sync_twins(engine, index):
    def chat_engines() -> list[Any]:
        return [
            as_chat_engine(engine, index=index, similarity_top_k=2, strategy="legolink:2")
            for _ in QUESTIONS
        ]

    sync_engines = chat_engines()
    first = [e.chat(q) for e, q in zip(sync_engines, QUESTIONS)]
    follow = [e.stream_chat("And when was that?") for e in sync_engines]
    follow_text = ["".join(r.response_gen) for r in follow]

    async def together() -> tuple[list[Any], list[str]]:
        engines = chat_engines()
        answers = await asyncio.gather(*(e.achat(q) for e, q in zip(engines, QUESTIONS)))

        async def stream(chat_engine: Any) -> str:
            response = await chat_engine.astream_chat("And when was that?")
            return "".join([piece async for piece in response.async_response_gen()])

        return list(answers), await asyncio.gather(*(stream(e) for e in engines))

    before = steps(engine)
    answers, streamed = asyncio.run(together())
    assert [a.response for a in answers] == [f.response for f in first]
    assert all(a.response for a in answers)
    assert streamed == follow_text and all(streamed)
    # 2 rounds of 5 answers of up to MAX_NEW tokens: one at a time, up to 2 * 5 * (MAX_NEW - 1)
    # decode steps; in one batch, about 2 * (MAX_NEW - 1)
    assert 0 < steps(engine) - before < len(QUESTIONS) * MAX_NEW
    assert refs(engine.prefix_tree) == 0


def test_cancelling_an_aquery_aborts_its_request(engine, index):
    query_engine = as_query_engine(engine, index=index, similarity_top_k=2, max_new_tokens=200)

    async def scenario() -> Response:
        decoder = engine.serving_loop().decoder
        task = asyncio.create_task(query_engine.aquery(QUESTIONS[0]))
        while not decoder.active:  # wait until it decodes
            await asyncio.sleep(0.001)
        assert refs(engine.prefix_tree) > 0  # it holds its linked path
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the abort reaches the loop before the next request (its inbox is in order)
        return await as_query_engine(engine, index=index, max_new_tokens=2).aquery(QUESTIONS[1])

    after = asyncio.run(scenario())
    decoder = engine.serving_loop().decoder
    assert len(after.metadata["usage"]["token_ids"]) == 2
    assert not decoder.has_work and decoder.steps < 100  # not 200 steps: it was cut short
    assert refs(engine.prefix_tree) == 0
