"""LoRA adapters placed and visible across a cluster (`pdserve up --enable-lora`, 1 prefill + 2 decode workers,
--max-loras 1): once a decode worker holds adapter ada, the coordinator sends ada's requests there whatever their
prompts (the rendezvous hash alone would spread 8 distinct prompts over both workers but for a 1-in-128 chance);
the coordinator's /metrics carries each decode worker's vllm:lora_requests_info and per-adapter request counts."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from pdserve.server.launcher import free_port
from tests.e2e.cluster import pdserve_up, worker_info


@pytest.fixture(scope="module")
def cluster(tiny_loras, tmp_path_factory):
    base, loras = tiny_loras
    http_port = free_port()
    args = ["--http-port", str(http_port), "--enable-lora", "--lora-modules", f"ada={loras['ada']}",
            f"bob={loras['bob']}", "--max-loras", "1", "--max-cpu-loras", "2", "--max-lora-rank", "16"]
    with pdserve_up(base, tmp_path_factory.mktemp("up"), prefill_workers=1, decode_workers=2,
                    extra_args=args) as state:
        state["http"] = f"http://127.0.0.1:{http_port}"
        yield state


def _samples(text: str, family: str) -> list[tuple[dict[str, str], float]]:
    """The family's samples in a /metrics text: (labels, value)."""
    out = []
    for line in text.splitlines():
        m = re.fullmatch(re.escape(family) + r"\{(.*)\} (\S+)", line)
        if m:
            out.append((dict(re.findall(r'(\w+)="([^"]*)"', m[1])), float(m[2])))
    return out


def _holding(cluster, name: str) -> list[str]:
    return [a for a in cluster["decode"] if name in [x.name for x in worker_info(a).load.device_loras]]


async def test_an_adapters_requests_follow_the_worker_that_holds_it(cluster):
    async with openai.AsyncOpenAI(base_url=f"{cluster['http']}/v1", api_key="unused", max_retries=0,
                                  timeout=120) as sdk:
        first = await sdk.completions.create(model="ada", prompt=[60, 61, 62, 3], max_tokens=2, temperature=0)
        assert first.model == "ada"
        [holder] = _holding(cluster, "ada")
        time.sleep(1.0)  # the coordinator's next GetInfo round (every 0.5 s) reads the holder's adapters
        prompts = [[(37 * i + 11 * j) % 500 + 3 for j in range(20)] for i in range(8)]  # distinct first blocks
        for prompt in prompts:  # one at a time: each sees the holder under its share of the load
            reply = await sdk.completions.create(model="ada", prompt=prompt, max_tokens=2, temperature=0)
            assert reply.model == "ada"
        assert _holding(cluster, "ada") == [holder]  # the other worker never loaded it
        text = httpx.get(f"{cluster['http']}/metrics", timeout=30).text
        counts = {}
        for labels, value in _samples(text, "pdserve_lora_requests_total"):
            if labels["lora_name"] == "ada":
                counts[labels["worker"]] = value
        assert list(counts.values()) == [9.0], counts  # all nine on one decode worker
        info = _samples(text, "vllm:lora_requests_info")
        assert sorted(labels["worker"] for labels, _ in info) == ["decode-0", "decode-1"], info
        assert all(labels["max_lora"] == "1" and labels["running_lora_adapters"] == "" for labels, _ in info)
        assert all(abs(value - time.time()) < 60 for _, value in info)
