"""A local OpenAI-compatible judge for the chaos run: deterministic scores (a function of the
rated text), and outages on demand (HTTP 503 until a deadline), so that a judge that stops
answering meets the run wherever it happens to be."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ChaosJudge:
    """``with ChaosJudge() as judge``: serves ``judge.url`` on 127.0.0.1 from a thread,
    stopped and joined on exit; :meth:`outage` takes it down for a while."""

    def __init__(self):
        self._down_until = 0.0
        self.requests = 0
        self.refused = 0
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with owner._lock:
                    owner.requests += 1
                    down = time.monotonic() < owner._down_until
                    owner.refused += down
                if down:
                    return self._send(503, b'{"error": "chaos: the judge is down"}')
                content = body["messages"][0]["content"]
                text = f"Score: {sum(map(ord, content)) % 7}"
                self._send(200, json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode())

            def _send(self, code: int, data: bytes):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = False
        self.server.block_on_close = True  # server_close joins the handler threads
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="chaos-judge")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def outage(self, seconds: float) -> None:
        """Answer 503 for the next ``seconds``."""
        with self._lock:
            self._down_until = time.monotonic() + seconds

    def __enter__(self) -> "ChaosJudge":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


__all__ = ["ChaosJudge"]
