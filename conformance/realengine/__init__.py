"""vLLM 0.33's real engine on CPU as a test bed: platform plugin, native-op stand-ins, a
plain-torch paged attention backend and a tiny deterministic hybrid model (``bed`` is the API).
"""
