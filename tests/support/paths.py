"""Where the repository is, for tests that run its scripts."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOT = str(REPO)
