"""Static geometry of one engine: group block sizes, hash granularity, alignment, EAGLE flags.

Everything here is derived once from the configuration and never changes. Each derived value
names the vLLM 0.33 code that computes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tailproof.reference.releases import DEFAULT, RELEASES, Release
from tailproof.spec.arithmetic import hit_alignment, lcm_all, partial_hash_hits_enabled

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
MAMBA_ALIGN = "mamba_align"
KINDS = (FULL_ATTENTION, SLIDING_WINDOW, MAMBA_ALIGN)


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group (``KVCacheGroupSpec``): its manager kind, block size, EAGLE flag,
    for a sliding-window group its window in tokens (``SlidingWindowSpec``) and for a Mamba
    group its speculative blocks (``MambaSpec.num_speculative_blocks``)."""

    kind: str
    block_size: int
    eagle: bool = False
    sliding_window: int | None = None
    num_speculative_blocks: int = 0

    @property
    def is_mamba(self) -> bool:
        return self.kind == MAMBA_ALIGN


@dataclass(frozen=True)
class SpecGroup:
    """Groups sharing one spec, looked up jointly (mirrors ``kv_cache_coordinator.SpecGroup``)."""

    kind: str
    block_size: int
    group_ids: tuple[int, ...]
    use_eagle: bool
    sliding_window: int | None = None


@dataclass(frozen=True)
class Geometry:
    groups: tuple[GroupSpec, ...]
    hash_block_size: int
    num_blocks: int
    enable_caching: bool = True
    use_eagle: bool = False
    max_model_len: int = 8192
    max_num_scheduled_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    split_block_size: int | None = None  # cache_config.block_size override (trace config)
    # CacheConfig.enable_mamba_shared_prefix_checkpoint (the engine flag, as configured).
    enable_mamba_shared_prefix_checkpoint: bool = False
    # EXTENSION (docs/junctions.md, "The hook"): the connector's scheduler hook set
    # Scheduler.mamba_shared_prefix_checkpoint (the managers' flag is left as it is).
    scheduler_junction_hook: bool = False
    # EXTENSION (docs/junctions.md, "Device junctions"): the hook also set
    # KVCacheManager.mamba_shared_prefix_checkpoint and every MambaManager's flag, no EAGLE.
    manager_junction_hook: bool = False
    # The vLLM release whose semantics the model follows where releases differ (releases.py).
    vllm: str = DEFAULT
    # Derived in __post_init__.
    scheduler_block_size: int = field(init=False)
    coordinator_kind: str = field(init=False)  # "none" | "unitary" | "hybrid"
    partial_hits: bool = field(init=False)
    alignment: int = field(init=False)
    eagle_group_ids: frozenset[int] = field(init=False)
    drop_eagle_group_ids: frozenset[int] = field(init=False)
    manager_use_eagle: tuple[bool, ...] = field(init=False)
    attention_groups: tuple[SpecGroup, ...] = field(init=False)

    def __post_init__(self) -> None:
        h = self.hash_block_size
        sizes = [g.block_size for g in self.groups]
        for g in self.groups:
            if g.kind not in KINDS:
                raise ValueError(f"unsupported group kind {g.kind!r}")
            if g.block_size % h:
                raise ValueError(f"hash_block_size {h} must divide block size {g.block_size}")
            if (g.kind == SLIDING_WINDOW) != (g.sliding_window is not None):
                raise ValueError("a window is given exactly for sliding-window groups")
            if g.num_speculative_blocks and g.kind != MAMBA_ALIGN:
                raise ValueError("only Mamba groups have speculative blocks")
        if self.vllm not in RELEASES:
            raise ValueError(f"unsupported vLLM release {self.vllm!r}")
        # resolve_kv_cache_block_sizes: lcm of the groups when hybrid, else the one block size.
        sbs = lcm_all(sizes) if len(sizes) > 1 else sizes[0]
        # get_kv_cache_coordinator: no caching -> NoPrefixCache; one group -> Unitary.
        if not self.enable_caching:
            kind = "none"
        elif len(self.groups) == 1:
            kind = "unitary"
            if h != sizes[0]:
                raise ValueError("UnitaryKVCacheCoordinator assumes hash_block_size == block_size")
        else:
            kind = "hybrid"
        # kv_cache_utils.partial_hash_hits_enabled with the manager classes: a
        # SlidingWindowManager (no fine-grained lookup) whose block is not h turns hits off.
        partial = partial_hash_hits_enabled(
            [g.block_size for g in self.groups if g.kind == MAMBA_ALIGN], h, kind == "hybrid"
        ) and all(g.block_size == h for g in self.groups if g.kind == SLIDING_WINDOW)
        # HybridKVCacheCoordinator._cache_hit_alignment_tokens; other coordinators keep the
        # manager default (scheduler_block_size).
        alignment = hit_alignment(h, sbs, partial)
        # KVCacheCoordinator.__init__: flagged groups, or all when none is flagged.
        eagle_ids = frozenset(i for i, g in enumerate(self.groups) if g.eagle)
        if self.use_eagle and not eagle_ids:
            eagle_ids = frozenset(range(len(self.groups)))
        drop_ids = eagle_ids if self.use_eagle else frozenset()
        attention_groups = split_spec_groups(self.groups, drop_ids)
        # Manager.use_eagle: hybrid propagates the spec-group bit
        # (verify_and_split_kv_cache_groups); unitary sets ``0 in drop_eagle_group_ids``.
        use = [False] * len(self.groups)
        if kind == "hybrid":
            for sg in attention_groups:
                if sg.use_eagle:
                    for gid in sg.group_ids:
                        use[gid] = True
        elif kind == "unitary":
            use[0] = 0 in drop_ids
        object.__setattr__(self, "scheduler_block_size", sbs)
        object.__setattr__(self, "coordinator_kind", kind)
        object.__setattr__(self, "partial_hits", partial)
        object.__setattr__(self, "alignment", alignment)
        object.__setattr__(self, "eagle_group_ids", eagle_ids)
        object.__setattr__(self, "drop_eagle_group_ids", drop_ids)
        object.__setattr__(self, "manager_use_eagle", tuple(use))
        object.__setattr__(self, "attention_groups", attention_groups)

    @property
    def release(self) -> Release:
        """The switches of the release the model follows (``releases.py``)."""
        return RELEASES[self.vllm]

    # --- scheduler-side values (Scheduler.__init__ / engine/core.py) ---

    @property
    def has_mamba(self) -> bool:
        return any(g.kind == MAMBA_ALIGN for g in self.groups)

    @property
    def cache_config_block_size(self) -> int:
        """``cache_config.block_size`` as ``_mamba_block_aligned_split`` reads it: its Mamba
        alignment unit. Taken as the (largest) Mamba block size, as the conformance harness's
        vLLM adapter and the verified C-series runs do. Real hybrid models give attention and
        Mamba one block size; engine/core.py would set ``min`` of the group sizes, which differs
        only when full attention uses smaller blocks than Mamba."""
        if self.split_block_size is not None:
            return self.split_block_size
        mamba = [g.block_size for g in self.groups if g.kind == MAMBA_ALIGN]
        return max(mamba) if mamba else min(g.block_size for g in self.groups)

    @property
    def mamba_partial_cache_hit(self) -> bool:
        """``Scheduler.mamba_partial_cache_hit``."""
        return (
            self.has_mamba
            and self.hash_block_size < self.scheduler_block_size
            and self.partial_hits
        )

    @property
    def manager_shared_prefix_checkpoint(self) -> bool:
        """``KVCacheManager.mamba_shared_prefix_checkpoint``: the flag takes effect only with an
        EAGLE group and partial hits (no multi-module MTP re-prefill tail is modelled, so
        ``num_reprefillable_tokens == 0``). It sets ``shared_prefix_checkpoint`` on every Mamba
        manager."""
        return (
            (self.enable_mamba_shared_prefix_checkpoint and bool(self.eagle_group_ids)
             or self.manager_junction_hook)
            and self.partial_hits
            and self.coordinator_kind == "hybrid"
        )

    @property
    def mamba_shared_prefix_checkpoint(self) -> bool:
        """``Scheduler.mamba_shared_prefix_checkpoint``: the split stops at the junction itself
        (not block-floored) only when the manager will key the state there, or when the
        junction-checkpoint hook set it (the connector then stores the state itself)."""
        return self.mamba_partial_cache_hit and (
            self.manager_shared_prefix_checkpoint or self.scheduler_junction_hook)

    @classmethod
    def from_config(cls, config: Any) -> Geometry:
        """A plain ``Geometry`` of a trace config (a subclass with more fields) or of anything
        with the same fields."""
        groups = tuple(
            GroupSpec(g.kind, int(g.block_size), bool(getattr(g, "eagle", False)),
                      getattr(g, "sliding_window", None),
                      int(getattr(g, "num_speculative_blocks", 0)))
            for g in config.groups
        )
        return cls(
            groups=groups,
            hash_block_size=int(config.hash_block_size),
            num_blocks=int(config.num_blocks),
            enable_caching=bool(getattr(config, "enable_caching", True)),
            use_eagle=bool(getattr(config, "use_eagle", False)),
            max_model_len=int(getattr(config, "max_model_len", 8192)),
            max_num_scheduled_tokens=int(getattr(config, "max_num_scheduled_tokens", 8192)),
            long_prefill_token_threshold=int(getattr(config, "long_prefill_token_threshold", 0)),
            split_block_size=getattr(config, "split_block_size", None),
            enable_mamba_shared_prefix_checkpoint=bool(
                getattr(config, "enable_mamba_shared_prefix_checkpoint", False)),
            vllm=getattr(config, "vllm", DEFAULT),
        )


def split_spec_groups(
    groups: tuple[GroupSpec, ...], drop_ids: frozenset[int]
) -> tuple[SpecGroup, ...]:
    """Mirrors ``HybridKVCacheCoordinator.verify_and_split_kv_cache_groups``: groups with an
    equal spec (here: same kind, block size and window) are merged, full attention first."""
    merged: list[SpecGroup] = []
    for i, g in enumerate(groups):
        eagle = i in drop_ids
        for idx, sg in enumerate(merged):
            if (sg.kind, sg.block_size, sg.sliding_window) == (
                    g.kind, g.block_size, g.sliding_window):
                merged[idx] = SpecGroup(
                    sg.kind, sg.block_size, (*sg.group_ids, i), sg.use_eagle or eagle,
                    sg.sliding_window,
                )
                break
        else:
            merged.append(SpecGroup(g.kind, g.block_size, (i,), eagle, g.sliding_window))
    merged.sort(key=lambda sg: sg.kind != FULL_ATTENTION)  # stable, like list.sort
    return tuple(merged)
