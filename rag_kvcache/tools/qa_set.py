"""`rag-kvcache dataset`: question-answering sets about invented facts, for `rag-kvcache eval`.

Every document describes one invented town (so no model can answer from memory) in about 256
tokens, the size `rag-kvcache ingest` cuts chunks to: its founding year, founder, mayor,
river, main export, festival day, lighthouse height and twin town, in random order among
filler sentences. The other documents of an item are towns with facts of the same kinds, so
an answer must be bound to the right town, the failure a stale cache makes.

An item is 4, 8 or 16 documents (~1K, 2K, 4K tokens) and asks either one fact (single-hop)
or, across two documents, a fact of the town twinned with another (two-hop). The design is
balanced over context size x where the answer's document sits (first / middle / last) x
where the fact sits inside it (early / middle / late) x hops, `repeats` items each, and every
item records these facts in `meta`, so accuracy can be broken down by them. The `dev` and
`test` splits come from different seeds: tune on dev, report test, never the reverse.
Generation is deterministic and needs no model (documents are sized by words, ~1.3 SmolLM2
tokens each).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CONTEXT_DOCUMENTS = {"1K": 4, "2K": 8, "4K": 16}
WHERE = ("first", "middle", "last")
SPLIT_SEEDS = {"dev": 1000, "test": 2000}
# items for training a link calibration only (`rag-kvcache calibrate`); never written by
# `dataset`, never evaluated: the dev and test items stay unseen by anything trained
TRAIN_SEED = 3000
DOCUMENT_WORDS = 180  # ~235-256 SmolLM2 tokens


def _words(text: str, sep: str | None = None) -> list[str]:
    return [w.strip() for w in text.split(sep) if w.strip()]


_TOWN_HEADS = _words("""
    Vell Orr Tass Brim Kest Hal Mirr Dun Ost Wend Corr Fen Lund Sael Harr Bryn Quell Tor
    Ask Rav Elm Gorr Nesh Pell Varr Isk Marr Thel Ulm Yarr
""")
_TOWN_TAILS = _words("marsh holm wick stead ford haven mere by thorpe dale port moor reach sund")
_FIRST = _words("""
    Oskar Hedda Jonas Marit Ansel Liv Tomas Signe Edvin Runa Kasper Ylva Anders Freja Matteo
    Ilse Bertil Sanne Viggo Maja Henrik Elin Aurel Tove Nils Petra Ivo Greta Leif Dagny
""")
_LAST_HEADS = _words("Bren Sor Tel Hald Mor Vass Kjell Rud Stav Lind Ek Bjor Fal Gran Nor Sel Ask")
_LAST_TAILS = _words("lund vik berg dahl strom gren man sen qvist holt")
_RIVERS = _words("""
    Orrin Tessel Vaska Limm Skarra Dovre Kell Amber Hask Yllen Morrow Quen Sibba Tarn Ulla
    Breck Fjell Gade
""")
_EXPORTS = _words(
    """smoked eel, amber beads, copper wire, rye flour, tar barrels, wool blankets, salted cod,
    pine resin, glass floats, oak barrels, iron nails, linen sailcloth, honey wax, slate tiles,
    rope, dried kelp, clay pipes, birch syrup""",
    ",",
)
_MONTHS = _words("""
    January February March April May June July August September October November December
""")
_ADJECTIVES = _words("narrow quiet steep windswept cobbled busy sheltered grey crooked sunlit")
_FEATURES = _words("harbor square market hill quay causeway boatyard chapel green landing")
_FOODS = _words("rye bread, fish soup, berry tarts, smoked cheese, oat cakes, pickled herring", ",")
_FILLER = (
    "The {adj} streets of {town} lead down toward the {feature}.",
    "Visitors to {town} often remark on the {adj} light over the {feature} in the evening.",
    "Bakeries near the {feature} sell {food} from early in the morning.",
    "In winter the {feature} of {town} is often hidden in thick fog.",
    "Many houses in {town} are painted in pale colors and have steep roofs.",
    "A small museum beside the {feature} shows old maps, tools and photographs of the town.",
    "Children in {town} learn to row on the calm water near the {feature}.",
    "The weekly market fills the {feature} with stalls selling {food} and fresh fish.",
    "Walking paths climb from the {feature} to a {adj} ridge with a wide view of the coast.",
    "Older residents still tell stories about the storms that once flooded the {feature}.",
    "The town library keeps its {adj} reading room open late on Thursdays.",
    "Fishing boats leave the {feature} before dawn and return in the early afternoon.",
    "Local musicians play in the {adj} courtyard behind the old customs house.",
    "A ferry connects {town} with the islands twice a day in summer.",
)


@dataclass(frozen=True)
class Fact:
    kind: str
    sentence: str
    question: str
    answer: str


@dataclass
class Town:
    name: str
    facts: dict[str, Fact] = field(default_factory=dict)

    def fact(self, kind: str, sentence: str, question: str, answer: str) -> None:
        self.facts[kind] = Fact(kind, sentence, question, answer)


class Namer:
    """Unique invented names within one item (towns, people, rivers, values)."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set[str]()

    def pick(self, make: Callable[[], str]) -> str:
        for _ in range(1000):
            value = make()
            if value not in self.used:
                self.used.add(value)
                return str(value)
        raise RuntimeError("ran out of invented names")

    def town(self) -> str:
        return self.pick(lambda: self.rng.choice(_TOWN_HEADS) + self.rng.choice(_TOWN_TAILS))

    def person(self) -> str:
        return self.pick(
            lambda: (
                f"{self.rng.choice(_FIRST)} "
                f"{self.rng.choice(_LAST_HEADS)}{self.rng.choice(_LAST_TAILS)}"
            )
        )

    def choice(self, pool: list[str]) -> str:
        return self.pick(lambda: self.rng.choice(pool))

    def number(self, low: int, high: int) -> str:
        return self.pick(lambda: str(self.rng.randint(low, high)))


def make_towns(rng: random.Random, count: int) -> list[Town]:
    """`count` towns with every fact kind, values distinct across the towns. Towns pair up
    as twins (0 with 1, 2 with 3, ...), said only in the second one's document, so "the town
    twinned with X" names one town and needs X's document to find it."""
    names = Namer(rng)
    towns = [Town(names.town()) for _ in range(count)]
    for town in towns:
        t, year, founder = town.name, names.number(1601, 1899), names.person()
        town.fact(
            "founded",
            f"{t} was founded in {year} by the merchant {founder}.",
            f"In which year was {t} founded?",
            year,
        )
        town.fact("founder", "", f"Who founded {t}?", founder)  # same sentence as "founded"
        mayor = names.person()
        town.fact(
            "mayor", f"The current mayor of {t} is {mayor}.", f"Who is the mayor of {t}?", mayor
        )
        river = names.choice(_RIVERS)
        town.fact(
            "river", f"{t} lies on the river {river}.", f"On which river does {t} lie?", river
        )
        export = names.choice(_EXPORTS)
        town.fact(
            "export",
            f"The main export of {t} is {export}.",
            f"What is the main export of {t}?",
            export,
        )
        day = names.pick(lambda: f"{rng.randint(1, 28)} {rng.choice(_MONTHS)}")
        town.fact(
            "festival",
            f"The lantern festival of {t} is held every year on {day}.",
            f"On which day is the lantern festival of {t} held?",
            day,
        )
        height = names.number(12, 48)
        town.fact(
            "lighthouse",
            f"The lighthouse of {t} is {height} meters tall.",
            f"How many meters tall is the lighthouse of {t}?",
            height,
        )
    for named, source in zip(towns[::2], towns[1::2], strict=False):  # pairs, said once
        source.fact(
            "twin",
            f"{source.name} is twinned with the town of {named.name}.",
            f"Which town is twinned with {source.name}?",
            named.name,
        )
    return towns


def document(rng: random.Random, town: Town, target: str | None, where: str) -> str:
    """The town's facts among filler sentences, ~DOCUMENT_WORDS words; the `target` fact
    (if any) placed early, in the middle, or late."""
    facts = [f.sentence for f in town.facts.values() if f.sentence]
    fillers = [
        template.format(
            town=town.name,
            adj=rng.choice(_ADJECTIVES),
            feature=rng.choice(_FEATURES),
            food=rng.choice(_FOODS),
        )
        for template in rng.sample(_FILLER, len(_FILLER))
    ]
    sentences = list(facts)
    for filler in fillers:
        if sum(len(s.split()) for s in sentences) + len(filler.split()) > DOCUMENT_WORDS:
            break
        sentences.append(filler)
    rng.shuffle(sentences)
    if target is not None:
        fact = town.facts[target].sentence or town.facts["founded"].sentence
        sentences.remove(fact)
        last = len(sentences)
        index = {"first": rng.randint(0, 1), "middle": last // 2, "last": last}[where]
        sentences.insert(index, fact)
    return " ".join(sentences)


def position(where: str, count: int, rng: random.Random) -> int:
    """Index of a document placed first, in the middle, or last among `count`."""
    return {"first": 0, "middle": rng.randint(1, count - 2), "last": count - 1}[where]


def make_item(
    rng: random.Random, item_id: str, context: str, doc_where: str, fact_where: str, hops: int
) -> dict[str, object]:
    """One item of the balanced design (see the module docstring)."""
    count = CONTEXT_DOCUMENTS[context]
    towns = make_towns(rng, count)
    kind = rng.choice(["founded", "founder", "mayor", "river", "export", "festival", "lighthouse"])
    answer_at = position(doc_where, count, rng)
    order = list(range(count))
    rng.shuffle(order)  # order[i] = which town sits at document i
    if hops == 2:  # the answer's town must be named by a twin: an even-indexed town
        named = 2 * rng.randrange(count // 2)
        at = order.index(named)
        order[at], order[answer_at] = order[answer_at], order[at]
    answer_town = towns[order[answer_at]]
    if hops == 1:
        question = answer_town.facts[kind].question
        bridge_at = None
    else:  # "the town twinned with X": X's document names the answer's town
        source = next(
            t for t in towns if "twin" in t.facts and t.facts["twin"].answer == answer_town.name
        )
        bridge_at = order.index(towns.index(source))
        question = answer_town.facts[kind].question.replace(
            answer_town.name, f"the town twinned with {source.name}"
        )
    documents = []
    for i, town_index in enumerate(order):
        town = towns[town_index]
        target = kind if i == answer_at else ("twin" if i == bridge_at else None)
        text = document(rng, town, target, fact_where)
        documents.append({"id": f"{item_id}-{town.name.lower()}", "text": text})
    return {
        "id": item_id,
        "documents": documents,
        "question": question,
        "answers": [answer_town.facts[kind].answer],
        "meta": {
            "context": context,
            "documents": count,
            "hops": hops,
            "fact": kind,
            "answer_document": answer_at,
            "answer_document_where": doc_where,
            "answer_in_document": fact_where,
            "bridge_document": bridge_at,
        },
    }


# repeats of the design a split holds at most: 100 (5,400 items a split) take ~300 MB and
# seconds to build; a mistyped huge count ran until it was killed, having written nothing
MAX_REPEATS = 100


def make_split(split: str, repeats: int = 4) -> list[dict[str, object]]:
    """Every cell of the design `repeats` times (2 hops x 3 x 3 x 3 contexts: 54 per repeat)."""
    rng = random.Random(TRAIN_SEED if split == "train" else SPLIT_SEEDS[split])
    items: list[dict[str, object]] = []
    for _ in range(repeats):
        for context in CONTEXT_DOCUMENTS:
            for doc_where in WHERE:
                for fact_where in WHERE:
                    for hops in (1, 2):
                        item_id = f"{split}-{len(items) + 1:04d}"
                        items.append(make_item(rng, item_id, context, doc_where, fact_where, hops))
    return items


def write_sets(out: Path, repeats: int = 4) -> dict[str, Path]:
    """OUT/dev.jsonl and OUT/test.jsonl; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in SPLIT_SEEDS:
        path = out / f"{split}.jsonl"
        lines = [json.dumps(item, ensure_ascii=False) for item in make_split(split, repeats)]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths[split] = path
    return paths
