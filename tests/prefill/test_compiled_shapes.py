"""Steps pack only into compiled shapes (shapes.py `CompiledShapes`, the scheduler's `token_room`): with some
shapes still compiling, a prompt is cut into the chunks a compiled shape holds and its context pads to a
compiled bucket; the exact steps and shapes for given compiled sets, by hand."""

from __future__ import annotations

import threading

from pdserve.server.prefill.scheduler import PrefillScheduler, Segment, packed_tokens
from pdserve.server.prefill.shapes import CompiledShapes, StepShape, prompt_shapes

from .jobs import Clock, Job, bucket

TOKENS = [16, 32, 64, 128, 256, 512]
CONTEXTS = [0, 256, 1024]
NO_CONTEXT = [StepShape(t, 0) for t in TOKENS]


def steps(compiled: CompiledShapes, *jobs: Job) -> list[tuple[list[str], StepShape | None]]:
    """Each step's segments (name[start:end]) and the compiled shape it packs into, fifo, until all ran."""
    s = PrefillScheduler("fifo", bucket=bucket, max_batch_size=4, max_batch_tokens=512, clock=Clock(),
                         max_context=1024, token_room=compiled.room)
    for job in jobs:
        s.add(job)
    out = []
    while step := s.next_step():
        shape = compiled.step_shape(packed_tokens(step), sum(g.start for g in step))
        out.append(([f"{g.job.name}[{g.start}:{g.end}]" for g in step], shape))
        run(step)
        s.finish(step)
    return out


def run(step: list[Segment[Job]]) -> None:
    for g in step:
        g.job.computed = g.end


def test_the_room_and_shape_of_a_step_come_from_the_compiled_shapes_alone():
    compiled = CompiledShapes([*NO_CONTEXT, StepShape(64, 1024)], [(8, 1024)])
    assert [compiled.room(c) for c in (0, 1, 256, 1024, 1025)] == [512, 64, 64, 64, 0]
    assert compiled.step_shape(40, 0) == StepShape(64, 0)
    assert compiled.step_shape(40, 100) == StepShape(64, 1024)  # context padded to the compiled bucket
    assert compiled.step_shape(65, 100) is None
    compiled.add(StepShape(128, 256))
    assert [compiled.room(c) for c in (0, 1, 256, 257)] == [512, 128, 128, 64]
    assert compiled.step_shape(40, 100) == StepShape(64, 1024)  # fewest token slots first
    assert compiled.step_shape(65, 100) == StepShape(128, 256)
    assert compiled.penalized_shape(1, 40) == (8, 1024)  # rows and prompts padded
    compiled.add((1, 64))
    compiled.add((2, 64))
    assert [compiled.penalized_shape(*p) for p in ((1, 40), (2, 64), (4, 64), (1, 65))] == [
        (1, 64), (2, 64), (8, 1024), (8, 1024)]
    assert compiled.penalized_shape(16, 16) is None


def test_a_cached_prefix_and_a_fresh_prompt_pack_into_the_first_set_then_into_the_grid():
    first_set = CompiledShapes([*NO_CONTEXT, StepShape(64, 1024)])
    # the cached prompt reads its 160-token prefix: only 64 token slots hold a context, so it runs in
    # 64-token chunks, and the fresh prompt beside it gets what is left of 64
    assert steps(first_set, Job("cached", 300, computed=160), Job("fresh", 100)) == [
        (["cached[160:224]"], StepShape(64, 1024)),
        (["cached[224:288]"], StepShape(64, 1024)),
        (["cached[288:300]", "fresh[0:48]"], StepShape(64, 1024)),
        (["fresh[48:100]"], StepShape(64, 1024)),
    ]
    assert steps(first_set, Job("fresh", 100), Job("other", 300)) == [  # no context: any token bucket
        (["fresh[0:100]", "other[0:300]"], StepShape(512, 0))]
    every = CompiledShapes.every(TOKENS, CONTEXTS, [1, 2, 4], [16, 32])
    assert steps(every, Job("cached", 300, computed=160), Job("fresh", 100)) == [
        (["cached[160:300]", "fresh[0:100]"], StepShape(256, 256))]
    grown = CompiledShapes([*NO_CONTEXT, StepShape(64, 1024), StepShape(256, 1024)])
    assert steps(grown, Job("cached", 300, computed=160), Job("fresh", 100)) == [
        (["cached[160:300]", "fresh[0:100]"], StepShape(256, 1024))]


def test_a_context_no_compiled_shape_holds_waits_and_blocks_never_split():
    compiled = CompiledShapes([*NO_CONTEXT, StepShape(16, 1024)])
    big_blocks = Job("big", 100, computed=64, block_size=32)  # 16 slots hold no whole 32-token block
    assert steps(compiled, big_blocks) == []
    compiled.add(StepShape(32, 256))
    assert steps(compiled, big_blocks) == [(["big[64:96]"], StepShape(32, 256)), (["big[96:100]"], StepShape(32, 256))]


def test_a_prompt_asks_for_the_shapes_it_would_run_alone_with_every_shape_compiled():
    assert prompt_shapes(300, 160, 512, TOKENS, CONTEXTS) == [StepShape(256, 256)]
    assert prompt_shapes(1000, 0, 256, TOKENS, CONTEXTS) == [
        StepShape(256, 0), StepShape(256, 256), StepShape(256, 1024), StepShape(256, 1024)]
    assert prompt_shapes(5, 0, 512, TOKENS, CONTEXTS) == [StepShape(16, 0)]


def test_compiles_finishing_on_many_threads_at_once_all_land():
    compiled = CompiledShapes()
    shapes = [StepShape(t, c) for t in range(1, 201) for c in (0, 256)]
    threads = [threading.Thread(target=lambda part=shapes[i::8]: [compiled.add(s) for s in part]) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compiled.steps == set(shapes) and compiled.room(1) == compiled.room(256) == 200
