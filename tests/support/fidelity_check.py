"""The check of one fidelity case against its bounds (tests/support/analysis_bounds.py), shared by the
cost model's tests against compiled HLO (tests/analysis/test_analysis*.py)."""

from __future__ import annotations

from jaxpar.analysis.reports.fidelity import AxisBytes
from tests.support.analysis_bounds import ABSENT, BOUNDS, FLOOR, MINOR


def axis_failures(rows: list[AxisBytes], bounds: dict, minor: float) -> list[str]:
    """Mesh-axis sets whose predicted wire bytes miss the compiled ones by more than their bound
    (`bounds`: {"data,expert": bound}, else `FLOOR`). A set counts when either side carries more
    than `minor` of the step's compiled bytes: one the model predicts but the program lacks has
    error +inf, one the program has but the model lacks -100%, and both fail."""
    total = sum(r.compiled for r in rows)
    failures = []
    for row in rows:
        if max(row.predicted, row.compiled) <= minor * total:
            continue
        bound = bounds.get(",".join(row.axes), FLOOR)
        if not abs(row.error) <= bound:
            failures.append(f"{','.join(row.axes)}: {row.error:+.2%} (bound {bound:.1%})")
    return failures


def check_case(name: str, fidelity, *, flops: bool = True):
    """`fidelity` within `BOUNDS[name]`: peak memory, wire bytes per mesh-axis set, matmul FLOPs
    (`flops`); no collective the model does not plan carrying more than `MINOR` of the step's bytes
    (0.5% at least), and none the model plans that the program lacks (but those in `ABSENT`)."""
    bound, minor = BOUNDS[name], MINOR.get(name, 0.001)
    report = fidelity.table()
    print(report)
    assert abs(fidelity.memory_error) <= bound.memory, report
    failures = axis_failures(fidelity.axis_bytes(), bound.bytes, minor)
    assert not failures, (failures, report)
    assert not fidelity.unexpected(min_fraction=max(minor, 0.005)), report
    assert not [p for p in fidelity.missing() if (p.kind, p.axes) not in ABSENT.get(name, ())], report
    if flops:
        assert abs(fidelity.flops_error) <= bound.flops, report
