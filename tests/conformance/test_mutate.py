"""The mutation kit over the installed vLLM's partial-tail code (0.33 or 0.34; ``make test``
runs both): every mutant still applies to the installed vLLM, as that release reads it,
mutants live only in their forked child, a stale snippet and a hang are reported as such, and
a fixed sample of mutants is killed by the corpus (so a drop in the suite's strength fails
CI)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM (0.33 or 0.34) is not installed in this environment")
pytestmark = pytest.mark.vllm

from tailproof.conformance.cli.main import main  # noqa: E402
from tailproof.conformance.harness.corpus import corpus_paths  # noqa: E402
from tailproof.conformance.harness.releases import installed_release  # noqa: E402
from tailproof.conformance.tools.mutate.apply import StaleMutant, mutated_source  # noqa: E402
from tailproof.conformance.tools.mutate.catalog import BP, MUTANTS, Mutant  # noqa: E402
from tailproof.conformance.tools.mutate.run import (  # noqa: E402
    BROKEN,
    KILLED,
    STALE,
    SURVIVED,
    run_mutants,
    select,
)
from tailproof.conformance.tools.mutate.workload import build_workload  # noqa: E402
from tailproof.reference.releases import DEFAULT, RELEASES  # noqa: E402

#: The fixed CI sample: every k-th mutant of the catalog (the corpus alone, no generated traces).
CI_SAMPLE = 16
#: Sample mutants only the generated traces kill today (``tailproof mutate`` runs those too).
CORPUS_SURVIVORS = {"md-tail-published-twice"}


@pytest.fixture(scope="module")
def corpus_workload():  # noqa: ANN201
    return build_workload(corpus_paths(), 0, 0)


def test_catalog_applies_to_installed_vllm() -> None:
    assert len(MUTANTS) >= 60
    assert len({m.id for m in MUTANTS}) == len(MUTANTS)
    assert {m.release for m in MUTANTS} <= set(RELEASES) | {None}
    for m in MUTANTS:  # variants name a later release, oldest first, and only for any-release
        releases = [v.release for v in m.variants]
        assert releases == sorted(set(releases), key=list(RELEASES).index), m.id
        assert m.release is None or not m.variants, m.id
        assert DEFAULT not in releases, m.id
    chosen = select()  # a mutant of another release's rule is not selected (docs/releases.md)
    assert {m.id for m in chosen} == {m.id for m in MUTANTS
                                      if m.release in (None, installed_release())}
    for m in chosen:  # each as the installed release reads it (Mutant.at)
        _, _, _, src = mutated_source(m)  # raises StaleMutant when vLLM moved
        compile(src, m.id, "exec")
        assert m.find != m.replace, m.id


def test_stale_snippet_is_reported() -> None:
    m = Mutant("stale-probe", BP, "BlockPool.touch", "no such code", "x", "probe")
    with pytest.raises(StaleMutant, match="found 0 times"):
        mutated_source(m)


def test_mutants_stay_in_their_child(corpus_workload) -> None:  # noqa: ANN001
    from vllm.v1.core.block_pool import BlockPool

    before = BlockPool.touch
    path = Path(inspect.getsourcefile(BlockPool))
    text = path.read_text()
    one = [m for m in MUTANTS if m.id == "bp-touch-keeps-in-queue"]
    report = run_mutants(one, corpus_workload, jobs=1, timeout_s=120)
    assert report.results[0].status == KILLED
    assert report.results[0].killed_by["trace"]
    assert BlockPool.touch is before and path.read_text() == text


def test_stale_and_hang_are_classified(corpus_workload) -> None:  # noqa: ANN001
    stale = Mutant("stale-probe", BP, "BlockPool.touch", "no such code", "x", "probe")
    hang = Mutant("hang-probe", BP, "BlockPool.get_num_free_blocks",
                  "return self.free_block_queue.num_free_blocks",
                  "while True:\n        pass", "an allocator that never answers")
    broken = Mutant("broken-probe", BP, "BlockPool.touch", "for block in blocks:",
                    "for block in blocks", "does not compile")
    report = run_mutants([stale, hang, broken], corpus_workload, jobs=2, timeout_s=8)
    by_id = {r.id: r for r in report.results}
    assert by_id["stale-probe"].status == STALE
    assert by_id["hang-probe"].status == KILLED
    assert by_id["hang-probe"].killed_by == {"timeout_s": 8}
    assert by_id["broken-probe"].status == BROKEN


def test_fixed_sample_is_killed_by_the_corpus(corpus_workload) -> None:  # noqa: ANN001
    sample = [m for m in select(sample=CI_SAMPLE) if not m.equivalent]
    report = run_mutants(sample, corpus_workload, jobs=2, timeout_s=240)
    assert len(sample) >= CI_SAMPLE - 2
    survivors = {r.id for r in report.results if r.status != KILLED}
    lost = sorted(survivors - CORPUS_SURVIVORS)
    assert not lost, f"the corpus no longer kills: {lost}"
    assert all(r.status in (KILLED, SURVIVED) for r in report.results)


def test_corpus_kills_the_window_store_mutants(corpus_workload) -> None:  # noqa: ANN001
    """The store path with a sliding-window group: the cases with a window kill the two
    mutants that no trace reached while connector traces could not carry a window."""
    chosen = select(ids=["mw-null-chunk-saved", "ms-tail-puts-null-accepted"])
    report = run_mutants(chosen, corpus_workload, jobs=2, timeout_s=240)
    killed = {r.id for r in report.results if r.status == KILLED}
    assert killed == {"mw-null-chunk-saved", "ms-tail-puts-null-accepted"}
    # today by conn_w01 (the null reachable chunk) and conn_w02 (the null tail blocks) on
    # vLLM 0.33; on 0.34 by their _v034 counterparts or conn_v034_missing_source_retried
    windowed = {j.name for j in corpus_workload.jobs
                if any(g.kind == "sliding_window" for g in j.config.groups)}
    assert all(r.killed_by["trace"] in windowed for r in report.results)


def test_cli_json_and_bad_module(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mutate", "--module", "no-such-module"]) == 2
    capsys.readouterr()
    rc = main(["mutate", "--json", "--mutant", "co-no-clipping", "--generated", "0",
               "--generated-connector", "0", "--generated-window", "0"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["killed"] == 1 and out["non_equivalent"] == 1
    assert out["by_module"]["core/kv_cache_coordinator"]["killed"] == 1
    assert out["mutants"][0]["killed_by"]["trace"]
    _report_with_mutation_is_valid(out)


def _report_with_mutation_is_valid(part: dict[str, object]) -> None:
    """``check --mutate --json``: the score joins the report as ``mutation`` (schema-valid,
    its time under ``timings``; a score below the minimum is its own result)."""
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    from tailproof.conformance.harness import report
    from tailproof.conformance.harness.vllm_compat import inspect_vllm

    schema = json.loads((Path(report.__file__).parents[1] / "schema" /
                         "report.schema.json").read_text())
    for passed in (True, False):
        mutation = {**part, "min_score": 0.95, "passed": passed}
        doc = report.document("check", vllm=inspect_vllm(["vllm"]).as_json(),
                              adapters=["reference"], not_run={}, strict_ids=False,
                              conformance=report.conformance_part([], 0.0),
                              proofs=report.proofs_part(None, "--no-prove", False),
                              findings=[], exit_code=0 if passed else 1, total_seconds=1.0,
                              mutation=mutation)
        jsonschema.Draft202012Validator(schema).validate(doc)
        assert doc["timings"]["mutation_s"] == part["seconds"]
        assert doc["result"] == ("agreed" if passed else "mutation_below_min")
