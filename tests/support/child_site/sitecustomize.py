"""Imported at start-up by every Python the suite starts (its folder leads their PYTHONPATH:
tests/support/compile_flags.py): the cyclic collector made rare, as in the suite's own workers
(tests/conftest.py says why). A tiny train.py run spent 0.41 of 5.2 CPU s in it, 0.08 s so."""

import gc

gc.set_threshold(50_000, 20, 100)
