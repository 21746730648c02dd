"""Child process for the store concurrency tests: `python store_worker.py ROLE ARGS_JSON`.

writer: stores its (overlapping) share of 24 chunks; reader: repeatedly reads whatever is
stored and checks every chunk against its own encoding of the same tokens. Prints a JSON
line with what it did. `churn` (run in a forked process by the fault-injection tests) keeps
ingesting, replacing and removing documents, with gc and verify in between, until killed.
"""

import hashlib
import json
import random
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from helpers import build_tiny, random_chunks

from rag_kvcache.engine import reencoder
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.storage.catalog import Catalog
from rag_kvcache.storage.store import TieredStore

ALL = random_chunks([3 + (i * 7) % 13 for i in range(24)], seed=42)


def main(role: str, args: dict) -> None:
    lm = build_tiny(torch.float64)
    catalog = Catalog(
        args["url"], path=Path(args["path"]) if args["path"] else None, schema=args["schema"]
    )
    store = TieredStore(Path(args["root"]), catalog=catalog)
    store.register_model(lm.fingerprint, "tiny", "float64", 3, 2, 16)
    expected = {kv.cache_id: kv for kv in encode_chunks(lm, ALL)}
    if role == "writer":
        k = args["index"]
        mine = [ids for i, ids in enumerate(ALL) if i % 4 != k]  # each chunk: 3 of 4 writers
        for kv in encode_chunks(lm, mine, batch_size=3):
            store.put(kv, "text")
        print(json.dumps({"stored": len(mine)}))
        return
    # reads for `seconds` from the first stored chunk on (on a loaded machine the writers
    # may take that long to load their model), or gives up after two minutes of nothing
    checked, deadline = 0, time.time() + 120
    while time.time() < deadline:
        ids = [r.cache_id for r in store.catalog.all_chunks("stored")]
        if ids and checked == 0:
            deadline = min(deadline, time.time() + args["seconds"])
        for kv in store.get(ids):
            want = expected[kv.cache_id]
            torch.testing.assert_close(kv.keys, want.keys, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(kv.values, want.values, rtol=1e-10, atol=1e-10)
            checked += 1
        for tier in store.hot:  # read through the durable tier again next round
            for cid in ids:
                tier.remove(cid)
    print(json.dumps({"checked": checked}))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))


# ----------------------------------------------------------------------------- churn (faults)

SOURCES = ("a.md", "b.md", "c.md", "d.md")


def version_hash(source: str, version: int) -> str:
    """The content hash of version `version` of a document (so the parent can read it back)."""
    return hashlib.sha256(f"{source}:{version}".encode()).hexdigest()


def churn(args: dict, report: Connection) -> None:
    """Ingest, replace and remove documents, gc and verify, in a random order, until killed
    (SIGKILL from the parent). Each committed document version is sent to `report` right
    after its commit: what the parent may hold the store to."""
    lm = build_tiny(torch.float64)
    catalog = Catalog(
        args["url"], path=Path(args["path"]) if args["path"] else None, schema=args["schema"]
    )
    store = TieredStore(
        Path(args["root"]),
        catalog=catalog,
        redis_url=args["redis_url"],
        reencode=reencoder(lm),
    )
    store.register_model(lm.fingerprint, "tiny", "float64", 3, 2, 16)
    rng = random.Random(args["seed"])
    version = args["seed"] * 1000
    report.send(("ready", "", 0))
    while True:
        op, source = (
            rng.choice(["ingest", "ingest", "ingest", "remove", "gc", "verify"]),
            (rng.choice(SOURCES)),
        )
        if op == "ingest":  # a new version shares its first chunk with every other version
            version += 1
            lengths = [4 + rng.randrange(12) for _ in range(rng.randint(1, 4))]
            chunks = [[7, 7, 7, source.encode()[0]], *random_chunks(lengths, seed=version)]
            ids = []
            for kv in encode_chunks(lm, chunks):
                store.put(kv, f"text of {kv.cache_id}")
                ids.append(kv.cache_id)
            _, dropped = catalog.set_document(source, version_hash(source, version), ids)
            report.send(("committed", source, version))
            for cid in dropped:
                store.remove(cid)
        elif op == "remove":  # said before: a kill may land between the commit and a report
            report.send(("removing", source, 0))
            for cid in catalog.remove_document(source):
                store.remove(cid)
        elif op == "gc":
            store.gc(pending_after_s=0)
        else:
            store.verify(repair=True)
