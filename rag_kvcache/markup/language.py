"""Prompt Cache's markup language: schemas of reusable prompt modules, and prompts that import
them. Compiles to units of tokens laid out at schema positions; `serve` reuses their KV.

    <schema name="travel">
      <system>You plan trips.</system>
      <user>
        <module name="trip-plan">Plan a trip of <param name="duration" len="4"/>.</module>
        <union>
          <module name="miami">Miami has beaches and Art Deco hotels.</module>
          <module name="paris">Paris has museums and cafes.</module>
        </union>
      </user>
      <scaffold modules="trip-plan miami"/>
    </schema>

    <prompt schema="travel"><trip-plan duration="3 days"/><miami/> What should I pack?</prompt>

Layout: elements take positions in document order; members of a `<union>` share one start
and the union is as long as its longest member; a `<param len=N>` reserves N positions for an
argument given at prompt time. Role elements become the model's own chat-template text around
their content; the closing of a final `<user>` is held back so the prompt's own text continues
that turn, followed by the assistant header. Text runs have their whitespace collapsed;
comments are ignored. Every run of text is a *unit*: tokens with a start position, owned by
the innermost module (or anonymous: always included). A scaffold is the listed modules and the
anonymous text encoded together as one unit, used when a prompt imports all of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from xml.parsers import expat

from rag_kvcache.errors import RagKVCacheError

ROLES = ("system", "user", "assistant")
_MARK = "\x00MARK\x00"


class MarkupError(RagKVCacheError, ValueError):
    """A schema or prompt is malformed or does not match its schema (line and column named)."""


# ----------------------------------------------------------------------------- parsing


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    line: int
    column: int
    children: list[Element | Text] = field(default_factory=list)

    def where(self) -> str:
        return f"line {self.line}, column {self.column}"


@dataclass
class Text:
    text: str
    line: int
    column: int


def parse(source: str) -> Element:
    """XML -> Element tree with positions (expat; comments dropped)."""
    root = Element("#document", {}, 1, 1)
    stack = [root]
    parser = expat.ParserCreate()

    def start(tag: str, attrs: dict[str, str]) -> None:
        node = Element(tag, attrs, parser.CurrentLineNumber, parser.CurrentColumnNumber + 1)
        stack[-1].children.append(node)
        stack.append(node)

    def end(_tag: str) -> None:
        stack.pop()

    def text(data: str) -> None:
        children = stack[-1].children
        if children and isinstance(children[-1], Text):
            children[-1].text += data
        else:
            line, column = parser.CurrentLineNumber, parser.CurrentColumnNumber + 1
            children.append(Text(data, line, column))

    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.CharacterDataHandler = text
    try:
        parser.Parse(source, True)
    except expat.ExpatError as e:
        raise MarkupError(
            f"line {e.lineno}, column {e.offset + 1}: {expat.errors.messages[e.code]}"
        ) from None
    elements = [c for c in root.children if isinstance(c, Element)]
    if len(elements) != 1:
        raise MarkupError("expected one top-level element")
    return elements[0]


# ----------------------------------------------------------------------------- schemas


@dataclass(frozen=True)
class Unit:
    """A run of tokens at schema positions start .. start + len - 1."""

    module: str | None  # None: anonymous text, always included
    token_ids: tuple[int, ...]
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class Param:
    module: str
    name: str
    start: int
    length: int


@dataclass(frozen=True)
class Module:
    name: str
    parent: str | None
    union: int | None  # members of one union share an id; a prompt may import one of them
    start: int
    end: int


@dataclass(frozen=True)
class Schema:
    name: str
    units: tuple[Unit, ...]
    modules: dict[str, Module]
    params: dict[tuple[str, str], Param]  # by (module, name)
    scaffolds: tuple[tuple[str, ...], ...]
    length: int  # positions the schema spans
    tail: tuple[int, ...]  # held-back end of the final user turn + the assistant header
    source: str  # the XML it was compiled from


class _Compiler:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.units: list[Unit] = []
        self.modules: dict[str, Module] = {}
        self.params: dict[tuple[str, str], Param] = {}
        self.scaffolds: list[tuple[str, ...]] = []
        self.unions = 0
        self.fresh = True  # at the start of a role or the schema: no space before text

    def tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def emit(self, module: str | None, text: str, pos: int, raw: bool = False) -> int:
        if not raw:
            text = re.sub(r"\s+", " ", text).strip()
            if not text:
                return pos
            text = text if self.fresh else " " + text
            self.fresh = False
        ids = self.tokens(text)
        if ids:
            self.units.append(Unit(module, tuple(ids), pos))
        return pos + len(ids)

    def walk(self, node: Element | Text, pos: int, module: str | None, union: int | None) -> int:
        if isinstance(node, Text):
            return self.emit(module, node.text, pos)
        tag = node.tag
        if tag == "module":
            name = node.attrs.get("name", "")
            if not re.fullmatch(r"[A-Za-z_][\w.-]*", name):
                raise MarkupError(f"{node.where()}: <module> needs a name (letters, digits, -_.)")
            if name in self.modules:
                raise MarkupError(f"{node.where()}: module {name!r} is defined twice")
            end = pos
            for child in node.children:
                end = self.walk(child, end, name, None)
            self.modules[name] = Module(name, module, union, pos, end)
            return end
        if tag == "union":
            self.unions += 1
            union_id = self.unions  # nested unions below take later ids
            ends = [pos]
            for child in node.children:
                if isinstance(child, Text):
                    if child.text.strip():
                        raise MarkupError(
                            f"line {child.line}: text inside <union>; wrap it in a <module>"
                        )
                    continue
                if child.tag != "module":
                    raise MarkupError(
                        f"{child.where()}: a <union> holds only <module>s, not <{child.tag}>"
                    )
                ends.append(self.walk(child, pos, module, union_id))
            return max(ends)
        if tag == "param":
            if module is None:
                raise MarkupError(f"{node.where()}: <param> must be inside a <module>")
            name, length = node.attrs.get("name", ""), node.attrs.get("len", "")
            if not name or not length.isdigit() or int(length) < 1:
                raise MarkupError(
                    f"{node.where()}: <param> needs name= and len= (a positive integer)"
                )
            self.params[(module, name)] = Param(module, name, pos, int(length))
            self.fresh = False
            return pos + int(length)
        if tag in ROLES:
            prefix, suffix = role_text(self.tokenizer, tag)
            pos = self.emit(None, prefix, pos, raw=True)
            self.fresh = True
            for child in node.children:
                pos = self.walk(child, pos, module, None)
            self.fresh = True
            return self.emit(None, suffix, pos, raw=True)
        if tag == "scaffold" and module is None:
            names = tuple(node.attrs.get("modules", "").split())
            if not names:
                raise MarkupError(f'{node.where()}: <scaffold> needs modules="a b ..."')
            self.scaffolds.append(names)
            return pos
        raise MarkupError(f"{node.where()}: unknown element <{tag}> in a schema")


def role_text(tokenizer: Any, role: str) -> tuple[str, str]:
    """The chat template's text before and after a message of `role` (after a system turn)."""
    if not getattr(tokenizer, "chat_template", None):
        return f"{role}: ", "\n"
    before = [{"role": "system", "content": "x"}] if role != "system" else []
    if role == "assistant":
        before.append({"role": "user", "content": "y"})
    head = tokenizer.apply_chat_template(before, tokenize=False) if before else ""
    full = tokenizer.apply_chat_template(
        [*before, {"role": role, "content": _MARK}], tokenize=False
    )
    prefix, suffix = full[len(head) :].split(_MARK)
    return prefix, suffix


def assistant_header(tokenizer: Any) -> str:
    if not getattr(tokenizer, "chat_template", None):
        return "assistant: "
    turn = [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]
    plain = tokenizer.apply_chat_template(turn, tokenize=False)
    return tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)[
        len(plain) :
    ]


def compile_schema(source: str, tokenizer: Any) -> Schema:
    """Parse and lay out a `<schema>`; errors name the line and column."""
    root = parse(source)
    if root.tag != "schema" or not root.attrs.get("name"):
        raise MarkupError(f'{root.where()}: expected <schema name="...">, got <{root.tag}>')
    compiler = _Compiler(tokenizer)
    pos = 0
    last_role = None
    for child in root.children:
        pos = compiler.walk(child, pos, None, None)
        if isinstance(child, Element):
            last_role = (
                child.tag
                if child.tag in ROLES
                else (last_role if child.tag == "scaffold" else None)
            )
    tail: list[int] = []
    if last_role == "user":  # hold back the end of the user turn: the prompt continues it
        suffix = compiler.units.pop()
        tail = list(suffix.token_ids)
        pos = suffix.start
    tail += compiler.tokens(assistant_header(tokenizer)) if last_role == "user" else []
    for names in compiler.scaffolds:
        for name in names:
            if name not in compiler.modules:
                raise MarkupError(f"scaffold names unknown module {name!r}")
        scaffold_unit([u for u in compiler.units if u.module is None or u.module in names])
    return Schema(
        root.attrs["name"],
        tuple(compiler.units),
        compiler.modules,
        compiler.params,
        tuple(compiler.scaffolds),
        pos,
        tuple(tail),
        source,
    )


# ----------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class CompiledPrompt:
    """What serving a prompt needs: cached units at their positions, and new tokens."""

    schema: Schema
    imported: tuple[str, ...]  # in the prompt's order (ancestors added first)
    units: tuple[Unit, ...]  # to take from the cache, schema order (a scaffold as one unit)
    new_ids: tuple[int, ...]  # parameter arguments, then the prompt's text and the tail
    new_positions: tuple[int, ...]
    arguments: dict[tuple[str, str], tuple[int, ...]]  # parameter tokens, by (module, name)


def compile_prompt(source: str, schemas: dict[str, Schema], tokenizer: Any) -> CompiledPrompt:
    """Parse a `<prompt schema=...>` and check it against its schema."""
    root = parse(source)
    if root.tag != "prompt":
        raise MarkupError(f'{root.where()}: expected <prompt schema="...">, got <{root.tag}>')
    name = root.attrs.get("schema", "")
    if name not in schemas:
        known = ", ".join(sorted(schemas)) or "none"
        raise MarkupError(f"{root.where()}: unknown schema {name!r} (known: {known})")
    schema = schemas[name]
    imported: list[str] = []
    values: dict[tuple[str, str], tuple[str, Element]] = {}
    texts: list[str] = []
    for child in root.children:
        if isinstance(child, Text):
            texts.append(child.text)
            continue
        module = schema.modules.get(child.tag)
        if module is None:
            raise MarkupError(
                f"{child.where()}: schema {name!r} has no module {child.tag!r} "
                f"(modules: {', '.join(schema.modules)})"
            )
        chain = [module.name]
        while schema.modules[chain[0]].parent is not None:
            chain.insert(0, schema.modules[chain[0]].parent)  # type: ignore[arg-type]
        imported += [m for m in chain if m not in imported]
        for param_name, value in child.attrs.items():
            if (child.tag, param_name) not in schema.params:
                raise MarkupError(
                    f"{child.where()}: module {child.tag!r} has no parameter {param_name!r}"
                )
            values[(child.tag, param_name)] = (value, child)
    unions: dict[int, str] = {}
    for module_name in imported:
        union = schema.modules[module_name].union
        if union is not None and unions.setdefault(union, module_name) != module_name:
            raise MarkupError(
                f"modules {unions[union]!r} and {module_name!r} are members of one <union>; "
                "import at most one of them"
            )
    arguments: dict[tuple[str, str], tuple[int, ...]] = {}
    new: list[tuple[int, int]] = []  # (position, token)
    for key, (value, element) in values.items():
        param = schema.params[key]
        ids = tuple(tokenizer(" " + value.strip(), add_special_tokens=False)["input_ids"])
        if len(ids) > param.length:
            raise MarkupError(
                f"{element.where()}: argument {key[1]}={value!r} of module {key[0]!r} is "
                f"{len(ids)} tokens; the parameter holds at most {param.length}"
            )
        arguments[key] = ids
        new += [(param.start + i, t) for i, t in enumerate(ids)]
    text = re.sub(r"\s+", " ", " ".join(texts)).strip()
    tail = list(tokenizer(" " + text, add_special_tokens=False)["input_ids"]) if text else []
    tail += schema.tail
    new += [(schema.length + i, t) for i, t in enumerate(tail)]
    if not new:
        raise MarkupError(f"{root.where()}: the prompt adds no text: nothing to answer")
    new.sort()
    return CompiledPrompt(
        schema,
        tuple(imported),
        select_units(schema, set(imported)),
        tuple(t for _, t in new),
        tuple(p for p, _ in new),
        arguments,
    )


def select_units(schema: Schema, imported: set[str]) -> tuple[Unit, ...]:
    """The anonymous units and the imported modules' units, in schema order; a scaffold whose
    modules are all imported replaces them and the anonymous text with its one unit."""
    units = [u for u in schema.units if u.module is None or u.module in imported]
    for names in schema.scaffolds:
        if set(names) <= imported:
            covered = [u for u in schema.units if u.module is None or u.module in names]
            merged = scaffold_unit(covered)
            units = [u for u in units if u not in covered]
            units.append(merged)
            break
    return tuple(sorted(units, key=lambda u: u.start))


def scaffold_unit(units: list[Unit]) -> Unit:
    """Units that form one gapless run, as one unit (encoded together)."""
    units = sorted(units, key=lambda u: u.start)
    for a, b in zip(units, units[1:]):
        if a.end != b.start:
            raise MarkupError(
                f"a scaffold must cover one gapless run of positions; {a.end}..{b.start - 1} "
                "belong to modules outside it (a union member or a parameter)"
            )
    return Unit("#scaffold", tuple(t for u in units for t in u.token_ids), units[0].start)
