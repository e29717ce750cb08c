"""Process-tree probes for the signal tests (the CLI and `prove`'s worker pool must leave no
child behind): read from /proc, no psutil. Importable from every test folder (the root
conftest's folder is on ``sys.path``)."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid``."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p.name))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
