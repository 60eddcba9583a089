"""`pdserve up` on a CPU without AVX-512: PDSERVE_CPU_ISA=avx2 makes oneDNN, ATen and XLA run as on an
AVX2-only machine (an AMD EPYC of the Rome generation, say), where oneDNN's bf16 prepacking raises at start."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer

from pdserve.server import hardware
from tests.e2e.cluster import pdserve_up, wait_all_blocks_free, worker_info
from tests.e2e.parity_cases import PROMPTS, generate_ids, hf_greedy

pytestmark = pytest.mark.skipif(hardware.cpu().arch != "x86_64",
                                reason=f"PDSERVE_CPU_ISA caps x86_64 CPUs; this one is {hardware.cpu().arch}")


def test_a_bf16_checkpoint_serves_on_an_avx2_cpu_with_transformers_tokens(tiny_model, tmp_path):
    """The fp32 fallback (forced: `auto` may measure plain bf16 faster) computes the tokens of transformers
    run in fp32 on the same bf16 weights; both tiers report the capped CPU and the path they took."""
    model_dir = tiny_model("qwen3", "bfloat16")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = PROMPTS[:4]
    expected = [hf_greedy(model_dir, tok.encode(p).ids) for p in prompts]
    with pdserve_up(model_dir, tmp_path, prefill_workers=1, decode_workers=1, extra_args=["--cpu-matmul", "float32", "--prefill-matmul", "xla-fp32"],
                    env={"PDSERVE_CPU_ISA": "avx2"}) as state:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: generate_ids(state["coordinator"], p), prompts))
        assert [ids for ids, _ in got] == expected
        decode, prefill = worker_info(state["decode"][0]).hardware, worker_info(state["prefill"][0]).hardware
        assert decode.cpu_family == prefill.cpu_family == "x86_64/avx2" and decode.cpu_cap == "avx2"
        assert decode.paths["matmuls"].startswith("bf16 weights -> fp32 compute (upcast at load, exact), torch's")
        assert decode.framework.startswith("torch ") and prefill.framework.startswith("jax ")
        assert prefill.paths["compute"] == "float32 matmuls on XLA:CPU"
        pairs = wait_all_blocks_free(state["decode"])
        assert all(free == total for free, total in pairs), pairs


def test_auto_on_an_avx2_cpu_picks_a_path_that_runs_and_serves(tiny_model, tmp_path):
    from pdserve.server.client import build_request, stream

    with pdserve_up(tiny_model("llama", "bfloat16"), tmp_path, prefill_workers=1, decode_workers=1,
                    env={"PDSERVE_CPU_ISA": "avx2"}) as state:
        msgs = list(stream(state["coordinator"], build_request(prompt="def main():", max_tokens=8, temperature=0.0,
                                                               ignore_eos=True), timeout=120))
        assert sum(len(m.token_ids) for m in msgs) == 8 and msgs[-1].finish_reason == 2
        matmuls = worker_info(state["decode"][0]).hardware.paths["matmuls"]
        assert "no native bf16 on this CPU; fastest measured" in matmuls
        assert "bf16 compute, prepacked for oneDNN" not in matmuls  # what raises at start on such a CPU
