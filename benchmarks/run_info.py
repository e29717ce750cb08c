"""What every benchmark script records beside its figures: the vLLM release it measured and
the machine's load, so that a figure in BENCHMARKS.md can be traced to one release and one run.

Why: the project supports two vLLM releases (the venv's own and an overlay selected with
``PYTHONPATH=$(scripts/vllm_env.sh 0.33)``); a script's ratios differ between them, and the
machine is shared, so a figure without its release and load cannot be compared with another.

    info = RunInfo.start()          # before the first round: release, load
    ...
    info.finish(figures, path)      # prints one JSON line on stdout; also writes it to path
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any


def vllm_version() -> str:
    """The imported vLLM's version (the overlay on ``PYTHONPATH`` shadows the venv's own, so the
    module is asked, not the installed distribution), or "none"."""
    try:
        import vllm
    except ImportError:
        return "none"
    return str(vllm.__version__)


def load_avg() -> list[float]:
    """1, 5 and 15-minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


@dataclass
class RunInfo:
    """The release and the load at the start of a run; ``finish`` adds the load at the end."""

    vllm: str
    load_before: list[float]
    started: float = field(default_factory=time.time)

    @classmethod
    def start(cls) -> RunInfo:
        info = cls(vllm_version(), load_avg())
        print(f"vLLM {info.vllm}; load average before {info.load_before}", flush=True)
        return info

    def document(self, figures: dict[str, Any]) -> dict[str, Any]:
        """``figures`` with the run's release, machine and loads."""
        return {"vllm": self.vllm, "python": platform.python_version(),
                "cpus": os.cpu_count(), "load_avg_before": self.load_before,
                "load_avg_after": load_avg(),
                "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(self.started)), **figures}

    def finish(self, figures: dict[str, Any], path: str | None = None) -> dict[str, Any]:
        """Print the document as one JSON line (``--json`` line), and write it to ``path``."""
        doc = self.document(figures)
        line = json.dumps(doc, separators=(",", ":"))
        print(f"--json {line}", flush=True)
        if path:
            with open(path, "w") as f:
                json.dump(doc, f, indent=1)
        return doc
