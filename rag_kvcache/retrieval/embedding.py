"""Sentence embeddings for retrieval: all-MiniLM-L6-v2 (shipped in a PyPI package), mean-pooled
over real tokens and L2-normalized, so FAISS inner product is cosine similarity."""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from rag_kvcache.model.loading import default_embedding_path, encoder_hidden_states, load_encoder

_WORD = re.compile(r"\S+")


class Embedder:
    """Texts -> unit vectors [n, dim] (float32). Deterministic; CPU; thread count as torch's.
    Safe to share between threads (the tokenizer's padding state is not: calls take turns).
    `Embedder.shared()` is the process's one instance per model folder."""

    _instances: ClassVar[dict[Path, Embedder]] = {}
    _instances_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def shared(cls, path: Path | None = None) -> Embedder:
        """The embedder of `path` (default all-MiniLM-L6-v2) that this process already
        loaded, or a new one: the engine's retrieval, the LlamaIndex embed model and the
        commands load the model once."""
        key = (Path(path) if path is not None else default_embedding_path()).resolve()
        with cls._instances_lock:
            if key not in cls._instances:
                cls._instances[key] = cls(path)
            return cls._instances[key]

    def __init__(self, path: Path | None = None, batch_size: int = 32, max_tokens: int = 256):
        self.path = Path(path) if path is not None else default_embedding_path()
        self.tokenizer, self.model = load_encoder(self.path)
        self.dim = int(self.model.config.hidden_size)
        self.batch_size = batch_size
        self.max_tokens = max_tokens  # the model was trained on 256-token windows
        self.name = self.path.name if self.path.name != "model" else self.path.parent.name
        self._lock = threading.Lock()

    def head(self, text: str) -> str:
        """The start of `text` that holds its first `max_tokens` tokens, so the embedding is
        the same: cut at a word's end once the words before hold more tokens than that
        (counted; a word can hold none: a zero-width space, a lone accent), else the whole
        text. The tokenizer reads a whole text before truncating it: a 7 MB question took
        seconds to embed for the same 256 tokens."""
        words = 2 * self.max_tokens
        while True:
            found = list(itertools.islice(_WORD.finditer(text), words))
            if len(found) < words:  # the whole text is no longer than this
                return text
            head = text[: found[-1].end()]
            if len(self.tokenizer.tokenize(head, verbose=False)) > self.max_tokens:
                return head
            words *= 4

    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        with self._lock:
            self._embed_into(out, texts)
        return out

    def _embed_into(self, out: np.ndarray, texts: Sequence[str]) -> None:
        for i in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                [self.head(text) for text in texts[i : i + self.batch_size]],
                padding=True,
                truncation=True,
                max_length=self.max_tokens,
                return_tensors="pt",
            )
            hidden = encoder_hidden_states(self.model, dict(batch))
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
            out[i : i + len(pooled)] = torch.nn.functional.normalize(pooled, dim=-1).numpy()
