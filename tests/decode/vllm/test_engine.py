"""The vLLM engine adapter against an in-memory twin of vLLM's LLMEngine (no vllm needed)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from pdserve.kvcache.codec import KvPiece
from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.scheduler import QueueFull
from pdserve.server.decode.sequence import Sequence, SeqState
from pdserve.server.decode.vllm.engine import RESERVED, VllmEngine
from pdserve.server.decode.vllm.staging import KvStaging, Staged, StagedKv
from pdserve.server.decode.vllm.cache_groups import CacheGroups
from pdserve.server.decode.vllm.worker import check_supported, cpu_threads_bind, vllm_speculative_config
from pdserve.server.decode.config import DecodeConfig
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=32, dtype="float32")
EOS = 99


class FakeLlm:
    """Each step gives every request the token after its last one, up to its max_tokens."""

    def __init__(self):
        self.requests: dict[str, tuple[list[int], object, list[int]]] = {}
        self.added: list[tuple[str, list[int], object]] = []
        self.aborted: list[str] = []
        self.refuse = False

    def add_request(self, request_id, prompt, params):
        if self.refuse:
            raise ValueError("vLLM refuses the request")
        self.added.append((request_id, prompt["prompt_token_ids"], params))
        self.requests[request_id] = (prompt["prompt_token_ids"], params, [])

    def abort_request(self, request_ids):
        self.aborted.extend(request_ids)
        for rid in request_ids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        outputs = []
        for rid, (prompt, params, out) in list(self.requests.items()):
            out.append((out or prompt)[-1] + 1)
            finished = len(out) == params.max_tokens
            if finished:
                del self.requests[rid]
            outputs.append(SimpleNamespace(request_id=rid, finished=finished,
                                           outputs=[SimpleNamespace(token_ids=[out[-1]])]))
        return outputs


def params_for(seq: Sequence, num_prompt_tokens: int):
    return SimpleNamespace(max_tokens=seq.sampling.max_tokens - seq.sample_index, extra_args=None)


def make_engine(free: int = 10, staging: KvStaging | None = None, max_model_len: int = 512, blocks_for=None):
    staged: dict[str, Staged] = {}
    llm = FakeLlm()
    engine = VllmEngine(llm, SimpleNamespace(vocab_size=128), LAYOUT, max_running=4, num_free_blocks=lambda: free,
                        num_total_blocks=10, sampling_params=params_for, staged=staged, params_key="pdserve_kv",
                        eos_ids=frozenset({EOS}), max_model_len=max_model_len, staging=staging,
                        blocks_for=blocks_for)
    return engine, llm, staged


def request(rid: str, prompt: list[int], max_tokens: int, **sampling) -> pb.DecodeRequest:
    return pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                            sampling=gen_pb.SamplingParams(max_tokens=max_tokens, **sampling))


def make_seq(rid: str, prompt: list[int], max_tokens: int, engine: VllmEngine, **sampling) -> Sequence:
    seq = engine.add(request(rid, prompt, max_tokens, **sampling))
    assert seq.admitted.done() and seq.state is SeqState.WAITING_KV
    return seq


def piece(num_tokens: int) -> KvPiece:
    kv = np.arange(2 * num_tokens * 2 * 32, dtype=np.float32).reshape(2, num_tokens, 2, 32)
    return KvPiece(layer_start=0, token_start=0, k=kv, v=kv, k_scales=None, v_scales=None)


async def drain(seq: Sequence) -> list[int]:
    tokens = []
    while (ids := await asyncio.wait_for(seq.events.get(), 5)) is not None:
        tokens.extend(ids)
    return tokens


async def test_vllm_decodes_from_the_first_token_with_the_staged_kv():
    engine, llm, staged = make_engine()
    seq = make_seq("r1", [5, 6, 7], max_tokens=4, engine=engine)
    engine.write("r1", piece(3))
    engine.start(seq, 20)
    assert await drain(seq) == [21, 22, 23]  # the first token (20) was the prefill's; vLLM samples the rest
    assert seq.output_ids == [20, 21, 22, 23] and seq.finish_reason == gen_pb.FINISH_REASON_LENGTH
    (vllm_id, prompt, params), = llm.added
    assert prompt == [5, 6, 7, 20] and params.max_tokens == 3
    assert params.extra_args == {"kv_transfer_params": {"pdserve_kv": vllm_id}}
    assert [p.num_tokens for p in staged[vllm_id].pieces] == [3]  # the connector's scheduler side takes them
    engine.abort("r1")
    await engine.close()


async def test_pdserve_stop_rules_end_the_stream_and_abort_it_in_vllm():
    engine, llm, _ = make_engine()
    seq = make_seq("r1", [EOS - 3], max_tokens=50, engine=engine)
    engine.start(seq, EOS - 2)
    assert await drain(seq) == [EOS - 1, EOS]
    assert seq.finish_reason == gen_pb.FINISH_REASON_STOP
    await asyncio.sleep(0.05)
    assert llm.aborted == [llm.added[0][0]] and not llm.requests
    assert engine.running == []
    await engine.close()


async def test_abort_and_release_free_the_request_in_vllm():
    engine, llm, staged = make_engine(free=100)
    seq = make_seq("r1", [1, 2], max_tokens=10**6, engine=engine, ignore_eos=True)
    engine.write("r1", piece(2))
    engine.start(seq, 3)
    assert (await asyncio.wait_for(seq.events.get(), 5))[0] == 4
    assert engine.abort("r1", gen_pb.FINISH_REASON_ABORT)
    assert not engine.abort("r1")
    for _ in range(100):
        if not llm.requests:
            break
        await asyncio.sleep(0.01)
    assert llm.aborted == [llm.added[0][0]] and not llm.requests and not staged
    assert engine.sequences == {} and engine.running == []
    await engine.close()


async def test_capacity_is_vllms_free_blocks_less_the_blocks_promised_to_waiting_requests():
    engine, _, _ = make_engine(free=10)
    seq = make_seq("r1", list(range(70)), max_tokens=30, engine=engine)  # a 70-token prompt: 3 blocks of 32
    assert seq.block_table == [RESERVED] * 3
    assert engine.num_free_blocks == 7 and engine.pool.num_total == 10
    load = engine.load()
    assert (load.free_kv_blocks, load.total_kv_blocks, load.waiting_requests, load.running_requests) == (7, 10, 1, 0)
    with pytest.raises(QueueFull):
        engine.add(request("r2", list(range(32 * 7 + 1)), max_tokens=1))  # 8 blocks
    assert "r2" not in engine.sequences
    make_seq("r2", list(range(32 * 7)), max_tokens=1, engine=engine)  # exactly the 7 left
    assert engine.num_free_blocks == 0
    seq.state = SeqState.RUNNING  # its KV arrived: vLLM's own count now holds its blocks
    assert engine.num_free_blocks == 3
    assert engine.abort("r2") and engine.num_free_blocks == 10


async def test_capacity_counts_a_prompts_blocks_in_every_kv_cache_group_less_a_windows_null_blocks():
    """Gemma 2's two groups (full, window 24): a 100-token prompt takes 4 + 2 of vLLM's blocks."""
    spec = lambda cls, w=None: type(cls, (), {"block_size": 32, "sliding_window": w})()  # noqa: E731
    groups = CacheGroups.of(SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(layer_names=["model.layers.1.a", "model.layers.3.a"], kv_cache_spec=spec("FullAttentionSpec")),
        SimpleNamespace(layer_names=["model.layers.0.a", "model.layers.2.a"],
                        kv_cache_spec=spec("SlidingWindowSpec", 24))]), 4, 32)
    engine, _, _ = make_engine(free=10, blocks_for=groups.blocks_for)
    seq = make_seq("r1", list(range(100)), max_tokens=3, engine=engine)
    assert seq.block_table == [RESERVED] * 6 and engine.num_free_blocks == 4
    with pytest.raises(QueueFull, match="6 blocks needed, 4 of 10 free"):
        engine.add(request("r2", list(range(100)), max_tokens=1))


async def test_the_running_cap_and_bad_requests_are_refused():
    engine, _, _ = make_engine(free=100)
    for i in range(4):
        make_seq(f"r{i}", [1], max_tokens=2, engine=engine)
    with pytest.raises(QueueFull, match="maximum of 4"):
        engine.add(request("r4", [1], max_tokens=2))
    with pytest.raises(ValueError, match="already decoding"):
        engine.add(request("r0", [1], max_tokens=2))
    with pytest.raises(ValueError, match="max_model_len 512"):
        engine.add(request("long", list(range(512)), max_tokens=2))


async def test_local_prefill_vllm_runs_the_prompt_and_returns_its_first_token():
    engine, llm, staged = make_engine()
    seq = make_seq("r1", [5, 6, 7], max_tokens=4, engine=engine)
    assert await asyncio.wait_for(engine.prefill_locally(seq), 5) == 8
    engine.start(seq, 8)  # the service's next call: vLLM already decodes it
    assert await drain(seq) == [9, 10, 11]
    assert seq.output_ids == [8, 9, 10, 11] and seq.finish_reason == gen_pb.FINISH_REASON_LENGTH
    (vllm_id, prompt, params), = llm.added
    assert prompt == [5, 6, 7] and params.max_tokens == 4 and params.extra_args is None and not staged
    engine.abort("r1")
    await engine.close()


async def wait_for(condition, what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_tensor_parallel_stages_go_through_shared_memory_and_never_outlive_their_request():
    staging = KvStaging(shared=True)  # /dev/shm, as the decode worker's
    # FakeLlm steps as fast as the engine thread runs: a context limit within reach would end r1 (and
    # release its stage) before the assertions below look at it
    engine, llm, staged = make_engine(free=100, staging=staging, max_model_len=1 << 40)
    # aborted while its KV arrives: the stage's file goes with it
    receiving = make_seq("receiving", [1, 2, 3], max_tokens=5, engine=engine)
    engine.write("receiving", piece(3))
    assert len(staging.files()) == 1
    assert engine.abort("receiving") and staging.files() == [] and receiving.finish_reason == gen_pb.FINISH_REASON_ABORT
    # started: the sealed stage waits for the connector, which vLLM's ranks read it through
    seq = make_seq("r1", [5, 6, 7], max_tokens=10**6, engine=engine, ignore_eos=True)
    engine.write("r1", piece(3))
    engine.start(seq, 20)
    assert (await asyncio.wait_for(seq.events.get(), 5))[0] == 21
    (vllm_id, _, _), = llm.added
    assert isinstance(staged[vllm_id], StagedKv) and staged[vllm_id].read(1, 2)[0].k.tobytes() == (
        piece(3).k[:, :, 1:2].tobytes())  # rank 1 of 2 reads kv head 1
    assert len(staging.files()) == 1
    # aborted before vLLM loaded it (this twin never does): released by the engine thread
    assert engine.abort("r1")
    await wait_for(lambda: not staging.files(), "the stage of an aborted request released")
    assert staged == {} and llm.aborted == [vllm_id]
    # vLLM refuses the request: its stage is released and the request fails
    llm.refuse = True
    refused = make_seq("refused", [1, 2], max_tokens=5, engine=engine)
    engine.write("refused", piece(2))
    engine.start(refused, 9)
    assert await drain(refused) == [] and refused.finish_reason == gen_pb.FINISH_REASON_ERROR
    assert staged == {} and staging.files() == []
    # closing the worker removes what is still staged, and the directory
    make_seq("left", [1, 2], max_tokens=5, engine=engine)
    engine.write("left", piece(2))
    assert len(staging.files()) == 1
    await engine.close()
    assert not staging.dir.exists()


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_quantized_kv_is_refused_naming_both_formats(kv_dtype, tmp_path):
    with pytest.raises(ValueError) as e:
        check_supported(DecodeConfig(model_dir=tmp_path, engine="vllm", kv_dtype=kv_dtype))
    message = str(e.value)
    assert f"--kv-dtype {kv_dtype}" in message and "per block per kv head" in message
    assert "k_scale/v_scale per layer" in message and "--engine native" in message
    check_supported(DecodeConfig(model_dir=tmp_path, engine="vllm", kv_dtype="bfloat16"))


def test_tensor_parallelism_is_vllms_and_refused_for_the_native_engine(tmp_path):
    assert DecodeConfig(model_dir=tmp_path, engine="vllm", tensor_parallel_size=8).tensor_parallel_size == 8
    with pytest.raises(ValueError, match="the native decode engine runs on one device; use --engine vllm"):
        DecodeConfig(model_dir=tmp_path, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="must be >= 1"):
        DecodeConfig(model_dir=tmp_path, engine="vllm", tensor_parallel_size=0)


def test_cpu_ranks_get_their_own_cores_where_vllm_cannot_bind_them_by_numa_node():
    assert cpu_threads_bind([0, 1], num_numa_nodes=1, tp=2) == "0|1"
    assert cpu_threads_bind(list(range(8)), num_numa_nodes=1, tp=2) == "0,1,2,3|4,5,6,7"
    assert cpu_threads_bind([2, 3, 5, 7, 9], num_numa_nodes=1, tp=2) == "2,3|5,7"  # its affinity, evenly
    assert cpu_threads_bind(list(range(8)), num_numa_nodes=2, tp=2) is None  # vLLM's "auto": a node per rank
    with pytest.raises(ValueError, match="needs a core per rank; this worker may use 2"):
        cpu_threads_bind([0, 1], num_numa_nodes=1, tp=4)


def test_ngram_speculation_is_vllms_own_under_the_vllm_engine(tmp_path):
    """--speculative-config passes to vLLM's speculative_config with the same keys; pdserve's own
    disable_by_batch_size, which vLLM 0.32 lacks, is refused by name."""
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    config = DecodeConfig(model_dir=tmp_path, engine="vllm", speculative_config=spec)
    assert vllm_speculative_config(config.speculative) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3, "prompt_lookup_max": 3}
    with pytest.raises(ValueError, match="disable_by_batch_size is pdserve's native engine's; vLLM 0.32"):
        DecodeConfig(model_dir=tmp_path, engine="vllm",
                     speculative_config='{"method": "ngram", "disable_by_batch_size": 4}')


async def test_a_worker_whose_vllm_runs_no_grammar_processor_refuses_structured_requests_saying_why():
    engine, _, _ = make_engine()
    engine.grammar_refusal = "vLLM 0.32 refuses custom logits processors beside its speculation"
    req = request("r1", [1, 2], max_tokens=2)
    req.sampling.structured.regex = "[a-c]+"
    with pytest.raises(ValueError, match="sampling.structured: vLLM 0.32 refuses custom logits processors"):
        engine.add(req)
    assert "r1" not in engine.sequences
    make_seq("r2", [1, 2], max_tokens=2, engine=engine)  # an unconstrained one is served
