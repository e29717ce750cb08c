"""Seeded mutations of the corpus (text-level and structural) through the CLI's own entry:
no traceback, no hang, exit 2 with one line for every rejected input, and every accepted
input replays to 0 or 1.

Most inputs run in-process through ``main(argv)`` (the console script's function) with
stderr captured; a few run as subprocesses of the installed ``tailproof`` script.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tailproof.conformance.cli.main import main
from tailproof.conformance.format.ops import all_op_specs
from tailproof.conformance.harness.corpus import corpus_paths

N_MUTATIONS = 2000
SEED = 20261130
PER_INPUT_S = 20  # a hang is a failure

# Small corpus cases keep each replay cheap.
SOURCES = [p for p in corpus_paths() if p.stat().st_size < 4000]

EVIL_VALUES: list[Any] = [
    None, True, False, -1, 0, 1, 2**31, 2**63, 2**63 - 1, 2**64, 10**9, 10**30, 1e9, 0.5,
    "", "x", "plan", "a" * 300, [], {}, [1, 2], [[0, 4]], [[0, -4]], [[99, 4]], {"op": "new_step"},
    ["lookup"], {"range": [0, 10**12]}, {"fill": 1, "n": 10**9}, {"prompt_of": "zz", "n": 1},
    [{"range": [2**63 - 2, 2**63 + 2]}], {"refcounts": [1, 2]}, {"keys": [[1]]},
    json.loads("[" * 40 + "]" * 40), ["ok", ["full", 2**40]],
]


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _structural(rng: random.Random, doc: dict[str, Any]) -> str:
    doc = copy.deepcopy(doc)
    paths = [p for p in _paths(doc) if p]
    path = rng.choice(paths)
    parent, key = _get(doc, path[:-1]), path[-1]
    kind = rng.randrange(8)
    if kind <= 2:
        parent[key] = copy.deepcopy(rng.choice(EVIL_VALUES))
    elif kind == 3:
        del parent[key]
    elif kind == 4 and isinstance(parent, dict):
        parent["unexpected_" + str(rng.randrange(9))] = rng.choice(EVIL_VALUES)
    elif kind == 5 and doc["ops"]:
        i, j = rng.randrange(len(doc["ops"])), rng.randrange(len(doc["ops"]))
        doc["ops"][i], doc["ops"][j] = doc["ops"][j], doc["ops"][i]
    elif kind == 6 and doc["ops"]:
        i = rng.randrange(len(doc["ops"]))
        doc["ops"][i]["op"] = rng.choice(sorted(all_op_specs()))
    elif doc["ops"]:
        i = rng.randrange(len(doc["ops"]))
        doc["ops"].insert(rng.randrange(len(doc["ops"]) + 1), copy.deepcopy(doc["ops"][i]))
    return json.dumps(doc)


def _textual(rng: random.Random, text: str) -> bytes:
    data = bytearray(text.encode())
    kind = rng.randrange(7)
    pos = rng.randrange(len(data))
    if kind == 0:
        data[pos] = rng.randrange(256)
    elif kind == 1:
        del data[pos:]
    elif kind == 2:
        data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
    elif kind == 3:
        end = min(len(data), pos + rng.randrange(1, 40))
        data[pos:pos] = data[pos:end]
    elif kind == 4:
        digits = [i for i, c in enumerate(data) if chr(c).isdigit()]
        if digits:
            i = rng.choice(digits)
            data[i:i + 1] = rng.choice([b"9" * 5000, str(2**63).encode(), b"1e400", b"-0"])
    elif kind == 5:
        data = bytearray(b"[" * rng.choice([100, 3000]) + data)
    else:
        data = bytearray(rng.randbytes(rng.randrange(1, 64)))
    return bytes(data)


def _mutations() -> Iterator[tuple[int, bytes]]:
    rng = random.Random(SEED)
    docs = [json.loads(p.read_text()) for p in SOURCES]
    for i in range(N_MUTATIONS):
        doc = rng.choice(docs)
        if rng.random() < 0.5:
            yield i, _structural(rng, doc).encode()
        else:
            yield i, _textual(rng, json.dumps(doc, indent=rng.choice([None, 1])))


class Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(PER_INPUT_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    finally:
        signal.alarm(0)
    return rc, out.getvalue(), err.getvalue()


def test_fuzz_corpus_mutations_in_process(tmp_path: Path) -> None:
    assert len(SOURCES) >= 20
    counts = {"rejected": 0, "agreed": 0, "diverged": 0}
    path = tmp_path / "m.json"
    for i, data in _mutations():
        path.write_bytes(data)
        try:
            rc, out, err = _run(["validate", str(path)])
        except Hang:
            pytest.fail(f"mutation {i} hangs validate: {data[:300]!r}")
        assert "Traceback" not in err, (i, err)
        assert rc in (0, 2), (i, rc, err, data[:300])
        if rc == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and "fix:" in lines[0], (i, err)
            counts["rejected"] += 1
            continue
        # Accepted: it must replay (on the reference model) without an error of ours.
        try:
            rc, out, err = _run(["replay", str(path), "--against", "reference"])
        except Hang:
            pytest.fail(f"mutation {i} hangs replay: {data[:300]!r}")
        assert "Traceback" not in err, (i, err)
        if rc == 2:
            # bad input known only once an adapter ran it (an expect key nothing observes, a
            # commit with no allocate since the last one): still one line naming the op
            lines = err.strip().splitlines()
            assert len(lines) == 1 and "fix:" in lines[0], (i, err)
            counts["rejected"] += 1
            continue
        assert rc in (0, 1), (i, rc, err, data[:300])
        counts["agreed" if rc == 0 else "diverged"] += 1
    print(f"fuzz: {N_MUTATIONS} mutations: {counts}")
    assert counts["rejected"] > N_MUTATIONS // 2
    assert counts["agreed"] + counts["diverged"] > 50


@pytest.mark.skipif(shutil.which("tailproof") is None
                    and not (Path(sys.executable).parent / "tailproof").exists(),
                    reason="the tailproof console script is not installed in this environment")
def test_fuzz_some_through_the_console_script(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "tailproof"
    script = str(exe) if exe.exists() else "tailproof"
    picked = [d for i, d in _mutations() if i % 600 == 7][:4]
    for n, data in enumerate(picked):
        path = tmp_path / f"m{n}.json"
        path.write_bytes(data)
        proc = subprocess.run([script, "replay", str(path), "--against", "reference"],
                              capture_output=True, text=True, timeout=120)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert proc.returncode in (0, 1, 2), (proc.returncode, proc.stderr)
        if proc.returncode == 2:
            assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
