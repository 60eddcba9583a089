"""benchmarks.window_kv: a windowed model's KV bytes per request fall with the window, within the bound."""

from __future__ import annotations

from pdserve.benchmarks import window_kv


async def test_a_prompt_of_4x_the_window_sends_the_global_share_and_one_window_per_local_layer():
    rows = await window_kv.rows([32, 64], num_layers=4, kv_heads=2, head_dim=16, block_size=16)
    assert len(rows) == 4
    for r in rows:
        assert r.bytes_sent <= r.bound < r.bytes_all_global
    by = {(r.shape.split()[0], r.window): r for r in rows}
    per_layer_token = 2 * 2 * 16 * 2  # K and V, 2 heads x 16 dims, bf16
    # Every layer windowed: one window (W tokens: 4W - 3W of whole blocks) of 4 layers = a quarter.
    assert by["all", 64].bytes_sent == 4 * 64 * per_layer_token and by["all", 64].ratio == 0.25
    # Alternating: 2 global layers whole + 2 local layers one window each.
    assert by["local/global", 32].bytes_sent == (2 * 128 + 2 * 32) * per_layer_token
