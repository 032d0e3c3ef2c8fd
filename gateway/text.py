"""Tokens to streamable text: incremental detokenizing and stop strings.

Two things must never reach a client: half of a multi-byte character, and any
part of a stop string. Both are solved by holding text back:

- `IncrementalDetokenizer` emits only what the last token added, and nothing
  while the tokens so far end inside a UTF-8 character: tokenizers' own
  incremental decoding (`DecodeStream`) where the tokenizer has a Rust
  backend, else a sliding window of tokens decoded in Python.
- `StopStrings` finds stop strings in the text and says how long a suffix of
  it could still grow into one (that suffix is held back).

`TextStream` puts them together for one choice: tokens in, `Piece`s of text
out, each with the tokens whose text it completes (for logprobs) and each
token's share of the piece's text (`spans`, for per-token provenance).
"""

from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import dataclass, field
from functools import cache

from tokenizers.decoders import DecodeStream

from workers.protocol import TokenLogprob

REPLACEMENT = "\ufffd"


@cache
def byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable stand-in of each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]
    return "ByteLevel" in kinds


class TokenText:
    """The text and the exact bytes of single tokens (for logprobs)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = is_byte_level(tokenizer)
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self.cache:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            data = list(text.encode())
            piece = self.tokenizer.convert_ids_to_tokens(token)
            table = byte_of_char()
            special = token in getattr(self.tokenizer, "all_special_ids", ())
            if self.byte_level and not special and piece and all(ch in table for ch in piece):
                data = [table[ch] for ch in piece]  # a token may hold part of a character
            self.cache[token] = (text, data)
        return self.cache[token]


class IncrementalDetokenizer:
    """Token ids in, text out, never splitting a character.

    With a Rust backend (every transformers tokenizer built on `tokenizers`) its
    `DecodeStream` does the work, about a fifth of the Python window's cost a token
    (bench/runs/2026-11-29-detokenize). Otherwise the text of token i is
    decode(window + i) minus decode(window), with the window starting a token or more
    back so that tokenizers that drop a leading space of the first token
    (SentencePiece) still render it.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self.prefix = 0  # window start (with the Rust backend: the first id not yet emitted)
        self.read = 0  # ids[prefix:read] are already emitted

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def push(self, token: int) -> str:
        """The text the token completes ("" while a character is incomplete)."""
        self.ids.append(token)
        if self.backend is not None:
            text = self.stream.step(self.backend, token)
            if text:
                self.prefix = self.read = len(self.ids)
            return text or ""
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is still held (an incomplete character decodes as U+FFFD)."""
        if self.backend is not None:
            held, self.prefix = self.ids[self.prefix :], len(self.ids)
            self.read = self.prefix
            return self.decode(held) if held else ""
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]  # distinct, non-empty

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, text: str, start: int) -> tuple[int, int] | None:
        """(start, end) of the earliest stop string in text that starts at or after `start`
        (the longest of those that start there)."""
        hits = [(i, i + len(s)) for s in self.stops if (i := text.find(s, start)) >= 0]
        return min(hits, key=lambda hit: (hit[0], -hit[1]), default=None)

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


@dataclass
class Piece:
    text: str = ""
    tokens: list[int] = field(default_factory=list)  # tokens whose text this piece completes
    logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, when asked for
    offsets: list[int] = field(default_factory=list)  # where each token's text starts
    # (index of a generated token, its part of `text`): the parts join to `text`, in order
    spans: list[tuple[int, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.text or self.tokens)


class TextStream:
    """One choice's generated tokens in, releasable text out.

    Released text is final: it never contains any part of a stop string nor an
    incomplete character. Stop strings are searched in the unreleased text, so
    one that spans two rounds is found as well as one inside a round.
    """

    def __init__(
        self,
        tokenizer,
        stops: list[str],
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ):
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stops = StopStrings(stops)
        self.include_stop = include_stop  # the text ends with the stop string found, not before
        self.text = ""  # decoded so far (cut at the stop string once found)
        self.released = 0  # text[:released] went out
        self.tokens: list[int] = []  # generated tokens (up to the one completing a stop)
        self.logprobs: list[TokenLogprob] = []
        self.ends: list[int] = []  # text length after each token that completed its text
        self.sent = 0  # tokens[:sent] went out
        self.spanned = 0  # tokens[:spanned] went out in spans with all of their text
        self.stopped = False  # a stop string was found

    def push(
        self,
        tokens: list[int],
        logprobs: list[TokenLogprob] | None = None,
        last_textless: bool = False,
    ) -> Piece:
        """Adds a round's tokens; returns what can be released now. `last_textless`: the last
        token is the stop token that ended the choice, which adds no text (vLLM's rule)."""
        for i, token in enumerate(tokens):
            self.tokens.append(token)
            if logprobs is not None:
                self.logprobs.append(logprobs[i])
            if last_textless and i == len(tokens) - 1:
                break
            added = self.detokenizer.push(token)
            if added:  # this token, and any that produced no text before it, end here
                self.text += added
                self.ends += [len(self.text)] * (len(self.tokens) - len(self.ends))
            hit = self.stops.find(self.text, self.released) if added and self.stops else None
            if hit is not None:
                cut = hit[1] if self.include_stop else hit[0]
                self.text, self.stopped = self.text[:cut], True
                return self.release(len(self.text), final=True)
        return self.release(len(self.text) - self.stops.holdback(self.text))

    def finish(self) -> Piece:
        """The end of the choice: flushes held characters and held stop prefixes."""
        if not self.stopped:
            self.text += self.detokenizer.flush()
        return self.release(len(self.text), final=True)

    def release(self, upto: int, final: bool = False) -> Piece:
        """Text up to `upto`, with the tokens it completes (every token when final)."""
        begin = self.released
        piece = Piece(self.text[begin:upto])
        self.released = max(self.released, upto)
        done = len(self.tokens) if final else bisect_right(self.ends, upto)  # ends: ascending
        for i in range(self.sent, done):
            piece.tokens.append(self.tokens[i])
            start = self.ends[min(i, len(self.ends)) - 1] if i and self.ends else 0
            piece.offsets.append(min(start, len(self.text)))
            if self.logprobs:
                piece.logprobs.append(self.logprobs[i])
        self.sent = max(self.sent, done)
        piece.spans = self.spans(begin, self.released, done)
        return piece

    def bounds(self, i: int) -> tuple[int, int]:
        """Token i's text, text[start:end]. A character that several tokens make (the bytes
        of one UTF-8 character) goes with the first of them; the others have none."""
        n = len(self.ends)
        start = self.ends[i - 1] if 0 < i <= n else 0 if i == 0 else len(self.text)
        end = self.ends[i] if i < n else len(self.text)  # a held token: what flush added
        return min(start, len(self.text)), min(end, len(self.text))

    def spans(self, a: int, b: int, released: int) -> list[tuple[int, str]]:
        """Each token's part of text[a:b], in order: the tokens released (tokens[:released]) and
        a token whose text is only partly out (a stop-string prefix is held inside it)."""
        spans = []
        while self.spanned < len(self.tokens):
            i = self.spanned
            start, end = self.bounds(i)
            part = self.text[max(start, a) : max(min(end, b), a)]
            if part or i < released:
                spans.append((i, part))
            if i >= released:
                break
            self.spanned += 1
        return spans
