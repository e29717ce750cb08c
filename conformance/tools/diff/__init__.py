"""``tailproof diff``: what changes between two installed vLLM releases (docs/releases.md)."""
