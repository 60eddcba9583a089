"""Request validation and sampling defaults; the coordinator's config checks."""

from __future__ import annotations

import pytest

from pdserve.v1 import generation_pb2
from pdserve.server.coordinator.config import CoordinatorConfig
from pdserve.server.coordinator.validate import InvalidRequest, Limits, validate

LIMITS = Limits(max_model_len=64, vocab_size=100)


class ByteEncoder:
    """One id per character (its code point mod 100): enough to count prompt tokens."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]


def req(text: str | None = "hello", ids: list[int] | None = None, request_id: str = "", **sampling):
    r = generation_pb2.GenerateRequest(
        request_id=request_id, sampling=generation_pb2.SamplingParams(**sampling)
    )
    if ids is not None:
        r.token_ids.ids.extend(ids)
    elif text is not None:
        r.text = text
    return r


def invalid(r: generation_pb2.GenerateRequest) -> str:
    with pytest.raises(InvalidRequest) as e:
        validate(r, ByteEncoder(), LIMITS)
    return str(e.value)


def test_defaults_are_filled_in_and_seed_stays_unset():
    v = validate(req("hello"), ByteEncoder(), LIMITS)
    assert v.prompt_ids == [4, 1, 8, 8, 11]
    s = v.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k) == (16, 1.0, 1.0, 0)
    for name in ("max_tokens", "temperature", "top_p", "top_k"):
        assert s.HasField(name)
    assert not s.HasField("seed")
    assert len(v.request_id) == 32 and int(v.request_id, 16) >= 0
    assert validate(req("hello"), ByteEncoder(), LIMITS).request_id != v.request_id


def test_client_values_are_kept():
    v = validate(
        req(
            ids=[1, 2, 99],
            request_id="abc",
            max_tokens=3,
            temperature=0.0,
            top_p=0.5,
            top_k=40,
            seed=0,
            stop=["\n\n"],
            stop_token_ids=[7],
            ignore_eos=True,
        ),
        ByteEncoder(),
        LIMITS,
    )
    assert v.request_id == "abc" and v.prompt_ids == [1, 2, 99]
    s = v.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (3, 0.0, 0.5, 40, 0)
    assert s.HasField("seed")
    assert (list(s.stop), list(s.stop_token_ids), s.ignore_eos) == (["\n\n"], [7], True)


def test_length_limit_is_inclusive():
    assert validate(req("x" * 48, max_tokens=16), ByteEncoder(), LIMITS).prompt_ids == [20] * 48
    assert invalid(req("x" * 48, max_tokens=17)) == (
        "max_tokens 17 + a prompt of 48 tokens = 65 exceeds the model's max_model_len 64"
    )
    assert (
        invalid(req("x" * 60))
        == "max_tokens 16 + a prompt of 60 tokens = 76 exceeds the model's max_model_len 64"
    )


@pytest.mark.parametrize(
    "r, message",
    [
        (req(""), "prompt must not be empty: set text or token_ids"),
        (req(None), "prompt must not be empty: set text or token_ids"),
        (req(ids=[]), "prompt must not be empty: set text or token_ids"),
        (req(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (req(max_tokens=-3), "max_tokens must be >= 1, got -3"),
        (req(temperature=-1.0), "temperature must be >= 0 (0 means greedy), got -1.0"),
        (req(temperature=float("nan")), "temperature must be >= 0 (0 means greedy), got nan"),
        (req(top_p=0.0), "top_p must lie in (0, 1], got 0.0"),
        (req(top_p=-0.5), "top_p must lie in (0, 1], got -0.5"),
        (req(top_p=1.5), "top_p must lie in (0, 1], got 1.5"),
        (req(top_k=-1), "top_k must be >= 0 (0 turns it off), got -1"),
        (req(ids=[0, 100]), "token_ids: id 100 lies outside [0, 100)"),
        (req(ids=[-1]), "token_ids: id -1 lies outside [0, 100)"),
        (req(stop_token_ids=[100]), "stop_token_ids: id 100 lies outside [0, 100)"),
        (req(stop=["s"] * 17), "stop holds 17 strings; at most 16 are allowed"),
        (req(stop=["ok", ""]), "stop must not contain an empty string"),
        (req(request_id="r" * 257), "request_id has 257 characters; at most 256"),
    ],
)
def test_each_bad_field_is_named(r, message):
    assert invalid(r) == message


def test_top_p_one_and_sixteen_stops_are_fine():
    v = validate(req(top_p=1.0, stop=[str(i) for i in range(16)]), ByteEncoder(), LIMITS)
    assert v.sampling.top_p == 1.0 and len(v.sampling.stop) == 16


# ---- CoordinatorConfig --------------------------------------------------------


def test_config_defaults(tmp_path):
    c = CoordinatorConfig(str(tmp_path), prefill_addresses=("127.0.0.1:1",), decode_addresses=["host:2"])
    assert (c.model_dir, c.port, c.host, c.lease_seconds, c.refresh_seconds) == (
        tmp_path,
        50051,
        "127.0.0.1",
        30.0,
        0.5,
    )
    assert c.prefill_addresses == ["127.0.0.1:1"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(port=70000), "port must lie in [0, 65535], got 70000"),
        (dict(prefill_addresses=["nohost"]), "prefill_addresses: 'nohost' is not HOST:PORT"),
        (dict(decode_addresses=["h:0"]), "decode_addresses: 'h:0' is not HOST:PORT"),
        (dict(prefill_addresses=["h:1"], decode_addresses=["h:1"]), "worker addresses given twice: h:1"),
        (dict(lease_seconds=0), "lease_seconds must be > 0, got 0"),
        (dict(refresh_seconds=-1), "refresh_seconds must be > 0, got -1"),
    ],
)
def test_config_is_checked(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as e:
        CoordinatorConfig(tmp_path, **kwargs)
    assert str(e.value).startswith(message)


def test_config_needs_a_model_directory(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        CoordinatorConfig(tmp_path / "absent")
