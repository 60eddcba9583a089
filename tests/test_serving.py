"""serving.run: the server's loop, then every object left frozen out of the garbage collector (the exit of a
stopped worker then skips collecting its heap)."""

from __future__ import annotations

import gc

import pytest

from pdserve.server import serving


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_run_freezes_what_is_left_once_the_loop_has_stopped(unfrozen):
    ran = []

    async def main() -> None:
        ran.append(gc.get_freeze_count())

    serving.run(main)
    assert ran == [0]  # nothing frozen while the server runs
    assert gc.get_freeze_count() > 0


def test_a_ctrl_c_ends_the_loop_cleanly_and_freezes_too(unfrozen):
    async def main() -> None:
        raise KeyboardInterrupt

    serving.run(main)
    assert gc.get_freeze_count() > 0
