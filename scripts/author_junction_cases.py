"""Entry point kept for the docs and CI: the builders live in
``tailproof.conformance.tools.authoring.junction_cases`` (run it with ``-m`` the same way).

    .venv/bin/python scripts/author_junction_cases.py [--check] [--out DIR] [NAME ...]
"""

import sys

from tailproof.conformance.tools.authoring import junction_cases
from tailproof.conformance.tools.authoring.author import main

if __name__ == "__main__":
    raise SystemExit(main(junction_cases.ALL, sys.argv[1:]))
