"""Pure-torch equivalents of the native ``_C`` ops vLLM's CPU path calls in the test bed.

Why: the installed vLLM wheel is a CUDA build, so ``torch.ops._C`` has no CPU kernels. The
test-bed platform (``platform.TestBedPlatform.import_kernels``) registers these instead; each
mirrors the contract of the op it replaces, cited per function. Registered once per process,
all of them on either release (an op a release never calls is never reached):

* vLLM 0.33's V1 CPU runner: ``init_cpu_memory_env``, ``compute_slot_mapping_kernel_impl``,
  ``greedy_argmax``, ``fused_gumbel_argmax``;
* vLLM 0.34's standalone Model Runner V2 (``v1/worker/cpu/``, through ``vllm/_cpu_ops.py``):
  ``init_cpu_memory_env`` and the batch, block-table and sampling kernels below. Their C++ is
  not in the wheel; each is the CPU twin of a Triton kernel of the GPU Model Runner V2
  (``v1/worker/gpu/``), whose contract the stand-in follows and cites.
"""

from __future__ import annotations

import threading

import torch

_LOCK = threading.Lock()
_LIB: torch.library.Library | None = None
PAD_SLOT_ID = -1  # vllm.v1.attention.backends.utils.PAD_SLOT_ID

#: op name -> schema (``torch.library``; ``(a!)`` marks a tensor the op writes)
SCHEMAS = {
    "init_cpu_memory_env": "(int[] nodes) -> ()",
    # vLLM 0.33 (V1)
    "compute_slot_mapping_kernel_impl": "(Tensor query_start_loc, Tensor positions, "
    "Tensor block_table, Tensor(a!) slot_mapping, int block_size) -> ()",
    "greedy_argmax": "(Tensor logits) -> Tensor",
    "fused_gumbel_argmax": "(Tensor logits, Tensor seeds) -> Tensor",
    # vLLM 0.34 (standalone Model Runner V2)
    "gather_block_table_cpu": "(Tensor block_table, Tensor(a!) output, Tensor idx_mapping, "
    "Tensor num_blocks, int num_reqs_padded) -> ()",
    "compute_slot_mapping_cpu": "(Tensor block_table, Tensor(a!) slot_mapping, "
    "Tensor idx_mapping, Tensor query_start_loc, Tensor positions, int block_size, "
    "bool mapping_enabled, int pad_slot_id) -> ()",
    "prepare_prefill_inputs_cpu": "(Tensor(a!) input_ids, Tensor(b!) next_prefill_tokens, "
    "Tensor idx_mapping, Tensor query_start_loc, Tensor all_token_ids, Tensor prefill_len, "
    "Tensor num_computed_tokens) -> ()",
    "prepare_pos_seq_lens_cpu": "(Tensor idx_mapping, Tensor query_start_loc, "
    "Tensor num_computed_tokens, Tensor(a!) pos, Tensor(b!) seq_lens) -> ()",
    "combine_sampled_and_draft_tokens_cpu": "(Tensor(a!) input_ids, Tensor idx_mapping, "
    "Tensor last_sampled_tokens, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor prefill_len, Tensor draft_tokens, Tensor cu_num_logits, int num_logits, "
    "int num_new_sampled_tokens) -> Tensor",
    "post_update_cpu": "(Tensor idx_mapping, Tensor(a!) num_computed_tokens, "
    "Tensor(b!) last_sampled_tokens, Tensor(c!)? output_bin_counts, Tensor sampled_tokens, "
    "Tensor num_sampled, Tensor num_rejected, Tensor? query_start_loc, "
    "Tensor(d!) all_token_ids, Tensor(e!) total_len) -> ()",
    "gumbel_sample_cpu": "(Tensor logits, Tensor expanded_idx_mapping, Tensor temperature, "
    "Tensor seeds, Tensor positions, bool apply_temperature, bool is_drafting, "
    "bool use_fp64) -> Tensor",
}


def init_cpu_memory_env(nodes: list[int]) -> None:
    """``CPUWorker.__init__`` binds the worker's memory node; one-node test bed: nothing to do."""


# --- vLLM 0.33, Model Runner V1 ---------------------------------------------------------------


def compute_slot_mapping_kernel_impl(query_start_loc: torch.Tensor, positions: torch.Tensor,
                                     block_table: torch.Tensor, slot_mapping: torch.Tensor,
                                     block_size: int) -> None:
    """slot = block_table[req, pos // block_size] * block_size + pos % block_size, per token;
    the rest padded with PAD_SLOT_ID (``ComputeSlotMappingKernel.kernel``, block_table.py)."""
    qsl = query_start_loc.to(torch.int64)
    n = int(qsl[-1])
    counts = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    pos = positions[:n].to(torch.int64)
    blocks = block_table[req, pos // block_size].to(torch.int64)
    slot_mapping[:n] = blocks * block_size + pos % block_size
    slot_mapping[n:] = PAD_SLOT_ID


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax, first index on ties (``Sampler.greedy_sample``'s non-CPU branch)."""
    return logits.argmax(dim=-1).view(-1)


def fused_gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """argmax(logits + Gumbel noise), the noise of row i drawn from seed ``seeds[i]``
    (``TopKTopPSampler`` random sampling on CPU)."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    for i in range(logits.shape[0]):
        out[i] = _gumbel_argmax(logits[i].double(), int(seeds[i]))
    return out


def _gumbel_argmax(row: torch.Tensor, seed: int) -> int:
    """argmax(row + Gumbel noise), the noise from a float64 generator seeded by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(row.shape[0], generator=g, dtype=torch.float64).clamp_(1e-20, 1.0)
    return int(torch.argmax(row.double() - torch.log(-torch.log(u))))


# --- vLLM 0.34, the standalone Model Runner V2 ------------------------------------------------


def _spans(query_start_loc: torch.Tensor, num_reqs: int) -> list[tuple[int, int]]:
    """Each batch row's token range ``[start, end)`` from ``query_start_loc``."""
    qsl = query_start_loc[: num_reqs + 1].tolist()
    return list(zip(qsl[:-1], qsl[1:], strict=True))


def gather_block_table_cpu(block_table: torch.Tensor, output: torch.Tensor,
                           idx_mapping: torch.Tensor, num_blocks: torch.Tensor,
                           num_reqs_padded: int) -> None:
    """Row b of ``output`` gets the first ``num_blocks[r]`` entries of row ``r = idx_mapping[b]``
    of ``block_table``; rows past the batch, up to ``num_reqs_padded``, are zeroed
    (``_gather_block_tables_kernel``, ``v1/worker/gpu/block_table.py``; the CPU caller
    ``CPUBlockTables.gather_block_tables`` masks sliding windows itself)."""
    num_reqs = idx_mapping.shape[0]
    for b, r in enumerate(idx_mapping.tolist()):
        n = int(num_blocks[r])
        output[b, :n] = block_table[r, :n]
    output[num_reqs:num_reqs_padded] = 0


def compute_slot_mapping_cpu(block_table: torch.Tensor, slot_mapping: torch.Tensor,
                             idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                             positions: torch.Tensor, block_size: int, mapping_enabled: bool,
                             pad_slot_id: int) -> None:
    """Per token of row b: ``block_table[r, pos // block_size] * block_size + pos % block_size``
    with ``r = idx_mapping[b]``; ``pad_slot_id`` for a group without slot mapping, a row with
    ``r < 0`` (a dummy request), and every entry past the batch's tokens
    (``_compute_slot_mappings_kernel``, ``v1/worker/gpu/block_table.py``, no context
    parallelism)."""
    num_reqs = idx_mapping.shape[0]
    qsl = query_start_loc[: num_reqs + 1].to(torch.int64)
    n = int(qsl[-1])
    slot_mapping[n:] = pad_slot_id
    if not mapping_enabled:
        slot_mapping[:n] = pad_slot_id
        return
    req = idx_mapping.to(torch.int64).repeat_interleave(qsl[1:] - qsl[:-1])
    pos = positions[:n].to(torch.int64)
    real = req >= 0
    blocks = block_table[req.clamp(min=0), pos // block_size].to(torch.int64)
    slots = blocks * block_size + pos % block_size
    slot_mapping[:n] = torch.where(real, slots, pad_slot_id)


def prepare_prefill_inputs_cpu(input_ids: torch.Tensor, next_prefill_tokens: torch.Tensor,
                               idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                               all_token_ids: torch.Tensor, prefill_len: torch.Tensor,
                               num_computed_tokens: torch.Tensor) -> None:
    """For each row still prefilling (``num_computed < prefill_len`` of its request): its
    scheduled tokens ``all_token_ids[r, computed : computed + query_len]`` into ``input_ids``,
    and the next ``next_prefill_tokens.shape[0]`` prefill tokens after them (0 past the
    prefill) into column r of ``next_prefill_tokens`` (``_prepare_prefill_inputs_kernel``,
    ``v1/worker/gpu/input_batch.py``)."""
    num_lookahead = next_prefill_tokens.shape[0]
    rows = idx_mapping.tolist()
    for (start, end), r in zip(_spans(query_start_loc, len(rows)), rows, strict=True):
        computed, plen = int(num_computed_tokens[r]), int(prefill_len[r])
        if computed >= plen:
            continue
        qlen = end - start
        input_ids[start:end] = all_token_ids[r, computed:computed + qlen]
        for j in range(num_lookahead):
            p = computed + qlen + j
            next_prefill_tokens[j, r] = all_token_ids[r, p] if p < plen else 0


def prepare_pos_seq_lens_cpu(idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                             num_computed_tokens: torch.Tensor, pos: torch.Tensor,
                             seq_lens: torch.Tensor) -> None:
    """Row b: ``seq_lens[b] = computed + query_len`` and positions ``computed ..`` for its
    tokens; ``seq_lens`` past the batch zeroed (``_prepare_pos_seq_lens_kernel``,
    ``v1/worker/gpu/input_batch.py``)."""
    rows = idx_mapping.tolist()
    for b, ((start, end), r) in enumerate(zip(_spans(query_start_loc, len(rows)), rows,
                                              strict=True)):
        computed = int(num_computed_tokens[r])
        seq_lens[b] = computed + end - start
        pos[start:end] = torch.arange(computed, computed + end - start, dtype=pos.dtype)
    seq_lens[len(rows):] = 0


def combine_sampled_and_draft_tokens_cpu(
        input_ids: torch.Tensor, idx_mapping: torch.Tensor, last_sampled_tokens: torch.Tensor,
        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, prefill_len: torch.Tensor,
        draft_tokens: torch.Tensor, cu_num_logits: torch.Tensor, num_logits: int,
        num_new_sampled_tokens: int) -> torch.Tensor:
    """The logits indices (row b's last ``cu_num_logits[b+1] - cu_num_logits[b]`` tokens); for
    a row past its prefill, its last sampled token (flat element r of ``last_sampled_tokens``)
    into its first logit slot when that slot is past the prefill, and its draft tokens into the
    last slots (``_combine_sampled_and_draft_tokens_kernel``, ``v1/worker/gpu/input_batch.py``)."""
    out = torch.empty(num_logits, dtype=torch.int64)
    last = last_sampled_tokens.reshape(-1)
    cu = cu_num_logits.tolist()
    qsl = query_start_loc.tolist()
    for b, r in enumerate(idx_mapping.tolist()):
        nlog = cu[b + 1] - cu[b]
        ndraft = nlog - num_new_sampled_tokens
        qend = qsl[b + 1]
        first = qend - nlog
        out[cu[b]:cu[b + 1]] = torch.arange(first, qend)
        seq_len, plen = int(seq_lens[b]), int(prefill_len[r])
        if seq_len <= plen:
            continue
        if num_new_sampled_tokens > 0 and seq_len - nlog >= plen:
            input_ids[first] = last[r]
        if ndraft > 0:
            input_ids[qend - ndraft:qend] = draft_tokens[r, :ndraft]
    return out


def post_update_cpu(idx_mapping: torch.Tensor, num_computed_tokens: torch.Tensor,
                    last_sampled_tokens: torch.Tensor, output_bin_counts: torch.Tensor | None,
                    sampled_tokens: torch.Tensor, num_sampled: torch.Tensor,
                    num_rejected: torch.Tensor, query_start_loc: torch.Tensor | None,
                    all_token_ids: torch.Tensor, total_len: torch.Tensor) -> None:
    """After sampling, per row b with ``r = idx_mapping[b] >= 0``: its ``num_sampled[b]`` tokens
    appended to ``all_token_ids[r]`` at ``total_len[r]`` (and counted in ``output_bin_counts``),
    the last one kept as r's last sampled token, ``total_len`` advanced, and
    ``num_computed_tokens[r]`` advanced by ``query_len - num_rejected[b]`` (query length 0 when
    ``query_start_loc`` is None) (``_post_update_kernel``, ``v1/worker/gpu/input_batch.py``, no
    draft tokens)."""
    last = last_sampled_tokens.view(-1)
    for b, r in enumerate(idx_mapping.tolist()):
        if r < 0:
            continue
        tlen, ns = int(total_len[r]), int(num_sampled[b])
        if ns > 0:
            last[r] = sampled_tokens[b, ns - 1]
            total_len[r] = tlen + ns
        for i in range(ns):
            tok = int(sampled_tokens[b, i])
            all_token_ids[r, tlen + i] = tok
            if output_bin_counts is not None:
                output_bin_counts[r, tok] += 1
        qlen = 0 if query_start_loc is None else int(query_start_loc[b + 1] - query_start_loc[b])
        delta = qlen - int(num_rejected[b])
        if delta:
            num_computed_tokens[r] += delta


def gumbel_sample_cpu(logits: torch.Tensor, expanded_idx_mapping: torch.Tensor,
                      temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                      apply_temperature: bool, is_drafting: bool, use_fp64: bool) -> torch.Tensor:
    """Per token row i of request ``r = expanded_idx_mapping[i]``: plain argmax at temperature
    0 (the first maximum, the first NaN first, as ``torch.argmax``), else the argmax of the
    (temperature-scaled when ``apply_temperature``) logits plus Gumbel noise drawn for
    ``(seeds[r], positions[i], is_drafting)`` (``gumbel_noised_argmax`` /
    ``_gumbel_sample_kernel``, ``v1/worker/gpu/sample/gumbel.py``). The noise comes from a
    torch generator, not vLLM's murmur3 stream: random samples differ from vLLM's, greedy ones
    (the test bed's) do not."""
    dtype = torch.float64 if use_fp64 else torch.float32
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    for i, r in enumerate(expanded_idx_mapping.tolist()):
        row = logits[i].to(dtype)
        temp = float(temperature[r]) if r >= 0 else 0.0
        if temp == 0.0:
            out[i] = int(torch.argmax(row))
            continue
        if apply_temperature:
            row = row / temp
        stream = hash((int(seeds[r]), int(positions[i]), is_drafting)) & ((1 << 63) - 1)
        out[i] = _gumbel_argmax(row, stream)
    return out


def define(lib: torch.library.Library) -> None:
    """Define and implement every op of :data:`SCHEMAS` in ``lib``'s namespace."""
    for name, schema in SCHEMAS.items():
        lib.define(name + schema)
        lib.impl(name, globals()[name], "CompositeExplicitAutograd")


def register() -> None:
    """Define every op of :data:`SCHEMAS` in the ``_C`` namespace (idempotent; keeps the
    library alive)."""
    global _LIB
    with _LOCK:
        if _LIB is not None:
            return
        lib = torch.library.Library("_C", "FRAGMENT")
        define(lib)
        _LIB = lib
