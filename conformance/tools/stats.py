"""``tailproof stats URL``: the connector's counters from a running engine's ``/metrics``.

Reads the ``vllm:tailproof_*`` Prometheus series (``impl/metrics.py``: events by name, state
gauges, the job latency histogram), sums them over engines and models, and prints lookups,
hit tokens split by granularity (whole lcm blocks vs sub-block tails), the hit ratio,
puts/gets, failures by kind and pinned blocks.

The endpoint is outside input and is read bounded (docs/security.md, "Bounded readers"):
at most MAX_RESPONSE_BYTES, within ``--timeout`` seconds in all (a watchdog shuts the socket
down at the deadline, so a slow drip cannot stretch it), and every sample it uses must be a
finite number >= 0; anything else is exit 2 with one line.
"""

from __future__ import annotations

import http.client
import math
import re
import socket
import threading
import urllib.parse
from typing import Any

from tailproof.conformance.harness.errors import UsageError

EVENTS = "vllm:tailproof_events_total"
STATE = "vllm:tailproof_state"
LATENCY = "vllm:tailproof_job_latency_seconds"

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
FAILURE_PREFIXES = ("put_fail_", "get_fail_")
FAILURE_EVENTS = ("load_failures", "job_errors", "lookup_errors")
#: largest /metrics response read (bytes); a real one is a few hundred KiB even with many
#: models and engines
MAX_RESPONSE_BYTES = 16 << 20
_CHUNK = 1 << 16
#: longest sample line parsed (a longer one is not the connector's; skipped, so the regex
#: never runs on megabytes)
_MAX_LINE = 1 << 16


def metrics_url(url: str) -> str:
    """``host:port`` or a base URL -> the ``/metrics`` URL (http only)."""
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"stats: {url!r} is not an http(s) URL",
                         "pass the engine's address, e.g. http://127.0.0.1:8000/metrics")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urllib.parse.urlunsplit(parts)


def _cannot_read(url: str, reason: object) -> UsageError:
    return UsageError(f"stats: cannot read {url}: {reason}",
                      "check the engine is running and the address/port")


def fetch(url: str, timeout: float) -> str:
    """The body of ``GET url``: at most MAX_RESPONSE_BYTES, all of it within ``timeout``
    seconds (connect, headers and body together), else a UsageError."""
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    try:
        conn = cls(parts.hostname or "", parts.port, timeout=timeout)
    except (http.client.HTTPException, ValueError) as e:  # a bad port
        raise _cannot_read(url, e) from None
    expired = threading.Event()
    socks: list[socket.socket] = []  # the connection's socket (http.client drops its own
    # reference once a Connection: close response is read)

    def stop() -> None:  # the deadline: wake a read blocked on a dripping server
        expired.set()
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(timeout, stop)
    watchdog.daemon = True
    watchdog.start()
    body = bytearray()
    try:
        conn.connect()
        socks.append(conn.sock)
        if expired.is_set():  # the deadline passed while connecting
            stop()
        conn.request("GET", urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, "")),
                     headers={"Accept": "text/plain"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise UsageError(f"stats: {url} answered HTTP {resp.status} {resp.reason}",
                             "pass the engine's metrics URL, e.g. http://127.0.0.1:8000/metrics")
        while chunk := resp.read1(_CHUNK):
            body += chunk
            if len(body) > MAX_RESPONSE_BYTES:
                raise UsageError(f"stats: {url} sent more than {MAX_RESPONSE_BYTES} bytes "
                                 "(the limit)", "point stats at the engine's own /metrics")
    except (http.client.HTTPException, OSError, ValueError) as e:
        if not expired.is_set():
            raise _cannot_read(url, getattr(e, "reason", None) or e or type(e).__name__) \
                from None
    finally:
        watchdog.cancel()
        conn.close()
    if expired.is_set():
        raise UsageError(f"stats: {url} did not answer in full within {timeout:g} s",
                         "check the engine is responsive, or raise --timeout")
    return body.decode("utf-8", "replace")


def parse(text: str) -> dict[str, dict[str, float]]:
    """Sum the tailproof series by their ``event`` / ``state`` label (and the histogram's
    count and sum), over every other label."""
    out: dict[str, dict[str, float]] = {"events": {}, "state": {}, "latency": {}}
    for line in text.splitlines():
        if not line.startswith("vllm:tailproof_") or len(line) > _MAX_LINE:
            continue
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m[1], dict(_LABEL.findall(m[2] or "")), m[3]
        if name not in (EVENTS, STATE, LATENCY + "_count", LATENCY + "_sum"):
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        if not math.isfinite(v) or v < 0:
            raise UsageError(f"stats: sample {name}{(m[2] or '')[:200]} is {value[:40]}, "
                             "not a finite number >= 0", "point stats at an engine running "
                             "TailproofConnector (its counters are never NaN or negative)")
        if name == EVENTS:
            key, part = labels.get("event", ""), "events"
        elif name == STATE:
            key, part = labels.get("state", ""), "state"
        elif name in (LATENCY + "_count", LATENCY + "_sum"):
            key, part = name.rsplit("_", 1)[1], "latency"
        else:
            continue
        bucket = out[part]
        if part == "state":
            bucket[key] = max(bucket.get(key, 0.0), v)  # gauges: the latest per engine
        else:
            bucket[key] = bucket.get(key, 0.0) + v
    return out


def summary(series: dict[str, dict[str, float]]) -> dict[str, Any]:
    ev = {k: int(v) for k, v in series["events"].items()}
    g = ev.get
    lookup_tokens = g("lookup_tokens", 0)
    whole, tail = g("hit_tokens_whole_blocks", 0), g("hit_tokens_sub_block_tail", 0)
    failures = {k: v for k, v in sorted(ev.items())
                if k.startswith(FAILURE_PREFIXES) or k in FAILURE_EVENTS}
    lat = series["latency"]
    count = int(lat.get("count", 0))
    return {
        "lookups": g("lookups", 0), "lookup_hits": g("lookup_hits", 0),
        "lookup_hits_sub_block_tail": g("lookup_hits_sub_block_tail", 0),
        "lookup_tokens": lookup_tokens,
        "hit_tokens": {"whole_blocks": whole, "sub_block_tail": tail, "total": whole + tail},
        "hit_ratio": round((whole + tail) / lookup_tokens, 4) if lookup_tokens else None,
        "puts": {"batches": g("put_batches", 0), "keys": g("put_keys", 0),
                 "bytes": g("put_bytes", 0), "exists": g("put_exists", 0)},
        "gets": {"batches": g("get_batches", 0), "keys": g("get_keys", 0),
                 "bytes": g("get_bytes", 0)},
        "failures": failures,
        "jobs": {"emitted": g("jobs_emitted", 0), "loads": g("loads_emitted", 0),
                 "skipped_pressure": g("jobs_skipped_pressure", 0),
                 "latency_count": count,
                 "latency_avg_ms": round(lat["sum"] / count * 1e3, 3) if count else None},
        "pinned_blocks": int(series["state"].get("pinned_blocks", 0)),
        "pressure_active": bool(series["state"].get("pressure_active", 0)),
    }


def render(s: dict[str, Any], url: str) -> str:
    h = s["hit_tokens"]
    ratio = "n/a (no lookups)" if s["hit_ratio"] is None else f"{s['hit_ratio']:.1%}"
    fails = ", ".join(f"{k} {v}" for k, v in s["failures"].items()) or "none"
    lat = s["jobs"]["latency_avg_ms"]
    return "\n".join([
        f"tailproof connector at {url}",
        f"  lookups        {s['lookups']} ({s['lookup_hits']} hit, "
        f"{s['lookup_hits_sub_block_tail']} with a sub-block tail)",
        f"  hit tokens     {h['total']} = {h['whole_blocks']} whole blocks + "
        f"{h['sub_block_tail']} sub-block tail, of {s['lookup_tokens']} looked up",
        f"  hit ratio      {ratio}",
        f"  puts           {s['puts']['keys']} keys in {s['puts']['batches']} batches, "
        f"{s['puts']['bytes']} bytes ({s['puts']['exists']} already stored)",
        f"  gets           {s['gets']['keys']} keys in {s['gets']['batches']} batches, "
        f"{s['gets']['bytes']} bytes",
        f"  failures       {fails}",
        f"  store jobs     {s['jobs']['emitted']} saves, {s['jobs']['loads']} loads, "
        f"{s['jobs']['skipped_pressure']} skipped under pressure"
        + (f", avg {lat} ms" if lat is not None else ""),
        f"  pinned blocks  {s['pinned_blocks']}"
        + (" (pressure gate active)" if s["pressure_active"] else ""),
    ])


def read_stats(url: str, timeout: float) -> tuple[str, dict[str, Any]]:
    full = metrics_url(url)
    series = parse(fetch(full, timeout))
    if not any(series.values()):
        raise UsageError(f"stats: {full} has no vllm:tailproof_* series",
                         "is the engine running TailproofConnector (kv_transfer_config), and "
                         "has it served a request yet?")
    return full, summary(series)
