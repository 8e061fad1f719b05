"""Nested dataclass configs from a TOML file plus ``--section.field value`` overrides.

Each module owns its config dataclass and documents a field with a string literal right
after it (as attribute docstrings); those strings are the ``--help`` text. A field typed
``Literal[...]`` accepts only those strings. Errors name the key and suggest the nearest
valid one. Nothing here knows about training: ``config.py`` holds the root config.

The other command-line tools (generate.py, evaluate.py, hf.py, prepare.py) use
``ArgumentParser`` and ``number`` below, so every bad flag ends the same way: one line
``error: ...`` and status 2.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import gc
import inspect
import os
import sys
import textwrap
import types
import typing
from typing import Any, Literal, NoReturn

import tomli_w
import tomllib

from core.errors import ConfigError


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line 'error: ...' on stderr and exits with status 2.

    Flags are taken only by their whole name (allow_abbrev False unless asked): a prefix such as
    '--dtyp' or '--max_seq' is a misspelling to name with its near miss, not a flag to guess.
    """

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        self._given = sys.argv[1:] if args is None else list(args)  # for error(): a subcommand's own flags
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            flags = [w for w in message.split(": ", 1)[1].split() if w.startswith("-")]
            message += _near_misses(flags, self._all_flags())
        elif message.startswith("the following arguments are required: "):
            # A subcommand checks its required flags before its parent names the flags nobody knows, so a misspelt
            # required flag ('--run-dir') would read as a missing one: name it as the near miss it is.
            known = self._all_flags()
            given = [w for w in getattr(self, "_given", []) if w.startswith("--") and w.split("=")[0] not in known]
            message += _near_misses(given, known)
        print(f"error: {message}; see --help".replace("\n", "\\n"), file=sys.stderr, flush=True)
        raise SystemExit(2)

    def _all_flags(self) -> list[str]:
        """Every option string of this parser and its subcommands' parsers."""
        flags = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    flags += list(sub._option_string_actions)
        return flags


def _near_misses(flags: list[str], known: list[str]) -> str:
    """"; '--dtyp': did you mean '--dtype'?" for each of flags (as given, '--f=v' too) close to one of known; else ''."""
    near = [(f, difflib.get_close_matches(f.split("=")[0], known, n=1)) for f in flags]
    hints = [f"'{f}': did you mean '{n[0]}'?" for f, n in near if n]
    return "; " + "; ".join(hints) if hints else ""


def number(kind: type, ok, rule: str):
    """An argparse type: kind(text) (int or float) that ok(value) accepts; else the flag's error says rule.

    E.g. number(int, lambda v: v >= 1, "an int >= 1"). NaN never passes (every comparison is False).
    """
    def parse(text: str):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}")
        return value
    parse.__name__ = kind.__name__
    return parse


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass: {field name: the string literal after it}."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _suggest(name: str, choices, prefix: str = "") -> str:
    """'; did you mean 'PREFIX.near'?' (the full dotted key, as the user types it), else the valid names."""
    near = difflib.get_close_matches(name, list(choices), n=1)
    dotted = f"{prefix}." if prefix else ""
    return f"; did you mean '{dotted}{near[0]}'?" if near else f"; valid: {', '.join(sorted(choices))}"


def _short(value: Any, limit: int = 60) -> str:
    """repr(value), cut to limit characters so an error stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def choices_text(choices) -> str:
    """('a', 'b', 'c') -> "'a', 'b' or 'c'", for messages."""
    quoted = [f"'{c}'" for c in choices]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _optional(typ):
    """X for a field typed X | None (unset: None, which TOML cannot write), else None."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(typ)) == 2:
            return args[0]
    return None


def _table_list(typ):
    """The dataclass D of a field typed list[D] (a TOML array of tables, [[section.field]]), else None."""
    if typing.get_origin(typ) is list:
        (item,) = typing.get_args(typ)
        if dataclasses.is_dataclass(item):
            return item
    return None


def build_table(key: str, cls, values: Any):
    """A dataclass cls from a TOML table {field: value}; ConfigError naming key.field for unknown keys or bad values."""
    if not isinstance(values, dict):
        raise ConfigError(f"{key}: expected a table of {', '.join(f.name for f in dataclasses.fields(cls))}, "
                          f"got {_short(values)}")
    fields = _hints(cls)
    for k in values:
        if k not in fields:
            raise ConfigError(f"unknown config key '{key}.{k}'{_suggest(k, fields, key)}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in values]
    if missing:  # else the dataclass' TypeError, or a default that reads as a value in a later message
        table = key.rsplit("[", 1)[0]
        raise ConfigError(f"{key}: no {missing[0]} given; every [[{table}]] table needs {' and '.join(required)}")
    try:
        return cls(**{k: _convert(f"{key}.{k}", v, fields[k]) for k, v in values.items()})
    except ValueError as e:  # a dataclass' own validation raising ValueError
        raise ConfigError(str(e)) from e


def _convert(key: str, value: Any, typ) -> Any:
    """Coerce a TOML or command-line value to the field's type; raise ConfigError if it can't."""
    origin = typing.get_origin(typ)
    inner = _optional(typ)
    if inner is not None:
        return None if value is None else _convert(key, value, inner)
    item = _table_list(typ)
    if item is not None:
        if isinstance(value, list):
            return [build_table(f"{key}[{i}]", item, v) for i, v in enumerate(value)]
        raise ConfigError(f"{key}: expected [[{key}]] tables in the --config file, got {_short(value)}")
    if origin is dict:
        key_type, value_type = typing.get_args(typ)
        if isinstance(value, dict):
            return {_convert(key, k, key_type): _convert(f"{key}.{k}", v, value_type) for k, v in value.items()}
        raise ConfigError(f"{key}: expected a table {{name = value, ...}}, got {_short(value)}")
    if origin is Literal:
        choices = typing.get_args(typ)
        if isinstance(value, str):
            if value in choices:
                return value
            raise ConfigError(f"{key} must be {choices_text(choices)}, got {_short(value)}")
        typ = str  # a number or table where a choice belongs: "expected str"
    elif typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif typ is int:
        number = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str):
            try:
                number = int(value.replace("_", ""))
            except ValueError:
                pass
        if number is not None:
            if not -2**63 <= number < 2**63:  # torch and numpy take 64-bit ints (seeds, step counts)
                raise ConfigError(f"{key}: {_short(number)} is out of range; use a 64-bit int (|value| < 2**63)")
            return number
    elif typ is float:
        try:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, str):
                return float(value)
        except (ValueError, OverflowError):  # OverflowError: an int beyond the float range
            pass
    elif typ is str:
        if isinstance(value, str):
            return _utf8(key, value)
    elif origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        args = typing.get_args(typ)
        if isinstance(items, (list, tuple)) and len(items) == len(args):
            return tuple(_convert(key, v, t) for v, t in zip(items, args))
    raise ConfigError(f"{key}: expected {getattr(typ, '__name__', typ)}, got {_short(value)}")


def _utf8(key: str, value: str) -> str:
    """value, if it is UTF-8 text; else ConfigError (bytes of another encoding reach argv as lone surrogates, which
    config.toml, JSON records and W&B cannot hold)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{key}: {_short(value)} holds a byte that is not UTF-8 ({value[e.start]!r} at {e.start}); "
                          f"give it as UTF-8 text") from None
    return value


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def build(root_cls, sections: dict[str, dict], presets: dict[str, dict[str, dict]] | None = None):
    """Build root_cls from {section: {field: value}}; raises ConfigError on unknown keys or bad types.

    A section may name a preset ('preset = "debug"') when presets[section] has one: its
    values apply first, explicit keys override them.
    """
    presets = presets or {}
    hints = _hints(root_cls)
    kwargs = {}
    top = {f.name: f for f in dataclasses.fields(root_cls)}
    for name, value in sections.items():
        if name not in top:
            raise ConfigError(f"unknown config section or key '{name}'{_suggest(name, top)}")
        if not dataclasses.is_dataclass(hints[name]):
            kwargs[name] = _convert(name, value, hints[name])
    for name, f in top.items():
        cls = hints[name]
        if not dataclasses.is_dataclass(cls):
            continue
        values = sections.get(name, {})
        if not isinstance(values, dict):
            raise ConfigError(f"'{name}' is a section: set its fields as --{name}.FIELD value or in [{name}]")
        values = dict(values)
        merged: dict[str, Any] = {}
        preset = values.pop("preset", None)
        if preset is not None and not isinstance(preset, str):
            raise ConfigError(f"{name}.preset: expected a preset name (str), got {_short(preset)}"
                              f"; valid: {', '.join(sorted(presets.get(name, {})))}")
        if preset is not None:
            table = presets.get(name, {})
            if preset not in table:
                raise ConfigError(f"{name}.preset: unknown preset '{preset}'{_suggest(preset, table)}")
            merged.update(table[preset])
        merged.update(values)
        fields = _hints(cls)
        for key in merged:
            if key not in fields:
                raise ConfigError(f"unknown config key '{name}.{key}'{_suggest(key, fields, name)}")
        try:
            kwargs[name] = cls(**{k: _convert(f"{name}.{k}", v, fields[k]) for k, v in merged.items()})
        except ValueError as e:  # model.ModelArgs' own validation (model.py imports nothing of ours)
            raise ConfigError(str(e)) from e
    return root_cls(**kwargs)


def parse_args(root_cls, argv: list[str] | None, presets=None, description: str = ""):
    """Parse ``--config FILE.toml`` and ``--section.field value`` (or ``=value``) into root_cls.

    ``--help`` prints every field with its type, default and doc, then exits 0.
    Raises ConfigError for an unreadable file, an unknown key or a bad value.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text(root_cls, description, presets))
        raise SystemExit(0)
    sections: dict[str, Any] = {}
    pairs = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --section.field value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"--{key} needs a value: --{key} VALUE or --{key}=VALUE")
            value = argv[i + 1]
            i += 1
        pairs.append((key, value))
        i += 1
    for key, value in pairs:
        if key == "config":
            try:
                with open(value, "rb") as f:
                    loaded = tomllib.load(f)
            except OSError as e:
                raise ConfigError(f"--config: cannot read '{value}': {e.strerror}; give an existing TOML file") from e
            except UnicodeDecodeError as e:
                raise ConfigError(f"--config: '{value}' is not UTF-8 text (byte {e.start}); give a TOML file") from e
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"--config: '{value}' is not valid TOML: {e}; fix that line") from e
            except ValueError as e:  # e.g. a NUL byte in the path
                raise ConfigError(f"--config: cannot read {value!r}: {e}") from e
            for sec, vals in loaded.items():
                if isinstance(vals, dict) and isinstance(sections.get(sec), dict):
                    sections[sec].update(vals)
                else:
                    sections[sec] = dict(vals) if isinstance(vals, dict) else vals
    for key, value in pairs:
        if key == "config":
            continue
        sec, dot, name = key.partition(".")
        if dot:
            sections.setdefault(sec, {})
            if not isinstance(sections[sec], dict):
                raise ConfigError(f"--{key}: '{sec}' is not a section")
            sections[sec][name] = value
        else:
            sections[key] = value
    return build(root_cls, sections, presets)


def _type_name(typ) -> str:
    if typing.get_origin(typ) is Literal:
        return "|".join(typing.get_args(typ))
    if _optional(typ) is not None:
        return _type_name(_optional(typ))
    if typing.get_origin(typ) in (list, dict):
        return str(typ).replace("typing.", "").split(".")[-1] if _table_list(typ) is None else \
            f"list[{_table_list(typ).__name__}]"
    return getattr(typ, "__name__", str(typ))


def _default_text(field: dataclasses.Field) -> str:
    """A field's default for --help: repr of its default or of its default_factory's value, or 'required'."""
    if field.default_factory is not dataclasses.MISSING:
        return repr(field.default_factory())
    return "required" if field.default is dataclasses.MISSING else repr(field.default)


def help_text(root_cls, description: str = "", presets: dict[str, dict[str, dict]] | None = None) -> str:
    """Every field of root_cls as '--section.field TYPE (default X): doc', and each section's presets."""
    lines = [description, "", "usage: --config FILE.toml [--section.field VALUE ...]", ""]
    hints = _hints(root_cls)
    top_docs = field_docs(root_cls)
    for f in dataclasses.fields(root_cls):
        cls = hints[f.name]
        if not dataclasses.is_dataclass(cls):
            lines.append(f"  --{f.name} {_type_name(cls)} (default {_default_text(f)}): {top_docs.get(f.name, '')}")
            continue
        lines.append(f"[{f.name}] {top_docs.get(f.name, '')}")
        if (presets or {}).get(f.name):
            lines.append(f"  --{f.name}.preset {'|'.join(presets[f.name])}: start from that preset's values; the "
                         f"section's other fields override them")
        docs = field_docs(cls)
        for sub in dataclasses.fields(cls):
            typ = _hints(cls)[sub.name]
            item = _table_list(typ)
            if item is None:
                lines.append(f"  --{f.name}.{sub.name} {_type_name(typ)} "
                             f"(default {_default_text(sub)}): {docs.get(sub.name, '')}")
                continue
            lines.append(f"  [[{f.name}.{sub.name}]] tables (in the --config file): {docs.get(sub.name, '')}")
            item_docs = field_docs(item)
            for field in dataclasses.fields(item):
                default = "unset" if field.default is None else _default_text(field)
                lines.append(f"      {field.name} {_type_name(_hints(item)[field.name])} "
                             f"(default {default}): {item_docs.get(field.name, '')}")
    return "\n".join(lines)


def to_toml(cfg) -> str:
    """The resolved config (a dataclass of dataclasses) as TOML that parse_args reads back (--config).

    Written by tomli_w, so every string, Unicode included, is escaped as TOML wants it. Unset
    (None) fields are left out: TOML has no null, and reading the file back leaves them unset.
    """
    return tomli_w.dumps(_without_none(dataclasses.asdict(cfg)))


def _without_none(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _without_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, (list, tuple)):
        return [_without_none(x) for x in v]
    return v


def write_resolved(cfg, path: str) -> None:
    """Write to_toml(cfg) to path atomically."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(to_toml(cfg))
    os.replace(tmp, path)


def exit_command(status: int) -> NoReturn:
    """sys.exit(status) for a command's ``__main__``, skipping the interpreter's last garbage collection.

    That collection walks every object torch's import made (about 0.7 s of each process's exit
    on CPU, paid by every rank of every launch) and frees nothing the exit would not free.
    gc.freeze() moves those objects out of its reach; atexit handlers, open files' flushes on
    close and module teardown still run. Only at the very end of a process: it leaves the
    objects alive when the call was made uncollectable.
    """
    gc.freeze()
    sys.exit(status)
