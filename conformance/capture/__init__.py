"""Capture traces from a live vLLM 0.33 engine: the recorder (``recorder``) and its vLLM plugin
(``plugin``), which run inside production engines and need only the trace format.
``tailproof capture``'s CPU engine and workloads are ``tools/capture_engine/``.
"""
