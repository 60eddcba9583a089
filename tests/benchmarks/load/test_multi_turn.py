"""`benchmarks/load/multi_turn.py`: its conversations built exactly, and a tiny real run on pdserve with the embedded
model (2 conversations x 2 turns): the rows exist and the second turn computes less than its prompt."""

from __future__ import annotations

import json

from pdserve.benchmarks.load import multi_turn, multi_turn_workload as workload

IDS = list(range(10, 500)) * 4


def test_conversations_share_only_the_system_prompt_and_fit_the_model():
    shape = workload.Shape("synthetic", system=20, user=5, answer=7)
    convs = workload.build(shape, 3, 10, 60, IDS, seed=1)
    assert [len(c.turns) for c in convs] == [3, 3, 3]  # 20 + 3 * 12 = 56 fits 60, a fourth turn does not
    assert convs[0].system_ids == convs[1].system_ids == convs[2].system_ids and len(convs[0].system_ids) == 20
    assert convs[0].turns[0].new_ids != convs[1].turns[0].new_ids
    assert [c.prompt_len(2) for c in convs] == [20 + 2 * 12 + 5] * 3
    assert [c.start_s for c in convs] == [0.0, 0.0, 0.0]  # rate 0: one after another
    assert workload.build(shape, 3, 10, 60, IDS, seed=1) == convs  # seeded
    paced = workload.build(shape, 3, 2, 60, IDS, seed=1, rate=2.0)
    assert paced[0].start_s == 0.0 and 0 < paced[1].start_s < paced[2].start_s


def test_agentic_turns_are_tool_outputs_with_short_answers():
    shape = workload.Shape("agentic", system=30, user=8, answer=4, tool=16, think_s=0.0)
    conv = workload.build(shape, 1, 6, 512, IDS, seed=3)[0]
    assert len(conv.turns) == 6 and len(conv.turns[0].new_ids) == 8
    assert all(2 <= t.answer_len <= 6 for t in conv.turns) and all(t.think_s == 0.0 for t in conv.turns)


def test_new_tokens_is_what_no_earlier_sequence_starts_with():
    assert workload.new_tokens([1, 2, 3, 4], []) == 4
    assert workload.new_tokens([1, 2, 3, 4], [[1, 2, 9], [1, 2, 3, 7, 7]]) == 1
    assert workload.new_tokens([1, 2], [[1, 2, 3]]) == 0


def test_pdserve_counters_split_the_tiers():
    text = "\n".join([
        "# TYPE pdserve_prefill_computed_tokens counter",
        'pdserve_prefill_computed_tokens_total{model_name="m",role="prefill",engine="0"} 100.0',
        'pdserve_prefill_computed_tokens_total{model_name="m",role="decode",engine="1"} 20.0',
        "# TYPE pdserve_prefix_cache_hits counter",
        'pdserve_prefix_cache_hits_total{model_name="m",role="decode",engine="1"} 80.0',
        "# TYPE pdserve_kv_offload_hits counter",
        'pdserve_kv_offload_hits_total{model_name="m",role="decode",tier="host",engine="1"} 2.0', ""])
    assert multi_turn.counters("pdserve", text) == {"computed": 120.0, "hit:decode-host": 32.0,
                                                    "hit:decode-device": 48.0}


def test_a_tiny_run_on_pdserve(tmp_path):
    multi_turn.main(["--systems", "pdserve", "--conversations", "2", "--turns", "2", "--think-time", "0",
                     "--pdserve-args", "--compile-before-serving common", "--compile-wait", "0",
                     "--out", str(tmp_path)])
    run = json.loads((tmp_path / "results.json").read_text())["runs"][0]
    rows = sorted(run["rows"], key=lambda r: (r["conversation"], r["turn"]))
    assert [(r["conversation"], r["turn"]) for r in rows] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(r["error"] is None and r["isolated"] and r["answer_tokens"] == 48 for r in rows)
    assert [r["prompt_tokens"] for r in rows] == [160, 240, 160, 240]  # 128 system + 32 user; + 48 answer + 32
    assert [r["new_tokens"] for r in rows] == [160, 32, 32, 32]
    for r in rows:
        if r["turn"] == 2:  # the history's full blocks are cached: at most its last partial block and the new turn
            assert 32 <= r["computed"] < r["prompt_tokens"]
    assert "| pdserve | 2 |" in (tmp_path / "results.md").read_text()
