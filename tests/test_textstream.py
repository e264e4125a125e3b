"""Streaming text: stop strings across token boundaries, held-back partial text."""

from serve_app.engine.textstream import TextStream


class CharTok:
    """Each id is one character; id 0 stands for half of a multi-byte character."""

    def decode(self, ids, skip_special_tokens=True):
        out = "".join(chr(i) if i else "\ufffd" for i in ids)
        return out.replace("\ufffd\ufffd", "é")  # two halves make one character


def ids(s):
    return [ord(c) for c in s]


def test_plain_text_streams_as_it_comes():
    ts = TextStream(CharTok(), [])
    assert ts.push(ids("ab")) + ts.push(ids("c")) == "abc"


def test_stop_string_split_across_pushes_is_held_back_then_cut():
    ts = TextStream(CharTok(), ["END"])
    assert ts.push(ids("hello E")) == "hello "  # "E" might start END
    assert ts.push(ids("N")) == ""
    assert not ts.stopped
    assert ts.push(ids("Dmore")) == ""
    assert ts.stopped and ts.text == "hello "


def test_false_alarm_prefix_is_released():
    ts = TextStream(CharTok(), ["END"])
    assert ts.push(ids("an E")) == "an "
    assert ts.push(ids("gg")) == "Egg"
    assert ts.flush() == ""


def test_partial_utf8_is_held_back():
    ts = TextStream(CharTok(), [])
    assert ts.push(ids("caf") + [0]) == "caf"
    assert ts.push([0]) == "é"


def test_flush_releases_held_text_when_finishing():
    ts = TextStream(CharTok(), ["STOP"])
    assert ts.push(ids("abST")) == "ab"
    assert ts.flush() == "ST"
