"""Serving markup prompts (Prompt Cache) from cached module KV.

Every unit of a schema (a run of a module's text, the anonymous text, a scaffold) is encoded
once, alone, and kept in the engine's store under its content hash, like a RAG chunk: a schema
edit re-encodes only the units whose tokens changed. Serving a prompt places the imported
units' KV at their schema positions (keys rotated there: the same as encoding them there),
computes the parameter arguments and the prompt's text at their positions in one forward
(each new token sees every token at an earlier position), and decodes. The second mode links
the imported units back to back with a link strategy instead, so modules can be reordered and
no positions are left empty.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from rag_kvcache.answer import Answer, AnswerStream, Placement, Prepared, answer_steps, prepare
from rag_kvcache.engine import RagKVCache
from rag_kvcache.errors import ContextTooLongError
from rag_kvcache.kv import ChunkKV, EncodeSettings
from rag_kvcache.markup.language import (
    MarkupError,
    Schema,
    Unit,
    compile_schema,
    read_source,
    scaffold_unit,
)
from rag_kvcache.markup.prompt import CompiledPrompt, compile_prompt
from rag_kvcache.strategy import Strategy

POSITIONS = Strategy("positions")  # Prompt Cache: every unit at its schema position


@dataclass(frozen=True)
class SchemaAdded:
    name: str
    modules: int
    units: int
    encoded: int  # units encoded now (the rest were cached: unchanged since last time)


@dataclass(frozen=True)
class SchemasLoaded:
    added: list[SchemaAdded]
    skipped: list[tuple[Path, str]]  # (file, why): left out, the rest loaded


class PromptCache:
    """Schemas compiled for one engine's model; their units live in the engine's store."""

    def __init__(self, engine: RagKVCache):
        self.engine = engine
        self.schemas: dict[str, Schema] = {}

    def add_schema(self, source: str) -> SchemaAdded:
        """Compile a schema and encode its units (and scaffolds) that are not cached yet."""
        return self.add(self.checked_schema(source))

    def checked_schema(self, source: str) -> Schema:
        """A schema compiled for this model, nothing encoded yet (a caller may check its name
        first); refused if its positions pass the model's window."""
        if not isinstance(source, str):  # (None failed deep in the parser, an AttributeError)
            raise TypeError(f"a schema is its markup text, a str; got {type(source).__name__}")
        schema = compile_schema(source, self.engine.lm.tokenizer)
        window = self.engine.lm.max_context
        if schema.length > window:  # its later positions could never be attended
            raise ContextTooLongError(
                f"schema {schema.name!r} spans {schema.length} positions; the model's window "
                f"is {window}"
            )
        return schema

    def add(self, schema: Schema) -> SchemaAdded:
        """Encode a compiled schema's units (and scaffolds) that are not cached yet."""
        units = list(schema.units)
        for names in schema.scaffolds:
            covered = [u for u in schema.units if u.module is None or u.module in names]
            units.append(scaffold_unit(covered))
        _, encoded = self._cache(units)
        self.schemas[schema.name] = schema
        return SchemaAdded(schema.name, len(schema.modules), len(units), encoded)

    def load_folder(self, folder: Path, encode: bool = True) -> SchemasLoaded:
        """Add every `*.xml` schema in a folder (the CLI keeps them under the store root);
        with `encode=False` only compiled, for listing (nothing is written to the store).

        A file that no longer compiles or fits (edited by hand, or stored before a check
        existed) is skipped with its reason, so one bad schema does not take the others'
        prompts down with it; a store that fails (a full disk) still raises. Two files that
        define one schema name: the file named after it (`NAME.xml`, as `schema add` writes
        it) is served, else the first by file name, and the other is skipped, saying so."""
        skipped: list[tuple[Path, str]] = []
        compiled: list[tuple[Path, Schema]] = []
        for path in sorted(folder.glob("*.xml")):
            if not path.is_file():  # a folder, or a FIFO, whose read would never end
                skipped.append((path, "not a regular file"))
                continue
            try:
                compiled.append((path, self.checked_schema(read_source(path))))
            except (MarkupError, ContextTooLongError) as e:
                skipped.append((path, str(e)))
            except OSError as e:
                skipped.append((path, f"cannot read it: {e.strerror or e}"))
        served: dict[str, Path] = {}
        for path, schema in sorted(compiled, key=lambda c: c[0].stem != c[1].name):  # (stable)
            if schema.name in served:
                skipped.append(
                    (
                        path,
                        f"defines schema {schema.name!r} again; {served[schema.name].name}'s "
                        "is the one served",
                    )
                )
            else:
                served[schema.name] = path
        chosen = [schema for path, schema in compiled if served.get(schema.name) == path]
        if encode:
            return SchemasLoaded([self.add(schema) for schema in chosen], sorted(skipped))
        self.schemas |= {schema.name: schema for schema in chosen}
        listed = [
            SchemaAdded(s.name, len(s.modules), len(s.units) + len(s.scaffolds), 0) for s in chosen
        ]
        return SchemasLoaded(listed, sorted(skipped))

    def compile(self, prompt: str) -> CompiledPrompt:
        if not isinstance(prompt, str):  # (None failed deep in the parser, an AttributeError)
            raise TypeError(
                "a prompt is its markup text (a str) or a CompiledPrompt; got "
                + type(prompt).__name__
            )
        return compile_prompt(prompt, self.schemas, self.engine.lm.tokenizer)

    def serve(
        self,
        prompt: str | CompiledPrompt,
        strategy: Strategy | str = POSITIONS,
        max_new_tokens: int | None = None,
    ) -> Answer:
        """Answer a prompt through the engine's answer path: at schema positions (`positions`,
        the default), with a link strategy (imported modules back to back, any order), or by a
        plain prefill of the same tokens in position order (`prefill`), for comparison."""
        compiled = prompt if isinstance(prompt, CompiledPrompt) else self.compile(prompt)
        strategy = Strategy.parse(strategy)
        end = max(compiled.new_positions, default=0) + 1
        if end > self.engine.lm.max_context:  # a schema added before its window was checked
            raise ContextTooLongError(
                f"the prompt reaches position {end}; the model's window is "
                f"{self.engine.lm.max_context}"
            )
        if strategy.order != "given":
            raise MarkupError("a prompt imports its modules in its own order; drop the +order")
        lm = self.engine.lm
        gen = self.engine.config.generation
        if max_new_tokens is not None:
            gen = replace(gen, max_new_tokens=max_new_tokens)
        new_ids = list(compiled.new_ids)
        placement: Placement | None = None
        units = compiled.units
        if strategy.kind == "positions" or not strategy.uses_cache:
            placement = schema_placement(compiled)
        elif compiled.arguments:
            raise MarkupError(
                "parameters need their schema positions; serve with strategy='positions'"
            )
        else:
            units = linked_order(compiled)

        def context() -> Prepared:
            chunks = self._chunks(units)  # encodes only what is missing (e.g. expired)
            return prepare(lm, chunks, new_ids, strategy, gen.max_new_tokens, placement)

        return AnswerStream(answer_steps(lm, context, len(new_ids), strategy, gen)).finish()

    def _cache(self, units: list[Unit]) -> tuple[list[str], int]:
        token_lists = [list(u.token_ids) for u in units]
        texts = [self.engine.lm.tokenizer.decode(t) for t in token_lists]
        return self.engine.cache_token_ids(token_lists, EncodeSettings(), texts)

    def _chunks(self, units: tuple[Unit, ...]) -> list[ChunkKV]:
        ids, _ = self._cache(list(units))  # encodes only what is missing (e.g. expired)
        return self.engine.store.get(ids)


def schema_placement(compiled: CompiledPrompt) -> Placement:
    """Where the prompt's units and its own tokens sit in the schema's positions."""
    return Placement(tuple(u.start for u in compiled.units), tuple(compiled.new_positions))


def linked_order(compiled: CompiledPrompt) -> tuple[Unit, ...]:
    """Units for position-independent linking: the anonymous text before the first module,
    then each imported module's units in the prompt's order, then the other anonymous text."""
    units = compiled.units
    if any(u.module == "#scaffold" for u in units):
        return units
    first = min((u.start for u in units if u.module is not None), default=None)
    head = [u for u in units if u.module is None and (first is None or u.start < first)]
    rest = [u for u in units if u.module is None and u not in head]
    modules = [u for name in compiled.imported for u in units if u.module == name]
    return tuple(head + modules + rest)
