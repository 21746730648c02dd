"""An answer's text as it grows (`serving.text.TextPieces`): stripped for an answer to a
question; as decoded, space before its first word included, for a prompt's continuation,
whatever the tokenizer (byte-level BPE keeps that space; SentencePiece drops it at a text's
start)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rag_kvcache.serving.text import TextPieces

WORDS = ["<eos>", "▁The", "▁capital", "▁is", "▁Paris", ".", "▁and", "▁caf", "é"]


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A real tokenizers-library tokenizer that decodes as Llama 2's does (Metaspace: a word's
    leading "▁" is a space, dropped at the start of a text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    return SimpleNamespace(tokenizer=fast, eos_ids={0})  # what TextPieces reads of a model


def ids(*words: str) -> list[int]:
    return [WORDS.index(w) for w in words]


def joined(pieces: TextPieces, tokens: list[int]) -> str:
    return "".join(pieces.add(t) for t in tokens) + pieces.finish()


def test_a_continuation_keeps_the_space_a_sentencepiece_decoder_drops(sentencepiece_like) -> None:
    prompt, answer = ids("▁The", "▁capital", "▁is"), ids("▁Paris", ".", "<eos>")
    lm = sentencepiece_like
    assert lm.tokenizer.decode(ids("▁Paris", ".")) == "Paris."  # the dropped space
    assert joined(TextPieces(lm, strip=False, lead=prompt), answer) == " Paris."
    assert joined(TextPieces(lm, strip=False), answer) == "Paris."  # no prompt: none to keep
    assert joined(TextPieces(lm, strip=True, lead=prompt), answer) == "Paris."
    pieces = TextPieces(lm, strip=False, lead=prompt)
    assert [pieces.add(t) for t in ids("▁caf", "é", "▁and")] == [" caf", "é", " and"]


def test_a_byte_level_tokenizer_decodes_alike_with_or_without_the_lead(tiny32) -> None:
    tokenizer = tiny32.tokenizer
    prompt = tokenizer.encode("The harbor is", add_special_tokens=False)
    answer = tokenizer.encode(" deep, and café is open.", add_special_tokens=False)
    with_lead = joined(TextPieces(tiny32, strip=False, lead=prompt), answer)
    assert with_lead == joined(TextPieces(tiny32, strip=False), answer)
    assert with_lead == " deep, and café is open."


def test_a_lead_cut_inside_a_character_is_shortened_to_whole_ones() -> None:
    """Llama 2's tokenizer spells a character it lacks as byte tokens, decoded as one group:
    a lead of the prompt's last 4 tokens that starts inside such a character decodes to
    U+FFFD, and the answer's own first bytes were read into that broken group ("字 word" came
    out "��� word")."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    words = ["<eos>", "▁The", "▁word", *(f"<0x{b:02X}>" for b in range(256))]
    vocab = {w: i for i, w in enumerate(words)}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<eos>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence(  # Llama 2's decoder
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    lm = SimpleNamespace(tokenizer=fast, eos_ids={0})

    def spelled(text: str) -> list[int]:
        return [vocab[f"<0x{b:02X}>"] for b in text.encode()]

    prompt = [vocab["▁The"], *spelled("中文")]  # its last 4 tokens start inside 中
    answer = [*spelled("字"), vocab["▁word"]]
    assert fast.decode(prompt[-4:]).startswith("\ufffd")  # the case itself
    assert joined(TextPieces(lm, strip=False, lead=prompt), answer) == "字 word"
    assert joined(TextPieces(lm, strip=False, lead=[vocab["▁The"]]), answer) == "字 word"


@pytest.mark.parametrize("strip", [True, False])
def test_an_answer_cut_inside_a_character_ends_before_it(tiny32, strip: bool) -> None:
    """max_new_tokens can stop an answer after the first byte of a character (a byte-level
    tokenizer spells "é" of "café" as two tokens here): the text ended in U+FFFD, a character
    the model never wrote."""
    tokenizer = tiny32.tokenizer
    answer = tokenizer.encode(" a café", add_special_tokens=False)
    cut = next(n for n in range(len(answer)) if tokenizer.decode(answer[:n]).endswith("\ufffd"))
    assert tokenizer.decode(answer[:cut]) == " a caf\ufffd"  # the case itself
    pieces = TextPieces(tiny32, strip=strip)
    assert joined(pieces, answer[:cut]) == (" a caf"[strip:])
    assert pieces.text == " a caf"[strip:]  # the answer's text, as the stream's pieces
    assert joined(TextPieces(tiny32, strip=strip), answer) == " a café"[strip:]
