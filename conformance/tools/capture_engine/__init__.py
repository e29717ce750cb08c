"""``tailproof capture``'s engine: vLLM 0.33's real Scheduler on CPU with in-process worker
ranks, the named workloads and the corpus regeneration (``corpus``)."""
