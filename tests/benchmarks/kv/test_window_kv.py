"""benchmarks.kv.window: a windowed model's KV bytes per request fall with the window, within the bound."""

from __future__ import annotations

from pdserve.benchmarks.kv import window as window_kv


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


async def test_a_windowed_sequence_holds_a_window_of_decode_cache_blocks_and_more_of_them_fit():
    rows = await window_kv.cache_rows([32], num_layers=4, block_size=16, cache_blocks=64, multiples=(1, 4))
    got = [(r.shape.split()[0], r.context_tokens, r.blocks_held, r.blocks_all_global, r.max_sequences,
            r.max_sequences_all_global) for r in rows]
    assert got == [
        ("all", 32, 2, 2, 32, 32),  # within the window: every block
        ("all", 128, 2, 8, 32, 8),  # 4x the window: the window's 2 blocks, so 4x the sequences fit
        ("local/global", 32, 2, 2, 32, 32),
        ("local/global", 128, 8, 8, 8, 8),  # global layers read every block: nothing is dropped
    ]
