"""The prefill's matmul path: which paths can serve which weights, the fastest exact-enough one chosen from
timings, the choice cached per machine and model shape, forced paths refused where they cannot run."""

from __future__ import annotations

import json

import pytest

from pdserve.server import cli
from pdserve.server.model.config import load_config
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.matmul_choice import (TOLERANCE, cache_key, choose, choose_attention, layer_shapes, measure,
                                                  measure_attention, runnable)


def test_which_paths_can_serve_which_weights():
    assert runnable("auto", "bfloat16", onednn_bf16=True, devices=1) == ["xla-fp32", "xla-bf16", "onednn-bf16"]
    assert runnable("auto", "bfloat16", onednn_bf16=False, devices=1) == ["xla-fp32", "xla-bf16"]  # AVX2-only
    assert runnable("auto", "bfloat16", onednn_bf16=True, devices=2) == ["xla-fp32", "xla-bf16"]  # sharded
    assert runnable("bfloat16", "bfloat16", onednn_bf16=True, devices=1) == ["xla-bf16", "onednn-bf16"]
    assert runnable("bfloat16", "float32", onednn_bf16=False, devices=1) == ["xla-bf16"]
    assert runnable("auto", "float32", onednn_bf16=True, devices=1) == ["xla-fp32"]  # transformers' own tokens
    assert runnable("float32", "bfloat16", onednn_bf16=True, devices=1) == ["xla-fp32"]


def _timer(results: dict[str, tuple[float, float]], calls: list):
    def timer(paths, shapes):
        calls.append(list(paths))
        assert [s for _, s in shapes] == [(128, 4, 32), (128, 2, 32), (128, 2, 32), (4, 32, 128), (128, 256),
                                          (128, 256), (256, 128)]  # the tiny llama's q, k, v, o, gate, up, down
        return {p: results[p] for p in paths}
    return timer


def test_the_fastest_exact_path_is_chosen_and_cached(tiny_model, tmp_path):
    config = load_config(tiny_model("llama", "bfloat16"))
    cache, calls = tmp_path / "prefill-matmul.json", []
    timer = _timer({"xla-fp32": (0.040, 1e-7), "xla-bf16": (0.020, 4e-3), "onednn-bf16": (0.010, 4e-3)}, calls)
    choice = choose("auto", "auto", config, onednn_bf16=True, devices=1, threads=1, cache=cache, timer=timer)
    assert (choice.path, choice.dtype) == ("onednn-bf16", "bfloat16")
    assert choice.timings == {"xla-fp32": 0.040, "xla-bf16": 0.020, "onednn-bf16": 0.010}
    assert "xla-fp32 40.0 ms" in choice.why and "onednn-bf16 10.0 ms" in choice.why
    assert calls == [["xla-fp32", "xla-bf16", "onednn-bf16"]]
    [(key, entry)] = json.loads(cache.read_text()).items()
    assert key == cache_key(layer_shapes(config), ["xla-fp32", "xla-bf16", "onednn-bf16"], 512, 1)
    assert entry["path"] == "onednn-bf16"

    again = choose("auto", "auto", config, onednn_bf16=True, devices=1, threads=1, cache=cache, timer=timer)
    assert (again.path, again.timings) == ("onednn-bf16", choice.timings)
    assert "cached in" in again.why and len(calls) == 1  # the hit timed nothing

    # another machine's view (2 threads; or no oneDNN: other candidates) is another key: measured afresh
    slow_onednn = _timer({"xla-fp32": (0.040, 1e-7), "xla-bf16": (0.020, 4e-3), "onednn-bf16": (0.030, 4e-3)}, calls)
    assert choose("auto", "auto", config, True, 1, threads=2, cache=cache, timer=slow_onednn).path == "xla-bf16"
    assert choose("auto", "auto", config, False, 1, threads=1, cache=cache, timer=slow_onednn).path == "xla-bf16"
    assert len(calls) == 3 and len(json.loads(cache.read_text())) == 3


def test_a_path_that_is_not_exact_enough_is_passed_over(tiny_model, tmp_path):
    config = load_config(tiny_model("llama", "bfloat16"))
    calls: list = []
    timer = _timer({"xla-fp32": (0.040, 1e-7), "xla-bf16": (0.020, 0.5), "onednn-bf16": (0.010, 0.03)}, calls)
    choice = choose("auto", "auto", config, True, 1, 1, cache=tmp_path / "c.json", timer=timer)
    assert choice.path == "xla-fp32"
    assert "not exact enough: xla-bf16, onednn-bf16" in choice.why


def test_one_candidate_or_a_forced_path_times_nothing(tiny_model, tmp_path):
    fp32, bf16 = load_config(tiny_model("llama")), load_config(tiny_model("llama", "bfloat16"))

    def never(paths, shapes):
        raise AssertionError("timed")

    kw = dict(cache=tmp_path / "c.json", timer=never)
    assert choose("auto", "auto", fp32, True, 1, 1, **kw).path == "xla-fp32"
    assert choose("auto", "float32", bf16, True, 1, 1, **kw).path == "xla-fp32"
    assert choose("auto", "bfloat16", bf16, False, 1, 1, **kw).path == "xla-bf16"  # AVX2-only, bf16 asked for
    forced = choose("xla-bf16", "auto", bf16, False, 1, 1, **kw)  # the AVX2-only fallback, forced
    assert (forced.path, forced.dtype, forced.why) == ("xla-bf16", "bfloat16", "forced by --prefill-matmul")
    assert choose("onednn-bf16", "auto", bf16, True, 1, 1, **kw).path == "onednn-bf16"
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("requested, weight_dtype, onednn, devices, words", [
    ("onednn-bf16", "auto", False, 1, "oneDNN runs no bf16 linear here"),
    ("onednn-bf16", "auto", True, 2, "shards over 2"),
    ("xla-bf16", "float32", True, 1, "--weight-dtype float32"),
    ("bf16", "auto", True, 1, "must be one of auto, xla-fp32, xla-bf16, onednn-bf16"),
])
def test_a_forced_path_that_cannot_run_is_refused_naming_the_flag(tiny_model, requested, weight_dtype, onednn, devices,
                                                                  words):
    config = load_config(tiny_model("llama", "bfloat16"))
    with pytest.raises(ValueError, match="--prefill-matmul") as e:
        choose(requested, weight_dtype, config, onednn, devices, 1, timer=None)  # type: ignore[arg-type]
    assert words in str(e.value)


def test_the_flag_on_pdserve_prefill_and_up(tiny_model):
    model = str(tiny_model("llama"))
    args = cli.build_parser().parse_args(["prefill", "--model", model, "--prefill-matmul", "onednn-bf16"])
    config = cli._config(PrefillConfig, args, model_dir=cli._resolve_model(args), **cli._dtypes(args, kv_flag=None))
    assert config.prefill_matmul == "onednn-bf16"
    args = cli.build_parser().parse_args(["up", "--model", model, "--prefill-matmul", "xla-bf16"])
    _, prefill, _ = cli._tier_configs(args, cli._resolve_model(args), 0)
    assert prefill.prefill_matmul == "xla-bf16"
    with pytest.raises(ValueError, match="--weight-dtype int8 has its own"):
        PrefillConfig(model_dir=model, prefill_matmul="xla-bf16", weight_dtype="int8")


def test_the_real_probes_measure_every_path_exactly_enough(tiny_model):
    """`measure` runs each path's layer as the model does (onednn-bf16: packed q/k/v, the fused MLP) and checks it
    against fp64; `measure_attention` times XLA's and the host's attention on one causal prompt."""
    from pdserve.server import hardware

    config = load_config(tiny_model("llama", "bfloat16"))
    paths = ["xla-fp32", "xla-bf16"] + (["onednn-bf16"] if hardware.torch_probe().onednn_bf16 else [])
    results = measure(paths, layer_shapes(config), tokens=64, reps=1)
    assert sorted(results) == sorted(paths)
    assert results["xla-fp32"][1] <= TOLERANCE["float32"]
    assert all(err <= TOLERANCE["bfloat16"] and seconds > 0 for seconds, err in results.values())
    if "onednn-bf16" in paths:
        attention = measure_attention(config, tokens=64, reps=1)
        assert sorted(attention) == ["host", "xla"]
        assert all(err <= TOLERANCE["bfloat16"] and seconds > 0 for seconds, err in attention.values())


def test_attention_is_chosen_by_measurement_beside_onednn_and_cached(tiny_model, tmp_path):
    config = load_config(tiny_model("llama", "bfloat16"))
    cache, calls = tmp_path / "prefill-matmul.json", []

    def timer(results):
        return lambda c: calls.append(c.num_heads) or results

    host_faster = timer({"xla": (0.030, 4e-3), "host": (0.010, 4e-3)})
    choice = choose_attention("auto", "onednn-bf16", config, threads=1, cache=cache, timer=host_faster)
    assert (choice.where, choice.timings) == ("host", {"xla": 0.030, "host": 0.010})
    assert "xla 30.0 ms" in choice.why and "host 10.0 ms" in choice.why
    again = choose_attention("auto", "onednn-bf16", config, threads=1, cache=cache, timer=host_faster)
    assert again.where == "host" and "cached in" in again.why and calls == [4]
    wrong = timer({"xla": (0.030, 4e-3), "host": (0.010, 0.5)})  # a host kernel off by half: passed over
    assert choose_attention("auto", "onednn-bf16", config, threads=2, cache=cache, timer=wrong).where == "xla"
    assert choose_attention("xla", "onednn-bf16", config, 1, cache, timer=wrong).describe() == \
        "xla (forced by --prefill-attention)"
    assert choose_attention("auto", "xla-bf16", config, 1, cache, timer=wrong).describe() == "xla (beside xla-bf16)"
    with pytest.raises(ValueError, match="--prefill-attention host runs beside --prefill-matmul onednn-bf16"):
        choose_attention("host", "xla-fp32", config, 1, cache, timer=wrong)
    capped = load_config(tiny_model("gemma2", "bfloat16"))
    assert choose_attention("host", "onednn-bf16", capped, 1, cache, timer=wrong).where == "xla"
    assert len(calls) == 2
    with pytest.raises(ValueError, match="--prefill-attention must be one of auto, xla, host"):
        PrefillConfig(model_dir=tiny_model("llama", "bfloat16"), prefill_attention="gpu")
