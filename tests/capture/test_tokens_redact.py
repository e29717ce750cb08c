"""Compact token notation writer and the redactor's equality-structure guarantee."""

from __future__ import annotations

import hashlib
import random

from tailproof.conformance.capture.redact import Redactor
from tailproof.conformance.capture.tokens import PrefixIndex, run_length
from tailproof.conformance.format.tokens import expand

H = 4


def _hashes(tokens: list[int]) -> list[bytes]:
    """A chained block hash at granularity H (vLLM's shape: parent + block tokens)."""
    out, parent = [], b""
    for k in range(len(tokens) // H):
        parent = hashlib.sha256(parent + repr(tokens[k * H:(k + 1) * H]).encode()).digest()
        out.append(parent)
    return out


def test_run_length_round_trips() -> None:
    rng = random.Random(1)
    for _ in range(200):
        toks = []
        for _ in range(rng.randrange(0, 8)):
            kind = rng.randrange(3)
            a = rng.randrange(0, 50)
            n = rng.randrange(1, 9)
            toks += [a] * n if kind == 0 else list(range(a, a + n)) if kind == 1 else [a]
        assert expand(run_length(toks), {}) == toks
    assert run_length(list(range(5, 105))) == [{"range": [5, 105]}]
    assert run_length([7] * 9) == [{"fill": 7, "n": 9}]


def test_prefix_index_writes_shared_prefixes() -> None:
    idx = PrefixIndex(H)
    a = list(range(100, 130))
    b = a[:22] + [1, 2, 3]
    prompts: dict[str, list[int]] = {}
    ea = idx.encode("A", a, _hashes(a))
    prompts["A"] = expand(ea, prompts)
    eb = idx.encode("B", b, _hashes(b))
    assert eb[0] == {"prompt_of": "A", "n": 22}
    assert expand(eb, prompts) == b
    # A reused id replaces its old prompt: nothing may point at the old one any more.
    a2 = [9] * 12
    prompts["A"] = expand(idx.encode("A", a2, _hashes(a2)), prompts)
    c = a[:20]
    ec = idx.encode("C", c, _hashes(c))
    assert expand(ec, prompts) == c


def test_redaction_keeps_exactly_the_hash_equality_structure() -> None:
    rng = random.Random(7)
    red = Redactor(H)
    base = [rng.randrange(5) for _ in range(40)]
    seqs = [base[: rng.randrange(0, 40)] + [rng.randrange(5) for _ in range(rng.randrange(1, 30))]
            for _ in range(60)]
    canon = [red.tokens(s, 0, _hashes(s)) for s in seqs]
    for i in range(len(seqs)):
        for j in range(len(seqs)):
            hi, hj = _hashes(seqs[i]), _hashes(seqs[j])
            ci, cj = _hashes(canon[i]), _hashes(canon[j])
            for k in range(min(len(hi), len(hj))):
                assert (hi[k] == hj[k]) == (ci[k] == cj[k])
    # The same token in different contexts is renamed differently.
    x = red.tokens([3, 3, 3, 3, 3], 0, _hashes([3, 3, 3, 3, 3]))
    assert x[0] != x[4]
    # Streaming: renaming a continuation equals renaming the whole sequence.
    s = seqs[0] + [1, 2, 3, 4, 0, 0]
    whole = Redactor(H).tokens(s, 0, _hashes(s))
    r2 = Redactor(H)
    part = r2.tokens(s[:10], 0, _hashes(s[:10])) + r2.tokens(s[10:], 10, _hashes(s))
    assert part == whole
