"""The shipped corpus: ``conformance/cases/*.json`` (package data), where the CLI, the mutant
runner and the tests find it."""

from __future__ import annotations

from pathlib import Path

CASES_DIR = Path(__file__).resolve().parents[1] / "cases"


def corpus_paths() -> list[Path]:
    """Every case of the shipped corpus, in name order."""
    return sorted(CASES_DIR.glob("*.json"))
