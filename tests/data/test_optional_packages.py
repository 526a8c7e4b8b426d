"""Optional packages: the extras in pyproject.toml hold what jaxpar imports for a feature, and a
missing one is one line naming the extra (exit 2 from scripts/train.py, nothing written).

A missing package is simulated in a child process by `sys.modules[name] = None`, which makes
`import name` fail as if it were not installed; each test checks that the simulation bites (the
plain import fails, or transformers itself prints its advice) before trusting the line jaxpar prints.
"""

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from tokenizers import Tokenizer

from jaxpar.extras import EXTRAS
from tests.support.documents import make_tokenizer, write_jsonl
from tests.support.hidden_packages import run_without, train_without
from tests.support.paths import REPO

# ---------------------------------------------------------------- the extras hold what jaxpar imports


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def _closure(requirements) -> set[str]:
    """Distributions `requirements` install, transitively (installed metadata; extras of dependencies left out)."""
    seen, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = _name(str(req))
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in importlib.metadata.requires(req.name) or []]
        except importlib.metadata.PackageNotFoundError:
            pass
    return seen


def third_party_imports(root) -> dict[str, str]:
    """Top-level module -> a file that imports it (statically, or through `require("module", ...)`),
    for every module under `root` that is neither the standard library nor jaxpar."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require" and node.args:
                names = [node.args[0].value] if isinstance(node.args[0], ast.Constant) else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "jaxpar":
                    found.setdefault(top, str(path.relative_to(root.parent)))
    return found


def test_every_package_jaxpar_imports_comes_with_the_install_or_its_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = _closure(project["dependencies"])
    extras = project["optional-dependencies"]
    distributions = importlib.metadata.packages_distributions()
    imported = third_party_imports(REPO / "jaxpar")
    assert {"jax", "transformers", "datasets"} <= set(imported), "the import scan finds nothing"
    problems = []
    for module, where in sorted(imported.items()):
        dists = {_name(d) for d in distributions.get(module, [module])}
        if module in EXTRAS:
            extra, package = EXTRAS[module][0].strip("[]"), EXTRAS[module][1]
            if _name(package) not in _closure(extras.get(extra, [])):
                problems.append(f"{where} imports {module}, which the [{extra}] extra does not install")
        elif not dists & core:
            problems.append(f"{where} imports {module}, which `pip install -e .` does not install and jaxpar.extras does not name")
    for bracketed, package in EXTRAS.values():  # every extra the one-line messages name exists and installs it
        extra = bracketed.strip("[]")
        if _name(package) not in _closure(extras.get(extra, [])):
            problems.append(f"jaxpar.extras names [{extra}] for {package}, which that extra does not install")
    assert not problems, "\n".join(problems)
    assert "tensorboard" in extras and "tensorboard" not in core, "viewing TensorBoard scalars is the [tensorboard] extra"


def test_the_import_scan_sees_an_import_no_extra_holds(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("import os\nfrom jaxpar import extras\nimport yaml\n\ndef f():\n    require('toml', 'x')\n")
    assert third_party_imports(tmp_path / "pkg") == {"yaml": "pkg/a.py", "toml": "pkg/a.py"}


# ---------------------------------------------------------------- a missing package is one line


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_without_transformers_or_datasets_is_one_line_and_exit_2(tmp_path):
    tokenizer = make_tokenizer(tmp_path / "tok")
    corpus = write_jsonl(tmp_path / "docs.jsonl", ["one document", "another document"] * 50)
    workdir = tmp_path / "run"
    done = train_without(["transformers"], f"--workdir={workdir}", f"--config.data.tokenizer={tokenizer}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert _one_error_line(done) == (
        f"error: data.tokenizer={tokenizer!r} needs transformers, which is not installed: "
        f'pip install -e ".[data]" (or pip install transformers)'
    )
    done = train_without(["datasets"], f"--workdir={workdir}", "--config.data.source=datasets", f"--config.data.path={corpus}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert _one_error_line(done) == (
        "error: data.source='datasets' needs datasets, which is not installed: pip install -e \".[data]\" (or pip install datasets)"
    )
    assert not workdir.exists(), "nothing is written"


def test_the_library_names_the_extra_where_it_imports_transformers_or_datasets(tmp_path):
    tokenizer = make_tokenizer(tmp_path / "tok")
    records = write_jsonl(tmp_path / "docs.json", ["a record"])
    code = f"""
try:
    import transformers
except ImportError:
    print("hidden")
from jaxpar.data.documents import DataError
from jaxpar.data.hf_stream import open_stream
from jaxpar.data.prepare import PrepareError, load_tokenizer
from jaxpar.data.tokenizer import TextTokenizer, TokenizerError
for attempt, error in [(lambda: TextTokenizer({tokenizer!r}), TokenizerError), (lambda: load_tokenizer({tokenizer!r}), PrepareError),
                       (lambda: open_stream([{records!r}], needed_by="--input file x.json"), DataError)]:
    try:
        attempt()
    except error as e:
        print(e)
"""
    done = run_without(["transformers", "datasets"], code)
    assert done.returncode == 0, done.stderr[-3000:]
    hint = 'which is not installed: pip install -e ".[data]" (or pip install'
    assert done.stdout.splitlines() == [
        "hidden",
        f"data.tokenizer={tokenizer!r} needs transformers, {hint} transformers)",
        f"--tokenizer={tokenizer} needs transformers, {hint} transformers)",
        f"--input file x.json needs datasets, {hint} datasets)",
    ]


def test_a_tokenizer_loads_without_pytorch_and_without_its_advice(tmp_path):
    """transformers advises that PyTorch is missing on import; a tokenizer never needs it."""
    tokenizer = make_tokenizer(tmp_path / "tok")
    load = f"from jaxpar.data.tokenizer import TextTokenizer\nprint(TextTokenizer({tokenizer!r}).vocab_size)\n"
    done = run_without(["torch"], load)
    size = Tokenizer.from_file(os.path.join(tokenizer, "tokenizer.json")).get_vocab_size()  # the tokenizers library's count
    assert done.returncode == 0 and done.stdout.split() == [str(size)], done.stderr[-3000:]
    assert "PyTorch" not in done.stderr, done.stderr
    # The control: without jaxpar's filter the same child prints the advice (so the simulation bites).
    bare = run_without(["torch"], "import transformers\n")
    assert "PyTorch was not found" in bare.stderr, bare.stderr[-3000:]
