"""A rolling upgrade in vLLM's real engine: a vLLM 0.33 engine (Model Runner V1) and a vLLM 0.34
engine (the standalone CPU Model Runner V2), each in its own bed process on its release's vLLM
(``EngineSpec.vllm_release``: the overlay ``scripts/vllm_env.sh`` names), share one namespace on
one real ``mooncake_master`` on 127.0.0.1, as the old and the new release of one deployment do
while it is upgraded engine by engine.

What an upgrade does to the stored values: they are kept. Both releases lay a block's bytes out
alike (``impl/fingerprint.py``: vLLM 0.34's new spec fields at their 0.33 value are left out,
``LAYOUT_NEUTRAL_FIELDS``, and so is where blocks sit in memory, ``PHYSICAL_PLACEMENT_FIELDS``),
so they compute one layout fingerprint and address the same keys. Shown here: the upgraded
engine serves what the old one stored, the old one serves what the upgraded one stored, both
equal to the truth (an engine with prefix caching off) with no value failing verification, and
the two releases store the same keys with byte-identical payloads for the same prompts. Where a
0.34 engine lays bytes out differently (FlashInfer ReplaySSM's ``state_alignment``, head-major
slots) its fingerprint differs and it misses the old values instead (``tests/impl/
test_fingerprint.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tailproof.conformance.realengine import bed as tb
from tailproof.conformance.realengine.oracle import MAX_TOKENS

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.vllm, pytest.mark.mooncake]

OLD, NEW = "0.33", "0.34"
SET_A = (3, 6, 9, 11)  # shared-prefix prompts of 100+, 200+, 320+ and 515+ tokens
SET_B = (4, 7, 10)  # 128+, 257+ and 400+: new tails over prefixes set A stored
NAMESPACE = "rt-rolling-upgrade"
MC_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR"}


@pytest.fixture(scope="module")
def both_releases() -> None:
    for release in (OLD, NEW):
        try:
            tb.release_sys_path(release)
        except tb.BedError as exc:
            pytest.skip(f"needs vLLM {OLD} and {NEW} installed side by side "
                        f"(scripts/bootstrap.sh): {exc}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One model folder for both engines (the fingerprint names the model path)."""
    from tailproof.conformance.realengine.model import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("model"), seed=0)


def _engine(master: Any, model_dir: Any, release: str) -> tb.Bed:
    kt = tb.tailproof_connector({"store": "mooncake", "master_address": master.address,
                                 "namespace": NAMESPACE, "global_segment_size": 64 << 20})
    return tb.Bed(tb.EngineSpec(kv_transfer_config=kt, env=dict(MC_ENV), vllm_release=release),
                  model_dir=model_dir)


@pytest.fixture(scope="module")
def old(both_releases: None, master: Any, model_dir: Any) -> Iterator[tb.Bed]:
    with _engine(master, model_dir, OLD) as bed:
        yield bed


@pytest.fixture(scope="module")
def new(old: tb.Bed, master: Any, model_dir: Any) -> Iterator[tb.Bed]:
    with _engine(master, model_dir, NEW) as bed:
        yield bed


@pytest.fixture(scope="module")
def cases(prompts: list[list[int]], truth: list[tuple[int, ...]]) -> dict[str, Any]:
    return {name: ([prompts[i] for i in idx], [list(truth[i]) for i in idx])
            for name, idx in (("A", SET_A), ("B", SET_B))}


@pytest.fixture(scope="module")
def stored_by_old(old: tb.Bed, master: Any, cases: dict[str, Any]) -> list[str]:
    """The old release serves set A first (cold): the keys it stored."""
    prompts, want = cases["A"]
    assert _tokens(old.generate(prompts, MAX_TOKENS)) == want
    assert old.call(tb.drain_store_jobs, 120.0)
    keys = _ours(master)
    assert keys
    return keys


# --- run in a bed process (Bed.call / Bed.worker) -------------------------------------------


def fingerprint(llm: Any) -> tuple[str, str, Any]:
    """(vLLM release, the connector's layout fingerprint digest, what it covers)."""
    import vllm

    fp = tb.scheduler_connector(llm).fingerprint
    return vllm.__version__, fp.digest, fp.parts


def prefix_slots(llm: Any, prompts: list[list[int]]) -> dict[str, int]:
    """Every h-token prefix of ``prompts``, by its block hash as keys spell it (hashed by the
    engine core's own hasher): how many token slots of its last block it fills."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    core = llm.llm_engine.engine_core.engine_core
    block = core.vllm_config.cache_config.block_size
    h = llm.llm_engine.vllm_config.cache_config.prefix_match_unit
    out: dict[str, int] = {}
    for i, p in enumerate(prompts):
        req = Request(f"slots{i}", list(p), sampling_params=SamplingParams(max_tokens=1),
                      pooling_params=None, block_hasher=core.request_block_hasher)
        for j, bh in enumerate(req.block_hashes):
            end = (j + 1) * h
            out[bytes(bh).hex()] = end - (end - 1) // block * block
    return out


def prefix_digests(worker: Any, keys: list[str], slots: dict[str, int]) -> dict[str, str | None]:
    """Per key, a digest of the bytes of its stored value that the key names (None: absent):
    Mamba states whole; attention pages only the token slots its prefix fills (``slots``, by
    the key's hash). The rest of such a block is whatever the device block held when the save
    ran (later tokens of the request that stored it, or nothing yet): no load reads it, the
    loading request computes those positions before it attends to them."""
    import hashlib

    import numpy as np
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from tailproof.impl.keys import parse_key
    from tailproof.impl.value_format import HEADER_BYTES

    side = get_kv_transfer_group().worker_side
    out: dict[str, str | None] = {}
    for key in keys:
        parsed = parse_key(key)
        size = tb._value_size(side.store, key)
        buf = np.empty(size or 0, np.uint8)
        if size is None or not side.store.get(key, buf).ok:
            out[key] = None
            continue
        digest, at = hashlib.blake2b(), HEADER_BYTES
        for seg in side.layout.groups[parsed.group]:
            page = buf[at:at + seg.block_nbytes]
            at += seg.block_nbytes
            shape = seg.page_shape
            if shape is not None and shape[1] > 1:  # an attention page [H, N, C bytes]
                page = page.reshape(shape)[:, :slots[parsed.block_hash.hex()], :]
            digest.update(page.tobytes())
        out[key] = digest.hexdigest()
    return out


# --- helpers ---------------------------------------------------------------------------------


def _tokens(got: list[tb.Completion]) -> list[list[int]]:
    return [list(c.tokens) for c in got]


def _ours(master: Any) -> list[str]:
    return [k for k in master.keys() if k.startswith(f"kv2:{NAMESPACE}@")]


def _gets(bed: tb.Bed) -> int:
    return sum(c.get("get_keys", 0) for c in bed.worker(tb.connector_counters))


def _verify_failures(bed: tb.Bed) -> int:
    return sum(v for c in bed.worker(tb.connector_counters) for k, v in c.items()
               if k.startswith("verify_fail"))


def _served_from_store(bed: tb.Bed, prompts: list[list[int]]) -> tuple[list[tb.Completion],
                                                                        set[str]]:
    """``prompts`` with the device cache empty: completions and the store keys loaded."""
    assert bed.reset_prefix_cache()
    assert all(bed.worker(tb.record_store_reads))
    try:
        got = bed.generate(prompts, MAX_TOKENS)
    finally:
        read = {k for keys in bed.worker(tb.recorded_store_reads) for k in keys}
    return got, read


# --- the tests ------------------------------------------------------------------------------


def test_both_releases_compute_one_layout_fingerprint(old: tb.Bed, new: tb.Bed) -> None:
    (v_old, fp_old, parts_old), (v_new, fp_new, parts_new) = old.call(fingerprint), \
        new.call(fingerprint)
    assert v_old.startswith(OLD) and v_new.startswith(NEW)
    assert parts_old == parts_new
    assert fp_old == fp_new


def test_the_upgraded_engine_serves_what_the_old_release_stored(
        new: tb.Bed, stored_by_old: list[str], cases: dict[str, Any]) -> None:
    prompts, want = cases["A"]
    failures = _verify_failures(new)
    got, read = _served_from_store(new, prompts)
    assert _tokens(got) == want
    assert all(c.num_cached_tokens > 0 for c in got)
    assert read and read <= set(stored_by_old)  # every value it loaded, 0.33 wrote
    assert _verify_failures(new) == failures


def test_the_old_release_serves_what_the_upgraded_engine_stored(
        old: tb.Bed, new: tb.Bed, master: Any, stored_by_old: list[str],
        cases: dict[str, Any]) -> None:
    prompts, want = cases["B"]
    before = set(_ours(master))
    assert _tokens(new.generate(prompts, MAX_TOKENS)) == want  # new tails: 0.34 stores them
    assert new.call(tb.drain_store_jobs, 120.0)
    by_new = set(_ours(master)) - before
    assert by_new
    failures = _verify_failures(old)
    got, read = _served_from_store(old, prompts)
    assert _tokens(got) == want
    assert all(c.num_cached_tokens > 0 for c in got)
    assert read & by_new  # 0.33 loaded values 0.34 wrote
    assert _verify_failures(old) == failures


def test_both_releases_store_the_same_keys_and_bytes(
        new: tb.Bed, master: Any, stored_by_old: list[str], cases: dict[str, Any]) -> None:
    """The upgraded engine stores set A again under a fresh key epoch of its own (a prefix-
    cache reset moves it there; nothing is reachable, so it computes and stores everything):
    the same keys as the old release's, epoch aside, each value's payload byte for byte."""
    prompts, want = cases["A"]
    assert new.call(tb.drain_store_jobs, 120.0)
    assert new.reset_prefix_cache(reset_connector=True)
    epoch = new.call(tb.scheduler_pins)["epoch"]
    gets = _gets(new)
    assert _tokens(new.generate(prompts, MAX_TOKENS)) == want
    assert _gets(new) == gets  # computed, nothing loaded: the fresh epoch holds nothing
    assert new.call(tb.drain_store_jobs, 120.0)
    mine = [k for k in _ours(master) if f"@e{epoch}@" in k]
    theirs = {k.replace("@e0@", f"@e{epoch}@"): k for k in stored_by_old}
    assert sorted(mine) == sorted(theirs)
    slots = new.call(prefix_slots, prompts)
    (digests,) = new.worker(prefix_digests, [*mine, *theirs.values()], slots)
    assert all(digests.values()), [k for k, d in digests.items() if d is None]
    differ = [k for k in mine if digests[k] != digests[theirs[k]]]
    assert not differ, f"{len(differ)} of {len(mine)} values differ between the releases"
