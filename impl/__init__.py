"""The production connector: ``tailproof.impl.connector.TailproofConnector`` (see
docs/deploy.md and docs/impl.md) and the stores behind it (``tailproof.impl.stores``)."""
