"""Checks on a quotient a script prints beside the rounded numbers it was made of.

A script divides its unrounded numbers and prints all three rounded, so the printed quotient can be
checked only against the interval the printed operands allow, widened by its own rounding. A relative
tolerance picked by hand fails when the operands happen to be small (a 0.081 s step printed to 1 ms
is 0.6% off), and hides a real error when they are large.
"""


def quotient_interval(numerator, denominator, numerator_decimals=None, denominator_decimals=None):
    """The interval numerator / denominator lies in when each was printed to that many decimals
    (None: exact)."""
    def half(decimals):
        return 0.0 if decimals is None else 0.5 * 10.0 ** -decimals

    n, d = half(numerator_decimals), half(denominator_decimals)
    assert denominator - d > 0, f"a denominator of {denominator} printed to {denominator_decimals} decimals says nothing"
    return (numerator - n) / (denominator + d), (numerator + n) / (denominator - d)


def assert_printed_quotient(printed, numerator, denominator, *, decimals, numerator_decimals=None,
                            denominator_decimals=None, context=None):
    """`printed` (to `decimals`) is numerator / denominator of the unrounded numbers these were printed from."""
    low, high = quotient_interval(numerator, denominator, numerator_decimals, denominator_decimals)
    slack = 0.5 * 10.0 ** -decimals + 1e-9
    assert low - slack <= printed <= high + slack, (printed, (low, high), context)
