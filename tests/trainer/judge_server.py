"""A stand-in OpenAI-compatible judge for the tests: ``POST /v1/chat/completions`` on
127.0.0.1 (a free port), served by threads of the test's own process, stopped and joined
by :meth:`JudgeServer.stop` (the context manager calls it on every exit path).

It answers with a number that depends on every character of the user message (so the
samples of a group differ). From request ``after + 1`` on, a ``fault``: ``garbage`` (HTTP
200 with a body that is not JSON), ``words`` (a chat completion with no number in it),
``slow`` (holds the request until the server stops, at most :data:`SLOW_S`: far beyond any
timeout a test sets, and never waited for whole: :meth:`stop` releases it), ``stop`` (the
connection closes unanswered and the server stops itself: later requests are refused).
``hold_first=N``: the first N requests are held until ``POST /release`` arrives (at most
:data:`SLOW_S`), then answered."""

from __future__ import annotations

import threading

from portarl.bench.chaos.judge import JSONHandler, chat_reply, threaded_server

SLOW_S = 600.0


class JudgeServer:
    def __init__(self, fault: str | None = None, after: int = 0, hold_first: int = 0):
        self.fault, self.after, self.hold_first = fault, after, hold_first
        self.released = threading.Event()  # POST /release: the held requests are answered
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.release = threading.Event()  # ends a slow request's wait
        self.stopped = threading.Event()
        self.stopper: threading.Thread | None = None
        owner = self

        class Handler(JSONHandler):
            def do_POST(self):
                body = self.read_json()
                if self.path == "/release":
                    owner.released.set()
                    return self.send_json(b"{}")
                with owner.lock:
                    owner.requests.append({"path": self.path, **body})
                    count = len(owner.requests)
                if count <= owner.hold_first:
                    owner.released.wait(SLOW_S)
                fault = owner.fault if count > owner.after else None
                if fault == "stop":
                    owner.stop_soon()
                    self.close_connection = True  # no reply: the connection just closes
                    return
                if fault == "slow":
                    owner.release.wait(SLOW_S)
                    return
                if fault == "garbage":
                    return self.send_json(b"<html>502 oops</html>")
                self.send_json(chat_reply(body, "I cannot rate this." if fault == "words" else None))

        self.server, self.thread = threaded_server(Handler, "judge-server")
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop_soon(self) -> None:
        """Stop from a handler thread (it cannot join itself): a thread of its own does it."""
        with self.lock:
            if self.stopper is None:
                self.stopper = threading.Thread(target=self._stop_listening, name="judge-server-stopper")
                self.stopper.start()

    def _stop_listening(self) -> None:
        self.server.shutdown()
        self.server.socket.close()  # new connections are refused from here on
        self.stopped.set()

    def stop(self) -> None:
        self.release.set()
        self.released.set()
        self.stop_soon()
        self.stopper.join()
        self.thread.join()
        self.server.server_close()  # joins the handler threads (block_on_close)

    def __enter__(self) -> "JudgeServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
