"""The streamed text is exactly `tokenizers.Tokenizer.decode` of the ids, for every tokenizer kind: byte-level
BPE, and SentencePiece-style byte fallback (BPE and Unigram; Llama 2's prepended-and-stripped space, Gemma's
plain one, a Metaspace pre-tokenizer), with added and special tokens, special tokens skipped or not.

Random Unicode (astral planes, combining marks, CJK, emoji, whitespace) is encoded by small vocabularies,
so that most characters are spelt in bytes, and the ids are fed one at a time."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.server.coordinator.detokenizer import Completion, IncrementalDetokenizer
from pdserve.server.model.tokenizer import Tokenizer
from tests.tokenizer_kinds import KINDS, SPECIAL, byte_fallback, with_added


EXAMPLES = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module", params=list(KINDS))
def tok(request) -> Tokenizer:
    tok = Tokenizer(with_added(KINDS[request.param]()))
    assert bool(tok.byte_pieces) == request.param.startswith("byte-fallback")
    return tok


PIECES = ["€", "中文", "😀", "🎉", "e\u0301", "\u0915\u094d\u0937", "𝔘𝔫𝔦", "\U000e0041", " ", "  ", "\n", "\t",
          "hello world", "€uro", "▁", " ▁x", SPECIAL, "def f(x):", "ab", "\u00a0", "\u3000"]
texts = st.lists(st.one_of(st.characters(exclude_categories=["Cs"]), st.sampled_from(PIECES)),
                 max_size=24).map("".join)


def stream(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool) -> list[str]:
    """The deltas, one id at a time, then the flush."""
    d = IncrementalDetokenizer(tok, prompt, skip)
    return [d.push([i]) for i in ids] + [d.flush()]


def check_deltas(tok: Tokenizer, ids: list[int], deltas: list[str], skip: bool) -> None:
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == expected, (ids, deltas)
    for delta in deltas:
        delta.encode("utf-8")  # no lone surrogates
    # nothing is held once the text so far is settled (no byte run open, no incomplete character)
    out = ""
    for k, delta in enumerate(deltas[:-1], start=1):
        out += delta
        visible = [i for i in ids[:k] if not (skip and i in tok.special_ids)]
        settled = not visible or visible[-1] not in tok.byte_pieces
        so_far = tok.decode(ids[:k], skip_special_tokens=skip)
        if settled and not so_far.endswith("\ufffd"):
            assert out == so_far, (ids[:k], out, so_far)


@EXAMPLES
@given(text=texts, skip=st.booleans())
def test_streamed_deltas_join_to_the_decode_of_all_ids(tok, text, skip):
    ids = tok.hf.encode(text, add_special_tokens=False).ids
    check_deltas(tok, ids, stream(tok, [], ids, skip), skip)


@EXAMPLES
@given(ids=st.data(), skip=st.booleans())
def test_any_ids_join_to_their_decode(tok, ids, skip):
    """What a random model draws: byte pieces in any order, runs that are not UTF-8, specials inside runs."""
    vocab = tok.vocab_size
    picks = ids.draw(st.lists(st.one_of(st.integers(0, vocab - 1), st.sampled_from(sorted(tok.byte_pieces) or [0])),
                              max_size=30))
    check_deltas(tok, picks, stream(tok, [], picks, skip), skip)


@EXAMPLES
@given(prompt=texts, text=texts)
def test_after_a_prompt_the_text_is_what_follows_the_prompts_text(tok, prompt, text):
    """The first output piece keeps its leading space (the decoder's Strip applies to the prompt's text), and
    output bytes that continue the prompt's last run of byte pieces read with all of it."""
    prompt_ids = tok.hf.encode(prompt, add_special_tokens=False).ids
    ids = tok.hf.encode(text, add_special_tokens=False).ids
    whole, before = tok.decode(prompt_ids + ids), tok.decode(prompt_ids)
    if whole.startswith(before):  # the prompt's text is not changed by what follows
        assert "".join(stream(tok, prompt_ids, ids, True)) == whole[len(before):]


def test_output_bytes_continue_the_prompts_run_of_byte_pieces():
    tok = Tokenizer(byte_fallback(strip_leading_space=False))  # Gemma's: nothing prepended, a run can go on
    prompt, ids = tok.hf.encode("中文中文", add_special_tokens=False).ids, tok.hf.encode("字 x", add_special_tokens=False).ids
    assert len(prompt) == 12 and all(i in tok.byte_pieces for i in prompt + ids[:3])
    assert "".join(stream(tok, prompt, ids, True)) == "字 x"


@EXAMPLES
@given(text=texts, data=st.data())
def test_stop_strings_cut_the_exact_text(tok, text, data):
    ids = tok.hf.encode(text, add_special_tokens=False).ids
    full = tok.decode(ids)
    stop = data.draw(st.text(min_size=1, max_size=3) | st.sampled_from(["中", "😀", "€", "文 ", "\u0301"]))
    c = Completion(tok, [], [stop])
    pieces = []
    for i in ids:
        if c.stopped:
            break
        pieces.append(c.add([i])[1])
    out = "".join(pieces) + c.finish()
    assert (out, c.stopped) == ((full[:full.find(stop)], True) if stop in full else (full, False))


def testbyte_fallback_characters_come_out_whole_and_at_once():
    """The issue's cases: "€" was "�€", "😀" "��😀", "中文" "�中����中文"."""
    tok = Tokenizer(byte_fallback())
    for text in ["€", "😀", "中文", "a € b 😀 c 中文"]:
        ids = tok.hf.encode(text, add_special_tokens=False).ids
        assert len(ids) > len(text)  # spelt in byte pieces
        deltas = stream(tok, [], ids, True)
        assert "".join(deltas) == text and "\ufffd" not in "".join(deltas)
    ids = tok.hf.encode("x😀 y", add_special_tokens=False).ids
    assert [tok.hf.id_to_token(i) for i in ids] == ["▁", "x", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "▁", "y"]
    # the run's text goes out with the piece that ends it
    assert stream(tok, [], ids, True) == ["", "x", "", "", "", "", "😀 ", "y", ""]
    # a byte that makes the run invalid turns all of it into U+FFFDs, as decode does: nothing went out early
    bad = ids[:6] + [tok.hf.token_to_id("<0x80>")] + ids[6:]
    assert stream(tok, [], bad, True) == ["", "x", "", "", "", "", "", "\ufffd" * 5 + " ", "y", ""]
    assert tok.decode(bad) == "x" + "\ufffd" * 5 + " y"
    # cut at the end of the output inside a run: what decode gives, at the flush
    assert "".join(stream(tok, [], ids[:4], True)) == tok.decode(ids[:4]) == "x\ufffd\ufffd"


def test_a_long_run_of_byte_pieces_goes_out_past_max_run_and_the_work_stays_bounded():
    from pdserve.server.coordinator.detokenizer import MAX_RUN

    class Counting(Tokenizer):
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.longest = max(Counting.longest, len(ids))
            return super().decode(ids, skip_special_tokens)

    tok = Counting(byte_fallback(strip_leading_space=False))
    ids = tok.hf.encode("😀" * 100 + " x", add_special_tokens=False).ids
    assert len(ids) == 402
    deltas = stream(tok, [], ids, True)
    assert "".join(deltas) == "😀" * 100 + " x"
    assert "".join(deltas[: MAX_RUN + 4]) == "😀" * (MAX_RUN // 4)  # out as whole characters past MAX_RUN
    assert Counting.longest <= 3 * MAX_RUN + 2  # the context (at most 2 * MAX_RUN) and what is held
    # a run that is not UTF-8 goes out as it will decode, one U+FFFD per byte, however long
    bad = [tok.hf.token_to_id("<0x80>")] * 200 + tok.hf.encode(" x", add_special_tokens=False).ids
    deltas = stream(tok, [], bad, True)
    assert "".join(deltas) == tok.decode(bad) == "\ufffd" * 200 + " x"
    assert "".join(deltas[:100]) == "\ufffd" * (MAX_RUN + 1)


@EXAMPLES
@given(text=st.lists(st.characters(min_codepoint=0x800, exclude_categories=["Cs"]), min_size=20, max_size=60)
       .map("".join), noise=st.lists(st.integers(0, 255), max_size=200), skip=st.booleans())
def test_runs_longer_than_max_run_still_join_to_the_decode(tok, text, noise, skip):
    """Characters of three and four bytes with no space between (runs past MAX_RUN), and long random byte runs."""
    ids = tok.hf.encode(text, add_special_tokens=False).ids
    check_deltas(tok, ids, stream(tok, [], ids, skip), skip)
    by_byte = {b: i for i, b in tok.byte_pieces.items()}
    if by_byte:
        ids = [by_byte[b] for b in noise]
        check_deltas(tok, ids, stream(tok, [], ids, skip), skip)
