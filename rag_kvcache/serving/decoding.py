"""Prefill (the baseline every speed-up is measured against) and the decode loop.

`prefill -> decode` as plain functions, gpt-fast style: the linker replaces only the prefill.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch

from rag_kvcache.config import GenerationConfig
from rag_kvcache.errors import ContextTooLongError
from rag_kvcache.model.adapter import Cache, buffered_cache, forward, new_buffers
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.timing import STAGE_CHOOSE, STAGE_FORWARD, stage


def check_window(lm: LoadedModel, prompt_tokens: int) -> None:
    """A prompt of this many tokens fits the model's window (else a ContextTooLongError)."""
    if prompt_tokens > lm.max_context:
        raise ContextTooLongError(
            f"{prompt_tokens} prompt tokens exceed the model's window of {lm.max_context}"
        )


def prefill(lm: LoadedModel, token_ids: list[int], reserve: int = 0) -> tuple[Cache, torch.Tensor]:
    """Plain causal prefill of token_ids: (cache, next-token logits [vocab]).

    The cache is the same preallocated kind the linker makes (with `reserve` free slots), so
    baseline and linked answers decode at the same speed.
    """
    check_window(lm, len(token_ids))
    with stage(STAGE_FORWARD):
        ids = torch.tensor([token_ids], device=lm.device)  # [1, T]
        keys, values = new_buffers(lm, len(token_ids) + reserve)
        cache = buffered_cache(lm, keys, values, 0)
        logits, cache = forward(lm, ids, cache=cache, logits_to_keep=1)
    return cache, logits[0, -1]


def sampling_generator(seed: int | None) -> torch.Generator:
    """The random stream a request samples from. None: a fresh one, so that an unseeded
    request is sampled anew each time (as OpenAI's API does; every answer was alike). A seed
    (a negative one as its 64-bit two's complement) is hashed first: torch's CPU generator
    keeps 32 of its bits, so seeds alike in those, 5 and 2**32 + 5, drew the same tokens."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()  # from the operating system's randomness
        return generator
    mixed = hashlib.blake2b((seed % 2**64).to_bytes(8, "little"), digest_size=8).digest()
    return generator.manual_seed(int.from_bytes(mixed, "little"))


def next_token(logits: torch.Tensor, config: GenerationConfig, generator: torch.Generator) -> int:
    """Greedy when temperature is 0, else temperature + nucleus (top_p) sampling.

    In float64 with the largest logit subtracted first, so that any temperature > 0, however
    small, gives probabilities (a one-hot at the limit) and never inf / inf."""
    if config.temperature == 0:
        return int(logits.argmax())
    wide = logits.double()
    probs = torch.softmax((wide - wide.max()) / config.temperature, dim=-1)
    if config.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < config.top_p
        keep[0] = True  # the most likely token, whatever top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def finished(
    lm: LoadedModel, token: int, produced: int, position: int, config: GenerationConfig
) -> bool:
    """The stop rules, one place for every decode loop: an end-of-sequence token, the answer's
    length cap (`produced` tokens so far, this one included), or the model's window."""
    return token in lm.eos_ids or produced >= config.max_new_tokens or position >= lm.max_context


def decode(
    lm: LoadedModel,
    cache: Cache,
    logits: torch.Tensor,
    position: int,
    config: GenerationConfig,
) -> Iterator[int]:
    """Yield up to max_new_tokens tokens; the first comes from `logits` (computed by the
    prefill or the linker), each next one from a one-token forward at `position`, `position+1`...
    Stops after an end-of-sequence token (yielded) or at the model's window."""
    generator = sampling_generator(config.seed)
    for step in range(config.max_new_tokens):
        with stage(STAGE_CHOOSE):
            token = next_token(logits, config, generator)
        yield token
        if finished(lm, token, step + 1, position, config):
            return
        ids = torch.tensor([[token]], device=lm.device)
        pos = torch.tensor([[position]], device=lm.device)
        out, cache = forward(lm, ids, positions=pos, cache=cache, logits_to_keep=1)
        logits, position = out[0, -1], position + 1
