"""A small tokenizer for the tiny test models, built here in a fraction of a second: byte-level
BPE trained on the package's sample corpus, with SmolLM2's special tokens at SmolLM2's ids and
its ChatML chat template. Tests on the tiny models never load SmolLM2 (not even its tokenizer),
so they belong to the fast tier."""

from __future__ import annotations

import functools
import json
from typing import Any

from rag_kvcache.samples import sample_corpus_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@functools.cache
def build_tokenizer(vocab_size: int, trained: int = 2048) -> Any:
    """The tokenizer (a transformers PreTrainedTokenizerFast): `trained` tokens learnt from the
    sample corpus, padded to `vocab_size` with byte pairs no text encodes to, so every id a
    model of that vocabulary can emit decodes. eos is <|im_end|> (id 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    trainer = trainers.BpeTrainer(
        vocab_size=trained,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train(sorted(str(p) for p in sample_corpus_dir().glob("*.md")), trainer)

    spec = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    pairs = (a + b for a in alphabet for b in alphabet)  # ~65K, never merged by the trainer
    while len(vocab) < vocab_size:
        vocab.setdefault(next(pairs), len(vocab))
    padded = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_object=padded,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
