"""The generated QA sets: balanced, deterministic, each answer in exactly one document at the
position its metadata says, two-hop questions really needing a second document, splits apart."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest

from rag_kvcache.tools.cli import main
from rag_kvcache.tools.eval.dataset import load_dataset
from rag_kvcache.tools.qa_set import CONTEXT_DOCUMENTS, DOCUMENT_WORDS, make_split


def sentences(text: str) -> list[str]:
    return re.split(r"(?<=\.) ", text)


def test_the_design_is_balanced_and_deterministic() -> None:
    items = make_split("dev", repeats=2)
    assert len(items) == 2 * 54 and items == make_split("dev", repeats=2)
    cells = collections.Counter(
        (m["context"], m["answer_document_where"], m["answer_in_document"], m["hops"])
        for m in (i["meta"] for i in items)
    )
    assert len(cells) == 54 and set(cells.values()) == {2}
    for item in items:
        assert len(item["documents"]) == CONTEXT_DOCUMENTS[item["meta"]["context"]]
        for doc in item["documents"]:
            assert DOCUMENT_WORDS - 30 <= len(doc["text"].split()) <= DOCUMENT_WORDS


def test_each_answer_sits_in_one_document_where_the_metadata_says() -> None:
    for item in make_split("test", repeats=1):
        meta, answer = item["meta"], item["answers"][0]
        texts = [d["text"] for d in item["documents"]]
        holding = [i for i, t in enumerate(texts) if re.search(rf"\b{re.escape(answer)}\b", t)]
        assert holding == [meta["answer_document"]], (item["id"], answer, holding)
        last = len(texts) - 1
        where = {0: "first", last: "last"}.get(meta["answer_document"], "middle")
        assert where == meta["answer_document_where"]
        parts = sentences(texts[meta["answer_document"]])
        index = next(i for i, s in enumerate(parts) if answer in s)
        expected = {"first": range(0, 2), "middle": range(2, len(parts) - 1)}
        assert index in expected.get(meta["answer_in_document"], [len(parts) - 1]), item["id"]


def test_two_hop_questions_need_the_bridge_document() -> None:
    for item in make_split("dev", repeats=1):
        meta = item["meta"]
        if meta["hops"] == 1:
            assert meta["bridge_document"] is None and "twinned" not in item["question"]
            continue
        source = re.search(r"the town twinned with (\w+)", item["question"]).group(1)
        bridge = item["documents"][meta["bridge_document"]]["text"]
        answer_doc = item["documents"][meta["answer_document"]]["text"]
        town = re.search(rf"{source} is twinned with the town of (\w+)\.", bridge).group(1)
        assert town in answer_doc and source not in answer_doc  # hop 2 needs hop 1's document


def test_splits_share_no_item(tmp_path: Path) -> None:
    assert main(["dataset", "--out", str(tmp_path), "--repeats", "1"]) == 0
    dev, test = load_dataset(tmp_path / "dev.jsonl"), load_dataset(tmp_path / "test.jsonl")
    assert len(dev) == len(test) == 54
    assert not {i.question for i in dev} & {i.question for i in test}
    assert not {d for i in dev for d in i.documents} & {d for i in test for d in i.documents}
    with pytest.raises(SystemExit) as refused:  # argparse's error, naming --repeats
        main(["dataset", "--out", str(tmp_path), "--repeats", "0"])
    assert refused.value.code == 2
