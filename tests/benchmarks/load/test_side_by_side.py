"""The side-by-side's start-up record: seconds to ready per system and, for pdserve, until its prefill
worker compiled every shape (read from its metrics while it serves)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pdserve.benchmarks.servers import CompileWatch, pending_compiles
from pdserve.benchmarks.load.side_by_side import ROWS, startup, table


def test_startup_is_seconds_from_the_start():
    assert startup(100.0, 12.34, 130.06) == {"ready_s": 12.3, "all_compiled_s": 30.1}
    assert startup(100.0, 81.0, None) == {"ready_s": 81.0, "all_compiled_s": None}


def test_the_table_has_a_ready_row_per_system():
    results = {"vllm": [{"startup": startup(0.0, 81.0, None)}, {"startup": startup(0.0, 79.0, None)}],
               "pdserve": [{"startup": startup(0.0, 40.0, 120.0)}, {"startup": startup(0.0, 20.0, 30.0)}]}
    lines = table(results, ROWS, ["vllm", "pdserve"]).splitlines()
    assert lines[2] == "| ready after (s) | 80.0 [79.0-81.0] | 30.0 [20.0-40.0] | 0.373 [0.253-0.494] |"
    assert lines[3] == "| prefill: every shape compiled after (s) | - | 75.0 [30.0-120] | - |"
    assert len(lines) == 4


class _Metrics(BaseHTTPRequestHandler):
    pending = 3.0

    def do_GET(self):  # noqa: N802 - http.server's name
        body = ("# TYPE pdserve_prefill_compiles_pending gauge\n"
                f'pdserve_prefill_compiles_pending{{model_name="m",role="prefill"}} {_Metrics.pending}\n').encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_compile_watch_records_when_the_prefill_worker_reads_no_compile_pending():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        assert pending_compiles(url) == 3.0
        watch = CompileWatch(url, period=0.05)
        time.sleep(0.3)
        assert watch.done_at is None
        _Metrics.pending = 0.0
        before = time.monotonic()
        for _ in range(100):
            if watch.done_at is not None:
                break
            time.sleep(0.05)
        assert watch.done_at is not None and watch.done_at >= before
    finally:
        server.shutdown()
    assert pending_compiles(url) is None  # nobody serves it: not an error
