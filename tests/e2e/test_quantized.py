"""Quantized tiers end to end: int8/fp8 weights and fp8_e4m3/int8 KV through `pdserve up`, and the KV
bytes per token on the wire read from the transfer metrics of real workers."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from pdserve.benchmarks.engine.accuracy import Pipeline
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from tests.e2e.cluster import internal_metadata, pdserve_up, wait_all_blocks_free, worker_info
from tests.e2e.procs import Procs, counter, generate, list_workers, request, wait_until

# (prefill weights, decode weights, KV dtype): every quantized weight format on each tier, both KV formats
SETTINGS = [("int8", "fp8", "int8"), ("fp8", "int8", "fp8_e4m3")]
PROMPTS = [list(range(3, 24)), [7, 400, 12, 99, 5, 301, 44, 18, 250, 3, 3, 91, 17, 60, 8, 222, 31]]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=SETTINGS, ids=lambda s: "-".join(s))
def cluster(request, tiny_model, tmp_path_factory):
    prefill_weights, decode_weights, kv_dtype = request.param
    model = tiny_model("llama")
    flags = ["--prefill-weight-dtype", prefill_weights, "--decode-weight-dtype", decode_weights,
             "--kv-dtype", kv_dtype]
    with pdserve_up(model, tmp_path_factory.mktemp("quantized"), prefill_workers=1, decode_workers=1,
                    extra_args=flags) as state:
        yield request.param, model, state


def test_streams_equal_the_in_process_disaggregated_numerics(cluster):
    setting, model, state = cluster
    pipe = Pipeline(model, setting)  # JAX prefill -> KV quantized on the device -> torch decode
    for prompt in PROMPTS:
        got = generate(state["coordinator"], request(prompt, MAX_TOKENS))
        want = pipe.greedy(np.asarray([prompt]), MAX_TOKENS)[0].tolist()
        assert got == want
    layout = worker_info(state["decode"][0]).kv_layout
    assert (layout.dtype, layout.scale_granularity, layout.block_size) == (setting[2], "block_head", 16)
    free, total = wait_all_blocks_free(state["decode"])[0]
    assert free == total > 0


@pytest.mark.parametrize("dtype, granularity", [("fp8_e4m3", "none"), ("fp8_e5m2", "block_head"), ("int8", "tensor")])
def test_a_kv_format_the_prefill_worker_cannot_meet_is_refused_naming_both_sides(cluster, dtype, granularity):
    setting, _, state = cluster
    layout = worker_info(state["decode"][0]).kv_layout
    layout.dtype, layout.scale_granularity = dtype, granularity
    req = pb.PrefillRequest(request_id="mismatch", token_ids=[3, 4, 5], transfer_token=b"t",
                            target=pb.KvTarget(address="10.1.2.3:50053", layout=layout))
    with grpc.insecure_channel(state["prefill"][0]) as ch:
        with pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.PrefillStub(ch).Prefill(req, timeout=30, metadata=internal_metadata(state["prefill"][0]))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == (
        f"KV formats cannot meet: decode worker 10.1.2.3:50053 holds KV as dtype={dtype} scales={granularity}; "
        f"this prefill worker (--weight-dtype {setting[0]}) sends float32 (scales none), bfloat16 (scales none), "
        f"float16 (scales none), fp8_e4m3 (scales block_head), int8 (scales block_head)"
    )


def test_kv_bytes_per_token_on_the_wire_from_the_transfer_metrics(tiny_model, tmp_path_factory):
    """One prefill worker; four decode workers, one per KV dtype, each behind its own coordinator (a pool
    holds one KV layout): the bytes of one transfer, read from the decode workers' metrics, exactly."""
    procs = Procs(tiny_model("llama"), tmp_path_factory.mktemp("wire"))
    kv_dtypes = ("float32", "bfloat16", "int8", "fp8_e4m3")
    prompt = list(range(3, 51))  # 48 tokens: 3 blocks of 16
    try:
        # every process at once: their start-ups overlap
        prefill = procs.start("p0", "prefill", wait=False)
        decodes = {kv: procs.start(f"d-{kv}", "decode", "--kv-dtype", kv, "--kv-cache-tokens", "1024",
                                   *(["--weight-dtype", "int8"] if kv == "int8" else []), wait=False)
                   for kv in kv_dtypes}
        coordinators = {kv: procs.start(f"c-{kv}", "coordinator", "--prefill", prefill.address, "--decode",
                                        decodes[kv].address, metrics=False, wait=False) for kv in kv_dtypes}
        for proc in [prefill, *decodes.values()]:
            procs.wait_serving(proc)
        received = {}
        for kv in kv_dtypes:
            decode, coordinator = decodes[kv], coordinators[kv]
            # serving, with the prefill worker ready too (a prompt must cross the wire, not be prefilled locally)
            wait_until(lambda: healthy(coordinator.address)
                       and [w.state for w in list_workers(coordinator)] == ["ready", "ready"], f"c-{kv} serving")
            assert len(generate(coordinator.address, request(prompt, 4))) == 4
            samples = decode.metrics()
            assert counter(samples, "pdserve_kv_transfer_seconds_count") == 1
            received[kv] = counter(samples, "pdserve_kv_transfer_bytes_total")
        per_token = {kv: received[kv] / len(prompt) for kv in kv_dtypes}
        # tiny llama: 2 layers x 2 kv heads x 32 dims x (k, v) = 256 values a token; scales: 4 bytes x (k, v)
        # x 2 layers x 2 kv heads = 32 bytes a block of 16 tokens = 2 bytes a token
        assert per_token == {"float32": 1024.0, "bfloat16": 512.0, "int8": 256.0 + 2.0, "fp8_e4m3": 256.0 + 2.0}
        assert counter(prefill.metrics(), "pdserve_kv_transfer_bytes_total") == sum(received.values())
        log = procs.procs["d-int8"].log.read_text()
        assert "weights 0.5 MiB (int8, compute float32)" in log
        assert "KV cache on cpu: 64 blocks x 16 tokens = 1024 tokens (int8" in log
    finally:
        procs.stop_all()


def healthy(address: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_an_fp8_block_scaled_llama_serves_on_both_tiers_as_transformers_runs_its_twin(tiny_fp8_pair, tmp_path):
    """A checkpoint in DeepSeek-V3's fp8 format (e4m3 weights, 128x128 block scales) on another family: the prefill
    worker (first token, the KV sent) and the decode worker both dequantize it at load; the greedy tokens are
    transformers' on the float32 twin."""
    from tests.decode.test_engine import _hf_greedy

    fp8, twin = tiny_fp8_pair("llama")
    with pdserve_up(fp8, tmp_path, prefill_workers=1, decode_workers=1) as state:
        assert len(state["prefill"]) == 1
        for prompt in PROMPTS:
            assert generate(state["coordinator"], request(prompt, MAX_TOKENS)) == _hf_greedy(twin, prompt, MAX_TOKENS)
