"""Streaming text: stop strings cut exactly, held-back prefixes, partial UTF-8 never shown."""

from __future__ import annotations

import pytest

from orchestrator.text import TextStream


class ByteTokenizer:
    """Token id = one byte, like a byte-level BPE fallback; decoding may split a UTF-8 sequence."""

    def decode(self, token_ids, skip_special_tokens=True):
        return bytes(token_ids).decode("utf-8", errors="replace")


def _ids(text: str) -> list[int]:
    return list(text.encode())


def _stream(stream: TextStream, pieces: list[str]) -> tuple[str, list[int]]:
    shown, kept = "", []
    for piece in pieces:
        ids = _ids(piece)
        count, text = stream.add(ids)
        kept += ids[:count]
        shown += text
    return shown + stream.flush(), kept


def test_plain_text_is_streamed_whole():
    shown, kept = _stream(TextStream(ByteTokenizer()), ["hello ", "world"])
    assert shown == "hello world" and kept == _ids("hello world")


def test_stop_string_split_across_rounds_is_held_back_then_cut():
    stream = TextStream(ByteTokenizer(), ["STOP"])
    assert stream.add(_ids("abc ST")) == (6, "abc ")  # "ST" may begin the stop string
    count, text = stream.add(_ids("OPxyz"))
    assert stream.stopped and text == ""
    assert count == 2  # tokens up to the one that completed "STOP"
    assert stream.add(_ids("more")) == (0, "")


def test_a_prefix_that_does_not_complete_is_released():
    shown, _ = _stream(TextStream(ByteTokenizer(), ["STOP"]), ["a ST", "AR b"])
    assert shown == "a STAR b"


def test_dangling_stop_prefix_at_the_end_is_real_text():
    shown, _ = _stream(TextStream(ByteTokenizer(), ["STOP"]), ["end ST"])
    assert shown == "end ST"


def test_earliest_of_several_stop_strings_wins():
    stream = TextStream(ByteTokenizer(), ["world", "lo w"])
    count, text = stream.add(_ids("hello world!"))
    assert stream.stopped and text == "hel" and count == len("hello w")


@pytest.mark.parametrize("split", range(1, 4))
def test_partial_utf8_is_never_shown(split):
    word = "né€"  # 1 + 2 + 3 bytes
    data = word.encode()
    stream = TextStream(ByteTokenizer())
    shown = []
    for start in range(0, len(data), split):
        _, text = stream.add(list(data[start:start + split]))
        assert "\ufffd" not in text
        shown.append(text)
    shown.append(stream.flush())
    assert "".join(shown) == word


def test_stop_strings_need_a_tokenizer_and_must_not_be_empty():
    with pytest.raises(ValueError):
        TextStream(None, ["x"])
    with pytest.raises(ValueError):
        TextStream(ByteTokenizer(), [""])
    assert TextStream(None).add([1, 2, 3]) == (3, "")
