"""A request's answer text as it grows, one token at a time.

Decoding tokens one by one would split multi-byte characters and lose the tokenizer's spacing
rules, so the text is decoded whole each time and the new part handed out; a piece ending in
half a UTF-8 character waits for the next token. End-of-sequence tokens are not text. An
answer's text is stripped (unless `GenerationConfig.strip` is off: a text completion's), so a
stream holds back whitespace at its start and at its end until text follows it: the pieces
joined equal the `Answer`'s text.
Every decode loop streams through it (`answer.answer_steps`, the batch decoder).
"""

from __future__ import annotations

from collections.abc import Sequence

from rag_kvcache.model.loading import LoadedModel

LEAD_TOKENS = 4  # prompt tokens decoded before an answer kept as decoded (see `TextPieces`)


class TextPieces:
    """Feed tokens with `add` (each returns the text it completes), then `finish`.

    Unstripped (`strip=False`, a prompt's continuation), the answer is decoded after the last
    LEAD_TOKENS of the prompt (`lead`), whose own text is then cut off: a SentencePiece
    tokenizer drops the space a text's first word carries, so " Paris" alone decodes as
    "Paris", and the continuation would lose the space between the prompt and it."""

    def __init__(self, lm: LoadedModel, strip: bool = True, lead: Sequence[int] = ()):
        self.lm = lm
        self.strip = strip
        self.lead = [] if strip else list(lead[-LEAD_TOKENS:])
        self.lead_text = self._text(self.lead)
        while self.lead_text.startswith("\ufffd"):  # cut inside a character: the decoder
            del self.lead[0]  # would read the answer's first bytes into that broken group
            self.lead_text = self._text(self.lead)
        self.tokens: list[int] = []  # end-of-sequence dropped
        self.text = ""  # handed out so far

    def add(self, token: int) -> str:
        if token in self.lm.eos_ids:
            return ""
        self.tokens.append(token)
        full = self._decode()
        if full.endswith("\ufffd"):  # hold back half a UTF-8 character
            return ""
        return self._hand_out(full)

    def finish(self) -> str:
        """The rest of the text (what was held back), once no token follows. An answer cut
        inside a character (by max_new_tokens) ends before it: half a character is no text,
        and U+FFFD in its place is a character the model never wrote."""
        return self._hand_out(self._decode().rstrip("\ufffd"))

    def _hand_out(self, full: str) -> str:
        """The part of `full` (stripped, unless told not to) not handed out yet."""
        shown = full.strip() if self.strip else full
        piece, self.text = shown[len(self.text) :], shown
        return piece

    def _decode(self) -> str:
        if self.lead:
            full = self._text(self.lead + self.tokens)
            if full.startswith(self.lead_text):  # (else a character spans the two)
                return full[len(self.lead_text) :]
        return self._text(self.tokens)

    def _text(self, tokens: list[int]) -> str:
        return str(self.lm.tokenizer.decode(tokens, skip_special_tokens=True)) if tokens else ""
