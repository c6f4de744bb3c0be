"""Reading configuration: YAML, dotted command-line overrides, strict type coercion.

Generic over dataclasses: config/schema.py defines the sections and calls these. Loading is strict: an
unknown key, a value of the wrong type or a malformed YAML file raises `ConfigError` that names the
key and what was expected, so a typo never silently falls back to a default.

One rule empties a value (docs/usage.md, "Configuration"): null means not set. `key:` or `key: null` in a
file and `key=`, `key=null` or `key=~` on the command line give a field its default and remove an entry of a
mapping (so whatever reads the mapping, e.g. a kind's options dataclass, uses its own default). The empty string
is a value like any other, written quoted: `key: ""`, or `'key=""'` past the shell.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml

from grpo_vision.reading import what_is

# What one YAML file or override may hold. PyYAML's composer recurses once per level: 50,000 brackets were a
# RecursionError. Aliases share one object, so 9 levels of 10 (a 537-byte "billion laughs") load in a
# moment, but anything that walks the value (an error quoting it, a copy) meets 10^10 items.
MAX_YAML_DEPTH = 100  # lists and mappings nested in one another
MAX_YAML_VALUES = 100_000  # values in one document, each alias counted as what it stands for
BRIEF_WORK = 100_000  # characters of a value's repr that `brief` builds at most


class ConfigError(ValueError):
    """A configuration problem; the message names the key and how to fix it."""


class GrpoVisionWarning(UserWarning):
    """What the library warns its user of (a setting that costs memory, prompts left out of training): one line,
    `grpo-vision: warning: ...`, from a script as from the command line (cli/app.py), not Python's default of
    file:line and the library's source line, which name the library's code rather than what the user set."""


def warning_line(message) -> str:
    """A warning as grpo-vision prints it: one line, like its errors."""
    return f"grpo-vision: warning: {message}\n"


def _one_line(message, category, filename, lineno, line=None, *, _python=warnings.formatwarning) -> str:
    if issubclass(category, GrpoVisionWarning):
        return warning_line(message)
    return _python(message, category, filename, lineno, line)  # anyone else's warnings as Python prints them


warnings.formatwarning = _one_line  # once, at the library's first import: every module that warns imports this one


def brief(value: Any, limit: int = 80) -> str:
    """`repr(value)` for an error message, cut after `limit` characters with the full length noted:
    a rejected 10 MB prompt line would be echoed whole to stderr. Every error quotes user text
    through this. A value that is not text is walked for its first BRIEF_WORK characters only: a list
    holding itself 10 times over 9 levels (YAML aliases) has a repr of 10^10 items."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"
    text, more = _repr_prefix(value, BRIEF_WORK)
    if len(text) <= limit and not more:
        return text
    return f"{text[:limit]!r}... ({'more than ' if more else ''}{len(text)} characters)"


class _Piece(str):
    """Punctuation of a container's repr, told apart from a string value inside it."""


def _repr_prefix(value: Any, budget: int) -> tuple[str, bool]:
    """The first `budget` characters of repr(value) (lists, tuples, dicts and sets walked lazily, with a stack
    rather than recursion), and whether there is more."""
    def items(v):
        if isinstance(v, dict):
            yield _Piece("{")
            for i, (k, x) in enumerate(v.items()):
                yield from ((_Piece(", "),) if i else ()) + (k, _Piece(": "), x)
            yield _Piece("}")
            return
        ends = {list: "[]", tuple: "()"}.get(type(v), "{}")
        yield _Piece(ends[0] if v or type(v) is not set else "set(")
        for i, x in enumerate(v):
            yield from ((_Piece(", "),) if i else ()) + (x,)
        yield _Piece("," + ends[1] if type(v) is tuple and len(v) == 1 else ends[1] if v or type(v) is not set
                     else ")")

    out, size, stack = [], 0, [iter([value])]
    while stack:
        item = next(stack[-1], stack)  # the stack itself marks the end of an iterator
        if item is stack:
            stack.pop()
            continue
        if type(item) in (list, tuple, dict, set):
            stack.append(items(item))
            continue
        if type(item) is _Piece:
            piece = str(item)
        elif isinstance(item, str) and len(item) > budget:
            piece = repr(item[:budget + 1])  # its head is enough
        else:
            try:
                piece = repr(item)
            except ValueError:  # an integer past Python's 4300-digit limit of int -> str
                piece = f"<an integer of {item.bit_length()} bits>" if isinstance(item, int) else "<unprintable>"
        out.append(piece)
        size += len(piece)
        if size > budget:
            return "".join(out)[:budget], True
    return "".join(out), False


def read_yaml(path: str | Path) -> dict:
    """The mapping in the YAML file at `path`, or ConfigError naming the file and the problem."""
    path = Path(path)
    kind = what_is(path)
    if kind == "missing":
        raise ConfigError(f"config file not found: {path}")
    if kind:  # a FIFO would block the read for ever
        raise ConfigError(f"{path} is {kind}, not a config file: give a YAML file")
    try:
        with open(path, encoding="utf-8") as stream:  # a stream, so YAML errors name the file and line
            raw = yaml.load(stream, Loader=_StrictLoader) or {}
    except _TooBig as e:
        raise ConfigError(f"{path}, line {e.mark.line + 1}: {e.problem}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}): save it as UTF-8") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    return raw


class _TooBig(yaml.YAMLError):
    def __init__(self, problem: str, mark):
        super().__init__(problem)
        self.problem, self.mark = problem, mark


class _BoundedLoader(yaml.SafeLoader):
    """safe_load that refuses, while it composes, a value nested more than MAX_YAML_DEPTH deep or a document
    of more than MAX_YAML_VALUES values once its aliases are expanded (see above)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._sizes: dict = {}  # node -> the values it holds, its aliases counted as what they stand for

    def compose_node(self, parent, index):
        mark = self.peek_event().start_mark
        if self._depth >= MAX_YAML_DEPTH:
            raise _TooBig(f"lists and mappings nested more than {MAX_YAML_DEPTH} levels deep; write flatter YAML",
                          mark)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if node not in self._sizes:  # an alias returns its anchor's node, sized when it was composed
            children = node.value if isinstance(node, yaml.SequenceNode) else (
                [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
            self._sizes[node] = 1 + sum(self._sizes.get(c, 1) for c in children)
            if self._sizes[node] > MAX_YAML_VALUES:
                raise _TooBig(f"more than {MAX_YAML_VALUES} values once its aliases (*name) are expanded; write "
                              "the values out, or use fewer aliases", mark)
        return node


class _StrictLoader(_BoundedLoader):
    """safe_load that refuses a key given twice in one mapping (YAML keeps the last one silently), and values
    nested or aliased past the bounds above."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' appears twice in one mapping; keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def from_dict(cls: type, raw: dict, where: str = "config", prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: '{prefix.rstrip('.') or 'config'}' must be a mapping, got {brief(raw)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            raise ConfigError(_unknown_key(f"{prefix}{key}", str(key), names, where))
        if value is None and not _admits_none(hints[key]):  # `key:` is not set: the default (module docstring)
            continue
        if dataclasses.is_dataclass(hints[key]):
            kwargs[key] = from_dict(hints[key], {} if value is None else value, where, f"{prefix}{key}.")
        else:
            kwargs[key] = coerce(value, hints[key], f"{prefix}{key}", where)
    return cls(**kwargs)


def apply_override(cfg, item: str) -> None:
    """Apply one ``section.key=value`` override to dataclass `cfg`; the value is parsed for the field's type.

    A mapping field takes whole (``reward.weights={clip: 1.0}``) or one entry at a time
    (``reward.weights.aesthetic=0.25`` adds or replaces that entry; ``reward.options.clip.checkpoint=P``
    sets one key of a nested mapping). A null value (``key=``, ``key=null``) gives a field its default and
    removes a mapping's entry (the module docstring's rule)."""
    if "=" not in item:
        raise ConfigError(f"override {brief(item)} must look like section.key=value, e.g. train.lr=1e-5")
    dotted, text = item.split("=", 1)
    dotted = dotted.strip()
    *parents, leaf = dotted.split(".")
    node, prefix = cfg, ""
    for depth, part in enumerate(parents):
        names = [f.name for f in dataclasses.fields(node)]
        hint = typing.get_type_hints(type(node)).get(part)
        if typing.get_origin(hint) is dict:  # entries of a mapping, possibly nested
            _set_entry(getattr(node, part), hint, [*parents[depth + 1:], leaf], text, dotted, f"{prefix}{part}")
            return
        if part in names and not dataclasses.is_dataclass(getattr(node, part)):
            raise ConfigError(f"command line: '{prefix}{part}' is a value, not a section; write {prefix}{part}=VALUE")
        if part not in names:
            raise ConfigError(_unknown_key(prefix + part, part, names, "command line"))
        node, prefix = getattr(node, part), f"{prefix}{part}."
    names = [f.name for f in dataclasses.fields(node)]
    if leaf in names and dataclasses.is_dataclass(getattr(node, leaf)):
        raise ConfigError(f"command line: '{prefix}{leaf}' is a section, not a value; "
                          f"write {prefix}{leaf}.KEY=VALUE (its keys: "
                          f"{', '.join(f.name for f in dataclasses.fields(getattr(node, leaf)))})")
    if leaf not in names:
        raise ConfigError(_unknown_key(prefix + leaf, leaf, names, "command line"))
    hint = typing.get_type_hints(type(node))[leaf]
    value = _parse_text(text, hint)
    if value is None and not _admits_none(hint):
        setattr(node, leaf, _default(type(node), leaf, dotted))
        return
    setattr(node, leaf, coerce(value, hint, dotted, "command line"))


def _set_entry(mapping: dict, hint: Any, path: list[str], text: str, dotted: str, name: str) -> None:
    """Set `mapping[path[0]]...[path[-1]]` to `text` parsed for the mapping's value type."""
    _, value_type = typing.get_args(hint)
    if not path[0]:
        raise ConfigError(f"command line: '{dotted}' names no entry of '{name}'; write {name}.NAME=VALUE")
    if len(path) == 1:
        value = _parse_text(text, value_type)
        if value is None:  # not set: the entry goes, and its reader's default applies
            mapping.pop(path[0], None)
        else:
            mapping[path[0]] = coerce(value, value_type, dotted, "command line")
        return
    if typing.get_origin(value_type) is not dict:
        raise ConfigError(f"command line: '{name}.{path[0]}' is a value, not a mapping; write {name}.{path[0]}=VALUE")
    if _parse_text(text, Any) is None and path[0] not in mapping:
        return  # removing an entry of a mapping that is not there
    inner = mapping.setdefault(path[0], {})
    _set_entry(inner, value_type, path[1:], text, dotted, f"{name}.{path[0]}")


def _parse_text(text: str, hint: Any) -> Any:
    """An override's text as YAML reads it (None for ``key=``, ``key=null``, ``key=~``), except that a string
    field or entry keeps unquoted text as written: ``run.name=1e-5`` is the name "1e-5", ``'run.name="x y"'`` x y."""
    try:
        value = yaml.load(text, Loader=_BoundedLoader)
    except _TooBig as e:
        raise ConfigError(f"command line: {brief(text)}: {e.problem}") from None
    except yaml.YAMLError:
        return text
    if hint is str and value is not None and not (isinstance(value, str) and text.strip()[:1] in ("'", '"')):
        return text
    return value


def _admits_none(hint: Any) -> bool:
    """Whether None is a value of `hint` (`int | None`) rather than "not set"."""
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _default(cls: type, name: str, key: str) -> Any:
    """The default of field `name` of dataclass `cls`, a fresh copy for a mutable one."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    if f.default is dataclasses.MISSING:
        raise ConfigError(f"command line: '{key}' has no default to return to; give it a value")
    return f.default


def coerce(value: Any, hint: Any, key: str, where: str) -> Any:
    """Check `value` against type `hint`; convert the lossless cases (int -> float, "1e-5" -> float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:  # a reward's or policy kind's own options: checked by its registered dataclass
        return value

    def fail(expected: str) -> ConfigError:
        return ConfigError(f"{where}: '{key}' expects {expected}, got {brief(value)} ({type(value).__name__})")

    if origin is Literal:
        if value is False and "no" in args:  # YAML 1.1 reads a bare `no` (accelerate's spelling) as false
            return "no"
        if isinstance(value, bool) and ("on" if value else "off") in args:  # and bare `on` / `off` as booleans
            return "on" if value else "off"
        if value not in args:
            raise fail("one of " + ", ".join(repr(a) for a in args))
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(value, inner[0], key, where)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise fail("a boolean (true or false)")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise fail("an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise fail("a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise fail("a string")
    if origin is list:
        if not isinstance(value, list):
            raise fail(f"a list of {args[0].__name__}")
        return [coerce(v, args[0], f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise fail(f"a mapping of {args[0].__name__} to {args[1].__name__}")
        return {coerce(k, args[0], key, where): coerce(v, args[1], f"{key}.{k}", where) for k, v in value.items()
                if v is not None}  # a null entry is not set (module docstring)
    raise TypeError(f"unsupported config type {hint} for {key}")  # a bug in this file, not user input


def _unknown_key(full: str, key: str, names: list[str], where: str) -> str:
    close = difflib.get_close_matches(key, names, n=1)
    section = full.rsplit(".", 1)[0] if "." in full else "the top level"
    hint = f" (did you mean '{full[:-len(key)]}{close[0]}'?)" if close else ""
    return f"{where}: unknown key {brief(full)}{hint}; valid keys in {section}: {', '.join(names)}"
