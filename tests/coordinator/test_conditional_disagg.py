"""Conditional disaggregation in the coordinator, against scripted workers: each Decode call carries the
--conditional-disagg-* thresholds (none when no prefill worker is alive: it prefills locally anyway); a decode worker
that reports `reserved.local_prefill` gets no prefill call and sends the first token itself; the decisions and the
uncached tokens are counted by tier."""

from __future__ import annotations

import prometheus_client
import pytest

from pdserve.server.coordinator.config import CoordinatorConfig
from tests.coordinator.test_service import _cluster, generate, request


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


def _count(name: str, **labels: str) -> float:
    return sum(s.value for m in prometheus_client.REGISTRY.collect() for s in m.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _counts() -> tuple[float, ...]:
    return (_count("pdserve_conditional_disagg_total", where="local"),
            _count("pdserve_conditional_disagg_total", where="remote"),
            _count("pdserve_uncached_prompt_tokens_total", tier="decode"),
            _count("pdserve_uncached_prompt_tokens_total", tier="prefill"))


async def test_a_decode_worker_choosing_to_prefill_is_never_sent_to_the_prefill_tier(model_dir):
    async with _cluster(model_dir, conditional_disagg_max_uncached=300, conditional_disagg_min_cached=16) as cluster:
        cluster.decode.chooses_local, cluster.decode.cached_blocks = True, 1
        cluster.decode.local_first_token = 5
        cluster.decode.events = [[6], [7]]
        prompt = cluster.tokenizer.encode("import os\n" * 10)
        before = _counts()
        responses = await generate(cluster, request("import os\n" * 10))
        assert [i for r in responses for i in r.token_ids] == [5, 6, 7]
        (dreq,) = cluster.decode.requests
        assert (dreq.local_prefill, dreq.local_prefill_max_uncached, dreq.local_prefill_min_cached) == (False, 300, 16)
        assert cluster.prefill.requests == []  # the decode worker computed the prompt past its cached block
        assert [a - b for a, b in zip(_counts(), before)] == [1, 0, len(prompt) - 16, 0]

        cluster.decode.chooses_local = False  # the suffix is too long for it: the prefill tier computes it
        cluster.prefill.first_token_id = 5
        responses = await generate(cluster, request("import os\n" * 10))
        assert [i for r in responses for i in r.token_ids] == [5, 6, 7]
        (preq,) = cluster.prefill.requests
        assert preq.target.cached_blocks == 1  # the block the decode worker holds is not sent
        assert [a - b for a, b in zip(_counts(), before)] == [1, 1, len(prompt) - 16, len(prompt) - 16]


async def test_off_it_offers_nothing_and_without_a_prefill_worker_it_is_no_choice(model_dir):
    async with _cluster(model_dir, conditional_disagg_max_uncached=0) as cluster:
        cluster.decode.chooses_local = True  # would, if offered
        cluster.prefill.first_token_id = 5
        cluster.decode.events = [[6]]
        before = _counts()
        await generate(cluster, request("import os"))
        (dreq,) = cluster.decode.requests
        assert (dreq.local_prefill, dreq.local_prefill_max_uncached) == (False, 0)
        assert len(cluster.prefill.requests) == 1
        prompt = cluster.tokenizer.encode("import os")
        assert [a - b for a, b in zip(_counts(), before)] == [0, 0, 0, len(prompt)]

        await cluster.prefill_worker.stop()  # no prefill worker: the decode worker prefills, as before
        for _ in range(100):
            if not cluster.coordinator.pool.ready("prefill"):
                break
            await cluster.coordinator.pool.recheck("prefill", 0.1)
        await generate(cluster, request("import os"))
        dreq = cluster.decode.requests[-1]
        assert (dreq.local_prefill, dreq.local_prefill_max_uncached) == (True, 0)
        assert [a - b for a, b in zip(_counts(), before)] == [0, 0, len(prompt), len(prompt)]


@pytest.mark.parametrize("field, value", [("conditional_disagg_max_uncached", -1),
                                          ("conditional_disagg_min_cached", 2**32)])
def test_thresholds_out_of_range_are_refused_naming_the_flag(model_dir, field, value):
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=flag):
        CoordinatorConfig(model_dir, **{field: value})
