"""A real S3 endpoint on loopback for the tests: moto's server, behind a proxy that can inject faults.

boto3 and streaming reach it through S3_ENDPOINT_URL over HTTP, exactly as they would reach AWS.
The proxy forwards every request to moto unchanged unless a fault is armed: an HTTP error status
(e.g. 503 SlowDown, 403 AccessDenied) for the next N matching requests, a connection dropped
without a response (what a reset or a dead load balancer looks like to the client), or a request
held that long before its connection is dropped (an upload in flight, for a test to kill the
uploader in the middle of it).
"""

import http.client
import itertools
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


_PORT_BLOCK = 500  # ports per test process, below Linux's ephemeral range (32768-60999)
_next_port = itertools.count()


def free_port() -> int:
    """A free 127.0.0.1 port for a server that another process binds (torchrun's MASTER_PORT). Servers
    of this process bind port 0 instead. Each pytest-xdist process draws from a block of its own, under
    the ephemeral range where no bind(0) or outgoing connection lands: two processes probing at once
    can never be handed the same port, as bind(0)-and-close allowed."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    start = 20000 + _PORT_BLOCK * (int(worker) if worker.isdigit() else 0)
    for _ in range(_PORT_BLOCK):
        port = start + next(_next_port) % _PORT_BLOCK
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue  # held by something else: the next one
            return port
    raise OSError(f"no free port in 127.0.0.1:{start}-{start + _PORT_BLOCK - 1}")


@dataclass
class Fault:
    method: str  # HTTP method to match ("PUT", "GET", ... or "*")
    path_contains: str
    remaining: int  # how many matching requests to spoil; -1: all of them
    status: int | None  # HTTP status to answer with; None: drop the connection
    hold_s: float = 0.0  # before dropping the connection, hold the request this long
    serve: bool = False  # after holding, serve the request after all: a slow store, not a failing one


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client the test killed: expected
            super().handle_error(request, client_address)


class FaultProxy:
    """A threaded reverse proxy to `upstream_port` on 127.0.0.1; arm faults with `fail`."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.faults: list[Fault] = []
        self.spoiled = 0
        self.holding = threading.Event()  # set once a held request has arrived
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in arrival order
        self.spans: list[tuple[str, str, float, float]] = []  # (method, path, began, answered) of those answered
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                began = time.monotonic()
                with proxy.lock:
                    proxy.requests.append((self.command, self.path))
                # Decided on the headers: a body read after the test cleared the faults (its sender killed by then)
                # is still held, never stored.
                fault = proxy._take_fault(self.command, self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if fault is not None and fault.hold_s:
                    proxy.holding.set()
                    time.sleep(fault.hold_s)
                    if fault.serve:
                        fault = None
                if fault is not None and fault.status is None:
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # the client is gone already (a held request whose uploader was killed)
                    return
                if fault is not None:
                    code = {503: "SlowDown", 500: "InternalError", 403: "AccessDenied"}.get(fault.status, "Error")
                    payload = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                               f"<Message>injected by the test proxy</Message></Error>").encode()
                    self.send_response(fault.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()
                with proxy.lock:
                    proxy.spans.append((self.command, self.path, began, time.monotonic()))

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def fail(self, method: str, path_contains: str, times: int, status: int | None) -> None:
        with self.lock:
            self.faults.append(Fault(method, path_contains, times, status))

    def hold(self, method: str, path_contains: str, seconds: float) -> None:
        """Hold every matching request `seconds`, then drop its connection."""
        with self.lock:
            self.faults.append(Fault(method, path_contains, -1, None, seconds))

    def slow(self, method: str, path_contains: str, seconds: float) -> None:
        """Answer every matching request `seconds` late (a slow store: it is served)."""
        with self.lock:
            self.faults.append(Fault(method, path_contains, -1, None, seconds, serve=True))

    def most_at_once(self, method: str, path_contains: str) -> int:
        """The most matching requests that were in progress at the same moment (of those answered)."""
        with self.lock:
            events = sorted((t, step) for m, path, began, answered in self.spans
                            if m == method and path_contains in path for t, step in ((began, 1), (answered, -1)))
        most = now = 0
        for _, step in events:  # at equal times an answer (-1) comes before a start (+1): not overlapping
            now += step
            most = max(most, now)
        return most

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()
            self.spans.clear()
            self.spoiled = 0
            self.holding.clear()

    def count(self, method: str, path_contains: str) -> int:
        """How many `method` requests for a path containing `path_contains` have arrived so far."""
        with self.lock:
            return sum(1 for m, path in self.requests if m == method and path_contains in path)

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.remaining != 0 and fault.method in (method, "*") and fault.path_contains in path:
                    fault.remaining -= 1 if fault.remaining > 0 else 0
                    self.spoiled += 1
                    return fault
        return None

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_loopback_s3(*buckets: str):
    """moto's S3 server on a free 127.0.0.1 port, with the AWS variables that point clients at it.

    Returns the server (stop() it when done); the environment is set in this process, so
    subprocesses started afterwards inherit it.
    """
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()  # returns once bound
    port = server.get_host_and_port()[1]
    os.environ.update(S3_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="loopback",
                      AWS_SECRET_ACCESS_KEY="loopback", AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    from tokstream.object_store import s3_client

    for bucket in buckets:
        s3_client().create_bucket(Bucket=bucket)
    server.port = port
    return server
