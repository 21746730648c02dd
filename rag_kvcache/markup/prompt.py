"""Prompts of Prompt Cache's markup language, checked against their schema and compiled to
what serving needs: the cached units to take (at their schema positions) and the new tokens.

    <prompt schema="persona">
      <age><adult/></age>                 references nest as the schema nests its modules
      <trip-plan duration="3 days"/>      an argument, placed at its parameter's positions
      <user>Introduce yourself.</user>    a turn of its own, after the schema
    </prompt>

A prompt imports modules (their ancestors come along), fills parameters and adds text: free
text continues the schema's open user turn; `<system>`, `<user>`, `<assistant>` elements are
turns of their own, placed after the schema as Prompt Cache places a prompt's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rag_kvcache import chat_text
from rag_kvcache.markup.language import (
    ROLES,
    Element,
    MarkupError,
    Schema,
    Text,
    Unit,
    assistant_header,
    check_attributes,
    find_module,
    parse,
    role_text,
    scaffold_unit,
)


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
    check_attributes(root)
    name = root.attrs.get("schema", "")
    if name not in schemas:
        known = ", ".join(sorted(schemas)) or "none"
        raise MarkupError(f"{root.where()}: unknown schema {name!r} (known: {known})")
    schema = schemas[name]
    imported: list[str] = []
    values: dict[tuple[str, str], tuple[str, Element]] = {}
    turns: list[Text | Element] = []
    for child in root.children:
        if isinstance(child, Text) or child.tag in ROLES:
            turns.append(child)
        else:
            import_reference(schema, child, None, imported, values)
    unions: dict[int, str] = {}
    for path in imported:
        union = schema.modules[path].union
        if union is not None and unions.setdefault(union, path) != path:
            raise MarkupError(
                f"modules {unions[union]!r} and {path!r} are members of one <union>; "
                "import at most one of them"
            )
    arguments: dict[tuple[str, str], tuple[int, ...]] = {}
    new: list[tuple[int, int]] = []  # (position, token)
    for key, (value, element) in values.items():
        param = schema.params[key]
        text = value.strip()  # an empty argument leaves the slot empty, not a space in it
        ids = tuple(text_ids(tokenizer, " " + text)) if text else ()
        if len(ids) > param.length:
            raise MarkupError(
                f"{element.where()}: argument {key[1]}={value!r} of module {key[0]!r} is "
                f"{len(ids)} tokens; the parameter holds at most {param.length}"
            )
        arguments[key] = ids
        new += [(param.start + i, t) for i, t in enumerate(ids)]
    tail = conversation(turns, schema, tokenizer)
    new += [(schema.length + i, t) for i, t in enumerate(tail)]
    units = list(select_units(schema, set(imported)))
    end = max((u.end for u in units), default=0)
    if not new or max(p for p, _ in new) < end:
        # nothing new after the imported text (modules only, as in Prompt Cache's benchmarks,
        # or arguments inside it): its last token is the query, as a prefill's would be;
        # the answer began at an argument's slot, before the text that follows it
        if not units:
            raise MarkupError(f"{root.where()}: the prompt adds no text: nothing to answer")
        last = max(units, key=lambda u: u.end)
        units.remove(last)
        if len(last.token_ids) > 1:
            units.append(Unit(last.module, last.token_ids[:-1], last.start))
        new.append((last.end - 1, last.token_ids[-1]))
    new.sort()
    return CompiledPrompt(
        schema,
        tuple(imported),
        tuple(units),
        tuple(t for _, t in new),
        tuple(p for p, _ in new),
        arguments,
    )


def import_reference(
    schema: Schema,
    ref: Element,
    scope: str | None,
    imported: list[str],
    values: dict[tuple[str, str], tuple[str, Element]],
) -> None:
    """Import the module `ref` names (with its ancestors), its arguments and the references
    nested in it, which name its submodules (Prompt Cache: `<age><adult/></age>`)."""
    owner = f"schema {schema.name!r}" if scope is None else f"module {scope!r}"
    module = find_module(schema.modules, ref.tag, scope, ref.where(), owner)
    chain = [module.path]
    while schema.modules[chain[0]].parent is not None:
        chain.insert(0, schema.modules[chain[0]].parent)  # type: ignore[arg-type]
    imported += [m for m in chain if m not in imported]
    for param_name, value in ref.attrs.items():
        if (module.path, param_name) not in schema.params:
            raise MarkupError(
                f"{ref.where()}: module {module.path!r} has no parameter {param_name!r}"
            )
        if (module.path, param_name) in values:  # a module imported twice: one would be lost
            raise MarkupError(
                f"{ref.where()}: parameter {param_name!r} of module {module.path!r} is given "
                "twice; import the module once"
            )
        values[(module.path, param_name)] = (value, ref)
    for child in ref.children:
        if isinstance(child, Text):
            if child.text.strip():
                raise MarkupError(
                    f"line {child.line}, column {child.column}: text inside the reference to "
                    f"module {module.path!r}; a reference holds only references to submodules"
                )
        elif child.tag in ROLES:
            raise MarkupError(
                f"{child.where()}: a <{child.tag}> turn goes directly in the <prompt>, not "
                f"inside the reference to module {module.path!r}"
            )
        else:
            import_reference(schema, child, module.path, imported, values)


def conversation(turns: list[Text | Element], schema: Schema, tokenizer: Any) -> list[int]:
    """The prompt's own tokens, after the schema. Free text continues the schema's final user
    turn; a role element is a turn of its own, as in a schema (an open user turn is closed
    first), and a final user turn is followed by the assistant header, so the model answers."""

    def tokens(text: str) -> list[int]:  # the chat template's own: its control tokens
        return (
            list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
            if text
            else []
        )

    def written(text: str) -> list[int]:  # the prompt writer's: text only
        return text_ids(tokenizer, text) if text else []

    free = " ".join(t.text.strip() for t in turns if isinstance(t, Text) and t.text.strip())
    roles = [t for t in turns if isinstance(t, Element)]
    if not roles:
        return written(" " + free if free else "") + list(schema.tail)
    ids = written(" " + free if free else "") + list(schema.held_back)
    for turn in turns[turns.index(roles[0]) :]:
        if isinstance(turn, Text):
            if turn.text.strip():
                raise MarkupError(
                    f"line {turn.line}, column {turn.column}: text after a role turn; put it "
                    "inside a <user> (or <system>, <assistant>) element"
                )
            continue
        if any(isinstance(c, Element) for c in turn.children):
            raise MarkupError(f"{turn.where()}: a <{turn.tag}> turn of a prompt holds only text")
        check_attributes(turn)
        prefix, suffix = role_text(tokenizer, turn.tag)
        text = "".join(c.text for c in turn.children if isinstance(c, Text)).strip()
        ids += tokens(prefix) + written(text) + tokens(suffix)
    return ids + (tokens(assistant_header(tokenizer)) if roles[-1].tag == "user" else [])


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """What a prompt writes (an argument, free text, a turn's text) as text: `<|im_end|>`
    spelled in it (`&lt;|im_end|&gt;`) is those characters, never the control token, which
    would end a turn or forge one. Tokenized alone, so no token crosses into the template's."""
    return chat_text.text_ids(tokenizer, text)


def select_units(schema: Schema, imported: set[str]) -> tuple[Unit, ...]:
    """The anonymous units and the imported modules' units, in schema order; a scaffold whose
    modules are all imported replaces them and the anonymous text with its one unit: of
    several, the one covering the most modules (the first in the schema was taken, so a
    smaller scaffold listed first left the larger one's modules apart)."""
    units = [u for u in schema.units if u.module is None or u.module in imported]
    fitting = [names for names in schema.scaffolds if set(names) <= imported]
    if fitting:
        names = max(fitting, key=len)  # (the first of the largest)
        covered = [u for u in schema.units if u.module is None or u.module in names]
        units = [u for u in units if u not in covered]
        units.append(scaffold_unit(covered))
    return tuple(sorted(units, key=lambda u: u.start))
