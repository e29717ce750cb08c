#!/usr/bin/env bash
# The house's guards, a few seconds in all (make lint, make test): ruff (its rule set in
# pyproject.toml, PLR0915 among them: no function over 50 statements), no `type: ignore` in our
# code (there is no type checker to answer to), commit subjects of at most 72 characters, and
# the import contracts (scripts/lint_imports.sh).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
VENV="${TAILPROOF_VENV:-.venv}"
fail=0

"$VENV/bin/ruff" check --quiet . || fail=1

# Our tracked sources (every .py outside the venvs where this is not a git checkout).
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    sources() { git ls-files -z -- '*.py'; }
else
    sources() { find . -name '*.py' -not -path './.venv*' -print0; }
fi
if ignores="$(sources | xargs -0 grep -n 'type: *ignore' --)"; then
    echo "guards: 'type: ignore' in our code (fix the type, or cast with a reason):" >&2
    echo "$ignores" >&2
    fail=1
fi

# Commit subjects from the guard's first commit on (older history predates the rule). A shallow
# clone may lack that commit: then only HEAD's subject is checked, and the script says so.
SUBJECTS_FROM=4cd4d8492bfddab2dfcc9bab08456706450d076d
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    if git cat-file -e "$SUBJECTS_FROM^{commit}" 2>/dev/null; then
        range=("$SUBJECTS_FROM..HEAD")
    else
        echo "guards: commit $SUBJECTS_FROM not in this clone (shallow?): checking HEAD only" >&2
        range=(-1 HEAD)
    fi
    long="$(git log --format='%h%x09%s' "${range[@]}" | awk -F'\t' 'length($2) > 72')"
    if [ -n "$long" ]; then
        echo "guards: commit subjects over 72 characters (put the detail in the body):" >&2
        echo "$long" >&2
        fail=1
    fi
fi

if ! contracts="$(./scripts/lint_imports.sh 2>&1)"; then
    echo "$contracts" >&2
    fail=1
fi
[ "$fail" = 0 ] && echo "guards: ruff, no type: ignore, commit subjects, import contracts: ok"
exit "$fail"
