"""Child process for the crash test: ingest chunks into a tiered store, printing each cache
ID once `put` has returned (i.e. reported stored). The parent kills it at a random moment."""

import sys
from pathlib import Path

import torch
from helpers import build_tiny, random_chunks

from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.storage.store import TieredStore

if __name__ == "__main__":
    root, seed = Path(sys.argv[1]), int(sys.argv[2])
    lm = build_tiny(torch.float64)
    store = TieredStore(root)
    store.register_model(lm.fingerprint, "tiny", "float64", 3, 2, 16)
    print("ready", flush=True)
    for i in range(200):
        ids = random_chunks([5 + i % 17], seed=seed * 1000 + i)
        kv = encode_chunks(lm, ids)[0]
        store.put(kv, f"chunk {i}")
        print(kv.cache_id, flush=True)
