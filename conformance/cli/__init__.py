"""The ``tailproof`` command line: ``main`` builds the parser, one module per command."""
