"""The production connector: ``tailproof.impl.connector.TailproofConnector`` (see the README's
"Deploy in vLLM" and docs/impl.md) and the stores behind it (``tailproof.impl.stores``)."""
