"""A grammar child whose parent goes away (it stopped, or gave up on a job and closed the socket) exits quietly:
no traceback in the serving process's log, which the child's stderr is."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import pytest


def start_child() -> tuple[subprocess.Popen, Connection]:
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-m", "pdserve.server.structured.child", str(theirs.fileno())],
                             pass_fds=[theirs.fileno()], stderr=subprocess.PIPE, text=True)
    theirs.close()
    return child, Connection(ours.detach())


@pytest.mark.parametrize("when", ["before init", "during a job"])
def test_a_child_whose_parent_is_gone_exits_without_a_traceback(when):
    child, conn = start_child()
    if when == "during a job":
        conn.send(("init", None, 0, ()))
        assert conn.recv() == ("ready", None)
        conn.send((time.sleep, (0.5,)))
    conn.close()
    _, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    assert "Traceback" not in err, err
