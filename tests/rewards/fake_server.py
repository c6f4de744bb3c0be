"""A tiny HTTP server on loopback (the standard library's, in a thread) that answers what a test tells it to: the
misbehaving reward servers and the OpenAI-style judges the remote rewards are tested against."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import pytest


class FakeServer:
    """`answer(path, body, headers) -> (status, text)` answers every POST (None: the connection closes unanswered);
    `requests` keeps what came in."""

    def __init__(self, answer: Callable[[str, dict, dict], tuple[int, str]]):
        self.answer, self.requests = answer, []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append((self.path, body, dict(self.headers), time.monotonic()))
                answered = owner.answer(self.path, body, dict(self.headers))
                if answered is None:  # a server that dies mid-call: the connection closes, nothing sent
                    self.close_connection = True
                    return
                status, text = answered
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting (the slow case)
                    pass

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def json_answer(value, status: int = 200) -> tuple[int, str]:
    return status, json.dumps(value)


@pytest.fixture
def server():
    """`server(answer)` starts a FakeServer; every one started is closed after the test."""
    servers = []

    def start(answer):
        servers.append(FakeServer(answer))
        return servers[-1]
    yield start
    for s in servers:
        s.close()
