"""Each tier's flags come from its config dataclass: every existing spelling still parses to the same
settings, vLLM's spellings parse to pdserve's, and the help is the fields' docstrings."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.server import cli
from pdserve.server.coordinator.config import CoordinatorConfig
from pdserve.server.decode.config import DecodeConfig
from pdserve.server.flags import field_docs
from pdserve.server.prefill.config import PrefillConfig


def _parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


def test_pdserve_spellings_give_the_same_configs(tiny_model):
    model = str(tiny_model("llama"))
    args = _parse("decode", "--model", model, "--port", "7", "--host", "0.0.0.0", "--block-size", "32",
                  "--kv-cache-tokens", "4096", "--max-running", "3", "--weight-dtype", "int8", "--kv-dtype", "fp8_e4m3",
                  "--threads", "2", "--kv-port", "9", "--coordinator", "h:1", "--metrics-port", "5")
    config = cli._config(DecodeConfig, args, model_dir=cli._resolve_model(args), **cli._dtypes(args))
    assert config == DecodeConfig(model_dir=config.model_dir, port=7, host="0.0.0.0", block_size=32,
                                  kv_cache_tokens=4096, max_running=3, weight_dtype="int8", kv_dtype="fp8_e4m3",
                                  threads=2)
    assert (args.kv_port, args.coordinator, args.metrics_port) == (9, "h:1", 5)

    args = _parse("prefill", "--model", model, "--max-batch-size", "4", "--weight-dtype", "fp8")
    config = cli._config(PrefillConfig, args, model_dir=cli._resolve_model(args), **cli._dtypes(args, kv_flag=None))
    assert (config.port, config.max_batch_size, config.weight_dtype) == (50052, 4, "fp8")

    args = _parse("coordinator", "--model", model, "--prefill", "a:1", "--prefill", "b:2", "--decode", "c:3",
                  "--http-port", "0", "--max-queue", "5", "--default-timeout", "9", "--decode-policy", "power-of-two",
                  "--heartbeat-timeout", "4", "--max-migrations", "1", "--api-key", "k")
    config = cli._config(CoordinatorConfig, args, model_dir=cli._resolve_model(args))
    assert config.port == 50051 and config.prefill_addresses == ["a:1", "b:2"] and config.decode_addresses == ["c:3"]
    assert (config.http_port, config.max_queue, config.default_timeout, config.decode_policy) == (0, 5, 9.0, "power-of-two")
    assert (config.heartbeat_timeout, config.max_migrations, config.api_key) == (4.0, 1, "k")


def test_vllm_spellings_map_onto_pdserve_settings(tiny_model):
    model = str(tiny_model("llama"))
    args = _parse("decode", model, "--dtype", "float32", "--kv-cache-dtype", "fp8", "--max-num-seqs", "8",
                  "--served-model-name", "tiny", "alias", "--max-model-len", "256", "--tensor-parallel-size", "1",
                  "--gpu-memory-utilization", "0.9")
    config = cli._config(DecodeConfig, args, model_dir=cli._resolve_model(args), **cli._dtypes(args))
    assert (config.weight_dtype, config.kv_dtype, config.max_running) == ("float32", "fp8_e4m3", 8)
    assert (config.served_model_name, config.model_name, config.max_model_len) == (("tiny", "alias"), "tiny", 256)
    assert config.gpu_memory_utilization == 0.9

    args = _parse("prefill", "--model", model, "--quantization", "fp8", "--dtype", "bfloat16",
                  "--max-num-batched-tokens", "2048")
    config = cli._config(PrefillConfig, args, model_dir=cli._resolve_model(args), **cli._dtypes(args, kv_flag=None))
    assert (config.weight_dtype, config.max_batch_tokens) == ("fp8", 2048)


@pytest.mark.parametrize("argv, words", [
    (["decode", "--dtype", "half"], "--dtype 'half' is not served by pdserve; it takes auto, float32"),
    (["decode", "--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype 'fp8_e5m2' is not served"),
    (["prefill", "--quantization", "awq"], "--quantization 'awq' is not served"),
    (["decode", "--tensor-parallel-size", "2"], "the native decode engine runs on one device"),
    (["decode", "--gpu-memory-utilization", "1.5"], "must lie in (0, 1]"),
])
def test_what_pdserve_cannot_serve_is_refused_naming_the_flag(tiny_model, argv, words):
    args = _parse(*argv, str(tiny_model("llama")))
    cls = DecodeConfig if argv[0] == "decode" else PrefillConfig
    with pytest.raises(SystemExit, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        cli._config(cls, args, model_dir=cli._resolve_model(args),
                    **cli._dtypes(args, kv_flag="kv_dtype" if cls is DecodeConfig else None))


def test_a_model_id_is_served_under_its_id(tiny_model, tmp_path, monkeypatch):
    from tests.model.test_hub import hub_cache

    hub_cache(tiny_model("llama"), tmp_path, "pdserve-tests/tiny-llama")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    args = _parse("coordinator", "pdserve-tests/tiny-llama", "--download-dir", str(tmp_path))
    config = cli._config(CoordinatorConfig, args, model_dir=cli._resolve_model(args))
    assert config.model_name == "pdserve-tests/tiny-llama" and (config.model_dir / "config.json").exists()
    with pytest.raises(SystemExit, match="give the model"):
        cli._resolve_model(_parse("decode"))


def test_help_and_defaults_come_from_the_dataclass():
    parser = cli.build_parser()
    sub = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for role, cls in (("coordinator", CoordinatorConfig), ("prefill", PrefillConfig), ("decode", DecodeConfig)):
        actions = {a.dest: a for a in sub[role]._actions}
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("flag", {}).get("cli", True) is False:
                continue  # the model (positional or --model) and --metrics-port are every role's flags
            assert f.name in actions, (role, f.name)
            if f.name in docs:
                assert actions[f.name].help.startswith(docs[f.name]), (role, f.name)
            if f.name != "port" and f.default is not dataclasses.MISSING:
                assert actions[f.name].default == f.default, (role, f.name)
