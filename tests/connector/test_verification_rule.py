"""The reference's verified-load rule (``reference/connector/verification.py``): under this
engine's keys a value is valid or corrupt; every corrupt one fails the load closed and is
removed, whatever its kind; a miss removes nothing; keys the load does not read stay."""

from __future__ import annotations

from collections import Counter

import pytest

from tailproof.reference.connector.store import ScriptedStore
from tailproof.reference.connector.verification import FAILURE_KINDS, Corrupt, verified_load

MINE = ["m0", "m1", "m2"]
THEIRS = ["t0", "t1"]  # another identity's keys: never read by this engine


def _store(values: dict[str, object]) -> ScriptedStore:
    s = ScriptedStore()
    for k in MINE + THEIRS:
        s.add(k, ("tag", k))
    for k, v in values.items():
        if v is None:
            s.remove([k])
        else:
            s.add(k, v)
    return s


def test_intact_values_are_served() -> None:
    s = _store({})
    r = verified_load(s, MINE)
    assert r.served and not r.failures and r.removed == []
    assert set(s.keys) == set(MINE + THEIRS)


@pytest.mark.parametrize("kind", FAILURE_KINDS)
def test_every_kind_fails_closed_and_is_removed(kind: str) -> None:
    s = _store({"m1": Corrupt(kind), "t0": Corrupt(kind)})
    r = verified_load(s, MINE)
    assert not r.served and r.failures == Counter({kind: 1}) and r.removed == ["m1"]
    assert "m1" not in s.keys and {"m0", "m2", "t0", "t1"} <= set(s.keys)  # theirs: untouched
    s.add("m1", ("tag", "m1"))  # the writer's next save
    assert verified_load(s, MINE).served


def test_a_miss_removes_nothing_and_checks_only_what_the_store_refuses() -> None:
    s = _store({"m0": None, "m1": Corrupt("checksum"), "m2": Corrupt("length", wrong_size=True)})
    r = verified_load(s, MINE)
    assert not r.served and r.failures == Counter({"length": 1}) and r.removed == ["m2"]
    assert "m1" in s.keys  # never read: the batch failed before any byte was checked
    s = _store({"m0": None, "m1": Corrupt("checksum")})
    r = verified_load(s, MINE)
    assert not r.served and not r.failures and r.removed == []


def test_all_failures_are_counted_and_removed_together() -> None:
    s = _store({"m0": Corrupt("identity"), "m1": Corrupt("mac"), "m2": Corrupt("identity")})
    r = verified_load(s, MINE)
    assert r.failures == Counter({"identity": 2, "mac": 1}) and r.removed == MINE
    assert set(s.keys) == set(THEIRS)


def test_corrupt_names_a_known_kind() -> None:
    with pytest.raises(ValueError, match="Corrupt.kind"):
        Corrupt("bitrot")
    with pytest.raises(ValueError, match="Corrupt.wrong_size"):
        Corrupt("checksum", wrong_size=True)
