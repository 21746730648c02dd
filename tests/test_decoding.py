import torch

from rag_kvcache.config import GenerationConfig
from rag_kvcache.serving.decoding import next_token, sampling_generator
from rag_kvcache.serving.text import TextPieces


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert next_token(logits, GenerationConfig(), torch.Generator()) == 1


def test_tiny_top_p_keeps_only_the_most_likely_token() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    config = GenerationConfig(temperature=5.0, top_p=1e-6)
    picks = {next_token(logits, config, torch.Generator().manual_seed(s)) for s in range(20)}
    assert picks == {1}


def test_any_temperature_and_top_p_above_zero_give_a_token() -> None:
    """Past float32's range (a temperature of 1e-300 is 0 in float32, and logits / it are
    inf) sampling still draws from the limit, a one-hot on the most likely token; so does a
    top_p too small for float32."""
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    for temperature, top_p in ((1e-300, 1.0), (5e-324, 1.0), (1.0, 1e-300), (1e-45, 1e-45)):
        config = GenerationConfig(temperature=temperature, top_p=top_p)
        picks = {next_token(logits, config, torch.Generator().manual_seed(s)) for s in range(10)}
        assert picks == {1}, (temperature, top_p)


def test_sampling_is_seeded_and_spreads() -> None:
    logits = torch.zeros(50)
    config = GenerationConfig(temperature=1.0)

    def draw(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [next_token(logits, config, generator) for _ in range(30)]

    assert draw(3) == draw(3)
    assert len(set(draw(3))) > 5


def test_seeds_give_their_own_streams_and_no_seed_a_fresh_one() -> None:
    """Unseeded requests drew the same tokens every time (the seed defaulted to 0), and
    torch's CPU generator keeps 32 bits of a seed, so 5 and 2**32 + 5 drew the same too."""
    logits = torch.zeros(1000)
    config = GenerationConfig(temperature=1.0)

    def draw(seed: int | None) -> tuple[int, ...]:
        generator = sampling_generator(seed)
        return tuple(next_token(logits, config, generator) for _ in range(8))

    assert draw(5) == draw(5)
    alike_in_32_bits = [5, 2**32 + 5, 2**40 + 5, 2**63 + 5, 2**63 - 1]
    assert len({draw(seed) for seed in [*alike_in_32_bits, 2**64 - 1]}) == 6
    assert draw(-1) == draw(2**64 - 1)  # one 64-bit seed, written signed or not
    assert len({draw(None) for _ in range(5)}) == 5


def test_streamed_pieces_join_to_the_answers_stripped_text(tiny64) -> None:
    """An answer's text is stripped, so a stream holds back whitespace at its start and end
    until text follows it: the pieces, joined, are the answer's text (the server's streamed
    and whole replies agree)."""
    tok = tiny64.tokenizer
    tokens = tok.encode("  one two\n\n three \n", add_special_tokens=False)
    pieces = TextPieces(tiny64)
    streamed = [pieces.add(t) for t in tokens]
    streamed.append(pieces.finish())
    whole = tok.decode(tokens, skip_special_tokens=True)
    assert whole != whole.strip()  # the case: whitespace at both ends
    assert "".join(streamed) == whole.strip() == pieces.text
    assert not "".join(streamed).startswith((" ", "\n"))
