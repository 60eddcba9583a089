"""KvIndex from hand-built event batches: exact prefixes per worker and medium, removal, clear, sequence gaps filled
by replay or resynced, restarts, and the memory bound."""

from __future__ import annotations

from pdserve.kvcache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pdserve.server.coordinator.kv_index import KvIndex, key

H = [bytes([i]) * 32 for i in range(1, 9)]
"""Eight 32-byte block hashes, one chain: H[0] the first block."""


def stored(hashes: list[bytes], medium: str | None = "GPU", parent: bytes | None = None, as_int: bool = True):
    return BlockStored(block_hashes=[key(h) if as_int else h for h in hashes],
                       parent_block_hash=None if parent is None else key(parent), token_ids=[0] * 16 * len(hashes),
                       block_size=16, lora_id=None, medium=medium, lora_name=None)


def removed(hashes: list[bytes], medium: str | None = "GPU"):
    return BlockRemoved(block_hashes=[key(h) for h in hashes], medium=medium)


def batch(*events, ts: float = 1.0) -> KVEventBatch:
    return KVEventBatch(ts=ts, events=list(events))


class Replays:
    """A publisher's replay buffer: the batches kept from `first` on; records what was asked."""

    def __init__(self, batches: list[KVEventBatch], first: int = 0, answers: bool = True) -> None:
        self.batches, self.first, self.answers = batches, first, answers
        self.asked: list[int] = []

    def __call__(self, start: int):
        self.asked.append(start)
        if not self.answers:
            return None
        return [(s, b) for s, b in enumerate(self.batches) if s >= max(start, self.first)]


def _index(*workers: str) -> KvIndex:
    index = KvIndex()
    for w in workers:
        index.track(w, "decode", 16)
    return index


def test_stored_blocks_give_each_worker_its_exact_prefix_and_media():
    index = _index("d0", "d1")
    index.snapshot("d0", Replays([]))
    index.snapshot("d1", Replays([]))
    index.receive("d0", 0, batch(stored(H[:3])), None)
    index.receive("d1", 0, batch(stored(H[:1]), stored(H[1:2], medium=None, parent=H[0], as_int=False)), None)
    index.receive("d1", 1, batch(stored(H[:2], medium="CPU")), None)
    assert index.longest_prefix("d0", H[:5]) == (3, [("GPU",)] * 3)
    assert index.longest_prefix("d1", H[:5]) == (2, [("GPU", "CPU"), ("GPU", "CPU")])
    assert index.longest_prefix("d0", H[1:3]) == (2, [("GPU",)] * 2)  # any hash: chained hashes name a prefix
    assert index.longest_prefix("d0", [H[5], *H[:3]]) == (0, [])  # the first block missing: nothing usable
    assert index.longest_prefix("unknown", H) == (0, [])
    assert index.num_blocks() == 5 and index.state("d0") == "live"


def test_removed_takes_a_block_off_one_medium_and_a_hole_ends_the_prefix():
    index = _index("d0")
    index.snapshot("d0", Replays([]))
    index.receive("d0", 0, batch(stored(H[:4]), stored(H[:2], medium="DISK")), None)
    index.receive("d0", 1, batch(removed(H[:1]), removed(H[2:3])), None)
    assert index.longest_prefix("d0", H[:4]) == (2, [("DISK",), ("GPU", "DISK")])  # H[0] left on disk only
    index.receive("d0", 2, batch(removed(H[:2], medium="DISK")), None)
    assert index.longest_prefix("d0", H[:4]) == (0, [])
    assert index.num_blocks("d0") == 2  # H[1] (GPU) and H[3] (GPU) remain, behind holes
    index.receive("d0", 3, batch(removed([H[7]], medium="CPU")), None)  # a block never stored: nothing happens
    assert index.num_blocks("d0") == 2


def test_all_blocks_cleared_empties_one_worker_only():
    index = _index("d0", "p0")
    for w in ("d0", "p0"):
        index.snapshot(w, Replays([]))
        index.receive(w, 0, batch(stored(H[:2])), None)
    index.receive("d0", 1, batch(AllBlocksCleared(), stored(H[4:5])), None)
    assert index.longest_prefix("d0", H[:2]) == (0, [])
    assert index.longest_prefix("d0", H[4:5]) == (1, [("GPU",)])
    assert index.longest_prefix("p0", H[:2]) == (2, [("GPU",)] * 2)


def test_snapshot_reads_the_replay_buffer_so_a_late_reader_converges():
    history = [batch(stored(H[:3])), batch(removed(H[2:3])), batch(stored(H[2:3], medium="CPU"))]
    replays = Replays(history)
    late = _index("d0")
    assert late.snapshot("d0", replays) == "live" and replays.asked == [0]
    assert late.longest_prefix("d0", H[:3]) == (3, [("GPU",), ("GPU",), ("CPU",)])
    late.receive("d0", 2, history[2], replays)  # seen live too: applied already, skipped
    late.receive("d0", 3, batch(removed(H[:1])), replays)
    assert late.longest_prefix("d0", H[:3]) == (0, []) and replays.asked == [0]


def test_a_gap_asks_the_replay_endpoint_for_the_missing_range():
    history = [batch(stored(H[:1])), batch(stored(H[1:2])), batch(removed(H[:1])), batch(stored(H[:1], medium="CPU")),
               batch(stored(H[2:3]))]
    replays = Replays(history)
    index = _index("d0")
    index.snapshot("d0", Replays([]))  # joined before anything was published
    index.receive("d0", 0, history[0], replays)
    index.receive("d0", 3, history[3], replays)  # 1 and 2 lost on the way
    assert replays.asked == [1]
    assert index.longest_prefix("d0", H[:3]) == (3, [("CPU",), ("GPU",), ("GPU",)])  # 1..4 applied, in order
    index.receive("d0", 4, history[4], replays)  # came in the replay: skipped
    assert index.state("d0") == "live" and index.views["d0"].next_seq == 5


def test_a_gap_the_replay_cannot_fill_resyncs_to_a_partial_view():
    history = [batch(stored(H[:2])), batch(removed(H[:1])), batch(stored(H[4:5])), batch(stored(H[5:6]))]
    index = _index("d0", "d1", "d2")
    for w in ("d0", "d1", "d2"):
        index.snapshot(w, Replays([]))
        index.receive(w, 0, history[0], None)
    gone = Replays(history, first=2)  # the buffer moved past batch 1
    index.receive("d0", 2, history[2], gone)
    assert gone.asked == [1]
    # emptied (the lost batch removed H[0], which the view would have kept), then what the buffer held applied
    assert index.longest_prefix("d0", H[:2]) == (0, []) and index.num_blocks("d0") == 2
    assert index.longest_prefix("d0", H[4:6]) == (2, [("GPU",)] * 2) and index.views["d0"].next_seq == 4
    assert index.state("d0") == "partial"
    index.receive("d1", 3, history[3], None)  # no replay endpoint at all
    assert index.num_blocks("d1") == 1 and index.state("d1") == "partial"
    silent = Replays(history, answers=False)
    index.receive("d2", 2, history[2], silent)
    assert silent.asked == [1] and index.num_blocks("d2") == 1 and index.state("d2") == "partial"
    index.receive("d0", 4, batch(AllBlocksCleared()), None)  # the worker emptied its cache: exact again
    assert index.state("d0") == "live" and index.num_blocks("d0") == 0


def test_a_snapshot_past_the_buffer_start_is_partial_and_none_waits_for_sequence_zero():
    history = [batch(stored(H[:1])), batch(stored(H[1:2])), batch(stored(H[2:3]))]
    index = _index("d0", "d1", "d2")
    assert index.snapshot("d0", Replays(history, first=1)) == "partial"
    assert index.longest_prefix("d0", H[1:3]) == (2, [("GPU",)] * 2)
    assert index.snapshot("d1", None) == "syncing"  # no replay endpoint: the first batch decides
    index.receive("d1", 0, history[0], None)
    assert index.state("d1") == "live"
    index.snapshot("d2", None)
    index.receive("d2", 1, history[1], None)
    assert index.state("d2") == "partial" and index.longest_prefix("d2", H[1:2]) == (1, [("GPU",)])


def test_reset_and_drop_bound_what_a_worker_leaves_behind():
    index = KvIndex(max_blocks=3)
    index.track("d0", "decode", 16)
    index.snapshot("d0", Replays([]))
    index.receive("d0", 0, batch(stored(H[:5])), None)
    assert index.num_blocks("d0") == 3 and index.overflowed == 2
    assert index.longest_prefix("d0", H[2:5]) == (3, [("GPU",)] * 3)  # the oldest stored went first
    index.reset("d0")  # its publisher restarted: a new sequence from 0
    assert index.num_blocks("d0") == 0 and index.state("d0") == "syncing"
    index.receive("d0", 0, batch(stored(H[:1])), None)
    assert index.state("d0") == "live" and index.num_blocks("d0") == 1
    index.drop("d0")
    assert index.num_blocks() == 0 and index.views == {}
    index.receive("d0", 1, batch(stored(H[:1])), None)  # a straggler of a worker that left: ignored
    assert index.views == {}


def test_corrupt_batch_resyncs():
    index = _index("d0")
    index.snapshot("d0", Replays([]))
    index.receive("d0", 0, batch(stored(H[:2])), None)
    index.corrupt("d0", 1)
    assert index.state("d0") == "partial" and index.num_blocks("d0") == 0
    index.receive("d0", 2, batch(stored(H[:1])), None)
    assert index.longest_prefix("d0", H[:2]) == (1, [("GPU",)])
