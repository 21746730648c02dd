"""The QA sets `eval` reads: one `EvalItem` per JSONL line (`load_dataset`, a malformed
line an error naming the line and the field), and each item's documents put in the order a
retriever returns them (`in_retrieval_order`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from rag_kvcache.errors import ConfigError
from rag_kvcache.retrieval.embedding import Embedder
from rag_kvcache.tools.metrics import (
    normalize_answer,
)


@dataclass(frozen=True)
class EvalItem:
    id: str
    documents: tuple[str, ...]
    question: str
    answers: tuple[str, ...]


def read_json_text(path: Path) -> str:
    """A dataset's or report's text; a missing, unreadable or non-UTF-8 file is a ConfigError."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, not {type(value).__name__}")
    value.encode("utf-8")  # a lone surrogate (a JSON escape) failed mid-run, items answered
    return value


def json_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a JSONL file's lines that are not blank. Lines end at "\n" only:
    `str.splitlines` also cuts at U+2028, U+2029 and U+0085, which JSON strings may hold as
    they are (`json.dumps(ensure_ascii=False)` writes them so), and refused such a file."""
    for number, line in enumerate(read_json_text(Path(path)).split("\n"), 1):
        if line.strip():
            yield number, line


def load_dataset(path: Path) -> list[EvalItem]:
    """Read a JSONL QA set; a malformed line is an error naming the line and the field."""
    items = []
    first_line: dict[str, int] = {}
    for number, line in json_lines(path):
        where = f"{path}:{number}"
        try:
            raw = json.loads(line)
            documents = tuple(_text(d["text"], "a document's text") for d in raw["documents"])
            answers = raw["answers"]
            if not isinstance(answers, list):  # a string would be read letter by letter
                raise TypeError(f"answers must be a list of strings, not {type(answers).__name__}")
            answers = tuple(_text(a, "an answer") for a in answers)
            item_id = raw["id"]
            if not isinstance(item_id, str | int) or isinstance(item_id, bool):
                raise TypeError(f"id must be a string or a number, not {type(item_id).__name__}")
            str(item_id).encode("utf-8")  # a lone surrogate failed when the item was printed
            item = EvalItem(
                str(item_id), documents, _text(raw["question"], "the question"), answers
            )
        # (ValueError: JSON's, a number past Python's 4300 digits, a lone surrogate in the id;
        except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: nested
            raise ConfigError(  # past Python's recursion limit, a line of 100,000 "[")
                f"{where}: expected {{id, documents: [{{id, text}}], question, answers}} ({e!r})"
            ) from None
        if not documents or not answers or not item.question.strip():
            raise ConfigError(f"{where}: documents, question and answers must be non-empty")
        if not all(d.strip() for d in documents):  # nothing to cache: it failed mid-run
            raise ConfigError(f"{where}: a document's text is empty")
        if not all(normalize_answer(a) for a in answers):  # nothing would ever contain it
            raise ConfigError(
                f"{where}: an answer is empty once normalised (punctuation, articles)"
            )
        if item.id in first_line:  # rows are matched by id: one would stand for the other
            raise ConfigError(f"{where}: id {item.id!r} is already line {first_line[item.id]}'s")
        first_line[item.id] = number
        items.append(item)
    if not items:
        raise ConfigError(f"{path}: no items")
    return items


def in_retrieval_order(items: list[EvalItem], embedder: Embedder) -> list[EvalItem]:
    """Each item's documents as a retriever returns them: most similar to the question first
    (cosine of the library's retrieval embeddings; ties keep the given order)."""
    out = []
    for item in items:
        vectors = embedder.embed([item.question, *item.documents])
        scores = vectors[1:] @ vectors[0]
        ranked = sorted(range(len(item.documents)), key=lambda i: -float(scores[i]))
        out.append(replace(item, documents=tuple(item.documents[i] for i in ranked)))
    return out
