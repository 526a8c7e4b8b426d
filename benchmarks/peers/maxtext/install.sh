#!/usr/bin/env bash
# Builds MaxText's environment for the peer benchmark: a Python 3.12 virtual environment (MaxText 0.2.5
# needs >= 3.12; jaxpar's own may be older) holding requirements.txt and then the MaxText wheel without
# its dependencies. Safe to run again: an environment that already imports MaxText is left as it is.
#
#   benchmarks/peers/maxtext/install.sh            # into ~/.cache/jaxpar/maxtext-venv
#   MAXTEXT_VENV=/somewhere PYTHON312=/usr/bin/python3.12 benchmarks/peers/maxtext/install.sh
#
# Then `python scripts/bench.py mesh --maxtext` finds $MAXTEXT_VENV/bin/python (or pass --maxtext_python).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${MAXTEXT_VENV:-$HOME/.cache/jaxpar/maxtext-venv}"
version=0.2.5

imports_maxtext() {
  [ -x "$venv/bin/python" ] && JAX_PLATFORMS=cpu "$venv/bin/python" -c \
    "import importlib.metadata as m, maxtext.trainers.pre_train.train; assert m.version('maxtext') == '$version'" >/dev/null 2>&1
}

if imports_maxtext; then
  echo "MaxText $version is already installed in $venv"
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  python312="${PYTHON312:-}"
  if [ -z "$python312" ]; then  # python3.12 on PATH, else a pyenv-installed one
    for candidate in python3.12 "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12; do
      # run it: a pyenv shim answers `command -v` but fails when 3.12 is not selected
      if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then python312="$candidate"; break; fi
    done
  fi
  [ -n "$python312" ] || { echo "no Python 3.12 found: set PYTHON312=/path/to/python3.12" >&2; exit 1; }
  "$python312" -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements.txt"
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "maxtext==$version"
if imports_maxtext; then
  echo "MaxText $version installed in $venv"
else
  echo "MaxText does not import in $venv:" >&2
  JAX_PLATFORMS=cpu "$venv/bin/python" -c "import maxtext.trainers.pre_train.train" 2>&1 | tail -3 >&2
  exit 1
fi
