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

from rag_kvcache.model.loading import LoadedModel


class TextPieces:
    """Feed tokens with `add` (each returns the text it completes), then `finish`."""

    def __init__(self, lm: LoadedModel, strip: bool = True):
        self.lm = lm
        self.strip = strip
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
        """The rest of the text (what was held back), once no token follows."""
        return self._hand_out(self._decode())

    def _hand_out(self, full: str) -> str:
        """The part of `full` (stripped, unless told not to) not handed out yet."""
        shown = full.strip() if self.strip else full
        piece, self.text = shown[len(self.text) :], shown
        return piece

    def _decode(self) -> str:
        return str(self.lm.tokenizer.decode(self.tokens, skip_special_tokens=True))
