"""The native decode engine's whole step (forward, sampling, logprobs) on CPU, by sampling mix and batch.

    .venv/bin/python -m pdserve.benchmarks.engine.sampling_step [--batches 1 16] [--steps 30] [--vocab 32000]

A two-layer model of Qwen2.5-0.5B's layer shape (random weights, fp32) with a real-sized vocabulary, so that
sampling (penalties, grammar masks, sorts over the vocabulary, logprobs) is a visible share of the step. Each
figure is the best of `--steps` calls of `DecodeEngine._step` on the same batch (the sequences do not advance:
every call samples the same position), in ms. Mixes: `greedy` (every row temperature 0); `mixed` (rows in turn:
seeded top-p with logprobs, top-k with presence, frequency and repetition penalties, min-p with min_tokens,
unseeded temperature, greedy). Run it against two checkouts in turn to compare them (PYTHONPATH at each): the
engine's API is all it uses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import torch

from pdserve.benchmarks.engine.decode_step import random_qwen_shape
from pdserve.kvcache.layout import KvLayout
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.weights import build_model

MIXED = [
    dict(temperature=0.0),
    dict(temperature=0.8, top_p=0.9, seed=7, logprobs=2),
    dict(temperature=1.0, top_k=40, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
    dict(temperature=0.7, min_p=0.05, min_tokens=64),
    dict(temperature=1.0),
]


def _sampling(mix: str, row: int) -> gen_pb.SamplingParams:
    given = dict(temperature=0.0) if mix == "greedy" else MIXED[(row + 1) % len(MIXED)]
    return gen_pb.SamplingParams(**{"max_tokens": 1000, "top_p": 1.0, "ignore_eos": True, **given})


async def step_ms(engine: DecodeEngine, mix: str, batch: int, prompt_len: int, steps: int) -> float:
    engine._wake = lambda: None  # no decode loop: only the timed steps run
    seqs = []
    for i in range(batch):
        request = pb.DecodeRequest(request_id=f"{mix}-{batch}-{i}", sampling=_sampling(mix, i), local_prefill=True,
                                   prompt_token_ids=[(7 * i + j) % 1000 + 3 for j in range(prompt_len)])
        seq = engine.add(request)
        await seq.admitted
        engine.start(seq, await engine.prefill_locally(seq))
        seqs.append(seq)
    seqs = engine._schedule()  # each holds a block for its next token
    assert len(seqs) == batch, f"{len(seqs)} of {batch} sequences scheduled: give the cache more blocks"
    best = float("inf")
    for _ in range(steps + 2):
        start = time.perf_counter()
        engine._step(seqs)
        best = min(best, time.perf_counter() - start)
    for s in seqs:
        engine.abort(s.request_id)
    return best * 1e3


async def main(args) -> None:
    torch.set_num_threads(args.threads)
    config, weights = random_qwen_shape(args.layers, args.vocab)
    model = build_model(config, weights, dtype=torch.float32)
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=16, dtype="float32")
    rows = []
    for mix in ("greedy", "mixed"):
        for batch in args.batches:
            engine = DecodeEngine(model, layout, num_blocks=batch * 8 + 8, max_running=batch,
                                  eos_ids=frozenset({2}))
            ms = await step_ms(engine, mix, batch, args.prompt_len, args.steps)
            print(f"[sampling_step] {mix} batch {batch}: {ms:.2f} ms", file=sys.stderr, flush=True)
            rows.append({"mix": mix, "batch": batch, "ms": round(ms, 3)})
            await engine.close()
    print(json.dumps(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    asyncio.run(main(parser.parse_args()))
