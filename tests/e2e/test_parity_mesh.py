"""Greedy parity with transformers with the prefill worker on a two-device mesh, and a mesh the model cannot split."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer

from tests.e2e.cluster import pdserve_up, wait_all_blocks_free
from tests.e2e.parity_cases import PROMPTS, generate_ids, hf_greedy


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"])
def test_greedy_equals_transformers_with_prefill_on_a_two_device_mesh(family, tiny_model, tmp_path):
    """`pdserve up --tensor-parallel-size 2` on 2 forced host devices: the prefill worker shards kv heads
    and MLP (an MoE's experts) over both (decode workers run on one device), greedy tokens unchanged."""
    model_dir = tiny_model(family)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = [hf_greedy(model_dir, tok.encode(p).ids) for p in PROMPTS]
    with pdserve_up(model_dir, tmp_path, prefill_workers=1, decode_workers=1, extra_args=["--tensor-parallel-size", "2"],
                    env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}) as state:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: generate_ids(state["coordinator"], p), PROMPTS))
        assert [ids for ids, _ in got] == expected
        pairs = wait_all_blocks_free(state["decode"])
        assert all(free == total for free, total in pairs), pairs


def test_a_mesh_the_model_cannot_split_is_refused_at_start(tiny_model, tmp_path):
    """3 devices cannot each hold whole kv heads of a model with 2: the worker refuses, naming the fix."""
    with pytest.raises(RuntimeError, match=r"tensor parallelism 3 must divide the model's num_kv_heads \(2\).*"
                                           r"--tensor-parallel-size 1 or 2"):
        with pdserve_up(tiny_model("qwen3"), tmp_path, prefill_workers=1, decode_workers=1, timeout=120,
                        extra_args=["--tensor-parallel-size", "3"],
                        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=3"}):
            pass
