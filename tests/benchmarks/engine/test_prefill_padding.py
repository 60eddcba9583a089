"""benchmarks/engine/prefill.py's padding probe: one packed step of mixed lengths through the served engine."""

from __future__ import annotations

from pdserve.benchmarks.engine.prefill import padding_probe, padding_table


def test_mixed_prompts_pack_into_one_step_with_the_padding_of_its_buffer(tiny_model):
    result = padding_probe(tiny_model("llama"), [40, 8, 8, 8])
    # one step: segments start on 16-token blocks (48 + 3 x 16 = 96), the buffer a power of two (128)
    assert result["steps"] == 1 and result["slots"] == 128 and result["tokens"] == 64
    assert result["padding_share"] == 1 - 64 / 128
    assert result["old_slots"] == 4 * 64 and result["old_padding_share"] == 1 - 64 / 256
    assert "| 40 + 8 + 8 + 8 | 64 | 128 | 0.500 | 256 | 0.750 |" in padding_table(result)
