"""vLLM's LoRA flags on `pdserve up` and its tiers: both `--lora-modules` forms, vLLM's allowed ranks, and each tier
handed its own settings."""

from __future__ import annotations

import json

import pytest

from pdserve.server import cli
from pdserve.server.flags import config_to_argv
from pdserve.server.lora_config import LoraModule, parse_lora_modules


def test_lora_modules_parse_as_vllm_reads_them():
    specs = ("ada=/a", json.dumps({"name": "bob", "path": "/b", "base_model_name": "llama"}), "")
    assert parse_lora_modules(specs) == (LoraModule("ada", "/a"), LoraModule("bob", "/b", "llama"))
    with pytest.raises(ValueError, match="Invalid JSON format for --lora-modules: a,b"):
        parse_lora_modules(("a,b",))
    with pytest.raises(ValueError, match="Invalid fields for --lora-modules"):
        parse_lora_modules(('{"name": "a", "path": "/a", "rank": 3}',))
    with pytest.raises(ValueError, match="names an adapter twice: a"):
        parse_lora_modules(("a=/x", "a=/y"))


def test_pdserve_up_hands_each_tier_its_lora_settings(tiny_model):
    model = str(tiny_model("llama"))
    bob = json.dumps({"name": "bob", "path": "/b"})
    args = cli.build_parser().parse_args(
        ["up", "--model", model, "--enable-lora", "--lora-modules", "ada=/a", bob, "--max-loras", "2",
         "--max-cpu-loras", "4", "--max-lora-rank", "64", "--lora-dtype", "bfloat16"])
    coordinator, prefill, decode = cli._tier_configs(args, cli._resolve_model(args), None)
    assert (coordinator.enable_lora, coordinator.lora_modules, coordinator.max_lora_rank) == (True, ("ada=/a", bob), 64)
    assert (decode.enable_lora, decode.max_loras, decode.cpu_loras, decode.max_lora_rank, decode.lora_dtype) == \
        (True, 2, 4, 64, "bfloat16")
    for worker in (prefill, decode):  # both worker tiers compute with the adapters
        assert (worker.enable_lora, worker.max_loras, worker.cpu_loras, worker.max_lora_rank, worker.lora_dtype) == \
            (True, 2, 4, 64, "bfloat16")
        argv = config_to_argv(worker)
        assert "--max-cpu-loras" in argv and "--enable-lora" in argv and "--lora-modules" not in argv
    assert config_to_argv(coordinator)[-6:] == ["--enable-lora", "--lora-modules", "ada=/a", bob, "--max-lora-rank",
                                                "64"]
    assert "--max-cpu-loras" in config_to_argv(decode) and "--lora-modules" not in config_to_argv(decode)


@pytest.mark.parametrize("argv, words", [
    (["--enable-lora", "--max-lora-rank", "12"], "--max-lora-rank must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512"),
    (["--enable-lora", "--max-loras", "3", "--max-cpu-loras", "2"], "max_cpu_loras (2) must be >= max_loras (3)."),
    (["--lora-modules", "a=/a"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--decode-engine", "vllm"], "--enable-lora is built for --engine native so far"),
])
def test_lora_settings_vllm_refuses_are_refused(tiny_model, argv, words):
    args = cli.build_parser().parse_args(["up", "--model", str(tiny_model("llama")), *argv])
    with pytest.raises(ValueError) as e:
        cli._tier_configs(args, cli._resolve_model(args), None)
    assert words in str(e.value)
