"""A local OpenAI-compatible judge for the chaos run: deterministic scores (a function of the
rated text), and outages on demand (HTTP 503 until a deadline), so that a judge that stops
answering meets the run wherever it happens to be.

The pieces every stand-in judge needs (the chaos run's and the tests', tests/trainer/
judge_server.py) live here once: :class:`JSONHandler` (a quiet handler that reads and sends
JSON), :func:`chat_reply` (the score a stand-in gives a message) and :func:`threaded_server`
(a server on a free local port whose close joins its handler threads)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JSONHandler(BaseHTTPRequestHandler):
    """Request handler with JSON in and out, and no access log on stderr."""

    def log_message(self, *args):  # quiet
        pass

    def read_json(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")

    def send_json(self, data: bytes, code: int = 200) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def chat_reply(body: dict, text: str | None = None) -> bytes:
    """A chat completion answering ``body``: ``text``, or by default a score that depends on
    every character of the first message (so the samples of a group differ)."""
    if text is None:
        text = f"Score: {sum(map(ord, body['messages'][0]['content'])) % 7}"
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()


def threaded_server(handler: type[BaseHTTPRequestHandler], name: str) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """A server on 127.0.0.1 (a free port) and the (unstarted) thread that serves it;
    ``server_close`` joins the handler threads."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = False
    server.block_on_close = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=name)
    return server, thread


class ChaosJudge:
    """``with ChaosJudge() as judge``: serves ``judge.url`` on 127.0.0.1 from a thread,
    stopped and joined on exit; :meth:`outage` takes it down for a while."""

    def __init__(self):
        self._down_until = 0.0
        self.requests = 0
        self.refused = 0
        self._lock = threading.Lock()
        owner = self

        class Handler(JSONHandler):
            def do_POST(self):
                body = self.read_json()
                with owner._lock:
                    owner.requests += 1
                    down = time.monotonic() < owner._down_until
                    owner.refused += down
                if down:
                    return self.send_json(b'{"error": "chaos: the judge is down"}', 503)
                self.send_json(chat_reply(body))

        self.server, self.thread = threaded_server(Handler, "chaos-judge")

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


__all__ = ["ChaosJudge", "JSONHandler", "chat_reply", "threaded_server"]
