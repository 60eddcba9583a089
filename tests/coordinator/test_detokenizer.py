"""Incremental detokenization with the tiny byte-level BPE tokenizer, and stop strings across pieces."""

from __future__ import annotations

import pytest

from pdserve.server.coordinator.detokenizer import (PROMPT_CONTEXT, Completion, IncrementalDetokenizer,
                                                    StopStringMatcher)
from pdserve.server.model.tokenizer import Tokenizer

TEXT = "def greet():\n    return '你好，世界！ 😀🎉 héllo — ok'\n"
EOS = 0


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model("llama"))


class CountingDecoder:
    """Records the longest id list decoded: the detokenizer's window."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.longest = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens)


def completed_text(tok: Tokenizer, ids: list[int]) -> list[str]:
    """Oracle: after each id, the whole characters decoded so far (a full decode each time)."""
    pieces, before = [], ""
    for k in range(1, len(ids) + 1):
        now = tok.decode(ids[:k]).rstrip("\ufffd")
        pieces.append(now[len(before) :])
        before = now
    return pieces


def test_multibyte_characters_wait_for_their_last_byte(tok):
    ids = tok.encode("你好 😀")
    assert ids == [162, 123, 256, 163, 100, 123, 222, 174, 255, 248, 224]  # one token per byte or two
    d = IncrementalDetokenizer(tok, tok.encode("say: "))
    assert [d.push([i]) for i in ids] == ["", "", "你", "", "", "好", " ", "", "", "", "😀"]
    assert d.flush() == ""
    d = IncrementalDetokenizer(tok, [])
    assert [d.push(ids[:5]), d.push(ids[5:8]), d.push(ids[8:])] == ["你", "好 ", "😀"]


def test_one_id_at_a_time_matches_full_decodes_and_never_splits_a_character(tok):
    ids = tok.encode(TEXT)
    d = IncrementalDetokenizer(tok, tok.encode("# prompt\n"))
    pieces = [d.push([i]) for i in ids]
    assert pieces == completed_text(tok, ids)
    assert "".join(pieces) + d.flush() == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert sum(p == "" for p in pieces) >= 10  # the CJK and emoji bytes really were held back


@pytest.mark.parametrize("step", [2, 3, 5, 64])
def test_ids_in_events_of_any_size_give_the_same_text(tok, step):
    ids = tok.encode(TEXT)
    d = IncrementalDetokenizer(tok, [])
    pieces = [d.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    assert "".join(pieces) + d.flush() == TEXT
    assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_are_not_text(tok):
    d = IncrementalDetokenizer(tok, [])
    assert d.push(tok.encode(" done")) == " done"
    assert d.push([EOS]) == ""
    assert d.flush() == ""


def test_flush_gives_an_incomplete_last_character_as_a_replacement(tok):
    d = IncrementalDetokenizer(tok, [])
    assert [d.push([i]) for i in tok.encode("😀")[:2]] == ["", ""]
    assert d.flush() == "\ufffd"


def test_window_stays_bounded_on_long_output(tok):
    counter = CountingDecoder(tok)
    d = IncrementalDetokenizer(counter, list(range(2, 400)))
    ids = tok.encode(TEXT * 40)
    assert len(ids) > 1500
    assert "".join(d.push([i]) for i in ids) + d.flush() == TEXT * 40
    assert counter.longest <= 2 * PROMPT_CONTEXT + 3  # the context window and the ids held


def test_invalid_bytes_go_out_as_soon_as_they_can_no_longer_become_a_character(tok):
    continuation = tok.encode("😀")[1]  # the byte 0x9f alone is never a character
    counter = CountingDecoder(tok)
    d = IncrementalDetokenizer(counter, [])
    # each is sure to be invalid once the next byte is there (the last might still have been a lead byte's tail)
    assert [d.push([continuation]) for _ in range(8)] == ["", *["\ufffd"] * 7]
    assert d.flush() == "\ufffd"
    assert counter.longest <= 2 * PROMPT_CONTEXT + 2


def test_random_ids_in_random_events_give_the_whole_outputs_decode(tok):
    """A random model's output is mostly bytes that make no character: the text joined is still exactly
    the decode of the output (after the prompt's last ids), however the ids are split into events; the
    CI failure this pins down gave the prompt's own text back and repeated pieces."""
    import random

    rng = random.Random(1)
    vocab = tok.hf.get_vocab_size()
    for _ in range(400):
        ids = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 30))]
        prompt = tok.encode(rng.choice(["class Point:", "", "你好", "x = 😀"]))
        ctx = prompt[-PROMPT_CONTEXT:]
        expected = tok.decode(ctx + ids)[len(tok.decode(ctx)) :]
        one_by_one = IncrementalDetokenizer(tok, prompt)
        alone = [one_by_one.push([i]) for i in ids]
        assert "".join(alone) + one_by_one.flush() == expected, (prompt, ids)
        merged, pieces, at = IncrementalDetokenizer(tok, prompt), [], 0
        while at < len(ids):
            step = rng.randint(2, 5)
            pieces.append(merged.push(ids[at : at + step]))
            at += step
        assert "".join(pieces) + merged.flush() == expected, (prompt, ids)


# ---- StopStringMatcher ---------------------------------------------------------


def test_stop_string_cuts_right_before_it():
    m = StopStringMatcher(["world"])
    assert m.feed("Hello wor") == ("Hello ", False)
    assert m.feed("ld and more") == ("", True)
    assert m.feed("later") == ("", True)
    assert m.flush() == ""


def test_held_text_is_released_once_it_cannot_begin_a_stop():
    m = StopStringMatcher(["STOP", "\n\n"])
    assert m.feed("a S") == ("a ", False)
    assert m.feed("T") == ("", False)
    assert m.feed("x") == ("STx", False)
    assert m.feed("\n") == ("", False)
    assert m.feed("y") == ("\ny", False)
    assert m.feed("ST") == ("", False)
    assert m.flush() == "ST"


def test_earliest_stop_wins_and_stops_inside_one_piece_are_found():
    m = StopStringMatcher(["cd", "bcde"])
    assert m.feed("abcdef") == ("a", True)
    m = StopStringMatcher(["!"])
    assert m.feed("hi! there!") == ("hi", True)


def test_without_stops_text_passes_through():
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", False)
    assert m.flush() == ""


def test_empty_stop_is_refused():
    with pytest.raises(ValueError):
        StopStringMatcher(["a", ""])


# ---- Completion: detokenizer + stops, per id ----------------------------------


def test_stop_spanning_byte_tokens_ends_at_the_id_that_completes_it(tok):
    head = tok.encode("The answer is 42. ")
    stop = tok.encode("你好")
    assert stop == [162, 123, 256, 163, 100, 123]  # byte by byte
    ids = [*head, *stop, *tok.encode(" more text")]
    n = len(head)
    c = Completion(tok, [], ["你好"])
    taken1, text1 = c.add(ids[: n + 2])  # ends inside 你
    assert (taken1, text1, c.stopped) == (ids[: n + 2], "The answer is 42. ", False)
    taken2, text2 = c.add(ids[n + 2 :])
    assert (taken2, text2) == (ids[n + 2 : n + 6], "")
    assert c.stopped and c.num_tokens == n + 6
    assert c.add(ids[n + 6 :]) == ([], "")
    assert c.finish() == ""


def test_completion_without_stop_gives_all_text_at_finish(tok):
    ids = tok.encode("ok 😀")
    c = Completion(tok, [], ["zz"])
    taken, text = c.add(ids[:-1])
    assert (taken, text) == (ids[:-1], "ok ")
    assert c.finish() == "\ufffd"
    c = Completion(tok, [], [])
    assert c.add(ids) == (ids, "ok 😀")
    assert (c.finish(), c.num_tokens, c.stopped) == ("", len(ids), False)


def test_stop_found_only_in_the_flushed_tail(tok):
    c = Completion(tok, [], ["o\ufffd"])
    ids = tok.encode("go😀")
    assert c.add(ids[:-1]) == (ids[:-1], "g")
    assert c.finish() == ""
    assert c.stopped


def test_random_texts_chunkings_and_stops_match_a_plain_search(tok):
    import random

    rng = random.Random(0)
    alphabet = list("ab c\n.,") + ["你", "好", "界", "😀", "🎉", "é", "—", "ü"]
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = tok.encode(text)
        stop = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
        c = Completion(tok, tok.encode("x = "), [stop])
        pieces, at = [], 0
        while at < len(ids) and not c.stopped:
            step = rng.randint(1, 4)
            pieces.append(c.add(ids[at : at + step])[1])
            at += step
        out = "".join(pieces) + c.finish()
        assert all("\ufffd" not in p for p in pieces)
        expected = text[: text.find(stop)] if stop in text else text
        assert (out, c.stopped) == (expected, stop in text), (text, stop)
