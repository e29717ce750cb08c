"""The real-engine oracle: greedy outputs of the standard passes against an engine without
prefix caching (the ground truth).

The truth engine computes every prompt from scratch, with chunk boundaries of its own; the
caching engine's passes must reproduce its tokens exactly:

* ``cold``: first sight of the prompts (store empty unless shared);
* ``warm``: again, hits from vLLM's own device prefix cache;
* ``store-hit``: after ``reset_prefix_cache()`` (device only), hits from the store, including
  sub-block hits inside a Mamba block;
* ``after-reset``: after ``reset_prefix_cache(reset_connector=True)``: the connector moves to a
  fresh key epoch, nothing is reachable, everything is recomputed.

Greedy equality is the oracle because the model (``model.py``) is built so that a wrong value in
a loaded state or K/V block changes tokens, and its arithmetic does not depend on chunking.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tailproof.conformance.realengine.bed import Bed, Completion, EngineSpec

PASSES = ("cold", "warm", "store-hit", "after-reset")
VOCAB = 64  # model.CONFIG["vocab_size"]
FIRST_TOKEN = 3  # ids 0-2 are pad/bos/eos in config.json (unused: ignore_eos)
#: shared-prefix lengths of the default workload: inside the first block, on block and h
#: boundaries, just past them, several blocks (block 64, h 16)
#: decode length: crosses a 64-token Mamba block boundary while decoding
MAX_TOKENS = 80
PREFIX_LENGTHS = (16, 40, 64, 100, 128, 150, 200, 257, 288, 320, 400, 515)


def shared_prefix_prompts(seed: int = 0, lengths: Sequence[int] = PREFIX_LENGTHS,
                          tail: int = 23) -> list[list[int]]:
    """Prompts ``base[:L] + own tail`` for each L: pairs of prompts share prefixes of many
    lengths, so later requests hit blocks (and sub-block tails) that earlier ones computed."""
    rng = random.Random(seed)
    base = [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(max(lengths) + tail)]
    prompts = []
    for i, n in enumerate(lengths):
        own = [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(tail - i % 7)]
        prompts.append(base[:n] + own)
    return prompts


def ground_truth(prompts: Sequence[Sequence[int]], max_tokens: int,
                 spec: EngineSpec | None = None) -> list[tuple[int, ...]]:
    """Greedy tokens of an engine with prefix caching off and no connector."""
    spec = spec or EngineSpec(prefix_caching=False)
    with Bed(spec) as bed:
        return [c.tokens for c in bed.generate(prompts, max_tokens)]


#: called with (bed, pass name) right before each pass (tests, ``tailproof smoke`` hooks)
PassHook = Callable[[Bed, str], None]


def run_passes(bed: Bed, prompts: Sequence[Sequence[int]], max_tokens: int,
               before: PassHook | None = None) -> dict[str, list[Completion]]:
    """The four passes of :data:`PASSES`, in order, on one engine."""
    out: dict[str, list[Completion]] = {}
    for name in PASSES:
        if name == "store-hit":
            bed.reset_prefix_cache()
        elif name == "after-reset":
            bed.reset_prefix_cache(reset_connector=True)
        if before is not None:
            before(bed, name)
        out[name] = bed.generate(prompts, max_tokens)
    return out


@dataclass
class PassResult:
    """One pass against the truth."""

    name: str
    differences: list[str] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences


def compare(truth: Sequence[Sequence[int]], got: Sequence[Completion],
            name: str = "pass") -> PassResult:
    """Each prompt's tokens against the truth; a difference names the prompt and the first
    differing position."""
    res = PassResult(name, cached_tokens=[c.num_cached_tokens for c in got])
    if len(got) != len(truth):
        res.differences.append(f"{len(got)} completions for {len(truth)} prompts")
        return res
    for i, (want, c) in enumerate(zip(truth, got, strict=True)):
        have = list(c.tokens)
        if have != list(want):
            j = next((k for k, (a, b) in enumerate(zip(want, have, strict=False))
                      if a != b),
                     min(len(want), len(have)))
            exp = want[j] if j < len(want) else None
            saw = have[j] if j < len(have) else None
            res.differences.append(f"prompt {i}: token {j} is {saw}, expected {exp} "
                                   f"({c.num_cached_tokens} prompt tokens were cached)")
    return res
