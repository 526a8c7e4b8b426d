"""One markdown table writer for the reports the analysis and the scripts generate."""


def table(header: list[str], rows: list[list]) -> list[str]:
    """Lines of a markdown table; cells are formatted with str()."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows
    ]
