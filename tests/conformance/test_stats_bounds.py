"""``tailproof stats URL`` against hostile endpoints on 127.0.0.1: an endless body, a slow
drip and poisoned samples each end in exit 2 with one line, in bounded memory, each by the
bound its message names (the size cap or the deadline, never before it); no upper bound on
seconds (a loaded machine is slower, not wrong)."""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator

import pytest

from tailproof.conformance.cli.main import main
from tailproof.conformance.tools import stats

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[socket.socket, threading.Event], None]], str]]:
    """Start a one-connection-at-a-time server whose handler gets the socket and a stop
    event (set when the test ends, so a handler that paces itself ends with it)."""
    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    threads: list[threading.Thread] = []

    def start(handler: Callable[[socket.socket, threading.Event], None]) -> str:
        def loop() -> None:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(65536)  # the request
                    try:
                        handler(conn, stop)
                    except OSError:  # the client hung up: what a bounded reader does
                        pass

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        threads.append(t)
        return f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"

    yield start
    stop.set()
    listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
    listener.close()
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive()


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_endless_body_stops_at_the_size_cap(serve, capsys) -> None:
    def endless(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(HEAD)
        chunk = b"# filler\n" * 7000
        while not stop.is_set():
            conn.sendall(chunk)

    url = serve(endless)
    tracemalloc.start()
    try:
        rc = main(["stats", url, "--timeout", "30"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rc == 2  # ended by the size cap (the message), not the 30 s deadline
    assert f"more than {stats.MAX_RESPONSE_BYTES} bytes" in _one_line(capsys)
    assert peak < 4 * stats.MAX_RESPONSE_BYTES


def test_slow_drip_stops_at_the_deadline(serve, capsys) -> None:
    """One byte every 50 ms never trips a per-read socket timeout; the total one ends it."""
    def drip(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(HEAD)
        while not stop.wait(0.05):  # the adversary's pace, not a synchronisation
            conn.sendall(b"#")

    url = serve(drip)
    t0 = time.monotonic()
    assert main(["stats", url, "--timeout", "1"]) == 2
    assert time.monotonic() - t0 >= 1  # not before the deadline (the message says which)
    assert "did not answer in full within 1 s" in _one_line(capsys)


def test_dripping_headers_stop_at_the_deadline(serve, capsys) -> None:
    def drip(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        while not stop.wait(0.05):
            conn.sendall(b"X")

    url = serve(drip)
    t0 = time.monotonic()
    assert main(["stats", url, "--timeout", "1"]) == 2
    assert time.monotonic() - t0 >= 1  # not before the deadline
    assert "within 1 s" in _one_line(capsys)


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-3"])
def test_poisoned_sample_exit_2(serve, capsys, value: str) -> None:
    body = (f'vllm:tailproof_events_total{{engine="0",event="lookups"}} 3.0\n'
            f'vllm:tailproof_events_total{{engine="0",event="lookup_tokens"}} {value}\n')

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(HEAD + body.encode())

    url = serve(answer)
    assert main(["stats", url]) == 2
    line = _one_line(capsys)
    assert f"is {value}, not a finite number >= 0" in line and "lookup_tokens" in line


def test_nan_in_an_unused_series_is_ignored(serve, capsys) -> None:
    """Only the samples stats sums are checked: another exporter's NaN is not our input."""
    body = (b'vllm:tailproof_events_total{engine="0",event="lookups"} 3.0\n'
            b'vllm:tailproof_job_latency_seconds_bucket{le="+Inf"} NaN\n'
            b"vllm:other_gauge NaN\n")

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(HEAD + body)

    url = serve(answer)
    assert main(["stats", url, "--json"]) == 0
    assert '"lookups": 3' in capsys.readouterr().out


def test_non_200_exit_2(serve, capsys) -> None:
    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: /x\r\nConnection: close\r\n\r\n")

    assert main(["stats", serve(answer)]) == 2
    assert "answered HTTP 302" in _one_line(capsys)


def test_garbage_status_line_exit_2(serve, capsys) -> None:
    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"\x00\xffnot http at all\r\n\r\n")

    assert main(["stats", serve(answer)]) == 2
    assert "cannot read" in _one_line(capsys)
