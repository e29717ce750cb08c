"""vLLM's real engine on CPU as a test bed, on 0.33 and 0.34: platform plugin, native-op
stand-ins, a plain-torch paged attention backend and a tiny deterministic hybrid model (``bed``
is the API; ``release`` names where the two releases differ).
"""
