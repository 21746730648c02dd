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

Layout, as Prompt Cache's own parser reads it: elements take positions in document order;
members of a `<union>` share one start and the union is as long as its longest member; a
`<param len=N>` (Prompt Cache spells it `<parameter length=N>`) reserves N positions for an
argument given at prompt time. Module names are unique within their parent (a module is known
by its path, `age/default`); a prompt names a module by nesting references as the schema nests
modules (`<age><adult/></age>`), or by its name alone where that is unique. Role elements
become the model's own chat-template text around their content, in schemas and in prompts;
the closing of a schema's final `<user>` is held back so the prompt's free text continues that
turn, followed by the assistant header. A text run keeps its inner whitespace (code stays
code); the whitespace around it becomes one space, none at the start of a turn. Comments are
ignored. Every run of text is a *unit*: tokens with a start position, owned by the innermost
module (or anonymous: always included). A scaffold is the listed modules and the anonymous
text encoded together as one unit, used when a prompt imports all of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.parsers import expat

from rag_kvcache.errors import RagKVCacheError

ROLES = ("system", "user", "assistant")
MAX_DEPTH = 64  # elements nested deeper are refused (a parser's recursion, a reader's sense)
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


def read_source(path: Path) -> str:
    """A schema's or prompt's text from its file; one that is not UTF-8 is a MarkupError."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise MarkupError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None


def parse(source: str) -> Element:
    """XML -> Element tree with positions (expat; comments dropped). Elements nest at most
    MAX_DEPTH deep, and external entities (which would read files or URLs) are refused."""
    try:  # expat reads UTF-8: a byte that was not (kept as a lone surrogate) failed in it
        source.encode("utf-8")
    except UnicodeEncodeError as e:
        line = source.count("\n", 0, e.start) + 1
        column = e.start - (source.rfind("\n", 0, e.start) + 1) + 1
        raise MarkupError(
            f"line {line}, column {column}: {source[e.start]!r} is not a Unicode character (a "
            "byte that is not UTF-8, or a lone surrogate): send valid UTF-8"
        ) from None
    root = Element("#document", {}, 1, 1)
    stack = [root]
    pieces: dict[int, list[str]] = {}  # a Text's pieces by id: joined once, not appended to
    parser = expat.ParserCreate()

    def start(tag: str, attrs: dict[str, str]) -> None:
        node = Element(tag, attrs, parser.CurrentLineNumber, parser.CurrentColumnNumber + 1)
        if len(stack) > MAX_DEPTH:
            raise MarkupError(f"{node.where()}: elements nest more than {MAX_DEPTH} deep")
        stack[-1].children.append(node)
        stack.append(node)

    def end(_tag: str) -> None:
        stack.pop()

    def text(data: str) -> None:
        children = stack[-1].children
        if children and isinstance(children[-1], Text):
            pieces[id(children[-1])].append(data)  # expat gives text in many small pieces
        else:
            line, column = parser.CurrentLineNumber, parser.CurrentColumnNumber + 1
            children.append(Text(data, line, column))
            pieces[id(children[-1])] = [data]

    def external(*_: object) -> int:
        line, column = parser.CurrentLineNumber, parser.CurrentColumnNumber + 1
        raise MarkupError(f"line {line}, column {column}: external entities are not allowed")

    def skipped(name: str, _parameter: bool) -> None:  # a DOCTYPE naming an external DTD
        line, column = parser.CurrentLineNumber, parser.CurrentColumnNumber + 1
        raise MarkupError(  # makes expat pass an undefined entity over, silently dropped
            f"line {line}, column {column}: undefined entity &{name}; (external DTDs are not "
            "read: write the character itself)"
        )

    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.CharacterDataHandler = text
    parser.ExternalEntityRefHandler = external
    parser.SkippedEntityHandler = skipped
    try:
        parser.Parse(source, True)
    except expat.ExpatError as e:
        raise MarkupError(
            f"line {e.lineno}, column {e.offset + 1}: {expat.errors.messages[e.code]}"
        ) from None
    _join_texts(root, pieces)
    elements = [c for c in root.children if isinstance(c, Element)]
    if len(elements) != 1:
        raise MarkupError("expected one top-level element")
    return elements[0]


def _join_texts(node: Element, pieces: dict[int, list[str]]) -> None:
    """Each Text's pieces as its text (iteratively: the tree is at most MAX_DEPTH deep)."""
    todo = [node]
    while todo:
        for child in todo.pop().children:
            if isinstance(child, Text):
                child.text = "".join(pieces[id(child)])
            else:
                todo.append(child)


# ----------------------------------------------------------------------------- schemas

NAME = re.compile(r"[A-Za-z_][\w.-]*")  # module and parameter names: usable as XML tag names
_PARAM = frozenset({"name", "len", "length", "scaffold"})
ATTRIBUTES: dict[str, frozenset[str]] = {  # what each element takes: any other is a typo
    "schema": frozenset({"name"}),
    "prompt": frozenset({"schema"}),
    "module": frozenset({"name", "cache", "src"}),  # (src: refused with its own reason)
    "union": frozenset({"scaffold"}),
    "param": _PARAM,
    "parameter": _PARAM,
    "scaffold": frozenset({"modules"}),
    **{role: frozenset() for role in ROLES},
}


def check_attributes(node: Element) -> None:
    """Refuse an attribute the element does not take: `<module nmae=...>` or `<param len="2"
    length="50">` were read as if the typo or the second length were not there."""
    allowed = ATTRIBUTES[node.tag]
    if unknown := sorted(set(node.attrs) - allowed):
        takes = ", ".join(f"{a}=" for a in sorted(allowed)) or "no attributes"
        raise MarkupError(f"{node.where()}: <{node.tag}> has {unknown[0]}=; it takes {takes}")
    if {"len", "length"} <= set(node.attrs):
        raise MarkupError(f"{node.where()}: <{node.tag}> has len= and length=; give one")


@dataclass(frozen=True)
class Unit:
    """A run of tokens at schema positions start .. start + len - 1."""

    module: str | None  # the owning module's path; None: anonymous text, always included
    token_ids: tuple[int, ...]
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class Param:
    module: str  # path
    name: str
    start: int
    length: int


@dataclass(frozen=True)
class Module:
    name: str
    path: str  # names from the outermost module down, "age/default": unique in the schema
    parent: str | None  # the parent's path
    union: int | None  # members of one union share an id; a prompt may import one of them
    start: int
    end: int


@dataclass(frozen=True)
class Schema:
    name: str
    units: tuple[Unit, ...]
    modules: dict[str, Module]  # by path
    params: dict[tuple[str, str], Param]  # by (module path, name)
    scaffolds: tuple[tuple[str, ...], ...]  # module paths
    length: int  # positions the schema spans
    held_back: tuple[int, ...]  # the end of a final user turn, held back: the prompt continues it
    tail: tuple[int, ...]  # held_back + the assistant header
    source: str  # the XML it was compiled from


class _Compiler:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.units: list[Unit] = []
        self.modules: dict[str, Module] = {}
        self.params: dict[tuple[str, str], Param] = {}
        self.scaffolds: list[tuple[str, Element]] = []
        self.unions = 0
        self.fresh = True  # at the start of a role or the schema: no space before text
        self.space = False  # whitespace met since the last text: the next text starts with one

    def tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def emit(self, module: str | None, text: str, pos: int) -> int:
        ids = self.tokens(text)
        if ids:
            self.units.append(Unit(module, tuple(ids), pos))
        return pos + len(ids)

    def text(self, module: str | None, text: str, pos: int) -> int:
        """A text run: inner whitespace kept, the whitespace around it one space at most."""
        body = text.strip()
        if not body:
            self.space = self.space or bool(text)
            return pos
        if (self.space or text[0].isspace()) and not self.fresh:
            body = " " + body
        self.fresh, self.space = False, text[-1].isspace()
        return self.emit(module, body, pos)

    def walk(self, node: Element | Text, pos: int, module: str | None, union: int | None) -> int:
        if isinstance(node, Text):
            return self.text(module, node.text, pos)
        tag = node.tag
        if tag in ATTRIBUTES:
            check_attributes(node)
        if tag == "module":
            return self.module(node, pos, module, union)
        if tag == "union":
            return self.union(node, pos, module)
        if tag in ("param", "parameter"):
            return self.param(node, pos, module)
        if tag in ROLES:  # the role's text belongs to the module around it, as in Prompt Cache
            prefix, suffix = role_text(self.tokenizer, tag)
            pos = self.emit(module, prefix, pos)
            self.fresh, self.space = True, False
            for child in node.children:
                pos = self.walk(child, pos, module, None)
            self.fresh, self.space = True, False
            return self.emit(module, suffix, pos)
        if tag == "scaffold" and module is None:
            self.scaffolds.append((node.attrs.get("modules", ""), node))
            return pos
        raise MarkupError(f"{node.where()}: unknown element <{tag}> in a schema")

    def module(self, node: Element, pos: int, parent: str | None, union: int | None) -> int:
        name = node.attrs.get("name", "")
        if not NAME.fullmatch(name):
            raise MarkupError(
                f"{node.where()}: <module> needs a name of a letter A-Z or a-z, or '_', then "
                f"letters, digits, '_', '.' or '-' (got {name!r})"
            )
        if name in ROLES:  # a prompt's <user/> is a turn, so such a module could not be used
            raise MarkupError(f"{node.where()}: a module cannot be named {name!r}, like a role")
        path = name if parent is None else f"{parent}/{name}"
        if path in self.modules:
            raise MarkupError(f"{node.where()}: module {path!r} is defined twice")
        if "src" in node.attrs:
            raise MarkupError(
                f"{node.where()}: <module src=...> (text read from a file) is not supported; "
                "put the text inside the module"
            )
        if node.attrs.get("cache", "true") not in ("true", "false"):
            raise MarkupError(f'{node.where()}: <module cache=...> is "true" or "false"')
        end = pos
        for child in node.children:
            end = self.walk(child, end, path, None)
        self.modules[path] = Module(name, path, parent, union, pos, end)
        return end

    def union(self, node: Element, pos: int, module: str | None) -> int:
        self.unions += 1
        union_id = self.unions  # nested unions below take later ids
        before = (self.fresh, self.space)  # every member starts as the first one does
        ends, names = [pos], []
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
            self.fresh, self.space = before
            ends.append(self.walk(child, pos, module, union_id))
            names.append(child.attrs["name"])
        default = node.attrs.get("scaffold")  # Prompt Cache: the member encoded as context
        if default is not None and default not in names:
            raise MarkupError(
                f"{node.where()}: <union scaffold={default!r}> names none of its members "
                f"({', '.join(names)})"
            )
        self.fresh, self.space = before if max(ends) == pos else (False, False)
        return max(ends)

    def param(self, node: Element, pos: int, module: str | None) -> int:
        tag = node.tag
        if module is None:
            raise MarkupError(f"{node.where()}: <{tag}> must be inside a <module>")
        name = node.attrs.get("name", "")
        length = node.attrs.get("len", node.attrs.get("length", ""))
        if not NAME.fullmatch(name) or not re.fullmatch("[0-9]+", length) or int(length) < 1:
            raise MarkupError(
                f"{node.where()}: <{tag}> needs name= and len= (or length=), a positive integer"
            )
        if (module, name) in self.params:
            raise MarkupError(f"{node.where()}: module {module!r} has two parameters {name!r}")
        placeholder = node.attrs.get("scaffold", "")  # never encoded here: an empty slot
        if len(self.tokens(" " + placeholder.strip())) > int(length):
            raise MarkupError(
                f"{node.where()}: the scaffold of parameter {name!r} is longer than its "
                f"{length} tokens"
            )
        self.params[(module, name)] = Param(module, name, pos, int(length))
        self.fresh, self.space = False, False
        return pos + int(length)


def find_module(
    modules: dict[str, Module], name: str, scope: str | None, where: str, owner: str
) -> Module:
    """The module a reference names within `scope` (a module's path; None: the schema): the
    submodule of that name, else the one module below with that name; a path works too."""
    direct = name if scope is None else f"{scope}/{name}"
    if direct in modules:
        return modules[direct]
    below = [
        m
        for m in modules.values()
        if m.name == name and (scope is None or m.path.startswith(scope + "/"))
    ]
    if len(below) == 1:
        return below[0]
    if below:
        paths = ", ".join(m.path for m in below)
        parent = below[0].path.split("/")[-2]
        raise MarkupError(
            f"{where}: {name!r} names {len(below)} modules of {owner} ({paths}); nest the "
            f"reference in its parent's, as in <{parent}><{name}/></{parent}>"
        )
    known = ", ".join(m.name for m in modules.values() if m.parent == scope) or "none"
    raise MarkupError(f"{where}: {owner} has no module {name!r} (modules: {known})")


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
    check_attributes(root)
    compiler = _Compiler(tokenizer)
    pos = 0
    last_role = None
    for child in root.children:
        pos = compiler.walk(child, pos, None, None)
        if isinstance(child, Element) and child.tag != "scaffold":
            last_role = child.tag if child.tag in ROLES else None
        elif isinstance(child, Text) and child.text.strip():
            last_role = None
    held_back: list[int] = []
    if last_role == "user":  # hold back the end of the user turn: the prompt continues it
        held_back = compiler.tokens(role_text(tokenizer, "user")[1])
        if held_back:
            compiler.units.pop()
            pos -= len(held_back)
    header = compiler.tokens(assistant_header(tokenizer)) if last_role == "user" else []
    scaffolds = []
    for names, node in compiler.scaffolds:
        if not names.split():
            raise MarkupError(f'{node.where()}: <scaffold> needs modules="a b ..."')
        where, owner = node.where(), f"schema {root.attrs['name']!r}"
        for name in names.split():
            if not any(name in (m.path, m.name) for m in compiler.modules.values()):
                raise MarkupError(f"{where}: scaffold names unknown module {name!r}")
        paths = tuple(
            find_module(compiler.modules, n, None, where, owner).path for n in names.split()
        )
        scaffold_unit([u for u in compiler.units if u.module is None or u.module in paths])
        scaffolds.append(paths)
    return Schema(
        root.attrs["name"],
        tuple(compiler.units),
        compiler.modules,
        compiler.params,
        tuple(scaffolds),
        pos,
        tuple(held_back),
        tuple(held_back + header),
        source,
    )


def scaffold_unit(units: list[Unit]) -> Unit:
    """Units that form one gapless run, as one unit (encoded together)."""
    if not units:
        raise MarkupError("a scaffold must cover some text; its modules are empty")
    units = sorted(units, key=lambda u: u.start)
    for a, b in zip(units, units[1:]):
        if a.end > b.start:  # two members of one union start at the same position
            raise MarkupError(
                f"a scaffold cannot hold both {a.module!r} and {b.module!r}: they are members "
                "of one <union> (they share positions)"
            )
        if a.end != b.start:
            raise MarkupError(
                f"a scaffold must cover one gapless run of positions; {a.end}..{b.start - 1} "
                "belong to modules outside it (a union member or a parameter)"
            )
    return Unit("#scaffold", tuple(t for u in units for t in u.token_ids), units[0].start)
