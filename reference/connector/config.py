"""The connector's static configuration: its role and its view of the engine's geometry.

Mirrors ``MooncakeStoreScheduler.__init__`` (MS:138-205) and
``MooncakeStoreCoordinator.__init__`` / ``_verify_and_split_kv_cache_groups`` (MCO:87-226).
Every group kind of the trace format (full attention, sliding window, Mamba align) is
prefix-cacheable, so store group ids equal core group ids here
(``_store_group_id_by_kv_cache_group_id`` is the identity). A store spec group is the reference
core's ``SpecGroup`` (kind, block size, window): the store merges groups as the core does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tailproof.reference.geometry import (
    FULL_ATTENTION,
    MAMBA_ALIGN,
    Geometry,
    SpecGroup,
    split_spec_groups,
)
from tailproof.spec.arithmetic import eagle_proof_margin, lcm_all

ROLES = {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}


@dataclass(frozen=True)
class ConnectorConfig:
    """Trace config key ``connector`` after validation (see
    ``conformance/format/connector_config.py``)."""

    role: str = "producer"  # producer | consumer | both
    num_workers: int = 1
    save_decode_cache: bool = False
    enable_lookup: bool = True
    load_async: bool = False
    # The turn-end checkpoint extension (docs/reuse.md; not vLLM 0.33): off by default.
    turn_end_checkpoints: bool = False
    checkpoint_slots: int = 32
    checkpoint_reserve_blocks: int = 4
    decode_boundary_saves: bool = False
    checkpoint_lookup_wait: bool = False  # rule 7; impl's deployment default is True
    # Junction checkpoints (docs/junctions.md, "The extension"; not vLLM 0.33): off by default.
    junction_checkpoints: bool = False
    junction_index_blocks: int = 1 << 18
    # Pins (DEVIATIONS in scheduler.py; not vLLM 0.33): off in traces unless given (impl's
    # deployment defaults are True and 0.25).
    readable_pins: bool = False
    pin_budget_fraction: float | None = None
    device_junctions: bool = False  # the hook also sets the manager's junction keying

    @classmethod
    def from_doc(cls, doc: dict[str, Any] | None) -> ConnectorConfig:
        return cls(**(doc or {}))

    @property
    def is_consumer(self) -> bool:
        """``kv_role == "kv_consumer"`` (MS:308)."""
        return self.role == "consumer"

    @property
    def is_producer(self) -> bool:
        """``KVTransferConfig.is_kv_producer``: gates ``finalize_partial_tail_offloads``
        in ``Scheduler._connector_finished`` (SC:3362)."""
        return self.role in ("producer", "both")

    @property
    def can_put(self) -> bool:
        """``MooncakeStoreWorker.can_put`` (MW:1394): producers, or consumers saving decode."""
        return not self.is_consumer or self.save_decode_cache

    @property
    def capacity_only(self) -> bool:
        """``_capacity_only`` (MS:178-182): a consumer that neither looks up nor saves."""
        return self.is_consumer and not self.enable_lookup and not self.save_decode_cache


@dataclass(frozen=True)
class StoreGeometry:
    """What the connector knows of the engine: block sizes, h, lcm, partial hits, EAGLE."""

    block_sizes: tuple[int, ...]
    kinds: tuple[str, ...]  # per group: full_attention | sliding_window | mamba_align
    windows: tuple[int | None, ...]  # per group: the sliding window in tokens, else None
    mamba_group_ids: frozenset[int]
    hash_block_size: int
    scheduler_block_size: int
    partial_hits: bool
    use_eagle: bool
    attention_groups: tuple[SpecGroup, ...]
    eagle_proof_margin_by_group: dict[int, int]
    eagle_group_ids: frozenset[int]  # groups whose spec group drops the EAGLE block

    @property
    def alignment(self) -> int:
        """Lookup/save alignment (MCO:167-173, MS:225-227): h with partial hits, else lcm."""
        return self.hash_block_size if self.partial_hits else self.scheduler_block_size

    def align_lookup_length(self, n: int) -> int:
        """``align_lookup_length`` (MCO:167-173)."""
        a = self.alignment
        return n // a * a

    @classmethod
    def from_config(cls, config: Any) -> StoreGeometry:
        """Derive from a ``TraceConfig``; partial hits are the core geometry's
        (``spec.arithmetic.partial_hash_hits_enabled``; ``from_kv_cache_config``'s
        ``cache_hit_alignment_tokens < scheduler_block_size`` then always holds)."""
        geo = Geometry.from_config(config)
        sizes = tuple(g.block_size for g in geo.groups)
        kinds = tuple(g.kind for g in geo.groups)
        mamba = frozenset(i for i, k in enumerate(kinds) if k == MAMBA_ALIGN)
        h = geo.hash_block_size
        lcm = lcm_all(list(sizes)) if len(sizes) > 1 else sizes[0]
        partial = geo.partial_hits
        use_eagle = geo.use_eagle
        # _verify_and_split_kv_cache_groups: a spec group is EAGLE when one of its groups is
        # flagged (``is_eagle_group``); all are when EAGLE is on and none is (MCO:206-207).
        flagged = frozenset(i for i, g in enumerate(geo.groups) if g.eagle)
        merged = split_spec_groups(geo.groups, flagged)
        if use_eagle and not any(sg.use_eagle for sg in merged):
            merged = tuple(SpecGroup(sg.kind, sg.block_size, sg.group_ids, True,
                                     sg.sliding_window) for sg in merged)
        eagle_ids = frozenset(gid for sg in merged if sg.use_eagle for gid in sg.group_ids)
        # eagle_proof_margin_by_group (MCO:216-226): a fine-grained margin needs a manager with
        # ``supports_fine_grained_hash_lookup``: full attention yes, a sliding window no.
        margins = {
            gid: eagle_proof_margin(sg.block_size, h, partial and sg.kind == FULL_ATTENTION)
            for sg in merged if sg.use_eagle and sg.kind != MAMBA_ALIGN for gid in sg.group_ids
        }
        windows = tuple(g.sliding_window for g in geo.groups)
        return cls(sizes, kinds, windows, mamba, h, lcm, partial, use_eagle, merged, margins,
                   eagle_ids)
