"""Tokens to text while they are generated: incremental detokenization that never shows half a character, stop
sequences matched in the text (and held back while they may still be forming), and the text of single tokens for
log-probabilities."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from griffin.data.tokenizer import Tokenizer

MAX_CHAR_TOKENS = 4  # tokens one character can span (UTF-8 bytes)
CONTEXT_TOKENS = 6  # prompt tokens decoded before the first new one (SentencePiece drops a leading space alone)
_SURROGATES = frozenset(map(chr, range(0xDC80, 0xDD00)))  # undecodable bytes, as ByteTokenizer.decode escapes them


def clean(text: str) -> str:
    """``text`` as valid UTF-8: undecodable bytes (surrogate escapes) become U+FFFD."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def decode(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """``tokenizer.decode`` of the ids it knows: a model's vocabulary may be larger than its tokenizer's (padded
    embeddings), and such tokens have no text."""
    vocab = tokenizer.vocab_size
    return tokenizer.decode([i for i in ids if 0 <= i < vocab])


def incomplete(text: str) -> bool:
    """Whether ``text`` may end inside a character still being generated."""
    return bool(text) and (text[-1] == "\ufffd" or text[-1] in _SURROGATES)


class Detokenizer:
    """The text of generated tokens, one token at a time: ``add(token)`` returns the text it completes (nothing while
    it ends inside a multi-byte character), ``flush()`` what is left at the end. Tokens are decoded in the context of
    the previous ones (and of the prompt's last tokens), so spaces and merges come out as in a whole decode."""

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        # byte-level: an incremental UTF-8 decoder holds exactly the bytes that may still become a character
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace") if hasattr(tokenizer, "decode_bytes") else None
        self.ids = list(context[len(context) - CONTEXT_TOKENS :] if len(context) > CONTEXT_TOKENS else context)
        self.prefix = 0  # first token of the decoding window
        self.read = len(self.ids)  # tokens before this one have been turned into text

    def add(self, token: int) -> str:
        if self.utf8 is not None:
            return self.utf8.decode(bytes([token]) if 0 <= token < 256 else b"")
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        if self.utf8 is not None:
            return self.utf8.decode(b"", final=True)
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = decode(self.tokenizer, self.ids[self.prefix : self.read])
        after = decode(self.tokenizer, self.ids[self.prefix :])
        # hold back a possibly unfinished character, but no longer than a character can take (4 bytes): text that
        # stays invalid is shown (as U+FFFD) rather than held to the end
        pending = len(self.ids) - self.read
        if len(after) <= len(before) or (incomplete(after) and not final and pending < MAX_CHAR_TOKENS):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return clean(after[len(before) :])


def detokenize_reference(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The whole text of ``ids`` in one decode (what :class:`Detokenizer` adds up to)."""
    return clean(decode(tokenizer, ids))


class StopMatcher:
    """Cuts generated text at the first stop sequence. ``add(text)`` returns the text safe to show now and whether a
    stop sequence was reached (the text is cut before it); text that may be the start of a stop sequence is held back
    until it is known not to be (``finish()`` returns what is held at the end)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.longest = max(map(len, self.stops), default=0)
        self.text = ""
        self.sent = 0

    def add(self, delta: str) -> tuple[str, bool]:
        if not self.stops:
            self.text += delta
            self.sent = len(self.text)
            return delta, False
        start = max(0, len(self.text) - self.longest + 1)
        self.text += delta
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            return self.finish(), True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), hold, -1):
                if self.text.endswith(stop[:k]):
                    hold = k
                    break
        upto = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent : upto], upto
        return out, False

    def finish(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


def token_text(tokenizer: Tokenizer, token: int) -> str:
    """The text of one token for log-probabilities; a byte that is not a character alone is ``bytes:\\xNN``, a token
    the tokenizer does not have ``<|token_N|>``."""
    if not 0 <= token < tokenizer.vocab_size:
        return f"<|token_{token}|>"
    if hasattr(tokenizer, "decode_bytes"):
        raw = tokenizer.decode_bytes([token])
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "".join(f"bytes:\\x{b:02x}" for b in raw)
    return clean(tokenizer.decode([token]))


def token_bytes(tokenizer: Tokenizer, token: int) -> list[int]:
    """The UTF-8 bytes of one token (its raw byte for the byte-level tokenizer)."""
    if not 0 <= token < tokenizer.vocab_size:
        return []
    if hasattr(tokenizer, "decode_bytes"):
        return list(tokenizer.decode_bytes([token]))
    return list(clean(tokenizer.decode([token])).encode("utf-8"))
