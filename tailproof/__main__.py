"""``python -m tailproof`` is the ``tailproof`` command."""

from tailproof.conformance.cli import main

raise SystemExit(main())
