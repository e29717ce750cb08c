"""``tailproof mutate``: how many plausible bugs in vLLM 0.33's own partial-tail code the
corpus and the generators catch (catalog, in-memory application, forked runner)."""
