"""Each tier's flags come from its config dataclass: every existing spelling still parses to the same
settings, vLLM's spellings parse to pdserve's, and the help is the fields' docstrings."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdserve.server import cli, launcher
from pdserve.server.coordinator.config import CoordinatorConfig
from pdserve.server.decode.config import DecodeConfig
from pdserve.server.flags import config_to_argv, field_docs
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
    (["decode", "--speculative-config", '{"method": "eagle"}'], "method must be one of ngram, draft_model"),
    (["decode", "--speculative-config", '{"method": "draft_model", "model": "x"}'],
     "model 'x' is not a checkpoint the native decode engine serves: model directory 'x' does not exist"),
    (["decode", "--speculative-config", '{"method": "draft_model", "model": "x", "draft_tensor_parallel_size": 2}'],
     "draft_tensor_parallel_size 2: the native decode engine runs the draft on the target's one device"),
    (["decode", "--speculative-config", '{"method": "ngram", "acceptance_method": "x"}'],
     "does not take acceptance_method"),
    (["decode", "--engine", "vllm", "--speculative-config", '{"method": "draft_model", "model": "/nowhere"}'],
     "--engine native only"),
    (["decode", "--engine", "vllm", "--speculative-config", '{"method": "ngram", "disable_by_batch_size": 8}'],
     "vLLM 0.32's speculative config has no such key"),
    (["decode", "--kv-offloading-size", "0"], "--kv-offloading-size must be > 0 GiB"),
    (["prefill", "--kv-offloading-disk-path", "/a", "--kv-offloading-shared-path", "/a"], "give the shared one alone"),
    (["decode", "--engine", "vllm", "--kv-offloading-size", "1"], "are built for --engine native so far"),
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


def _parsed(role: str, cls, argv: list[str]):
    """The config the tier's own command builds from argv (as cmd_coordinator/cmd_prefill/cmd_decode do)."""
    args = _parse(role, *argv)
    dtypes = {} if cls is CoordinatorConfig else cli._dtypes(args, kv_flag="kv_dtype" if cls is DecodeConfig else None)
    return cli._config(cls, args, model_dir=cli._resolve_model(args), **dtypes)


def _worker_port(role: str) -> int:
    return _parse(role, "--model", "m").port


def test_a_config_written_as_flags_parses_back_to_itself(tiny_model):
    model = tiny_model("llama")
    configs = [
        ("coordinator", CoordinatorConfig(model_dir=model)),
        ("coordinator", CoordinatorConfig(
            model_dir=model, port=7, prefill_addresses=["a:1", "b:2"], decode_addresses=["c:3"],
            decode_policy="power-of-two", http_port=0, served_model_name=("tiny", "alias"), max_model_len=256,
            chat_template="{{ messages[0].content }}", ttft_budget=1.5, reuse_port=True,
            api_key="-starts-with-a-dash", stall_timeout=0.25)),
        ("prefill", PrefillConfig(model_dir=model)),
        ("prefill", PrefillConfig(
            model_dir=model, port=0, weight_dtype="int8", max_batch_tokens=128, max_prefill_chunk=64,
            prefix_cache_bytes=0, compilation_cache="none", compile_before_serving="all", tensor_parallel_size=2,
            expert_parallel_size=2, prefill_order="fifo", prefill_ageing=0.5)),
        ("decode", DecodeConfig(model_dir=model)),
        ("decode", DecodeConfig(
            model_dir=model, block_size=32, device="cpu", kv_cache_memory="1GiB", enforce_eager=True,
            enable_prefix_caching=False, weight_dtype="fp8", kv_dtype="fp8_e4m3", max_running=3, cpu_matmul="float32",
            gpu_memory_utilization=0.5, engine="vllm", tensor_parallel_size=2)),
    ]
    for role, config in configs:
        argv = config_to_argv(config, defaults={"port": _worker_port(role)})
        assert _parsed(role, type(config), ["--model", str(model), *argv]) == config, (role, argv)
    assert config_to_argv(DecodeConfig(model_dir=model)) == []
    assert config_to_argv(DecodeConfig(model_dir=model, enable_prefix_caching=False, max_running=3),
                          only=("enable_prefix_caching",)) == ["--no-enable-prefix-caching"]
    assert config_to_argv(CoordinatorConfig(model_dir=model, api_key="-k")) == ["--api-key=-k"]


def test_a_value_no_flag_spells_is_refused():
    @dataclasses.dataclass
    class Settings:
        names: tuple[str, ...] = ("a",)
        limit: int | None = 4

    assert config_to_argv(Settings(names=("b", "c"), limit=5)) == ["--names", "b", "c", "--limit", "5"]
    with pytest.raises(ValueError, match=r"--limit: None has no spelling on the command line \(its default is 4\)"):
        config_to_argv(Settings(limit=None))
    with pytest.raises(ValueError, match=r"--names: \(\) has no spelling"):
        config_to_argv(Settings(names=()))


UP_COMMAND_LINES = [
    [],
    ["--served-model-name", "tiny", "alias", "--max-model-len", "256", "--http-port", "8123", "--chat-template", "x",
     "--stall-timeout", "5", "--ttft-budget", "2"],
    ["--dtype", "float32", "--kv-cache-dtype", "fp8", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5",
     "--tensor-parallel-size", "2", "--expert-parallel-size", "2", "--enforce-eager", "--compile-before-serving",
     "all"],
    ["--quantization", "int8", "--prefill-weight-dtype", "fp8", "--kv-dtype", "int8", "--cpu-matmul", "float32",
     "--compilation-cache", "none", "--kv-streams", "2", "--prefill-order", "fifo", "--max-num-batched-tokens", "128",
     "--max-prefill-chunk", "64", "--prefix-cache-bytes", "0", "--kv-cache-memory", "1GiB", "--decode-device", "cpu"],
    ["--decode-engine", "vllm", "--decode-weight-dtype", "bfloat16", "--compile-cache-dir", "/shared/jax-cache"],
    ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'],
    ["--kv-events-config", '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5600", "topic": "kv@{worker}"}',
     "--prefix-caching-hash-algo", "sha256_cbor"],
    ["--kv-offloading-backend", "native", "--kv-offloading-size", "0.5", "--kv-offloading-disk-path", "/var/kv",
     "--kv-offloading-disk-size", "2", "--kv-offloading-shared-path", "/mnt/kv", "--kv-offloading-shared-size", "8"],
]


@pytest.mark.parametrize("up_argv", UP_COMMAND_LINES, ids=lambda argv: " ".join(argv[:2]) or "defaults")
def test_pdserve_up_hands_each_tier_the_config_it_built(tiny_model, up_argv):
    """The argv `pdserve up` starts each tier with parses, by that tier's own command, to the config up built."""
    model = tiny_model("llama")
    args = _parse("up", "--model", str(model), *up_argv)
    tiers = cli._tier_configs(args, cli._resolve_model(args), args.http_port)
    for role, config in zip(("coordinator", "prefill", "decode"), tiers):
        argv = ["--model", str(model), *config_to_argv(config), "--port", "0"]  # the launcher's port
        assert _parsed(role, type(config), argv) == dataclasses.replace(config, port=0), (role, argv)
    coordinator, prefill, decode = tiers
    if "--decode-engine" in up_argv:
        assert (decode.engine, decode.block_size, decode.weight_dtype) == ("vllm", cli.VLLM_BLOCK_SIZE, "bfloat16")
    if "--compile-cache-dir" in up_argv:  # one directory for every prefill worker (its canonical spelling)
        assert config_to_argv(prefill)[-2:] == ["--compilation-cache", "/shared/jax-cache"]
    if "--quantization" in up_argv:  # vLLM's spelling quantizes both tiers, over --prefill-weight-dtype
        assert (prefill.weight_dtype, decode.weight_dtype) == ("int8", "int8")
        assert (decode.kv_dtype, decode.device) == ("int8", "cpu")
    if "--dtype" in up_argv:
        assert (prefill.tensor_parallel_size, decode.tensor_parallel_size, decode.max_running) == (2, 1, 8)
        assert prefill.expert_parallel_size == 2
        assert (decode.kv_dtype, prefill.compile_before_serving) == ("fp8_e4m3", "all")
    if "--speculative-config" in up_argv:
        assert decode.speculative is not None and (decode.speculative.num_speculative_tokens,
                                                   decode.speculative.prompt_lookup_max) == (4, 3)
    if "--kv-events-config" in up_argv:  # both tiers publish; each worker binds its own ports (the launcher)
        assert prefill.kv_events == decode.kv_events and decode.kv_events.topic == "kv@{worker}"
        assert prefill.prefix_caching_hash_algo == decode.prefix_caching_hash_algo == "sha256_cbor"
        argv = launcher.kv_events_args(config_to_argv(decode), 2)
        mine = json.loads(argv[argv.index("--kv-events-config") + 1])
        assert (mine["endpoint"], mine["replay_endpoint"]) == ("tcp://*:5559", "tcp://*:5602")
    if "--kv-offloading-size" in up_argv:  # both worker tiers; each worker its own disk directory, one shared
        for tier in (prefill, decode):
            assert (tier.kv_offloading_size, tier.kv_offloading_disk_size, tier.kv_offloading_shared_size) == (0.5, 2, 8)
            assert (tier.kv_offloading_disk_path, tier.kv_offloading_shared_path) == ("/var/kv", "/mnt/kv")
        argv = launcher.offloading_args(config_to_argv(decode), "decode-1")
        assert argv[argv.index("--kv-offloading-disk-path") + 1] == "/var/kv/decode-1"
        assert argv[argv.index("--kv-offloading-shared-path") + 1] == "/mnt/kv"
    if "--served-model-name" in up_argv:
        assert all(t.served_model_name == ("tiny", "alias") and t.max_model_len == 256 for t in tiers)
        assert (coordinator.http_port, coordinator.stall_timeout, coordinator.ttft_budget) == (8123, 5.0, 2.0)


def test_pdserve_up_refuses_what_a_tier_would_in_its_own_spelling(tiny_model):
    args = _parse("up", "--model", str(tiny_model("llama")), "--decode-device", "tpu")
    with pytest.raises(ValueError, match="--decode-device takes auto, cpu, cuda or cuda:N, not 'tpu'"):
        cli._tier_configs(args, cli._resolve_model(args), None)
