"""Child process for the store concurrency tests: `python store_worker.py ROLE ARGS_JSON`.

writer: stores its (overlapping) share of 24 chunks; reader: repeatedly reads whatever is
stored and checks every chunk against its own encoding of the same tokens. Prints a JSON
line with what it did.
"""

import json
import sys
import time
from pathlib import Path

import torch
from helpers import build_tiny, random_chunks

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
    checked, deadline = 0, time.time() + args["seconds"]
    while time.time() < deadline:
        ids = [r.cache_id for r in store.catalog.all_chunks("stored")]
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
