"""The connector's static configuration: its role and its view of the engine's geometry.

Mirrors ``MooncakeStoreScheduler.__init__`` (MS:138-205) and
``MooncakeStoreCoordinator.__init__`` / ``_verify_and_split_kv_cache_groups`` (MCO:87-226).
Every Full-attention and Mamba-align group is prefix-cacheable, so store group ids equal core
group ids here (``_store_group_id_by_kv_cache_group_id`` is the identity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tailproof.reference.geometry import Geometry
from tailproof.spec.arithmetic import eagle_proof_margin, lcm_all

ROLES = {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}


@dataclass(frozen=True)
class ConnectorConfig:
    """Trace config key ``connector`` after validation (see ``conformance/connector_ops.py``)."""

    role: str = "producer"  # producer | consumer | both
    num_workers: int = 1
    save_decode_cache: bool = False
    enable_lookup: bool = True
    load_async: bool = False

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
class SpecGroup:
    """A store spec group: groups with an equal spec looked up jointly (MCO:179-208)."""

    is_mamba: bool
    block_size: int
    group_ids: tuple[int, ...]
    use_eagle: bool


@dataclass(frozen=True)
class StoreGeometry:
    """What the connector knows of the engine: block sizes, h, lcm, partial hits, EAGLE."""

    block_sizes: tuple[int, ...]
    mamba_group_ids: frozenset[int]
    hash_block_size: int
    lcm_block_size: int
    partial_hits: bool
    use_eagle: bool
    attention_groups: tuple[SpecGroup, ...]
    eagle_proof_margin_by_group: dict[int, int]

    @property
    def alignment(self) -> int:
        """Lookup/save alignment (MCO:167-173, MS:225-227): h with partial hits, else lcm."""
        return self.hash_block_size if self.partial_hits else self.lcm_block_size

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
        sizes = tuple(int(g.block_size) for g in config.groups)
        mamba = frozenset(i for i, g in enumerate(config.groups) if g.kind == "mamba_align")
        h = int(config.hash_block_size)
        lcm = lcm_all(list(sizes)) if len(sizes) > 1 else sizes[0]
        partial = geo.partial_hits
        use_eagle = bool(getattr(config, "use_eagle", False))
        merged: list[SpecGroup] = []
        for i, g in enumerate(config.groups):
            is_mamba = i in mamba
            eagle = bool(getattr(g, "eagle", False))
            for k, sg in enumerate(merged):
                if sg.is_mamba == is_mamba and sg.block_size == sizes[i]:
                    merged[k] = SpecGroup(is_mamba, sg.block_size, (*sg.group_ids, i),
                                          sg.use_eagle or eagle)
                    break
            else:
                merged.append(SpecGroup(is_mamba, sizes[i], (i,), eagle))
        merged.sort(key=lambda sg: sg.is_mamba)  # full attention first (MCO:204)
        if use_eagle and not any(sg.use_eagle for sg in merged):  # MCO:206-207
            merged = [SpecGroup(sg.is_mamba, sg.block_size, sg.group_ids, True) for sg in merged]
        margins = {  # eagle_proof_margin_by_group (MCO:216-226); FA supports fine lookup
            gid: eagle_proof_margin(sg.block_size, h, partial)
            for sg in merged if sg.use_eagle and not sg.is_mamba for gid in sg.group_ids
        }
        return cls(sizes, mamba, h, lcm, partial, use_eagle, tuple(merged), margins)
