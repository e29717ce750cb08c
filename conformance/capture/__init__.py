"""Capture traces from a live vLLM 0.33 engine: the recorder (``recorder``), its vLLM plugin
(``plugin``), and ``tailproof capture``'s CPU engine (``engine``) and workloads (``workloads``).
"""
