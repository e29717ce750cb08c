"""Map the top-level folders onto the tailproof.* package tree (see pyproject.toml)."""

from setuptools import find_packages, setup

PARTS = {"tailproof": "tailproof", "spec": "spec", "reference": "reference",
         "impl": "impl", "conformance": "conformance"}


def _packages() -> list[str]:
    names = ["tailproof"]
    for part, folder in PARTS.items():
        if part == "tailproof":
            continue
        names.append(f"tailproof.{part}")
        names += [f"tailproof.{part}.{sub}" for sub in find_packages(folder)]
    return names


setup(packages=_packages())
