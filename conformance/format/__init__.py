"""The trace format (tailproof-trace/1): the op vocabulary, token notation, limits, the loader
and its checks, the step protocol and what agreeing on an observation means."""
