"""A vLLM ``Executor`` whose single worker only samples, so vLLM's own ``EngineCore`` runs on
CPU with the weightless hybrid stand-in.

``EngineCore`` itself is vLLM's: it loads the general plugins (the recorder's entry point
included), asks the executor for the KV cache specs and memory, derives the
``KVCacheConfig`` and block sizes with vLLM's own functions, builds the scheduler from
``scheduler_config.get_scheduler_cls()`` and steps it (``schedule`` -> ``execute_model`` ->
``sample_tokens`` -> ``update_from_output``). The worker answers those RPCs without a model:
one attention layer and one Mamba layer (align mode) with equal page sizes, and a sampled
token that is a function of the sequence.
"""

from __future__ import annotations

from typing import Any

PAGE_BLOCKS = 64  # KV cache blocks the worker reports memory for


class SimWorker:
    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.pending: Any = None
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def get_kv_cache_spec(self) -> dict[str, Any]:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

        bs = self.vllm_config.cache_config.block_size
        # Equal page sizes: 2 (K, V) * bs * 1 head * 2 dims * 4 bytes = 16 * bs bytes.
        return {
            "model.layers.0.self_attn": FullAttentionSpec(
                block_size=bs, num_kv_heads=1, head_size=2, dtype=torch.float32),
            "model.layers.1.mamba": MambaSpec(
                block_size=bs, shapes=((2 * bs,), (2 * bs,)),
                dtypes=(torch.float32, torch.float32), mamba_cache_mode="align"),
        }

    def determine_available_memory(self) -> int:
        bs = self.vllm_config.cache_config.block_size
        return PAGE_BLOCKS * 16 * bs * 2

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def execute_model(self, scheduler_output: Any) -> None:
        """Track each request's length and computed tokens, as the model runner does."""
        so = self.pending = scheduler_output
        for r in so.scheduled_new_reqs:
            self.tokens[r.req_id] = list(r.prompt_token_ids)
            self.computed[r.req_id] = r.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            self.computed[rid] = cached.num_computed_tokens[i]
        return None

    def sample_tokens(self, grammar_output: Any) -> Any:
        from tailproof.conformance.vllm_release import model_runner_output

        so = self.pending
        rids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in rids:
            toks = self.tokens.setdefault(rid, [])
            done = self.computed.get(rid, 0) + so.num_scheduled_tokens[rid] >= len(toks)
            tok = 1000 + (sum(toks) * 31 + len(toks)) % 997
            if done:
                toks.append(tok)
            sampled.append([tok] if done else [])
        return model_runner_output(rids, sampled_token_ids=sampled)

    def take_draft_token_ids(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None  # control RPCs without a model (warm-up, layout...)


def executor_class() -> type:
    from vllm.v1.executor.abstract import Executor

    class SimExecutor(Executor):
        def _init_executor(self) -> None:
            self.worker = SimWorker(self.vllm_config)

        def collective_rpc(self, method: Any, timeout: Any = None, args: tuple = (),
                           kwargs: dict | None = None, non_block: bool = False) -> Any:
            fn = getattr(self.worker, method) if isinstance(method, str) else (
                lambda *a, **k: method(self.worker, *a, **k))
            out = [fn(*args, **(kwargs or {}))]
            if non_block:
                from concurrent.futures import Future

                f: Future = Future()
                f.set_result(out)
                return f
            return out

        def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
            out = self.collective_rpc("execute_model", args=(scheduler_output,),
                                      non_block=non_block)
            if non_block:
                from concurrent.futures import Future

                f: Future = Future()
                f.set_result(out.result()[0])
                return f
            return out[0]

        def compile_or_warm_up_model(self) -> None:
            return None  # nothing to compile: no model runs

        def check_health(self) -> None:
            return None

    return SimExecutor
