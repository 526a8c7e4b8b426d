"""Which parametrized cases of a heavy test stay in the fast tier (`pytest -m "not slow and not multiprocess"`).

A degeneracy suite's cases each compile a sharded train step; a contributor's loop keeps a few that
cover its parallelism and leaves the rest to the whole suite, which runs every case.
"""

import pytest


def slow_except(cases, *fast):
    """`cases` as parametrize values, in their order, with every case not named in `fast` marked
    `slow`. A case is a name, or a tuple of argument values (named in `fast` the same way). Naming
    a case that does not exist is an error, so a renamed case cannot leave the fast tier unseen."""
    cases = list(cases)
    unknown = [case for case in fast if case not in cases]
    if unknown:
        raise ValueError(f"fast cases {unknown} are not among the cases {cases}")
    return [
        case if case in fast else pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=pytest.mark.slow)
        for case in cases
    ]
