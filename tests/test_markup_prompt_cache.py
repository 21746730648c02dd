"""Prompt Cache's own markup, as its public repository writes it: the shapes of its examples,
its README's prompts and its benchmark schemas, rewritten with our own content as the
fixtures in tests/data/prompt_cache/. Each is accepted and laid out as Prompt Cache's parser
lays it out (modules child after child, a union as long as its longest member, a parameter
as long as its length, a prompt's own text after the whole schema), its role tags rendered
by the model's chat template; bad markup still gets a clear MarkupError, never a crash."""

from __future__ import annotations

import contextlib
import functools
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.answer import prompt_in_position_order
from rag_kvcache.markup.language import ROLES, MarkupError, Schema, compile_schema
from rag_kvcache.markup.prompt import CompiledPrompt, compile_prompt
from rag_kvcache.markup.prompt_cache import PromptCache, schema_placement

DATA = Path(__file__).resolve().parent / "data"
FIXTURES = sorted((DATA / "prompt_cache").glob("*.xml"))

# The prompts of Prompt Cache's README and benchmarks, in the same shapes.
CODE_PROMPT = """<prompt schema='code-generation-shop'>
    <cart.py/>
    <prices.py/>
    <receipt.py/>
    <user>
        Write a checkout function:
    </user>
</prompt>"""
PERSONA_PROMPT = """<prompt schema='persona'>
    <age>
        <young-adult/>
    </age>
    <residence>
        <harbour/>
    </residence>
    <occupation>
        <education/>
    </occupation>
    <personality>
        <reserved/>
    </personality>
    <user>
        Introduce yourself.
    </user>
</prompt>"""
REFERENCE_PROMPT = """<prompt schema="reference">
    <intro topic="robots">
        <aside/>
        <mode-custom manner="like a ship's pilot"/>
        <reader-expert/>
    </intro>
    <task>
        <task-robot speed="slow"/>
    </task>
    <user>Where will the robot go next?</user>
    <assistant>It will go forward.</assistant>
    <user>At what speed?</user>
</prompt>"""
TRIP_PROMPT = """<prompt schema="trip-parameters">
    <trip-plan duration="two weeks"><abroad><steppe/></abroad></trip-plan>
    <user>Plan it day by day.</user>
</prompt>"""
LETTERS_PROMPT = '<prompt schema="temperament">\n    <A/><D/>\n</prompt>'


@pytest.fixture(scope="module")
def schemas(smol_tokenizer) -> dict[str, Schema]:
    compiled = [compile_schema(path.read_text(), smol_tokenizer) for path in FIXTURES]
    return {schema.name: schema for schema in compiled}


def tokens(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat(tokenizer, *turns: tuple[str, str], answer: bool = True) -> str:
    messages = [{"role": role, "content": content} for role, content in turns]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=answer)


def text_in_position_order(tokenizer, compiled: CompiledPrompt) -> str:
    at = {u.start + i: t for u in compiled.units for i, t in enumerate(u.token_ids)}
    at.update(zip(compiled.new_positions, compiled.new_ids))
    return tokenizer.decode([at[p] for p in sorted(at)])


def module_text(source: str, path: str) -> str:
    """A module's own leading text in the XML, its surrounding whitespace dropped."""
    element = ET.fromstring(source)
    for name in path.split("/"):
        element = next(e for e in element.iter("module") if e.get("name") == name)
    return (element.text or "").strip()


def turn_text(source: str, role: str) -> str:
    """The leading text of the schema's `role` turn, its surrounding whitespace dropped."""
    turn = ET.fromstring(source).find(role)
    return "" if turn is None else (turn.text or "").strip()


# ----------------------------------------------------------------------------- the layout


def read_structure(source: str) -> tuple[dict, dict, list]:
    """From the XML alone, as Prompt Cache's parser reads it: each module's parent (names are
    unique within a parent, roles are only text around their content), each parameter's
    length, and the members of each union."""
    modules: dict[str, str | None] = {}
    params: dict[tuple[str, str], int] = {}
    unions: list[list[str]] = []

    def path(scope: str | None, element: ET.Element) -> str:
        name = element.get("name", "")
        return name if scope is None else f"{scope}/{name}"

    def read(element: ET.Element, scope: str | None) -> None:
        for child in element:
            if child.tag == "module":
                modules[path(scope, child)] = scope
                read(child, path(scope, child))
            elif child.tag == "union":
                unions.append([path(scope, member) for member in child])
                read(child, scope)
            elif child.tag in ("param", "parameter"):
                params[(scope, child.get("name"))] = int(child.get("length") or child.get("len"))
            elif child.tag in ROLES:
                read(child, scope)

    read(ET.fromstring(source), None)
    return modules, params, unions


def check_upstream_layout(schema: Schema) -> None:
    """Prompt Cache's layout rule: a schema or module is its children one after another, with
    no gap and no overlap: a run of text, a parameter (its length), a submodule (its own
    length), a union (as long as its longest member, every member starting where it starts)."""
    modules, params, unions = read_structure(schema.source)
    assert {path: m.parent for path, m in schema.modules.items()} == modules
    assert {key: p.length for key, p in schema.params.items()} == params
    ids = set()
    for members in unions:
        starts = {schema.modules[m].start for m in members}
        union_ids = {schema.modules[m].union for m in members}
        assert len(starts) == 1 and len(union_ids) == 1 and None not in union_ids
        ids |= union_ids
    assert len(ids) == len(unions)  # one id per union
    in_union = {m for members in unions for m in members}
    containers: list[str | None] = [None, *schema.modules]
    for container in containers:
        pieces = [(u.start, u.end) for u in schema.units if u.module == container]
        pieces += [
            (p.start, p.start + p.length) for p in schema.params.values() if p.module == container
        ]
        pieces += [
            (m.start, m.end)
            for m in schema.modules.values()
            if m.parent == container and m.path not in in_union
        ]
        for members in unions:
            if schema.modules[members[0]].parent == container:
                ends = [schema.modules[m].end for m in members]
                pieces.append((schema.modules[members[0]].start, max(ends)))
        if container is None:
            start, end = 0, schema.length
            pieces.append((schema.length, schema.length + len(schema.held_back)))
            end += len(schema.held_back)
        else:
            start, end = schema.modules[container].start, schema.modules[container].end
        position = start
        for a, b in sorted(pieces):
            assert a == position, (container, sorted(pieces))
            position = b
        assert position == end, container


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_each_fixture_is_laid_out_as_prompt_cache_lays_it_out(smol_tokenizer, path) -> None:
    check_upstream_layout(compile_schema(path.read_text(), smol_tokenizer))


def test_the_project_schemas_follow_the_same_rule(smol_tokenizer) -> None:
    for path in sorted((DATA / "schemas").glob("*.xml")):
        check_upstream_layout(compile_schema(path.read_text(), smol_tokenizer))


# ----------------------------------------------------------------------------- the prompts


def test_role_tags_in_a_prompt_are_turns(schemas, smol_tokenizer) -> None:
    """The README's demo prompt: files imported, then a `<user>` turn, which follows the
    whole schema (its closing assistant turn included), as upstream places a prompt's text."""
    schema = schemas["code-generation-shop"]
    compiled = compile_prompt(CODE_PROMPT, schemas, smol_tokenizer)
    assert compiled.imported == ("cart.py", "prices.py", "receipt.py")
    n = len(compiled.new_ids)
    assert compiled.new_positions == tuple(range(schema.length, schema.length + n))
    source = schema.source
    files = [module_text(source, name) for name in compiled.imported]
    expected = chat(
        smol_tokenizer,
        ("system", turn_text(source, "system")),
        ("user", " ".join([turn_text(source, "user"), *files])),
        ("assistant", turn_text(source, "assistant")),
        ("user", "Write a checkout function:"),
    )
    assert text_in_position_order(smol_tokenizer, compiled) == expected
    assert "    def add(self, sku, quantity):\n" in expected  # code stays code


def test_nested_references_pick_modules_by_scope(schemas, smol_tokenizer) -> None:
    """The README's persona prompt: each trait's member named inside its trait; "education"
    inside <occupation> is occupation's member, not the top-level trait of that name."""
    schema = schemas["persona"]
    compiled = compile_prompt(PERSONA_PROMPT, schemas, smol_tokenizer)
    picked = [
        "age/young-adult",
        "residence/harbour",
        "occupation/education",
        "personality/reserved",
    ]
    assert [m for m in compiled.imported if "/" in m] == picked
    assert "education" not in compiled.imported
    starts = {u.module: u.start for u in compiled.units if u.module}
    assert starts == {m: schema.modules[m.split("/")[0]].start for m in picked}  # union starts
    assert compiled.new_positions[0] == schema.length
    source = schema.source
    traits = [module_text(source, m) for m in picked]
    expected = chat(
        smol_tokenizer,
        ("system", turn_text(source, "system")),
        ("user", " ".join([turn_text(source, "user"), *traits])),  # the empty defaults: nothing
        ("assistant", turn_text(source, "assistant")),
        ("user", "Introduce yourself."),
    )
    assert text_in_position_order(smol_tokenizer, compiled) == expected
    flat = compile_prompt(
        '<prompt schema="persona"><young-adult/><harbour/><user>Hi.</user></prompt>',
        schemas,
        smol_tokenizer,
    )
    assert flat.imported[:2] == ("age", "age/young-adult")  # a unique name needs no nesting


def test_parameter_spelled_as_prompt_cache_spells_it(schemas, smol_tokenizer) -> None:
    """`<parameter name length>` reserves `length` positions where it stands; an argument
    fills the first of them and the text after the parameter starts after all of them."""
    schema = schemas["trip-parameters"]
    duration = schema.params[("trip-plan", "duration")]
    town = schema.params[("trip-plan/home", "town")]
    assert (duration.length, town.length) == (5, 8)
    plan = [u for u in schema.units if u.module == "trip-plan"]
    assert plan[0].end == duration.start and plan[1].start == duration.start + 5
    assert smol_tokenizer.decode(plan[1].token_ids) == "."  # no space: none in the source
    home = [u for u in schema.units if u.module == "trip-plan/home"]
    assert home[0].end == town.start and home[1].start == town.start + 8
    abroad = schema.modules["trip-plan/abroad"]
    abroad_text = next(u for u in schema.units if u.module == abroad.path)
    places = [schema.modules[f"trip-plan/abroad/{m}"] for m in ("lagoon", "steppe", "canyon")]
    assert {p.start for p in places} == {abroad_text.end}  # the nested union, after the text
    assert abroad.end == max(p.end for p in places) > min(p.end for p in places)
    assert schema.modules["trip-plan"].end == max(abroad.end, schema.modules["trip-plan/home"].end)

    compiled = compile_prompt(TRIP_PROMPT, schemas, smol_tokenizer)
    argument = compiled.arguments[("trip-plan", "duration")]
    assert argument == tuple(tokens(smol_tokenizer, " two weeks"))
    at = dict(zip(compiled.new_positions, compiled.new_ids))
    assert [at[duration.start + i] for i in range(len(argument))] == list(argument)
    assert duration.start + len(argument) not in at  # the rest of the slot stays empty
    assert compiled.imported == ("trip-plan", "trip-plan/abroad", "trip-plan/abroad/steppe")
    with pytest.raises(MarkupError, match="module 'trip-plan' has no parameter 'town'"):
        compile_prompt(  # arguments go to the module that declares the parameter
            '<prompt schema="trip-parameters"><trip-plan town="Oldham"/>x</prompt>',
            schemas,
            smol_tokenizer,
        )


def test_the_readme_reference_prompt(schemas, smol_tokenizer) -> None:
    """The README's PML reference: parameters in nested modules, members of unions inside a
    `<system>` turn inside a module, and a conversation of turns after the schema."""
    schema = schemas["reference"]
    compiled = compile_prompt(REFERENCE_PROMPT, schemas, smol_tokenizer)
    assert compiled.imported == (
        "intro",
        "intro/aside",
        "intro/mode-custom",
        "intro/reader-expert",
        "task",
        "task/task-robot",
    )
    at = dict(zip(compiled.new_positions, compiled.new_ids))
    for key, value in [
        (("intro", "topic"), " robots"),
        (("intro/mode-custom", "manner"), " like a ship's pilot"),
        (("task/task-robot", "speed"), " slow"),
    ]:
        start = schema.params[key].start
        ids = tokens(smol_tokenizer, value)
        assert [at[start + i] for i in range(len(ids))] == ids
    after = [t for p, t in zip(compiled.new_positions, compiled.new_ids) if p >= schema.length]
    head = chat(smol_tokenizer, ("system", "x"), answer=False)
    turns = chat(
        smol_tokenizer,
        ("system", "x"),
        ("user", "Where will the robot go next?"),
        ("assistant", "It will go forward."),
        ("user", "At what speed?"),
    )
    assert smol_tokenizer.decode(after) == turns[len(head) :]
    # the system turn's text belongs to the module around it: without <intro>, it is not there
    task_only = compile_prompt(
        '<prompt schema="reference"><task><task-forecast/></task><user>Go.</user></prompt>',
        schemas,
        smol_tokenizer,
    )
    assert all(u.module in ("task", "task/task-forecast") for u in task_only.units)
    assert "<|im_start|>system" not in text_in_position_order(smol_tokenizer, task_only)


def test_a_prompt_turn_closes_the_schemas_open_user_turn(smol_tokenizer) -> None:
    """Our schemas may end inside a `<user>` turn (free text continues it); a `<user>` element
    in the prompt closes it first and starts where Prompt Cache would: after the closing."""
    travel = compile_schema((DATA / "schemas" / "travel_planning.xml").read_text(), smol_tokenizer)
    schemas = {"travel": travel}
    free = compile_prompt('<prompt schema="travel"><coast/>Pack?</prompt>', schemas, smol_tokenizer)
    turn = compile_prompt(
        '<prompt schema="travel"><coast/><user>Pack?</user></prompt>', schemas, smol_tokenizer
    )
    head = chat(smol_tokenizer, ("system", "x"), ("user", "y"), answer=False)
    continued = chat(smol_tokenizer, ("system", "x"), ("user", "y Pack?"))
    two_turns = chat(smol_tokenizer, ("system", "x"), ("user", "y"), ("user", "Pack?"))
    assert travel.held_back and smol_tokenizer.decode(travel.held_back) == "<|im_end|>\n"
    assert smol_tokenizer.decode(free.new_ids) == continued[len(head) - len("<|im_end|>\n") :]
    assert smol_tokenizer.decode(turn.new_ids) == two_turns[len(head) - len("<|im_end|>\n") :]
    opening = tokens(smol_tokenizer, "<|im_start|>user\n")
    assert list(turn.new_ids[len(travel.held_back) :][: len(opening)]) == opening
    text_start = travel.length + len(travel.held_back) + len(opening)
    assert turn.new_ids[turn.new_positions.index(text_start)] == tokens(smol_tokenizer, "Pack")[0]


def test_a_prompt_of_modules_only_continues_the_schema(schemas, smol_tokenizer) -> None:
    """The benchmark's MBTI prompt imports modules and adds no text: the schema's last token
    is computed as the query instead of read from the cache."""
    schema = schemas["temperament"]
    compiled = compile_prompt(LETTERS_PROMPT, schemas, smol_tokenizer)
    assert compiled.imported == ("A", "D")
    assert compiled.new_positions == (schema.length - 1,)
    assert compiled.new_ids == (schema.units[-1].token_ids[-1],)
    assert compiled.units[-1].end == schema.length - 1
    assert schema.modules["AB"].start == schema.modules["AB"].end  # the placeholder is empty
    with pytest.raises(MarkupError, match="adds no text"):
        compile_prompt('<prompt schema="reference"><task/></prompt>', schemas, smol_tokenizer)


# ----------------------------------------------------------------------------- bad markup


@pytest.mark.parametrize(
    "prompt, message",
    [
        ('<prompt schema="persona"><default/>x</prompt>', r"'default' names 5 modules.*<age>"),
        ('<prompt schema="persona"><age><harbour/></age>x</prompt>', "module 'age' has no"),
        ('<prompt schema="persona"><age>old</age></prompt>', "text inside the reference"),
        ('<prompt schema="persona"><age><user>x</user></age></prompt>', "directly in the"),
        ('<prompt schema="persona"><user><age/></user></prompt>', "holds only text"),
        ('<prompt schema="persona"><user>q</user>loose</prompt>', "text after a role turn"),
        ('<prompt schema="persona"><age><child/><senior/></age>x</prompt>', "one <union>"),
        (  # the README's own example prompt names a module its schema lacks: upstream refuses
            '<prompt schema="reference"><intro><task2 val1="a"/></intro>x</prompt>',
            "module 'intro' has no module 'task2'",
        ),
        ('<prompt schema="reference"><intro tpoic="x"/>y</prompt>', "no parameter 'tpoic'"),
        (  # imported twice: one of the two arguments would be lost
            '<prompt schema="reference"><intro topic="a"/><intro topic="b"/>y</prompt>',
            "parameter 'topic' of module 'intro' is given twice",
        ),
    ],
)
def test_bad_prompts_are_refused_clearly(schemas, smol_tokenizer, prompt, message) -> None:
    with pytest.raises(MarkupError, match=message):
        compile_prompt(prompt, schemas, smol_tokenizer)


def schema_with(body: str) -> str:
    return f'<schema name="s"><user>{body}</user></schema>'


@pytest.mark.parametrize(
    "source, message",
    [
        (schema_with('<union scaffold="c"><module name="a">x</module></union>'), "names none"),
        (
            schema_with(
                '<module name="m">x <parameter name="p" length="2" scaffold="a much '
                'longer placeholder"/></module>'
            ),
            "longer than its 2 tokens",
        ),
        (schema_with('<module name="m" src="notes.txt"/>'), "not supported"),
        (schema_with('<module name="m" cache="maybe">x</module>'), "cache="),
        (
            schema_with(
                '<module name="m"><param name="p" len="2"/><parameter name="p" '
                'length="3"/></module>'
            ),
            "two parameters 'p'",
        ),
        (schema_with('<module name="m"><parameter name="p"/></module>'), r"len= \(or length=\)"),
        (schema_with('<module name="m"><parameter name="p" length="²"/></module>'), "length="),
        (
            schema_with(
                '<module name="a"><module name="b">x</module><union><module '
                'name="b">y</module></union></module>'
            ),
            "module 'a/b' is defined twice",
        ),
        (
            '<schema name="s"><module name="e"></module><scaffold modules="e"/></schema>',
            "scaffold must cover some text",
        ),
        (
            '<schema name="s"><module name="a"><module name="d">x</module></module><module '
            'name="b"><module name="d">y</module></module><scaffold modules="d"/></schema>',
            "'d' names 2 modules",
        ),
        (schema_with('<module name="user">x</module>'), "cannot be named 'user', like a role"),
        (
            schema_with(
                '<union><module name="m">x</module><module name="n">y</module></union>'
                '<scaffold modules="m n"/>'
            ),
            "cannot hold both 'm' and 'n': they are members of one <union>",
        ),
        (schema_with("<module name='m'>" * 70 + "x" + "</module>" * 70), "nest more than 64"),
        (  # the rule said "letters", and an accented one was refused without saying why
            schema_with('<module name="été">x</module>'),
            "needs a name of a letter A-Z or a-z, or '_', then .* \\(got 'été'\\)",
        ),
        (
            '<!DOCTYPE s [<!ENTITY x SYSTEM "file:///etc/hostname">]>'
            + schema_with('<module name="m">&x;</module>'),
            "external entities are not allowed",
        ),
        (  # an external DTD (never read) made expat drop the undefined entity silently
            '<!DOCTYPE s SYSTEM "x.dtd">' + schema_with('<module name="m">5 &euro; each</module>'),
            r"undefined entity &euro; \(external DTDs are not read",
        ),
    ],
)
def test_bad_schemas_are_refused_clearly(smol_tokenizer, source, message) -> None:
    with pytest.raises(MarkupError, match=message):
        compile_schema(source, smol_tokenizer)


def test_text_in_many_pieces_is_joined_whole() -> None:
    """expat hands text over in small pieces (around every entity, across buffer ends); they
    are joined once per run of text, not appended to one by one (which was quadratic: 2 s for
    a 1.4 MB module, 4x per doubling)."""
    from rag_kvcache.markup.language import Element, Text, parse

    body = "ab&amp;" * 200_000
    root = parse(schema_with(f'<module name="m">{body}<module name="n">c&lt;d</module>e</module>'))
    module = root.children[0].children[0]
    assert isinstance(module, Element) and [type(c) for c in module.children] == [
        Text,
        Element,
        Text,
    ]
    assert [getattr(c, "text", None) for c in module.children] == ["ab&" * 200_000, None, "e"]
    inner = module.children[1]
    assert isinstance(inner, Element) and inner.children[0].text == "c<d"  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- never a crash

TEXT = st.sampled_from(["", "text ", "  ", "a\n    b", "&amp; more"])
ATTRS = st.dictionaries(
    st.sampled_from(["name", "len", "length", "scaffold", "cache", "modules", "src", "topic"]),
    st.sampled_from(["a", "b", "default", "age", "1x", "", "3", "0", "²", "false", "a b", "a/b"]),
    max_size=3,
)


def markup(tags: list[str]) -> st.SearchStrategy[str]:
    def element(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        def render(tag: str, attrs: dict[str, str], inner: list[str]) -> str:
            pairs = "".join(f' {k}="{v}"' for k, v in attrs.items())
            return f"<{tag}{pairs}>{''.join(inner)}</{tag}>"

        return st.builds(render, st.sampled_from(tags), ATTRS, st.lists(children, max_size=3))

    return st.recursive(TEXT, element, max_leaves=10)


@functools.cache
def tiny_schemas(tokenizer) -> dict[str, Schema]:
    return {
        "persona": compile_schema((DATA / "prompt_cache" / "persona.xml").read_text(), tokenizer)
    }


SCHEMA_TAGS = ["module", "union", "param", "parameter", "system", "user", "assistant", "scaffold"]
PROMPT_TAGS = ["age", "default", "young-adult", "education", "occupation", "user", "assistant"]


@settings(max_examples=150, deadline=None)
@given(body=markup([*SCHEMA_TAGS, "bogus"]), cut=st.integers(0, 2))
def test_any_schema_compiles_or_is_refused_clearly(tiny_tokenizer, body, cut) -> None:
    source = f'<schema name="s">{body}</schema>'
    with contextlib.suppress(MarkupError):  # anything else fails the test
        compile_schema(source[: len(source) - 5 * cut], tiny_tokenizer)


@settings(max_examples=150, deadline=None)
@given(body=markup(PROMPT_TAGS), cut=st.integers(0, 2))
def test_any_prompt_compiles_or_is_refused_clearly(tiny_tokenizer, body, cut) -> None:
    source = f'<prompt schema="persona">{body}</prompt>'
    with contextlib.suppress(MarkupError):  # anything else fails the test
        compile_prompt(
            source[: len(source) - 5 * cut], tiny_schemas(tiny_tokenizer), tiny_tokenizer
        )


# ----------------------------------------------------------------------------- serving


@pytest.mark.parametrize(
    "prompt", [CODE_PROMPT, PERSONA_PROMPT, REFERENCE_PROMPT, TRIP_PROMPT, LETTERS_PROMPT]
)
def test_each_upstream_prompt_is_served_from_cached_modules(tiny64, prompt) -> None:
    """Served at schema positions (tiny float64 model): the imported units come from the cache
    and only the prompt's own tokens are computed; a prefill of the same tokens agrees on how
    many there are."""
    engine = RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=3)), lm=tiny64)
    cache = PromptCache(engine)
    for path in FIXTURES:
        cache.add_schema(path.read_text())
    compiled = cache.compile(prompt)
    served = cache.serve(compiled)
    context = sum(len(u.token_ids) for u in compiled.units)
    assert (served.context_tokens, served.computed_tokens) == (context, len(compiled.new_ids))
    ids = prompt_in_position_order(
        cache._chunks(compiled.units), list(compiled.new_ids), schema_placement(compiled)
    )
    plain = cache.serve(compiled, "prefill")
    assert plain.prompt_tokens == len(ids) == served.prompt_tokens
    assert plain.computed_tokens == len(ids) and served.token_ids
