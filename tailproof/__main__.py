"""``python -m tailproof`` is the ``tailproof`` command."""

from tailproof.conformance.cli.main import main

raise SystemExit(main())
