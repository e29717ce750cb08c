"""The reference model is pure Python: importing it (and its conformance shim) loads neither
vLLM nor torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("vllm", "torch")


def test_import_loads_no_vllm_or_torch() -> None:
    code = (
        "import sys\n"
        "import tailproof.reference as r\n"
        "import tailproof.reference.block_pool, tailproof.reference.coordinator\n"
        "import tailproof.reference.kv_manager, tailproof.reference.managers\n"
        "import tailproof.reference.scheduler_split\n"
        "import tailproof.conformance.harness.adapters.reference_core\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == ""


def test_no_module_imports_vllm_or_torch() -> None:
    files = [*sorted((ROOT / "reference").glob("*.py")),
             ROOT / "conformance" / "harness" / "adapters" / "reference_core.py"]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"
