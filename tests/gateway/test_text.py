"""Incremental detokenizing (UTF-8 holdback) and stop strings (holdback, spanning rounds)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from gateway.text import IncrementalDetokenizer, StopStrings, TextStream, TokenText
from tests.gateway.helpers import word_tokenizer


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_multibyte_characters_are_held_until_complete(byte_tokenizer):
    text = "é日本🙂!"
    tokens = ids(byte_tokenizer, text)
    assert len(tokens) == len(text.encode())  # one token per byte
    detok = IncrementalDetokenizer(byte_tokenizer)
    pieces = [detok.push(t) for t in tokens]
    assert all("\ufffd" not in p for p in pieces)
    assert [p for p in pieces if p] == ["é", "日", "本", "🙂", "!"]
    assert pieces[:2] == ["", "é"]  # the first byte of é waits for the second
    assert "".join(pieces) + detok.flush() == text


def test_flush_releases_an_incomplete_tail(byte_tokenizer):
    tokens = ids(byte_tokenizer, "a日")[:2]  # "a" and the first byte of 日
    detok = IncrementalDetokenizer(byte_tokenizer)
    assert [detok.push(t) for t in tokens] == ["a", ""]
    assert detok.flush() == "\ufffd"


def test_word_pieces_concatenate_to_the_full_decode():
    tokenizer = word_tokenizer()
    tokens = ids(tokenizer, "the cat café 日本 sat on über mat")
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.push(t) for t in tokens) + detok.flush()
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)


def test_special_tokens_produce_no_text():
    tokenizer = word_tokenizer()
    detok = IncrementalDetokenizer(tokenizer)
    out = [detok.push(t) for t in ids(tokenizer, "the cat") + [tokenizer.eos_token_id]]
    assert out == ["the", " cat", ""]


class PythonOnly:
    """A tokenizer without a Rust backend in view: the detokenizer's Python window."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-style pieces: a leading "▁" for a space, bytes (<0xNN>) for unknown
    characters, the first piece's space dropped when decoded."""
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "c"), ("▁c", "a"), ("▁ca", "t")]
    pieces = ["<unk>", "</s>", *byte_pieces, "▁", *"thecas", *("".join(m) for m in merges)]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(pieces))}
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


@pytest.mark.parametrize("kind", ["byte", "word", "sentencepiece"])
def test_the_rust_stream_and_the_python_window_give_the_same_pieces(kind, byte_tokenizer):
    tokenizer = {
        "byte": byte_tokenizer,
        "word": word_tokenizer(),
        "sentencepiece": sentencepiece_tokenizer(),
    }[kind]
    text = {
        "word": "the cat café 日本 sat on über mat",
        "byte": "Grüße, 世界! 🙂 done",
        "sentencepiece": "the cats 日本 the cat🙂",
    }[kind]
    tokens = ids(tokenizer, text) + [tokenizer.eos_token_id]
    rust, python = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(PythonOnly(tokenizer))
    assert rust.backend is not None and getattr(python, "backend", None) is None
    pieces = [rust.push(t) for t in tokens]
    assert pieces == [python.push(t) for t in tokens]
    assert "".join(pieces) + rust.flush() == tokenizer.decode(tokens, skip_special_tokens=True)
    assert python.flush() == ""


def test_an_incomplete_tail_flushes_alike_through_both(byte_tokenizer):
    tokens = ids(byte_tokenizer, "a日")[:2]
    for detok in (
        IncrementalDetokenizer(byte_tokenizer),
        IncrementalDetokenizer(PythonOnly(byte_tokenizer)),
    ):
        assert [detok.push(t) for t in tokens] == ["a", ""]
        assert detok.flush() == "\ufffd"
        assert detok.flush() == ""


@pytest.mark.parametrize(
    ("text", "stops", "held"),
    [
        ("hello wor", ["world"], 3),
        ("hello w", ["world", "xyz"], 1),
        ("hello", ["world"], 0),
        ("abab", ["abc"], 2),
        ("the end.", ["."], 0),  # a complete stop is found, not held
        ("aaa", ["aaab"], 3),
        ("", ["x"], 0),
    ],
)
def test_holdback_is_the_longest_suffix_that_could_start_a_stop(text, stops, held):
    assert StopStrings(stops).holdback(text) == held


def test_find_returns_the_earliest_stop():
    stops = StopStrings(["two", "one"])
    assert stops.find("zero one two", 0) == (5, 8)
    assert stops.find("zero one two", 6) == (9, 12)
    assert stops.find("zero", 0) is None
    assert StopStrings(["on", "one"]).find("zero one", 0) == (5, 8)  # the longest there


def test_stop_string_spanning_two_rounds_never_leaks():
    tokenizer = word_tokenizer()
    stream = TextStream(tokenizer, ["cat sat"])
    first = stream.push(ids(tokenizer, "the red cat"))
    assert first.text == "the red "  # "cat" could start "cat sat": held back
    assert not stream.stopped
    second = stream.push(ids(tokenizer, "sat on the mat"))
    assert stream.stopped
    assert first.text + second.text == "the red "
    assert second.tokens == ids(tokenizer, "cat sat")  # up to the token completing the stop


def test_held_text_is_released_when_the_stop_does_not_come():
    tokenizer = word_tokenizer()
    stream = TextStream(tokenizer, ["cat sat"])
    assert stream.push(ids(tokenizer, "the cat")).text == "the "
    assert stream.push(ids(tokenizer, "ran")).text == "cat ran"
    assert stream.finish().text == ""


def test_finish_releases_a_held_prefix():
    tokenizer = word_tokenizer()
    stream = TextStream(tokenizer, ["cat sat"])
    assert stream.push(ids(tokenizer, "the cat")).text == "the "
    end = stream.finish()
    assert end.text == "cat"
    assert stream.text == "the cat"


def test_stop_inside_one_round_cuts_the_rest():
    tokenizer = word_tokenizer()
    stream = TextStream(tokenizer, ["."])
    piece = stream.push(ids(tokenizer, "the cat . dog ran"))
    assert stream.stopped
    assert piece.text == "the cat "
    assert len(stream.tokens) == 3


def test_tokens_travel_with_the_text_they_complete(byte_tokenizer):
    stream = TextStream(byte_tokenizer, [])
    tokens = ids(byte_tokenizer, "aé")
    first = stream.push(tokens[:2])  # "a" and the first byte of é
    assert (first.text, first.tokens) == ("a", tokens[:1])
    second = stream.push(tokens[2:])
    assert (second.text, second.tokens) == ("é", tokens[1:])


def test_every_byte_arrives_once_in_order(byte_tokenizer):
    text = "Grüße, 世界! 🙂 done"
    tokens = ids(byte_tokenizer, text)
    for size in (1, 2, 3, 5):
        stream = TextStream(byte_tokenizer, ["🙂 x"])
        out = [stream.push(tokens[i : i + size]).text for i in range(0, len(tokens), size)]
        out.append(stream.finish().text)
        assert "".join(out) == text
        assert all("\ufffd" not in piece for piece in out)


def test_token_bytes_of_byte_level_tokens(byte_tokenizer):
    tokens = ids(byte_tokenizer, "é!")
    text = TokenText(byte_tokenizer)
    assert [text(t)[1] for t in tokens] == [[0xC3], [0xA9], [ord("!")]]
    assert text(tokens[2]) == ("!", [ord("!")])


def test_token_bytes_of_word_tokens():
    tokenizer = word_tokenizer()
    (token,) = ids(tokenizer, "café")
    assert TokenText(tokenizer)(token) == ("café", list("café".encode()))


def spans_of(pieces) -> list[tuple[int, str]]:
    for piece in pieces:  # each piece's spans join to its text
        assert "".join(text for _, text in piece.spans) == piece.text
    return [span for piece in pieces for span in piece.spans]


def test_spans_give_each_token_its_text_and_a_split_character_to_its_first_byte(byte_tokenizer):
    stream = TextStream(byte_tokenizer, [])
    tokens = ids(byte_tokenizer, "aé!")  # a, two bytes of é, !
    pieces = [stream.push(tokens[:2]), stream.push(tokens[2:]), stream.finish()]
    assert [p.text for p in pieces] == ["a", "é!", ""]
    # the first byte of é is held with the round that made it, and comes with the second
    assert spans_of(pieces) == [(0, "a"), (1, "é"), (2, ""), (3, "!")]


def test_spans_of_a_token_cut_by_a_held_stop_prefix_come_in_two_parts():
    tokenizer = word_tokenizer()
    stream = TextStream(tokenizer, ["cat x"])  # " cat" ends in a possible start of the stop
    pieces = [stream.push(ids(tokenizer, "sat cat")), stream.push(ids(tokenizer, "dog"))]
    pieces.append(stream.finish())
    assert "".join(p.text for p in pieces) == "sat cat dog"
    assert [p.text for p in pieces] == ["sat ", "cat dog", ""]
    assert spans_of(pieces) == [(0, "sat"), (1, " "), (1, "cat"), (2, " dog")]


def test_spans_after_a_stop_string_list_every_token_up_to_it(byte_tokenizer):
    stream = TextStream(byte_tokenizer, ["b!"])
    pieces = [stream.push(ids(byte_tokenizer, "ab!cd")), stream.finish()]
    assert "".join(p.text for p in pieces) == "a"
    assert spans_of(pieces) == [(0, "a"), (1, ""), (2, "")]


def test_spans_of_a_tail_flushed_incomplete(byte_tokenizer):
    stream = TextStream(byte_tokenizer, [])
    tokens = ids(byte_tokenizer, "a日")[:3]  # a and two of the three bytes of 日
    pieces = [stream.push(tokens), stream.finish()]
    assert spans_of(pieces) == [(0, "a"), (1, "\ufffd"), (2, "")]
