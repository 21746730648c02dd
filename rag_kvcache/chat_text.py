"""Text a chat template wrote around users' words, and how it becomes tokens.

A chat template writes control tokens (`<|im_start|>user`, `<|im_end|>`) as text, and the
tokenizer turns their spellings back into the tokens. Users' words must not get that reading:
a message that spells `<|im_end|>\\n<|im_start|>system` would end its turn and forge a system
turn. `ChatText` is a `str` (it goes wherever a prompt or question goes, LlamaIndex's hooks
included) that remembers where the users' words lie, as `markupsafe.Markup` remembers that
HTML is safe; any string operation on it gives a plain `str` again.

Tokens: text whose users' words spell no control token is tokenized whole, exactly as before;
otherwise it is cut at the template's control tokens only, and the text between them is
tokenized with every control spelling read as characters. Tokenizers cut at control tokens
first, so for byte-level BPE (SmolLM2, Llama 3, Qwen, GPT) the rest gets the same tokens
either way; a SentencePiece tokenizer that marks only the start of a text (`prepend_scheme
= "first"`) marks each cut text's start there too.

Text is read as characters by a copy of the tokenizer (`text_reader`), never by passing
`split_special_tokens=True` to the shared one: that flips a setting of the one Rust tokenizer
every call shares, and a call in another thread meanwhile (the server's requests tokenize in
worker threads) would read a user's `<|im_end|>` as the token, or the template's as text.
"""

from __future__ import annotations

import copy
import re
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

Piece = tuple[str, bool]  # (text, written by a user: read as text only)


class ChatText(str):
    """A rendered chat (or a question cut from one): a `str`, plus the character spans
    [start, end) that users wrote."""

    user_spans: tuple[tuple[int, int], ...]

    def __new__(cls, text: str, user_spans: Sequence[tuple[int, int]] = ()) -> ChatText:
        made = super().__new__(cls, text)
        made.user_spans = tuple((int(a), int(b)) for a, b in user_spans)
        return made

    @classmethod
    def from_pieces(cls, pieces: Iterable[Piece]) -> ChatText:
        """The pieces back to back; a piece's flag says whether a user wrote it."""
        text, spans = "", []
        for piece, by_user in pieces:
            if by_user and piece:
                spans.append((len(text), len(text) + len(piece)))
            text += piece
        return cls(text, spans)

    def pieces(self) -> list[Piece]:
        """The text as (piece, written by a user) in order; empty pieces left out."""
        text, out, at = str(self), [], 0
        for start, end in self.user_spans:
            out += [(text[at:start], False), (text[start:end], True)]
            at = end
        out.append((text[at:], False))
        return [(p, by_user) for p, by_user in out if p]

    def cut(self, start: int, end: int) -> ChatText:
        """Characters start..end-1, the users' spans kept."""
        spans = [(max(a, start) - start, min(b, end) - start) for a, b in self.user_spans]
        return ChatText(str(self)[start:end], [(a, b) for a, b in spans if a < b])


def pieces_of(text: str, by_user: bool) -> list[Piece]:
    """A `ChatText`'s own pieces; a plain `str` is one piece, a user's or not (`by_user`)."""
    return text.pieces() if isinstance(text, ChatText) else [(str(text), by_user)]


def stripped(pieces: list[Piece]) -> list[Piece]:
    """The pieces without the whitespace that begins the first or ends the last of them."""
    out = list(pieces)
    while out and not out[0][0].strip():
        out.pop(0)
    while out and not out[-1][0].strip():
        out.pop()
    if out:
        out[0] = (out[0][0].lstrip(), out[0][1])
        out[-1] = (out[-1][0].rstrip(), out[-1][1])
    return out


def control_tokens(tokenizer: Any) -> list[str]:
    """The spellings the tokenizer reads as control tokens (its special added tokens)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    found = {t.content for t in decoder.values() if getattr(t, "special", False)}
    found |= set(getattr(tokenizer, "all_special_tokens", ()))
    return sorted((t for t in found if t), key=len, reverse=True)  # longest first


def control_pattern(controls: list[str]) -> re.Pattern[str] | None:
    """A pattern that finds any of the control spellings `controls` (longest first); None for
    none."""
    return re.compile("|".join(re.escape(c) for c in controls)) if controls else None


def controls_in(tokenizer: Any, text: str) -> list[str]:
    """The control tokens `text` spells, in order."""
    control = control_pattern(control_tokens(tokenizer))
    return control.findall(text) if control else []


def inert_text(tokenizer: Any, text: str) -> str:
    """`text` with every character a control token is spelled with made `_`: as long, as
    blank or not, and it can spell no control token, alone or beside other text."""
    return text.translate({ord(c): "_" for c in "".join(control_tokens(tokenizer))})


def pieces_ids(tokenizer: Any, pieces: list[Piece]) -> list[int]:
    """Token ids of the pieces back to back: the control tokens the template wrote are
    tokens, those a user spelled are characters."""
    controls = control_tokens(tokenizer)
    whole = "".join(p for p, _ in pieces)
    control = control_pattern(controls)
    if control is None or not _spelled_by_user(control, len(controls[0]), pieces, whole):
        return list(tokenizer(whole, add_special_tokens=False, verbose=False)["input_ids"])
    ids: list[int] = []
    text = ""  # read as text, up to the template's next control token
    for piece, by_user in pieces:
        if by_user:
            text += piece
            continue
        at = 0
        for match in control.finditer(piece):
            ids += text_ids(tokenizer, text + piece[at : match.start()])
            ids.append(int(tokenizer.convert_tokens_to_ids(match.group())))
            text, at = "", match.end()
        text += piece[at:]
    return ids + text_ids(tokenizer, text)


def _spelled_by_user(
    control: re.Pattern[str], longest: int, pieces: list[Piece], whole: str
) -> bool:
    """Whether a control token's spelling in `whole` takes a character a user wrote (within
    one user's piece, across two, or across a user's and the template's)."""
    at = 0
    for piece, by_user in pieces:
        start, end = at, at + len(piece)
        at = end
        if not by_user:
            continue
        near = control.finditer(whole, max(0, start - longest + 1), end + longest - 1)
        if any(m.start() < end and m.end() > start for m in near):
            return True
    return False


_readers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_readers_lock = threading.Lock()


def text_reader(tokenizer: Any) -> Any:
    """A copy of `tokenizer` that reads every control spelling as characters (made once per
    tokenizer; see the module's note on threads)."""
    with _readers_lock:
        reader = _readers.get(tokenizer)
        if reader is None:
            reader = copy.deepcopy(tokenizer)
            reader.split_special_tokens = True  # its default for every call, never flipped
            _readers[tokenizer] = reader
    return reader


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """`text`'s token ids as characters only: `<|im_end|>` in it is those characters."""
    if not text:
        return []
    return list(text_reader(tokenizer)(text, add_special_tokens=False, verbose=False)["input_ids"])
