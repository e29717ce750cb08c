"""Entry point kept for the docs: the historical-bug case builder lives in
``tailproof.conformance.tools.authoring.history_cases`` (run it with ``-m`` the same way).

    .venv/bin/python scripts/author_history_cases.py [BUG ...]
"""

import sys

from tailproof.conformance.tools.authoring.history_cases import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
