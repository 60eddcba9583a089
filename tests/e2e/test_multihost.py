"""A prefill slice of two processes serving one mesh: `pdserve prefill --coordinator-address
127.0.0.1:P --num-processes 2 --process-id I` (JAX's gloo collectives between them on CPU). Process 0
is the worker; process 1 replays its steps (server/prefill/replay.py). Greedy tokens equal
transformers' for packed, chunked and prefix-cached prompts, and neither process compiles after
start; process 0's stop ends process 1; process 1's death ends process 0, naming it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from tokenizers import Tokenizer

from pdserve.server.client import stream
from pdserve.server.launcher import free_port
from pdserve.server.prefill.prefix_kv import BLOCK_SIZE
from tests.e2e.procs import Proc, Procs, counter, request
from tests.e2e.parity_cases import LONG_PROMPTS, PROMPTS, generate_ids, hf_greedy

def devices(n: int) -> dict[str, str]:
    """The environment of processes with n CPU devices each."""
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"}


def start_slice(procs: Procs, coordinator: Proc, *args: str) -> tuple[Proc, Proc]:
    """Process 1 (no server), then process 0 (the worker, registered with `coordinator`)."""
    port = free_port()

    def flags(i: int) -> list[str]:
        return ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i), *args]

    follower = procs.start("prefill-1", "prefill", *flags(1), metrics=False, wait=False)
    try:
        leader = procs.worker("prefill-0", "prefill", coordinator, *flags(0), timeout=400)
    except (RuntimeError, TimeoutError) as e:
        raise AssertionError(f"{e}\nprocess 1's log:\n{follower.log.read_text()[-3000:]}") from e
    return leader, follower


def test_a_two_process_slice_serves_greedy_parity_and_stops_with_process_0(tiny_model, tmp_path):
    model_dir = tiny_model("qwen3")  # q/k norms and a vocabulary-split lm_head: the head gathers over processes
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = PROMPTS + LONG_PROMPTS
    assert max(len(tok.encode(p).ids) for p in prompts) > 2 * 64, "a prompt must take several chunks"
    expected = [hf_greedy(model_dir, tok.encode(p).ids) for p in prompts]
    procs = Procs(model_dir, tmp_path, env={**devices(1), "JAX_LOG_COMPILES": "1"})
    try:
        # conditional disaggregation off: the repeated prompts go to the slice again (its prefix KV is checked)
        coordinator = procs.coordinator("coordinator", "--conditional-disagg-max-uncached", "0")
        procs.worker("decode", "decode", coordinator)
        leader, follower = start_slice(procs, coordinator, "--tensor-parallel-size", "2", "--max-prefill-chunk", "64",
                                       "--max-num-batched-tokens", "128")
        # Mixed lengths at once: packed into 128-token steps, the long ones chunk by chunk beside them.
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: generate_ids(coordinator.address, p)[0], prompts))
        assert got == expected
        # Again: the prefill worker holds their full blocks (host-side, on process 0) and computes the rest.
        hits = counter(leader.metrics(), "pdserve_prefill_prefix_cache_hit_tokens_total")
        assert [generate_ids(coordinator.address, p)[0] for p in LONG_PROMPTS] == expected[-2:]
        # every full block but the one holding the last token (which computes the first token)
        held = sum((len(tok.encode(p).ids) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in LONG_PROMPTS)
        assert counter(leader.metrics(), "pdserve_prefill_prefix_cache_hit_tokens_total") - hits == held
        procs.terminate("prefill-1")  # ignored: process 1 runs until process 0 stops the slice
        check_penalty_and_prompt_logprobs(coordinator, model_dir, tok.encode(PROMPTS[4]).ids)
        assert follower.popen.poll() is None
        assert "SIGTERM; process 1 exits when process 0 stops the slice" in follower.log.read_text()
        for proc, started in ((leader, "they replay every step"), (follower, "replaying its steps")):
            log = proc.log.read_text()
            assert "Compiling " in log.split(started)[0]  # JAX logs each compile: all of them at start
            assert "Compiling " not in log.split(started)[1], f"{proc.name} compiled on the request path"

        procs.terminate("prefill-0")  # drains, then stops the slice
        assert leader.popen.wait(60) == 0, leader.log.read_text()[-3000:]
        assert follower.popen.wait(60) == 0, follower.log.read_text()[-3000:]
        assert "process 0 stopped the slice after" in follower.log.read_text()
    finally:
        procs.stop_all()


def check_penalty_and_prompt_logprobs(coordinator: Proc, model_dir, prompt: list[int]) -> None:
    """The first token's penalty and the prompt's logprobs come from the slice's head (gathered from
    both processes): equal to transformers'."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, repetition_penalty=1.8,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1).numpy()  # [S, V]
    messages = list(stream(coordinator.address, request(prompt, 4, repetition_penalty=1.8, prompt_logprobs=1),
                           timeout=120))
    assert [t for m in messages for t in m.token_ids] == want
    prompt_lps = [e for m in messages for e in m.prompt_logprobs]
    assert [e.token_id for e in prompt_lps] == prompt[1:]
    np.testing.assert_allclose([e.logprob for e in prompt_lps], [ref[i - 1, prompt[i]] for i in range(1, len(prompt))],
                               atol=1e-4)


def test_a_follower_that_dies_ends_process_0_naming_it(tiny_model, tmp_path):
    """Two devices a process, the default size: the model's 2 kv heads split over one device of each."""
    procs = Procs(tiny_model("qwen2"), tmp_path, env=devices(2))
    try:
        coordinator = procs.coordinator()
        procs.worker("decode", "decode", coordinator)
        leader, follower = start_slice(procs, coordinator, "--max-model-len", "128", "--prefix-cache-bytes", "0")
        log = leader.log.read_text()
        assert "sharding over 2 of 4 devices" in log and "(tensor parallel 2 over cpu)" in log
        assert "] of processes [0, 1]" in log  # the mesh: one of each process's two devices
        ids = list(range(3, 40))
        assert len([t for m in stream(coordinator.address, request(ids, 3), timeout=120) for t in m.token_ids]) == 3
        procs.kill("prefill-1")
        assert leader.popen.wait(60) == 1
        assert "prefill slice: process 1 stopped (its replay connection to process 0 closed)" in leader.log.read_text()
    finally:
        procs.stop_all()
