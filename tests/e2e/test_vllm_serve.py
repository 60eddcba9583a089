"""Logprobs through real processes (`pdserve up` started as `vllm serve` would be: a Hugging Face model
id, resolved offline from a local hub cache, and vLLM's flags), against `transformers`.

lm-evaluation-harness scores a continuation with one completions request: `echo` + `logprobs` +
`max_tokens=1`, then reads `token_logprobs[ctxlen:-1]` and checks greediness with `top_logprobs`. The
prompt's logprobs come from the prefill tier's forward pass, the generated tokens' from the prefill
sampler (the first) and the decode sampler (the rest); all must equal transformers' within 1e-4 on
the tiny fp32 model.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch

from pdserve.server.client import build_request, stream
from pdserve.server.launcher import free_port
from tests.e2e.cluster import pdserve_up, wait_all_blocks_free

TOLERANCE = 1e-4
PROMPT_IDS = [1, 17, 45, 99, 3, 250, 7, 64, 12, 301, 5]
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


VLLM_SERVE_FLAGS = ["--served-model-name", "tiny", "--max-model-len", "256", "--dtype", "float32",
                    "--kv-cache-dtype", "auto", "--gpu-memory-utilization", "0.9", "--tensor-parallel-size", "1",
                    "--max-num-seqs", "16"]
"""From a typical `vllm serve MODEL ...` command line, as pdserve up takes it."""


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    """`pdserve up <hub model id> <vLLM's flags>`, the id resolved offline from a local hub cache."""
    from tests.model.test_hub import hub_cache

    cache = tmp_path_factory.mktemp("hf-cache")
    hub_cache(model_dir, cache, "pdserve-tests/tiny-llama")
    http_port = free_port()
    with pdserve_up("pdserve-tests/tiny-llama", tmp_path_factory.mktemp("up"), prefill_workers=1, decode_workers=1,
                    positional=True, env={"HF_HUB_OFFLINE": "1"},
                    extra_args=[*VLLM_SERVE_FLAGS, "--download-dir", str(cache), "--http-port", str(http_port)]) as state:
        state["http"] = f"http://127.0.0.1:{http_port}"
        state["model"] = "tiny"
        yield state
        pairs = wait_all_blocks_free(state["decode"])
        assert all(free == total for free, total in pairs), f"leaked KV blocks (free, total): {pairs}"


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    """ids -> transformers' log-softmax f32 [len(ids), V] (row i predicts ids[i + 1])."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()  # [S, V]
        return logits.log_softmax(-1).numpy()

    return run


def test_generate_returns_prompt_and_token_logprobs_equal_to_transformers(cluster, hf_logprobs):
    request = build_request(token_ids=PROMPT_IDS, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    request.sampling.logprobs = 3
    request.sampling.prompt_logprobs = 2
    messages = list(stream(cluster["coordinator"], request, timeout=60))
    out_ids = [i for m in messages for i in m.token_ids]
    token_lps = [e for m in messages for e in m.logprobs]
    prompt_lps = [e for m in messages for e in m.prompt_logprobs]
    assert len(out_ids) == NEW_TOKENS and len(token_lps) == NEW_TOKENS
    assert len(messages[0].prompt_logprobs) == len(PROMPT_IDS) - 1  # all on the first message

    ref = hf_logprobs(PROMPT_IDS + out_ids)  # [S, V]
    assert out_ids == [int(ref[len(PROMPT_IDS) - 1 + j].argmax()) for j in range(NEW_TOKENS)]  # greedy
    for pos, entry in enumerate(prompt_lps, start=1):
        row = ref[pos - 1]
        assert entry.token_id == PROMPT_IDS[pos]
        assert entry.logprob == pytest.approx(row[PROMPT_IDS[pos]], abs=TOLERANCE)
        assert list(entry.top_token_ids) == np.argsort(-row, kind="stable")[:2].tolist()
        np.testing.assert_allclose(entry.top_logprobs, np.sort(row)[::-1][:2], atol=TOLERANCE)
    for j, entry in enumerate(token_lps):
        row = ref[len(PROMPT_IDS) - 1 + j]
        assert entry.token_id == out_ids[j]
        assert entry.logprob == pytest.approx(row[out_ids[j]], abs=TOLERANCE)
        assert list(entry.top_token_ids) == np.argsort(-row, kind="stable")[:3].tolist()
        np.testing.assert_allclose(entry.top_logprobs, np.sort(row)[::-1][:3], atol=TOLERANCE)


def test_lm_eval_loglikelihood_request_through_the_openai_sdk(cluster, hf_logprobs):
    """What lm-evaluation-harness's `local-completions` model sends for a loglikelihood task."""
    context, continuation = PROMPT_IDS[:7], PROMPT_IDS[7:]
    with openai.OpenAI(base_url=f"{cluster['http']}/v1", api_key="unused", max_retries=0, timeout=60) as sdk:
        reply = sdk.completions.create(model=cluster["model"], prompt=context + continuation, echo=True,
                                       logprobs=1, max_tokens=1, temperature=0, seed=1234)
    choice = reply.choices[0]
    lp = choice.logprobs
    n = len(PROMPT_IDS)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = hf_logprobs(PROMPT_IDS)  # [n, V]
    expected = [float(ref[i - 1, PROMPT_IDS[i]]) for i in range(1, n)]
    np.testing.assert_allclose(lp.token_logprobs[1:n], expected, atol=TOLERANCE)
    # lm-eval's numbers: the continuation's summed logprob, and whether it is greedy.
    ctxlen = len(context)
    assert sum(lp.token_logprobs[ctxlen:-1]) == pytest.approx(sum(expected[ctxlen - 1:]), abs=1e-3)
    greedy = all(tok == max(top.values()) for tok, top in zip(lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1]))
    assert greedy == all(int(ref[i - 1].argmax()) == PROMPT_IDS[i] for i in range(ctxlen, n))
    # The one generated token: greedy, with its logprob.
    generated = int(ref[-1].argmax())
    assert lp.token_logprobs[n] == pytest.approx(float(ref[-1, generated]), abs=TOLERANCE)
    assert max(lp.top_logprobs[n].values()) == pytest.approx(float(ref[-1].max()), abs=TOLERANCE)
    assert choice.text.endswith(lp.tokens[n]) and lp.text_offset == sorted(lp.text_offset)
    assert reply.usage.prompt_tokens == n and reply.usage.completion_tokens == 1


def test_the_served_model_name_and_max_model_len_are_vllms(cluster):
    with openai.OpenAI(base_url=f"{cluster['http']}/v1", api_key="unused", max_retries=0, timeout=60) as sdk:
        (card,) = sdk.models.list().data
        assert card.id == "tiny" and card.model_extra["max_model_len"] == 256
        with pytest.raises(openai.BadRequestError, match="max_model_len 256"):
            sdk.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=250)


@pytest.fixture(scope="module")
def hf_generate(model_dir):
    """transformers' greedy generate: (prompt ids, max_new_tokens, **generate kwargs) -> new ids."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(ids: list[int], n: int, **kw) -> list[int]:
        kw.setdefault("eos_token_id", None)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
        return out[0, len(ids):].tolist()

    return run


def _sdk(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster['http']}/v1", api_key="unused", max_retries=0, timeout=60)


def test_repetition_penalty_greedy_equals_transformers(cluster, hf_generate):
    """The first token is penalized in the JAX prefill tier, the rest in the torch decode tier."""
    expected = hf_generate(PROMPT_IDS, 8, repetition_penalty=1.8)
    assert expected != hf_generate(PROMPT_IDS, 8)  # the penalty changes this output
    request = build_request(token_ids=PROMPT_IDS, max_tokens=8, temperature=0.0, ignore_eos=True)
    request.sampling.repetition_penalty = 1.8
    assert [i for m in stream(cluster["coordinator"], request, timeout=60) for i in m.token_ids] == expected


def test_min_tokens_holds_back_a_stop_token_as_transformers_min_new_tokens(cluster, hf_generate):
    free = hf_generate(PROMPT_IDS, 8)
    at = 0
    stop = free[at]  # greedy stops at once
    request = build_request(token_ids=PROMPT_IDS, max_tokens=8, temperature=0.0, stop_token_ids=[stop],
                            ignore_eos=True)
    short = list(stream(cluster["coordinator"], request, timeout=60))
    assert [i for m in short for i in m.token_ids] == free[: at + 1] and short[-1].stop_token_id == stop
    request.sampling.min_tokens = 5
    got = [i for m in stream(cluster["coordinator"], request, timeout=60) for i in m.token_ids]
    expected = hf_generate(PROMPT_IDS, 8, min_new_tokens=5, eos_token_id=[stop])
    assert got == expected and stop not in got[:5]


def test_stop_reason_names_the_stop_string(cluster):
    with _sdk(cluster) as sdk:
        free = sdk.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        text = free.choices[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        assert stop.strip(), text
        reply = sdk.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=12, temperature=0, stop=[stop],
                                       extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert choice.text == text[: text.index(stop)]
    assert free.choices[0].model_extra["stop_reason"] is None
