"""Loose comparison renames block ids by first appearance; strict compares them exactly."""

from tailproof.conformance.format.compare import Renamer, subset_match


def test_renaming_is_by_first_appearance_and_keeps_null() -> None:
    a, b = Renamer(), Renamer()
    obs_a = [{"new": [[5, 9], [0, 7]]}, {"copies": [[7, 11]], "free": 3},
             {"refcounts": [[5, 1], [11, 2]], "keys": [[1, 6, 11]]}]
    obs_b = [{"new": [[2, 3], [0, 4]]}, {"copies": [[4, 8]], "free": 3},
             {"refcounts": [[2, 1], [8, 2]], "keys": [[1, 6, 8]]}]
    assert [a.canon(o) for o in obs_a] == [b.canon(o) for o in obs_b]
    assert a.canon({"blocks": [[0, 5]]}) == {"blocks": [[0, 1]]}


def test_renaming_detects_a_different_pattern() -> None:
    a, b = Renamer(), Renamer()
    assert a.canon({"new": [[5, 9]], "block": 5}) != b.canon({"new": [[5, 9]], "block": 9})


def test_non_id_fields_untouched() -> None:
    r = Renamer()
    assert r.canon({"hit": 6, "free": 12, "ok": True}) == {"hit": 6, "free": 12, "ok": True}


def test_subset_match() -> None:
    assert subset_match({"hit": 6}, {"hit": 6, "free": 3})
    assert not subset_match({"hit": 6, "free": 2}, {"hit": 6, "free": 3})


def test_loose_expectations_rename_only_the_fields_they_pin() -> None:
    """An adapter that observes ids in a field the expectation leaves out (a captured trace's
    connector op pins only ``free``) is renamed over the pinned fields only, as the
    expectation is: the same ids then agree, a different pattern still diverges."""
    from tailproof.conformance.format.compare import project

    expects = [{"free": 4}, {"blocks": [[3, 8]]}]
    observed = [{"free": 4, "pins": [8]}, {"blocks": [[3, 8]], "hit": 2}]
    e, a, naive = Renamer(), Renamer(), Renamer()
    want = [e.canon(x) for x in expects]
    got = [a.canon(project(x, o)) for x, o in zip(expects, observed, strict=True)]
    assert all(subset_match(w, g) for w, g in zip(want, got, strict=True))
    # renaming the whole observation numbers 8 first and disagrees with the expectation
    assert not subset_match(want[1], [naive.canon(o) for o in observed][1])
    swapped = [a2.canon(project(x, o)) for a2 in [Renamer()]
               for x, o in zip(expects, [{"free": 4}, {"blocks": [[8, 3]]}], strict=True)]
    assert subset_match(want[1], swapped[1])  # a consistent renaming still agrees
    assert not subset_match(want[1], Renamer().canon({"blocks": [[3, 3]]}))
