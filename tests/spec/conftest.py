"""Hypothesis profiles for the spec machines: ``ci`` (default, >= 2,000 steps across both
machines) and ``dev`` (a quick look). Select with ``HYPOTHESIS_PROFILE=dev``."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Verbosity, settings

settings.register_profile(
    "ci", max_examples=120, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=list(HealthCheck), print_blob=True, verbosity=Verbosity.normal,
)
settings.register_profile(
    "dev", max_examples=20, stateful_step_count=20, deadline=None,
    suppress_health_check=list(HealthCheck), print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
