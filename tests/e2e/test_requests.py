"""Requests through `pdserve up` as a client sends them: streaming, sampling, cancel, bad input.

After each test every decode worker's free blocks are back at its total.
"""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import generation_pb2_grpc
from pdserve.server.client import build_request, stream
from tests.e2e.cluster import pdserve_up, wait_all_blocks_free


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    with pdserve_up(tiny_model("llama"), tmp_path_factory.mktemp("up"), prefill_workers=1, decode_workers=2) as state:
        yield state


@pytest.fixture(autouse=True)
def no_leaked_blocks(cluster):
    yield
    pairs = wait_all_blocks_free(cluster["decode"])
    assert all(free == total for free, total in pairs), f"leaked KV blocks (free, total): {pairs}"


def collect(addr: str, **kw) -> list[gen_pb.GenerateResponse]:
    return list(stream(addr, build_request(**kw), timeout=60))


def test_stream_shape_and_usage(cluster):
    msgs = collect(cluster["coordinator"], prompt="def main():", max_tokens=10, temperature=0.0, ignore_eos=True)
    assert msgs[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in msgs) == 10
    assert msgs[-1].usage.completion_tokens == 10
    assert msgs[-1].usage.prompt_tokens > 0
    assert all(m.finish_reason == 0 for m in msgs[:-1])


def test_seeded_sampling_repeats_and_max_tokens_one(cluster):
    addr = cluster["coordinator"]
    kw = dict(prompt="import sys\n", max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = [t for m in collect(addr, **kw) for t in m.token_ids]
    b = [t for m in collect(addr, **kw) for t in m.token_ids]
    assert a == b and len(a) == 8
    one = collect(addr, prompt="x", max_tokens=1, temperature=0.0, ignore_eos=True)
    assert sum(len(m.token_ids) for m in one) == 1
    assert one[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH


def test_stop_string_cuts_text(cluster):
    addr = cluster["coordinator"]
    full = "".join(m.text for m in collect(addr, prompt="def f(x):", max_tokens=24, temperature=0.0, ignore_eos=True))
    assert len(full) > 6
    stop = full[3:6]
    msgs = collect(addr, prompt="def f(x):", max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    text = "".join(m.text for m in msgs)
    assert msgs[-1].finish_reason == gen_pb.FINISH_REASON_STOP
    assert text == full[: full.index(stop)]


def test_stop_token_id_ends_the_stream(cluster):
    addr = cluster["coordinator"]
    kw = dict(prompt="class A:", max_tokens=10, temperature=0.0, ignore_eos=True)
    full = [t for m in collect(addr, **kw) for t in m.token_ids]
    stop_id = full[3]
    msgs = collect(addr, **kw, stop_token_ids=[stop_id])
    got = [t for m in msgs for t in m.token_ids]
    assert got == full[: full.index(stop_id) + 1]
    assert msgs[-1].finish_reason == gen_pb.FINISH_REASON_STOP


def test_cancel_mid_stream_frees_blocks(cluster):
    addr = cluster["coordinator"]
    with grpc.insecure_channel(addr) as ch:
        call = generation_pb2_grpc.GenerationStub(ch).Generate(
            build_request(prompt="while True:", max_tokens=400, temperature=0.0, ignore_eos=True), timeout=60)
        got = 0
        for msg in call:
            got += len(msg.token_ids)
            if got >= 3:
                call.cancel()
                break
    assert got >= 3
    # the no_leaked_blocks fixture checks both decode workers are back at their totals


BAD = [
    (dict(prompt=""), "prompt"),
    (dict(token_ids=[]), "prompt"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", max_tokens=-3), "max_tokens"),
    (dict(prompt="hi", max_tokens=100000), "max_tokens"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=-1), "top_k"),
    (dict(token_ids=[1, 2, 99999]), "token"),
    (dict(token_ids=[-1]), "token"),
]


@pytest.mark.parametrize("kwargs,field", BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_bad_input_is_invalid_argument_and_server_keeps_serving(cluster, kwargs, field):
    addr = cluster["coordinator"]
    with pytest.raises(grpc.RpcError) as err:
        collect(addr, **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    ok = collect(addr, prompt="ok", max_tokens=2, temperature=0.0, ignore_eos=True)
    assert ok[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH


def test_missing_or_corrupt_model_fails_at_start(tmp_path):
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "config.json").write_text("{oops")
    for model in (tmp_path / "absent", tmp_path / "corrupt"):
        out = subprocess.run([sys.executable, "-m", "pdserve.server.cli", "up", "--model", str(model)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0
        assert str(model) in out.stderr and ("does not exist" in out.stderr or "not valid JSON" in out.stderr)


def test_cli_generate_json(cluster):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.server.cli", "generate", "--addr", cluster["coordinator"], "--prompt", "def",
         "--max-tokens", "5", "--temperature", "0", "--ignore-eos", "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert sum(len(line["token_ids"]) for line in lines) == 5
    assert lines[-1]["finish_reason"] == "length"
    assert all("text" in line for line in lines)


def test_concurrent_streams_all_complete(cluster):
    from concurrent.futures import ThreadPoolExecutor

    addr = cluster["coordinator"]
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda i: collect(addr, prompt=f"value_{i} = ", max_tokens=6, temperature=0.0,
                                                  ignore_eos=True), range(12)))
    assert all(r[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH for r in results)
    assert all(sum(len(m.token_ids) for m in r) == 6 for r in results)
