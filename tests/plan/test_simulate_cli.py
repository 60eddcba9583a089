"""`pdserve plan simulate --json`: bench's summary keys, from the installed entry point."""

from __future__ import annotations

import json
import subprocess
import sys

from pdserve.server.plan.profile import DecodeCost, HandoffCost, PrefillCost, Profile


def test_simulate_json_has_bench_keys(tmp_path):
    Profile("cpu", "tiny", PrefillCost(0.25, 0.0), DecodeCost(0.0625, 0.0), HandoffCost(0.0, 1e30, 0), 4096,
            "scripted").save(tmp_path / "p.json")
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.server.cli", "plan", "simulate", "--profile", str(tmp_path / "p.json"),
         "--input-len", "16", "--output-len", "3", "--request-rate", "8", "--arrival", "constant",
         "--num-prompts", "4", "--slo-ttft-ms", "300", "--slo-tpot-ms", "100", "--json"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert {"median", "p99"} <= set(s[key])
    # the scripted run of tests/plan/test_simulator.py: TTFTs 0.25, 0.375, 0.25, 0.375
    assert s["ttft_ms"]["median"] == 312.5
    assert s["good_requests"] == 2 and s["goodput"] == 2 / 0.875
    assert s["sim"]["utilisation"] == {"prefill-0": 0.75 / 0.875, "decode-0": 0.4375 / 0.875}  # 7 steps: r1 and r2 share two


def test_simulate_refuses_a_missing_rate(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pdserve.server.cli", "plan", "simulate", "--profile", "x.json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "give --request-rate" in out.stderr


def test_baseline_is_colocated_on_as_many_workers(tmp_path):
    """The scripted run of test_simulator.py (disaggregated TTFTs 0.25, 0.375, 0.25, 0.375) beside colocated
    serving on 2 workers: r0 (0) and r2 (0.25) land on worker 0, r1 (0.125) and r3 (0.375) on worker 1 (most
    free blocks counting the coordinator's reservations, then the first). r0 and r1 prefill alone: 0.25 s.
    r2 arrives as r0's step ends and joins the next step with r0's first decode: 1/16 + 1/4, TTFT 0.3125 s;
    r3 likewise beside r1's: 0.3125 s."""
    from pdserve.server.plan import simulate_cli

    Profile("cpu", "tiny", PrefillCost(0.25, 0.0), DecodeCost(0.0625, 0.0), HandoffCost(0.0, 1e30, 0), 4096,
            "scripted").save(tmp_path / "p.json")
    args = simulate_cli.build_parser().parse_args(
        ["--profile", str(tmp_path / "p.json"), "--input-len", "16", "--output-len", "3", "--request-rate", "8",
         "--arrival", "constant", "--num-prompts", "4", "--baseline", "--decode-policy", "most-free-blocks"])
    s = simulate_cli.run(args)
    assert s["ttft_ms"]["median"] == 312.5
    base = s["baseline_colocated"]
    assert base["cluster"] == {"prefill_workers": 0, "decode_workers": 2, "colocated": True, "decode_hardware": "cpu"}
    assert base["completed"] == 4
    assert base["ttft_ms"]["median"] == 281.25 and base["ttft_ms"]["p99"] == 312.5


def test_host_and_dtype_flags_are_checked(tmp_path):
    import pytest

    from pdserve.server.plan import simulate_cli

    Profile("cpu", "tiny", PrefillCost(0.25, 0.0), DecodeCost(0.0625, 0.0), HandoffCost(0.0, 1e30, 0), 4096,
            "scripted").save(tmp_path / "p.json")
    base = ["--profile", str(tmp_path / "p.json"), "--input-len", "16", "--output-len", "3", "--request-rate", "8",
            "--arrival", "constant", "--num-prompts", "4"]
    for flags, message in ((["--host-cores", "0"], "host cores must be > 0"),
                           (["--host-cores", "2", "--external-cores", "-1"], "external_cores must be a finite number"),
                           (["--external-cores", "1"], "--external-cores and --placement need --host-cores"),
                               (["--placement", "prefill=0,decode=1,coordinator=0,client=0"], "--placement need --host-cores"),
                               (["--host-cores", "2", "--placement", "prefill=0,decode=2,coordinator=0,client=0"],
                                "decode's core must be an integer in \\[0, cores\\)"),
                           (["--kv-dtype", "int8"], "measured decode at weight/KV dtypes auto/auto, not auto/int8")):
        with pytest.raises(ValueError, match=message):
            simulate_cli.run(simulate_cli.build_parser().parse_args([*base, *flags]))
    # 2 cores for a prefill and a decode worker of one thread each (no front CPU in the profile): each gets a
    # core, the scripted run's TTFTs stand; on 1 core the steps that overlap stretch
    two = simulate_cli.run(simulate_cli.build_parser().parse_args([*base, "--host-cores", "2"]))
    one = simulate_cli.run(simulate_cli.build_parser().parse_args([*base, "--host-cores", "1"]))
    assert two["ttft_ms"]["median"] == 312.5 and two["cluster"]["decode_dtypes"] == "auto/auto"
    assert one["ttft_ms"]["median"] > 312.5
