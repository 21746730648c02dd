"""The engine loop: requests arriving, finishing and leaving at any step of a running batch
get exactly what `generate` gives each alone; cancelled requests let go of the prefix tree."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest
from helpers import SERVING_DOCS

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.answer import Answer
from rag_kvcache.errors import (
    ContextTooLongError,
    EngineClosedError,
    StrategyError,
    UnknownCacheIdError,
)
from rag_kvcache.serving.batch import BatchDecoder, BatchRequest
from rag_kvcache.serving.loop import AsyncTokenStream, EngineLoop
from rag_kvcache.serving.prefix_tree import PrefixTree
from rag_kvcache.strategy import Strategy

DOCS = SERVING_DOCS
QUESTIONS = ["Who designed the lighthouse?", "How deep is the harbor?", "When is it?"]
STRATEGIES = ["legolink:2", "naive", "full", "legolink:1+top:1"]


@pytest.fixture
def engine(tiny64) -> Iterator[RagKVCache]:
    engine = RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=6)), lm=tiny64)
    yield engine
    engine.close()


def refs(tree: PrefixTree) -> int:
    return sum(node.refs for node in tree.nodes())


def test_random_arrivals_lengths_and_aborts_equal_each_request_alone(engine, tiny64) -> None:
    """A seeded random schedule drives the decoder: requests of several strategies over
    overlapping chunks join at random steps with random lengths, some are aborted waiting or
    decoding. Every request that finishes has `generate`'s tokens and text, whatever else was
    in the batch; at the end the tree holds no reference."""
    ids = engine.generate_context_cache(DOCS)
    rng = random.Random(7)
    tree = engine.prefix_tree
    decoder = BatchDecoder(tiny64, tree, engine.store.get, max_batch=3)
    specs: dict[int, tuple[str, tuple[str, ...], str, int]] = {}
    tokens: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    done: dict[int, Answer] = {}
    aborted: set[int] = set()
    decoding = 0  # aborts of requests already in the batch (the others were waiting)
    to_add = 14
    while to_add or decoder.has_work:
        for _ in range(min(to_add, rng.choice([0, 0, 1, 2]))):
            chunks = tuple(rng.sample(ids, rng.randint(0, 3)))
            spec = (rng.choice(QUESTIONS), chunks, rng.choice(STRATEGIES), rng.randint(1, 8))
            request = engine._loop_request(
                spec[0], list(chunks), Strategy.parse(spec[2]), engine.generation_config(spec[3])
            )
            request_id = decoder.add_request(
                list(request.path), list(request.question), request.config, request.strategy
            )
            specs[request_id], tokens[request_id], text[request_id] = spec, [], ""
            to_add -= 1
        live = [i for i in specs if i not in done and i not in aborted]
        if live and rng.random() < 0.1:
            victim = rng.choice(live)
            decoding += victim in decoder.active
            assert decoder.abort(victim)
            aborted.add(victim)
        for out in decoder.step():
            assert out.error is None and out.token_id is not None
            assert out.request_id not in done and out.request_id not in aborted
            tokens[out.request_id].append(out.token_id)
            text[out.request_id] += out.text
            if out.finished:
                assert out.done is not None
                done[out.request_id] = engine._answer(out.done)
        assert len(decoder.active) <= 3
    assert 0 < decoding < len(aborted) and len(done) + len(aborted) == len(specs) == 14
    assert decoder.steps < sum(len(a.token_ids) for a in done.values())  # they did share steps
    for request_id, answer in done.items():
        query, chunks, strategy, max_new = specs[request_id]
        alone = engine.generate(query, list(chunks), strategy=strategy, max_new_tokens=max_new)
        assert isinstance(alone, Answer)
        assert answer.token_ids == alone.token_ids, specs[request_id]
        assert answer.text == alone.text == text[request_id].strip()
        assert answer.prompt_tokens == alone.prompt_tokens
        assert tuple(t for t in tokens[request_id] if t not in tiny64.eos_ids) == alone.token_ids
    assert refs(tree) == 0 and not decoder.abort(next(iter(done)))
    # one tree for every strategy, each keeping its own prefixes: a root per strategy used
    used = {specs[i][2] for i in specs}
    assert {root.cache_ids[0].split("/")[0] for root in tree.roots.values()} <= used
    assert len(tree.roots) > 1
    tree.clear()
    assert tree.nodes() == [] and tree.nbytes == 0


def test_aborting_an_active_request_releases_its_path(engine, tiny64) -> None:
    ids = engine.generate_context_cache(DOCS)
    decoder = BatchDecoder(tiny64, engine.prefix_tree, engine.store.get)
    strategy = Strategy.parse("legolink:2")
    keep = engine._loop_request("Who designed it?", ids[:2], strategy, engine.generation_config(20))
    drop = engine._loop_request("How deep is it?", ids[2:4], strategy, engine.generation_config(20))
    kept = decoder.add_request(list(keep.path), list(keep.question), keep.config, strategy)
    dropped = decoder.add_request(list(drop.path), list(drop.question), drop.config, strategy)
    decoder.step()
    decoder.step()  # both decode, in rows of the batch
    assert set(decoder.active) == {kept, dropped}
    leaf = decoder.active[dropped].leaf
    only_dropped = [n for n in engine.prefix_tree.nodes() if n.cache_ids[0] in leaf.cache_ids]
    assert only_dropped and all(n.refs == 1 for n in only_dropped)
    before = engine.prefix_tree.nbytes
    assert decoder.abort(dropped)
    assert all(n.refs == 0 for n in only_dropped) and set(decoder.active) == {kept}
    freed = engine.prefix_tree.clear()  # its chunks' KV can go now; the other's cannot
    assert freed == sum(n.nbytes for n in only_dropped) > 0
    assert engine.prefix_tree.nbytes == before - freed > 0
    while decoder.has_work:
        decoder.step()
    assert refs(engine.prefix_tree) == 0


def test_concurrent_agenerate_equals_sequential_generate_in_fewer_steps(engine) -> None:
    ids = engine.generate_context_cache(DOCS)
    requests = [
        ("Who designed the lighthouse?", ids[:3], "legolink:2", 6),
        ("When was it first lit?", ids[:2], "legolink:2", 4),
        ("How deep is the harbor?", ids[1:3], "naive", 6),
        ("When is the festival?", [ids[3], ids[0]], "full", 5),
        ("How many crews?", [], "legolink:2", 6),
    ]

    async def together() -> list[Answer]:
        return await asyncio.gather(
            *(engine.agenerate(q, c, strategy=s, max_new_tokens=n) for q, c, s, n in requests)
        )

    answers = asyncio.run(together())
    alone = [engine.generate(q, c, strategy=s, max_new_tokens=n) for q, c, s, n in requests]
    assert [a.token_ids for a in answers] == [a.token_ids for a in alone]
    assert [a.text for a in answers] == [a.text for a in alone]
    assert all(isinstance(a, Answer) and a.token_ids for a in answers)
    steps = engine.serving_loop().decoder.steps
    assert 0 < steps < sum(len(a.token_ids) for a in answers)
    assert refs(engine.prefix_tree) == 0


def test_astream_pieces_make_the_answer_and_closing_it_aborts(engine) -> None:
    ids = engine.generate_context_cache(DOCS)
    alone = engine.generate("Who designed it?", ids[:2], max_new_tokens=40)
    assert isinstance(alone, Answer) and len(alone.token_ids) > 10  # long enough to cut short

    async def scenario() -> tuple[str, int, Answer]:
        stream = engine.astream("Who designed it?", ids[:2], max_new_tokens=40)
        pieces = [piece async for piece in stream]
        assert stream.result is not None
        cut = engine.astream("Who designed it?", ids[:2], max_new_tokens=40)
        async for _ in cut:
            break  # one piece, then the caller walks away
        await cut.aclose()
        # a later request is taken after the abort (the loop's inbox is in order)
        after = await engine.agenerate("How deep is it?", ids[2:3], max_new_tokens=2)
        return "".join(pieces), engine.serving_loop().decoder.steps, after

    text, steps, after = asyncio.run(scenario())
    assert text.strip() == alone.text and len(after.token_ids) == 2
    decoder = engine.serving_loop().decoder
    assert not decoder.has_work and refs(engine.prefix_tree) == 0
    # the first request took len - 1 steps; the cut one did not run its 40 tokens
    assert steps < 2 * len(alone.token_ids)


def test_cancelling_an_awaiting_task_aborts_its_request(engine) -> None:
    ids = engine.generate_context_cache(DOCS)
    decoder = engine.serving_loop().decoder

    async def scenario() -> None:
        task = asyncio.create_task(engine.agenerate("Who?", ids[:3], max_new_tokens=200))
        while not decoder.active:  # wait until it decodes
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.agenerate("How deep is it?", ids[2:3], max_new_tokens=1)

    asyncio.run(scenario())
    assert not decoder.has_work and decoder.steps < 100
    assert refs(engine.prefix_tree) == 0


def test_an_unknown_cache_id_fails_that_request_only(engine) -> None:
    ids = engine.generate_context_cache(DOCS)
    missing = "0" * len(ids[0])

    async def together() -> list[Answer | BaseException]:
        return await asyncio.gather(
            engine.agenerate("Who designed it?", ids[:2]),
            engine.agenerate("Who?", [ids[0], missing]),
            engine.agenerate("How deep is it?", ids[1:3]),
            return_exceptions=True,
        )

    first, bad, last = asyncio.run(together())
    assert isinstance(bad, UnknownCacheIdError) and missing in str(bad)
    for answer, (query, chunks) in [
        (first, ("Who designed it?", ids[:2])),
        (last, ("How deep is it?", ids[1:3])),
    ]:
        alone = engine.generate(query, chunks)
        assert isinstance(answer, Answer) and isinstance(alone, Answer)
        assert answer.token_ids == alone.token_ids
    assert refs(engine.prefix_tree) == 0


def test_closing_fails_requests_in_flight_and_refuses_new_ones(engine) -> None:
    ids = engine.generate_context_cache(DOCS)
    decoder = engine.serving_loop().decoder

    async def scenario() -> None:
        task = asyncio.create_task(engine.agenerate("Who?", ids[:2], max_new_tokens=200))
        while not decoder.active:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.close)  # joins the loop thread
        with pytest.raises(EngineClosedError):
            await task
        with pytest.raises(EngineClosedError):
            await engine.agenerate("Who?", ids[:1])

    asyncio.run(scenario())
    assert refs(engine.prefix_tree) == 0 and not decoder.has_work
    alone = engine.generate("Who?", ids[:1])  # the plain path does not need the loop
    assert isinstance(alone, Answer) and alone.token_ids


def run_on(loop: EngineLoop, engine: RagKVCache, chunks: list[str], strategy: Strategy):
    """One request through `loop`, as `agenerate` makes it; its Answer."""

    async def run() -> Answer:
        request = engine._loop_request("Who?", chunks, strategy, engine.generation_config(None))
        stream = AsyncTokenStream(loop, request, engine._answer)
        async for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    return run()


async def together(loop: EngineLoop, runs: list) -> list[Answer | BaseException]:
    """Run requests whose submissions the loop thread takes in one go: it is kept from
    looking at its inbox until every one is there, so they are linked in the same step."""
    with loop._wake:
        tasks = [asyncio.ensure_future(run) for run in runs]
        while len(loop._inbox) < len(runs):
            await asyncio.sleep(0)
    return await asyncio.gather(*tasks, return_exceptions=True)


def test_a_bug_linking_one_request_fails_that_request_only(engine, tiny64) -> None:
    """A bug (not a library error) while one request is linked reaches that request alone:
    the requests linked and decoding beside it get what they get alone, and the loop goes on."""
    ids = engine.generate_context_cache(DOCS)
    broken = {ids[4]}

    def fetch(path: list[str]) -> list:
        if broken & set(path):
            raise RuntimeError("the store fell over")
        return engine.store.get(path)

    loop = EngineLoop(BatchDecoder(tiny64, engine.prefix_tree, fetch))
    strategy = Strategy.parse("legolink:2")
    try:
        requests = ([ids[0], ids[1]], [ids[4]], [ids[1], ids[2]])
        runs = [run_on(loop, engine, chunks, strategy) for chunks in requests]
        first, failed, last = asyncio.run(together(loop, runs))
        assert isinstance(failed, RuntimeError) and "fell over" in str(failed)
        for answer, chunks in ((first, ids[:2]), (last, ids[1:3])):
            alone = engine.generate("Who?", chunks, strategy=strategy)
            assert isinstance(answer, Answer) and isinstance(alone, Answer)
            assert answer.token_ids == alone.token_ids
        assert loop.decoder.has_work is False and refs(engine.prefix_tree) == 0
    finally:
        loop.close()


def test_a_failing_step_fails_the_requests_in_flight_and_the_loop_goes_on(engine, tiny64) -> None:
    """A bug in the batched decode forward, which every request in the batch shares, reaches
    every request then in flight; the loop thread survives it and answers the next request."""
    ids = engine.generate_context_cache(DOCS)
    decoder = BatchDecoder(tiny64, engine.prefix_tree, engine.store.get)
    forward, calls = decoder.forward, []

    def failing_once(active: list) -> None:
        calls.append(len(active))
        if calls.count(2) == 1 and len(active) == 2:  # the first forward of both together
            raise RuntimeError("the batch fell over")
        forward(active)

    decoder.forward = failing_once  # type: ignore[method-assign]
    loop = EngineLoop(decoder)
    strategy = Strategy.parse("legolink:2")
    try:
        runs = [run_on(loop, engine, chunks, strategy) for chunks in (ids[:2], ids[1:3])]
        failed = asyncio.run(together(loop, runs))
        assert calls[0] == 2  # linked in one step: both were in the batch that failed
        assert all(isinstance(f, RuntimeError) and "fell over" in str(f) for f in failed)
        answer = asyncio.run(run_on(loop, engine, ids[:2], strategy))
        alone = engine.generate("Who?", ids[:2], strategy=strategy)
        assert isinstance(alone, Answer) and answer.token_ids == alone.token_ids
        assert loop.decoder.has_work is False and refs(engine.prefix_tree) == 0
    finally:
        loop.close()


def test_plain_prompts_and_prefill_decode_in_the_batch_as_complete_and_generate(engine) -> None:
    """A plain prompt (`acomplete`, no chunks) and the `prefill` strategy are prefilled alone
    and decode in the loop's batch beside linked requests: each equals its sync twin token for
    token, and none of them leaves anything in the prefix tree."""
    ids = engine.generate_context_cache(DOCS)
    prompts = [
        engine.chat_prompt([{"role": "user", "content": "Who designed the lighthouse?"}]),
        "The harbor has three basins and",
    ]
    linked = ("How deep is the harbor?", ids[1:3], "legolink:2")
    prefilled = ("When is the festival?", [ids[3], ids[0]], "prefill")

    async def together() -> list[Answer]:
        return await asyncio.gather(
            engine.acomplete(prompts[0], max_new_tokens=6),
            engine.agenerate(*linked[:2], strategy=linked[2], max_new_tokens=6),
            engine.acomplete(prompts[1], max_new_tokens=5),
            engine.agenerate(*prefilled[:2], strategy=prefilled[2], max_new_tokens=6),
        )

    answers = asyncio.run(together())
    alone = [
        engine.complete(prompts[0], max_new_tokens=6),
        engine.generate(*linked[:2], strategy=linked[2], max_new_tokens=6),
        engine.complete(prompts[1], max_new_tokens=5),
        engine.generate(*prefilled[:2], strategy=prefilled[2], max_new_tokens=6),
    ]
    for answer, sync in zip(answers, alone, strict=True):
        assert isinstance(sync, Answer) and sync.token_ids
        assert answer.token_ids == sync.token_ids and answer.text == sync.text
        assert answer.strategy == sync.strategy
        assert answer.prompt_tokens == sync.prompt_tokens
        assert answer.context_tokens == sync.context_tokens
        assert answer.recomputed_tokens == sync.recomputed_tokens
    assert answers[0].context_tokens == 0 and answers[3].recomputed_tokens > 0
    decoder = engine.serving_loop().decoder
    assert 0 < decoder.steps < sum(len(a.token_ids) for a in answers)
    # only the linked request put KV in the tree: one root, its strategy's
    assert [r.cache_ids[0].split("/")[0] for r in engine.prefix_tree.roots.values()] == [
        "legolink:2"
    ]
    assert refs(engine.prefix_tree) == 0 and not decoder.has_work


def test_sampling_settings_reach_the_loop_as_generate_would_use_them(engine, tiny64) -> None:
    """temperature / top_p / seed given to astream sample as an engine configured with them
    samples in `generate` (float64: the batched logits equal the lone ones)."""
    ids = engine.generate_context_cache(DOCS)
    sampled = GenerationConfig(max_new_tokens=8, temperature=1.3, top_p=0.9, seed=11)
    configured = RagKVCache(EngineConfig(generation=sampled), lm=tiny64, store=engine.store)

    async def both() -> list[Answer]:
        kwargs = {"max_new_tokens": 8, "temperature": 1.3, "top_p": 0.9}
        return list(
            await asyncio.gather(
                engine.agenerate("Who designed it?", ids[:2], seed=11, **kwargs),
                engine.agenerate("Who designed it?", ids[:2], seed=12, **kwargs),
            )
        )

    eleven, twelve = asyncio.run(both())
    alone = configured.generate("Who designed it?", ids[:2])
    greedy = engine.generate("Who designed it?", ids[:2], max_new_tokens=8)
    assert isinstance(alone, Answer) and isinstance(greedy, Answer)
    assert eleven.token_ids == alone.token_ids
    assert eleven.token_ids != greedy.token_ids or twelve.token_ids != greedy.token_ids


def test_a_linked_requests_first_token_goes_out_before_the_next_is_linked(engine, tiny64) -> None:
    """Requests admitted in one step each link their context (a forward over it): the first
    token of each is emitted as soon as it is chosen, not after all of them are linked."""
    ids = engine.generate_context_cache(DOCS)
    events: list[str] = []

    def fetch(path: list[str]) -> list:
        events.append("link")
        return engine.store.get(path)

    decoder = BatchDecoder(tiny64, engine.prefix_tree, fetch)
    strategy = Strategy.parse("legolink:2")
    for i, question in enumerate(QUESTIONS):
        r = engine._loop_request(question, [ids[i]], strategy, engine.generation_config(4))
        decoder.add_request(list(r.path), list(r.question), r.config, strategy)
    outputs = decoder.step(lambda out: events.append(f"token {out.request_id}"))
    assert events == ["link", "token 0", "link", "token 1", "link", "token 2"]
    assert [o.request_id for o in outputs] == [0, 1, 2]
    while decoder.has_work:
        decoder.step()


@pytest.mark.parametrize("together", [True, False])
def test_questions_over_a_context_in_the_tree_are_asked_in_one_forward(
    engine, tiny64, monkeypatch, together
) -> None:
    """Requests over the same chunks arriving together: the first links them; the others
    find their whole context in the tree, and their questions are computed together in one
    forward after the admissions (or, past the size one forward takes, in several). Every
    answer equals `generate` alone."""
    import rag_kvcache.serving.batch as batch
    import rag_kvcache.serving.questions as questions

    ids = engine.generate_context_cache(DOCS)
    events: list[str] = []
    asked = batch.prefill_questions

    def prefill_questions(lm, paths, questions):  # type: ignore[no-untyped-def]
        events.append(f"ask {len(questions)}")
        return asked(lm, paths, questions)

    monkeypatch.setattr(batch, "prefill_questions", prefill_questions)

    def fetch(path: list[str]) -> list:
        events.append("fetch")
        return engine.store.get(path)

    decoder = BatchDecoder(tiny64, engine.prefix_tree, fetch)
    strategy = Strategy.parse("legolink:2")
    requests = []
    for question in QUESTIONS:
        r = engine._loop_request(question, ids[:2], strategy, engine.generation_config(4))
        requests.append(r)
        decoder.add_request(list(r.path), list(r.question), r.config, strategy)
    longest = max(len(r.question) for r in requests)
    if not together:  # room for one question a forward
        monkeypatch.setattr(questions, "MAX_TOKEN_PAIRS", longest * longest)
    decoder.step(lambda out: events.append(f"token {out.request_id}"))
    if together:
        assert events == ["fetch", "token 0", "fetch", "fetch", "ask 2", "token 1", "token 2"]
    else:
        assert events[4:] == ["ask 1", "token 1", "ask 1", "token 2"]
    done = {}
    while decoder.has_work:
        for out in decoder.step():
            if out.done is not None:
                done[out.request_id] = engine._answer(out.done)
    for request_id, question in enumerate(QUESTIONS):
        alone = engine.generate(question, ids[:2], strategy=strategy, max_new_tokens=4)
        assert isinstance(alone, Answer)
        answer = done[request_id]
        assert answer.token_ids == alone.token_ids
        assert answer.prompt_tokens == alone.prompt_tokens
    assert done[1].reused_tokens == done[1].context_tokens > 0 == done[1].recomputed_tokens
    assert refs(engine.prefix_tree) == 0


def test_a_question_over_a_context_in_the_tree_gets_links_checks(engine, tiny64) -> None:
    """Skipping the link for a context already in the tree skips none of its checks: a
    question that takes the prompt past the model's window is a ContextTooLongError, as it is
    for `generate`, and so is an empty one (a StrategyError)."""
    words = " ".join(DOCS * 20).split()
    question = "Who designed the lighthouse and when was it first lit? " * 5
    asked = len(engine.template.question_ids(tiny64.tokenizer, question))
    system = engine.store.get([engine.prefix_id])[0].num_tokens
    text = " ".join(words)
    while system + len(engine.template.chunk_ids(tiny64.tokenizer, text)) > (
        tiny64.max_context - asked // 2
    ):
        text = " ".join(text.split()[:-10])
    assert asked // 2 > 20  # a cut of ten words is less: the question takes it past the window
    [chunk] = engine.generate_context_cache([text])
    strategy = Strategy.parse("legolink:2")
    engine.generate_batch([BatchRequest("Who?", (chunk,), 2)], strategy=strategy)  # in the tree
    with pytest.raises(ContextTooLongError):
        engine.generate(question, [chunk], strategy=strategy, max_new_tokens=2)
    with pytest.raises(ContextTooLongError):
        engine.generate_batch([BatchRequest(question, (chunk,), 2)], strategy=strategy)
    decoder = BatchDecoder(tiny64, engine.prefix_tree, engine.store.get)
    r = engine._loop_request("Who?", [chunk], strategy, engine.generation_config(2))
    decoder.add_request(list(r.path), [], r.config, strategy)
    [out] = decoder.step()
    assert isinstance(out.error, StrategyError) and not decoder.has_work


def test_a_link_budget_lets_running_requests_decode_between_arrivals(engine, tiny64) -> None:
    """With a link budget, a step stops linking new requests once it spent that long while
    others decode (zero here: one link a step), so a burst of arrivals does not hold back the
    running requests' next tokens; requests whose context is in the tree are not linked and
    join together. Every answer still equals `generate` alone."""
    ids = engine.generate_context_cache(DOCS)
    strategy = Strategy.parse("legolink:2")
    decoder = BatchDecoder(tiny64, engine.prefix_tree, engine.store.get, link_budget_s=0.0)
    asked = [(q, [ids[i]]) for i, q in enumerate(QUESTIONS)]  # each links its chunk
    asked += [(q, [ids[0]]) for q in QUESTIONS[1:]]  # then over a context in the tree
    for query, chunks in asked:
        r = engine._loop_request(query, chunks, strategy, engine.generation_config(6))
        decoder.add_request(list(r.path), list(r.question), r.config, strategy)
    done, sizes = {}, []
    while decoder.has_work:
        for out in decoder.step():
            if out.done is not None:
                done[out.request_id] = engine._answer(out.done)
        sizes.append(len(decoder.active))
    assert sizes[:3] == [1, 2, 3]  # one link a step while the others decode
    assert sizes[3] == 5  # the last two only had their questions to compute: together
    for request_id, (query, chunks) in enumerate(asked):
        alone = engine.generate(query, chunks, strategy=strategy, max_new_tokens=6)
        assert isinstance(alone, Answer) and done[request_id].token_ids == alone.token_ids


EXITS_AFTER_ASYNC = """
import asyncio, faulthandler, tempfile
faulthandler.dump_traceback_later(600, exit=True)  # a test runner's watchdog, as pytest's
faulthandler.cancel_dump_traceback_later()
from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.config import StoreConfig
config = EngineConfig(
    store=StoreConfig(root=tempfile.mkdtemp()), generation=GenerationConfig(max_new_tokens=16)
)
engine = RagKVCache(config)
ids = engine.generate_context_cache(["The Orvane bridge was opened in 1907."])
print(asyncio.run(engine.agenerate("When was the bridge opened?", ids)).text)
"""  # and no engine.close(): the LlamaIndex docs never ask for one


@pytest.mark.slow  # SmolLM2: the tiny model never showed it
def test_a_process_that_never_closed_its_engine_exits_cleanly(tmp_path) -> None:
    """After asyncio use, a process whose engine loop was still running at exit aborted now
    and then ("terminate called without an active exception", exit code 134: 5 of 13 runs of
    a user's script, 2 of 8 of this one, whose faulthandler watchdog is what test runners
    start). The loops still running are closed at exit. Each run fails alone by chance; six
    find the old behaviour about 4 times in 5."""
    import subprocess
    import sys

    for _ in range(6):
        run = subprocess.run(
            [sys.executable, "-c", EXITS_AFTER_ASYNC], capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr[-2000:]
        assert "terminate called" not in run.stderr
