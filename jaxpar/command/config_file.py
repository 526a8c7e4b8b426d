"""`--config=FILE[:ARG]` and `--config.KEY=VALUE`: a config file's `get_config()` and the overrides
typed by the key they replace (bool, int, float, str, lists as `[1, 2]` or `1,2`; "None" for
optional keys). Every problem is a `UsageError` line naming the flag, the file (with the line that
raised) or the key (with the nearest known key for a typo)."""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import traceback

from ml_collections import ConfigDict

from jaxpar.command.flags import UsageError, parse_value
from jaxpar.config import MOVED_KEYS
from jaxpar.train.preflight import flat_keys, nearest_key


def _where(error: BaseException, path: str) -> str:
    """" at line N" of the innermost frame of `path` in the error's traceback, if any."""
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if os.path.abspath(frame.filename) == path]
    return f" at line {lines[-1]}" if lines else ""


def load_config(spec: str) -> ConfigDict:
    """The ConfigDict of `--config=FILE[:ARG]`: FILE's get_config() (or get_config(ARG))."""
    path, _, arg = spec.partition(":")
    flag = f"--config={spec}"
    if not os.path.exists(path):
        raise UsageError(f"{flag}: {path} does not exist")
    if not os.path.isfile(path):
        raise UsageError(f"{flag}: {path} is not a file")
    path = os.path.abspath(path)
    module_spec = importlib.util.spec_from_file_location(f"_jaxpar_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        with open(path) as f:
            source = f.read()
        code = compile(source, path, "exec")
    except SyntaxError as e:
        raise UsageError(f"{flag}: syntax error in {path} at line {e.lineno}: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag}: cannot read {path} ({type(e).__name__}: {e})") from None
    sys.modules[module_spec.name] = module
    try:
        exec(code, module.__dict__)
        get_config = module.__dict__.get("get_config")
        if not callable(get_config):
            raise UsageError(f"{flag}: {path} defines no get_config() function")
        config = get_config(arg) if arg else get_config()
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - any error in the user's file becomes one line naming it
        first = (str(e).strip().splitlines() or [""])[0]
        raise UsageError(f"{flag}: {path}{_where(e, path)} raised {type(e).__name__}: {first}") from None
    finally:
        sys.modules.pop(module_spec.name, None)
    if not isinstance(config, ConfigDict):
        raise UsageError(f"{flag}: get_config() in {path} returned a {type(config).__name__}, not an ml_collections ConfigDict")
    return config


def _list_value(flag: str, text: str) -> list:
    """A list key's value: a Python / JSON list literal (`[7]`, `[1, 2]`, `[]`), or comma-separated
    words (`7`, `1,2`), each an int, a float or else the word itself."""
    text = text.strip()
    if text.startswith(("[", "(")):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise UsageError(f"{flag}={text!r} is not a list; write it as [1, 2] or 1,2") from None
        if not isinstance(value, (list, tuple)):
            raise UsageError(f"{flag}={text!r} is not a list; write it as [1, 2] or 1,2")
        return list(value)
    return [_word(w.strip()) for w in text.split(",") if w.strip()]


def _word(word: str):
    for kind in (int, float):
        try:
            return kind(word)
        except ValueError:
            pass
    return word.strip("'\"")


def _value(flag: str, text: str, kind, current):
    """`text` as the value of a key of type `kind` now holding `current`: a list key (or one that
    takes any value, now holding a list, or given a list literal) reads a list."""
    if kind in (list, tuple) or (kind is object and (isinstance(current, (list, tuple)) or text.strip().startswith("["))):
        return _list_value(flag, text)
    return parse_value(flag, text, kind)


def apply_overrides(config: ConfigDict, overrides: list[tuple[str, str]], known: list[str] | None = None) -> None:
    """Sets each `--config.KEY=VALUE`; raises UsageError listing every unknown key or bad value.
    `known`: the key names to suggest from (default: the config's own)."""
    problems = []
    known = known if known is not None else flat_keys(config)
    for key, text in overrides:
        flag = f"--config.{key}"
        *sections, leaf = key.split(".")
        node = config
        for section in sections:
            node = node.get(section) if isinstance(node, ConfigDict) else None
        if key in MOVED_KEYS and not (isinstance(node, ConfigDict) and leaf in node):
            problems.append(f"{flag}: the key moved to --config.{MOVED_KEYS[key]}")
            continue
        if not isinstance(node, ConfigDict) or leaf not in node:
            near = nearest_key(key, known)
            problems.append(f"{flag}: unknown config key" + (f"; did you mean --config.{near}?" if near else ""))
            continue
        if isinstance(node[leaf], ConfigDict):
            problems.append(f"{flag}: {key} is a section; set one of its keys ({', '.join(sorted(node[leaf].keys()))})")
            continue
        kind = node.get_type(leaf)
        try:
            # None is accepted anywhere here; preflight's type check refuses it where a key needs a value.
            node[leaf] = None if text in ("None", "null") else _value(flag, text, kind, node[leaf])
        except UsageError as e:
            problems.append(str(e))
        except (TypeError, ValueError) as e:
            problems.append(f"{flag}={text!r}: {e}")
    if problems:
        raise UsageError("\n".join(problems))
