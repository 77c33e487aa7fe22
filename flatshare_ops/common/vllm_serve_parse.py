#!/usr/bin/env python
"""Parse `vllm serve` command lines with vLLM's own parser (vLLM 0.32.0 and 0.33.0).

A standalone script for another interpreter: an engine venv's (or .venv-vllm's)
Python runs it, so it uses only the standard library at import time and imports
vLLM inside functions.

    PYTHON vllm_serve_parse.py MODE < stdin.json > stdout.json

Modes
-----
parse
    stdin : JSON list of the words after `vllm serve`, model first,
            e.g. ["/models/m", "--port", "8000"].
    stdout: one result (below).
parse-many
    stdin : JSON list of such lists.
    stdout: JSON list of results, in order. All are parsed in this one process
            with one parser (built once); nothing carries over from one parse to
            the next (fresh namespace, the parser's per-parse attributes, vLLM's
            warn-once caches and the action defaults are reset before each).
preflight
    stdin : JSON list of the words after `vllm serve`, model first.
    stdout: {"ok": true, "checked": [...], "seconds": {stage: s}} or
            {"ok": false, "stage": STAGE, "error": MESSAGE, "checked": [...], "seconds": {...}}.
    What `vllm serve` runs before it touches the device, in this process's environment (the caller
    gives it the engine unit's own: VLLM_TARGET_DEVICE is NOT defaulted here): stage "parser" builds
    vLLM's serve parser (it builds vLLM's config defaults, so a venv whose platform cannot be inferred
    fails here: "RuntimeError: Failed to infer device type"); "cache" makes vLLM's cache directory
    (vllm.envs.VLLM_CACHE_ROOT: $VLLM_CACHE_ROOT, else $XDG_CACHE_HOME/vllm or ~/.cache/vllm) and writes a
    file in it, as the engine core does at start (run as the engine's user, this says whether it can);
    "parse" and "validate" as for `parse`;
    "config" runs AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=
    OPENAI_API_SERVER), as vllm/entrypoints/launchers/api_server/entry.py does at start (the model's
    config.json is read: --max-model-len above its positions, a speculative draft model that is not
    there); "model" reads the permissions of a local model directory's files (the weights themselves are read
    by the engine core, on the device); "tokenizer" builds vLLM's renderer (the tokenizer's files, read by the API server before the
    engine core starts) and reads the generation config; "scheduler" imports --scheduler-cls as the engine core does
    (vllm_config.scheduler_config.get_scheduler_cls()). `checked` names the stages passed.
options
    stdin : ignored.
    stdout: what building the `vllm serve` parser again needs (see
            `options_table`), one action per line, for committing as
            flatshare_ops/common/vllm_options/RELEASE.json (RELEASE: its
            vllm_release, the public version: 0.32.0 for 0.32.0+cpu).

A result is
    {"ok": true, "namespace": {dest: value}, "warnings": [...],
     "dataclass_fields": {dest: {...}}}
or  {"ok": false, "stage": "parse" | "validate", "error": MESSAGE,
     "prog": "vllm serve" | "vllm" | null, "exit_code": 2 | 0 | null, "warnings": [...]}

* namespace: vars(args) after parse_args(["serve", *argv]) and the serve
  subcommand's validate(), exactly as `vllm serve` runs them before starting;
  `dispatch_function` and `subparser` are dropped; values that are not JSON
  (tuples become lists) are str()-ed.
* dataclass_fields: for each namespace value that is a (pydantic) dataclass
  instance, i.e. a flag vLLM validates into a config class
  (--compilation-config, ...), its fields as JSON (pydantic's JSON mode), so a
  caller can compare them; the namespace itself holds the str() form.
* error: argparse's own message, without the usage text and the "PROG: error: "
  prefix (e.g. "argument --served-model-name: expected at least one argument",
  "unrecognized arguments: --kv-offload-size 24"), from the SystemExit vLLM's
  parser raises; prog says which parser spoke ("vllm serve" for errors of the
  serve subparser, "vllm" for unrecognized arguments, which the top-level parser
  reports). An exception that is not argparse's (vLLM's parse_args raises
  ValueError for a --served-model-name without a positional model, IndexError
  for a dotted flag without a value, ...) gives "TypeName: message", prog null.
  `-h/--help` gives ok false with exit_code 0 (vLLM prints help and exits).
  Validation errors (stage "validate") give "TypeName: message".
* warnings: what vLLM logged at WARNING or above while parsing and validating
  (e.g. "Found duplicate keys --additional-config.make_room.x").

Exit status: 0 whenever the input was usable (even if every line was rejected);
2 if the script itself is misused (bad mode, stdin not the expected JSON).

The parser is built as vllm/entrypoints/cli/main.py builds it for `vllm serve`:
top-level FlexibleArgumentParser(prog "vllm", with -v/--version) ->
add_subparsers(dest="subparser") -> ServeSubcommand().subparser_init(...)
.set_defaults(dispatch_function=...) -> parse_args(["serve", *argv]) ->
configure_logging_from_args(args) -> cmd.validate(args). The other subcommands
are not registered: they do not change the serve subparser (everything after
"serve" goes to it).

vLLM 0.32.0 vs 0.33.0: VLLM_SUBCMD_PARSER_EPILOG and cli_env_setup moved from
vllm.entrypoints.serve.utils.api_utils (0.32) to vllm.entrypoints.common.startup
(0.33); see `_startup_module`. vllm.entrypoints.cli.serve.cmd_init is in both.

No GPU here: VLLM_TARGET_DEVICE defaults to "cpu" (without it vLLM resolves to
UnspecifiedPlatform and building the parser fails in DeviceConfig). The only
parser-visible effect of the platform is the choice list of
--mm-processor-device (CUDA adds "cuda").
"""

from __future__ import annotations

import sys

# Run as a script, Python puts this file's directory first on sys.path, and
# flatshare_ops/common holds modules named like the standard library's
# (http.py): they would shadow it for vLLM (torch imports urllib -> http.client).
# Drop that entry before importing anything else.
if __name__ == "__main__" and sys.path and sys.path[0]:
    import os.path as _osp

    if _osp.realpath(sys.path[0]) == _osp.dirname(_osp.realpath(__file__)):
        del sys.path[0]

import copy
import io
import json
import os
import re
from typing import Any

MODES = ("parse", "parse-many", "options", "preflight")


class Usage(Exception):
    """The script was misused (exit 2)."""


# --------------------------------------------------------------------------
# Building the parser


def _startup_module() -> str:
    """Where VLLM_SUBCMD_PARSER_EPILOG and cli_env_setup live in this vLLM.

    0.33.0 moved them to vllm.entrypoints.common.startup; 0.32.0 has them in
    vllm.entrypoints.serve.utils.api_utils. Decided by whether the new module
    exists (find_spec), not by catching ImportError, so a real import failure
    inside the new module is reported as itself.
    """
    from importlib.util import find_spec

    try:
        if find_spec("vllm.entrypoints.common.startup") is not None:
            return "vllm.entrypoints.common.startup"
    except ModuleNotFoundError:  # vllm.entrypoints.common itself missing (0.32)
        pass
    return "vllm.entrypoints.serve.utils.api_utils"


class ServeParser:
    """vLLM's `vllm serve` parser, built once; `parse` runs one argv through it."""

    def __init__(self, default_device: bool = True) -> None:
        import importlib
        import importlib.metadata

        if default_device:
            os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        import vllm.entrypoints.cli.serve as serve_mod
        from vllm.logger import configure_logging_from_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        startup = importlib.import_module(_startup_module())
        startup.cli_env_setup()  # as main.py does (sets VLLM_WORKER_MULTIPROC_METHOD)

        self.release = importlib.metadata.version("vllm")
        self.configure_logging_from_args = configure_logging_from_args
        self.flexible_cls = FlexibleArgumentParser
        parser = FlexibleArgumentParser(
            prog="vllm",
            description="vLLM CLI",
            epilog=startup.VLLM_SUBCMD_PARSER_EPILOG.format(subcmd="[subcommand]"),
        )
        parser.add_argument("-v", "--version", action="version", version=self.release)
        subparsers = parser.add_subparsers(required=False, dest="subparser")
        self.cmds = {}
        self.serve: Any = None  # vLLM's serve subparser, found below (vllm is not typed where mypy runs)
        for cmd in serve_mod.cmd_init():
            sub = cmd.subparser_init(subparsers)
            sub.set_defaults(dispatch_function=cmd.cmd)
            self.cmds[cmd.name] = cmd
            if cmd.name == "serve":
                self.serve = sub
        self.top = parser
        # Pristine copies of every action default: vLLM code may mutate a
        # namespace value in place (the namespace holds the default objects).
        self._defaults = {id(a): copy.deepcopy(a.default) for a in self.serve._actions}
        self._warn_once_caches = _warn_once_caches()
        self._log: Any = _LogCapture()  # a logging.Handler with records and take(): see _LogCapture.__new__
        self._install_log_capture()

    def _install_log_capture(self) -> None:
        """Keep our handler on the "vllm" logger and let WARNING records through.

        configure_logging_from_args (run for every parse, as `vllm serve` does)
        re-applies vLLM's dictConfig, which replaces the "vllm" logger's handlers
        and level; so this runs before each stage. Lowering the logger's level to
        WARNING does not make vLLM print more: its own handler keeps its level.
        """
        import logging

        lg = logging.getLogger("vllm")
        if self._log not in lg.handlers:
            lg.addHandler(self._log)
        if lg.level == logging.NOTSET or lg.level > logging.WARNING:
            lg.setLevel(logging.WARNING)

    # one parse -------------------------------------------------------------

    def _reset(self) -> None:
        for a in self.serve._actions:
            a.default = copy.deepcopy(self._defaults[id(a)])
        for p in (self.top, self.serve):
            p._show_serve_task_hint = False
        self.flexible_cls._search_keyword = None
        for cache in self._warn_once_caches:
            cache.cache_clear()
        self._log.records.clear()
        self._install_log_capture()

    def parse(self, argv: list[str]) -> dict:
        """One `vllm serve ARGV` through parse_args and validate: a result dict."""
        self._reset()
        out, err = io.StringIO(), io.StringIO()
        real_out, real_err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = out, err
        try:
            try:
                args = self.top.parse_args(["serve", *argv])
            except SystemExit as e:
                return {"ok": False, "stage": "parse", **_argparse_error(err.getvalue(), e.code),
                        "warnings": self._log.take()}
            except Exception as e:  # noqa: BLE001 - vLLM's own parse_args raises these
                return {"ok": False, "stage": "parse", "error": f"{type(e).__name__}: {e}",
                        "prog": None, "exit_code": None, "warnings": self._log.take()}
            cmd = self.cmds[args.subparser]
            try:
                self.configure_logging_from_args(args)
                self._install_log_capture()
                cmd.validate(args)
            except SystemExit as e:
                return {"ok": False, "stage": "validate", **_argparse_error(err.getvalue(), e.code),
                        "warnings": self._log.take()}
            except Exception as e:  # noqa: BLE001 - the checks `vllm serve` runs before startup
                return {"ok": False, "stage": "validate", "error": f"{type(e).__name__}: {e}",
                        "prog": None, "exit_code": None, "warnings": self._log.take()}
        finally:
            sys.stdout, sys.stderr = real_out, real_err
            # Anything vLLM printed goes to our stderr, never to the JSON on stdout.
            sys.stderr.write(out.getvalue())
        ns = dict(vars(args))
        ns.pop("dispatch_function", None)
        ns.pop("subparser", None)
        dataclass_fields = {}
        for dest, value in ns.items():
            fields = _dataclass_json(value)
            if fields is not None:
                dataclass_fields[dest] = fields
        return {"ok": True, "namespace": {k: _jsonable(v) for k, v in sorted(ns.items())},
                "dataclass_fields": dataclass_fields, "warnings": self._log.take()}


class _LogCapture:
    """A logging handler keeping vLLM's WARNING+ messages of the current parse."""

    def __new__(cls):
        import logging

        class Handler(logging.Handler):
            def __init__(self):
                super().__init__(logging.WARNING)
                self.records: list[str] = []

            def emit(self, record):
                try:
                    self.records.append(record.getMessage())
                except Exception:  # noqa: BLE001
                    self.records.append(str(record.msg))

            def take(self):
                taken, self.records = self.records, []
                return taken

        return Handler()


def _warn_once_caches() -> list:
    """vLLM's warning_once/info_once lru_caches, cleared between parses."""
    import vllm.logger as vl

    return [f for name in dir(vl) if name.startswith("_print_") and name.endswith("_once")
            and hasattr(f := getattr(vl, name), "cache_clear")]


_ERROR_LINE = re.compile(r"^(?P<prog>[^\n]*?): error: (?P<msg>.*)\Z", re.M | re.S)


def _argparse_error(stderr: str, code) -> dict:
    """The message argparse printed before SystemExit, without usage and prefix."""
    if code == 0:
        return {"error": "help requested: vLLM prints its help and exits 0 without serving",
                "prog": None, "exit_code": 0}
    m = _ERROR_LINE.search(stderr)
    if m is None:
        return {"error": stderr.strip() or f"SystemExit({code!r})", "prog": None, "exit_code": code}
    return {"error": m.group("msg").rstrip("\n"), "prog": m.group("prog"), "exit_code": code}


def _jsonable(value):
    """value as JSON data: dict/list/str/int/float/bool/None kept, tuples as lists, others str()."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def _dataclass_json(value):
    """A dataclass instance's fields as JSON data (pydantic JSON mode), else None.

    A non-empty list of dataclass instances (--lora-modules) gives a list of them.
    """
    import dataclasses

    if isinstance(value, list) and value and all(
            dataclasses.is_dataclass(v) and not isinstance(v, type) for v in value):
        return [_dataclass_json(v) for v in value]
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return None
    try:
        from pydantic import TypeAdapter

        return TypeAdapter(type(value)).dump_python(value, mode="json")
    except Exception:  # noqa: BLE001
        try:
            return json.loads(json.dumps(dataclasses.asdict(value), default=str))
        except Exception:  # noqa: BLE001
            return None


# --------------------------------------------------------------------------
# The option table


ACTION_KINDS = {
    "_StoreAction": "store",
    "_StoreConstAction": "store_const",
    "_StoreTrueAction": "store_true",
    "_StoreFalseAction": "store_false",
    "_AppendAction": "append",
    "_AppendConstAction": "append_const",
    "_CountAction": "count",
    "_HelpAction": "help",
    "_VersionAction": "version",
    "_ExtendAction": "extend",
    "BooleanOptionalAction": "BooleanOptionalAction",
    "EnableDisableAction": "EnableDisableAction",
}


def classify_type(t) -> dict:
    """How an action's `type` converts a word, as data vllm_argv can act on.

    Derived from the live callable, not from its name alone:
    * builtins: None or str -> {"kind": "str"}; int; float; json.loads -> "json".
    * vLLM's wrappers (vllm/engine/arg_utils.py), recognised by qualname and
      unwrapped through their closure cells (inspect.getclosurevars):
      optional_type(f) -> {"kind": "optional", "inner": f}: "" and "None" give None;
      parse_type(f) -> {"kind": "parse_type", "inner": f}: a ValueError of f becomes
      "Value V cannot be converted to F." (F is repr(f));
      union_dict_and_str -> "json_or_str": a word matching ^\\s*{.*}\\s*$ goes through
      optional_type(json.loads), anything else stays a string;
      _compute_kwargs.<locals>.parse_dataclass -> {"kind": "dataclass", "class": C}:
      human-readable numbers in the JSON expanded, then pydantic validate_json into C.
    * human_readable_int / human_readable_int_or_auto (vllm/utils/argparse_utils.py).
    * anything else (lambdas) is probed: a function mapping "Ab-Cd" to "ab_cd" and
      "x" to "x" is {"kind": "lower_underscore"} (s.lower().replace("-", "_"));
      a function mapping "NoNe" and "none" to "" and other words to themselves is
      {"kind": "none_to_empty"} (0.33's parse_reasoning_parser);
      otherwise {"kind": "unknown", "qualname": ...} (vllm_argv refuses to guess).
    Every dict but the identity's ({"kind": "str"} for no type) also has "name":
    getattr(t, "__name__", repr(t)), which argparse puts in "invalid NAME value: 'V'";
    optional and parse_type have "repr", repr(f) without its address, for their message.
    """
    import inspect

    if t is None:
        return {"kind": "str"}  # argparse's identity: never fails, so it needs no name
    name = getattr(t, "__name__", repr(t))
    if t is str:
        return {"kind": "str", "name": name}
    if t is int:
        return {"kind": "int", "name": name}
    if t is float:
        return {"kind": "float", "name": name}
    if t is json.loads:
        return {"kind": "json", "name": name}
    qual = getattr(t, "__qualname__", "")
    mod = getattr(t, "__module__", "")
    if qual.endswith("optional_type.<locals>._optional_type"):
        inner = inspect.getclosurevars(t).nonlocals["return_type"]
        return {"kind": "optional", "name": name, "inner": classify_type(inner), "repr": _repr(inner)}
    if qual.endswith("parse_type.<locals>._parse_type"):
        inner = inspect.getclosurevars(t).nonlocals["return_type"]
        return {"kind": "parse_type", "name": name, "inner": classify_type(inner), "repr": _repr(inner)}
    if qual == "union_dict_and_str":
        return {"kind": "json_or_str", "name": name}
    if qual.endswith("parse_dataclass"):
        cls = (t.__defaults__ or (None,))[0]
        return {"kind": "dataclass", "name": name, "class": getattr(cls, "__name__", str(cls))}
    if qual in ("human_readable_int", "human_readable_int_or_auto") and mod.startswith("vllm"):
        return {"kind": qual, "name": name}
    probes: dict[str, list[tuple[str, object]]] = {
        # s.lower().replace("-", "_")  (--moe-backend, --linear-backend, ...)
        "lower_underscore": [("Ab-Cd", "ab_cd"), ("x", "x")],
        # [int(p) if p.isdigit() else p for p in (q.strip() for q in s.split(","))]
        # (--device-ids)
        "comma_list_int_or_str": [("2, x ,3", [2, "x", 3]), ("GPU-1", ["GPU-1"])],
        # "" if s.lower() == "none" else s  (0.33's parse_reasoning_parser)
        "none_to_empty": [("NoNe", ""), ("none", ""), ("x", "x"), ("None-x", "None-x")],
    }
    for kind, cases in probes.items():
        try:
            if all(t(arg) == want and type(t(arg)) is type(want) for arg, want in cases):
                return {"kind": kind, "name": name}
        except Exception:  # noqa: BLE001
            pass
    return {"kind": "unknown", "name": name, "qualname": f"{mod}.{qual}"}


def _repr(f) -> str:
    """repr(f) without the memory address (argparse messages show repr(type))."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(f))


def _is_json_value(value) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


def public_version(version: str) -> str:
    """A version without its local label (PEP 440: ``0.32.0+cpu`` is release 0.32.0 built locally)."""
    return version.partition("+")[0]


def _given_option_strings(action, registered: list[str]) -> list[str]:
    """The option strings vLLM passed to add_argument for ``action``.

    ``registered`` is every string the parser maps to the action, in registration
    order. BooleanOptionalAction adds ``--no-X`` for each ``--X`` it is given, and
    0.33's EnableDisableAction also ``--disable-X`` for ``--enable-X``: for those,
    each registered string the class does not add itself from the ones before
    it, checked by registering them again. Every other class registers what it
    is given.
    """
    import argparse

    if not isinstance(action, argparse.BooleanOptionalAction):
        return registered
    given: list[str] = []
    for opt in registered:
        if not given or opt not in type(action)(given, dest=action.dest).option_strings:
            given.append(opt)
    if type(action)(given, dest=action.dest).option_strings != registered:
        raise RuntimeError(f"{action.dest}: cannot tell which option strings vLLM gave "
                           f"{type(action).__name__} ({registered})")
    return given


def _action_entry(parser, action, registered: list[str]) -> dict:
    """One action as the data argparse's add_argument needs to build it again (see options_table)."""
    kind = ACTION_KINDS.get(type(action).__name__, type(action).__name__)
    given = _given_option_strings(action, registered)
    entry = {"dest": action.dest, "option_strings": given, "action": kind}
    if kind not in ("help", "version"):
        # What the class sets by itself is left out: add_argument sets it again.
        bare = type(action)(given, dest=action.dest)
        for attr in ("nargs", "const", "choices", "required"):
            value = getattr(action, attr)
            if value != getattr(bare, attr) and not (attr == "required" and not given):
                if attr == "choices":
                    value = [c if _is_json_value(c) else str(c) for c in value]
                entry[attr] = value if _is_json_value(value) else str(value)
        if not given and action.metavar is not None:
            entry["metavar"] = action.metavar  # argparse names a positional by it in errors
    if action.type is not None or action.nargs != 0:
        entry["type"] = classify_type(action.type)
    if action in getattr(parser, "_deprecated", ()):
        entry["deprecated"] = True
    return entry


def options_table(sp: ServeParser) -> dict:
    """What building vLLM's `vllm` parser and its `serve` subparser again needs, as JSON data.

    ``actions``: the serve subparser's actions in the order vLLM adds them
    (argparse lists the candidates of an ambiguous abbreviation in that order),
    each with: dest; option_strings, the strings vLLM passed to add_argument
    ([] for the positional; the class registers the rest: BooleanOptionalAction's
    --no-X, 0.33's EnableDisableAction's --disable-X); action, its kind
    (ACTION_KINDS, else the class name of vLLM's own action); nargs, const,
    choices, required only where they differ from what that class sets by
    itself; metavar for a positional that has one; type (classify_type) when
    the action takes words; deprecated when true; default, what `vllm serve
    MODEL` leaves in the namespace after parse and validate, when it is JSON
    data and not None, or no_json_default true when it is not JSON (a config
    object) or absent (a suppressed default).

    Top level: vllm_release (the public version), python (argparse's
    behaviour is that Python's), generated_by, parser (the serve subparser's
    prog, allow_abbrev, prefix_chars, fromfile_prefix_chars), top_level (the
    `vllm` parser's prog, its actions as above, its subparsers' dest),
    mutually_exclusive_groups.
    """
    import argparse

    parser = sp.serve
    bare = sp.parse(["MODEL"])
    if not bare["ok"]:
        raise RuntimeError(f"vllm serve MODEL does not parse: {bare['error']}")
    bare_ns = bare["namespace"]
    # Values not JSON in the namespace (e.g. dataclass instances) need the raw object.
    sp._reset()
    raw = vars(parser.parse_known_args(["MODEL"])[0])

    def registered(p) -> dict[int, list[str]]:
        strings: dict[int, list[str]] = {}
        for opt, action in p._option_string_actions.items():
            strings.setdefault(id(action), []).append(opt)
        return strings

    serve_strings = registered(parser)
    actions = []
    for a in parser._actions:
        entry = _action_entry(parser, a, serve_strings.get(id(a), []))
        if not a.option_strings:
            value = a.default
        elif a.dest == argparse.SUPPRESS or a.dest not in raw:
            value = argparse.SUPPRESS
        else:
            value = bare_ns.get(a.dest, raw[a.dest]) if _is_json_value(raw[a.dest]) else argparse.SUPPRESS
        if value is argparse.SUPPRESS or not _is_json_value(value):
            entry["no_json_default"] = True
        elif value is not None:
            entry["default"] = value
        actions.append(entry)
    top_strings = registered(sp.top)
    subparsers = next(a for a in sp.top._actions if isinstance(a, argparse._SubParsersAction))
    return {
        "vllm_release": public_version(sp.release),
        "python": ".".join(map(str, sys.version_info[:2])),
        "generated_by": "flatshare_ops/common/vllm_serve_parse.py options",
        "parser": {
            "prog": parser.prog,
            "allow_abbrev": parser.allow_abbrev,
            "prefix_chars": parser.prefix_chars,
            "fromfile_prefix_chars": parser.fromfile_prefix_chars,
        },
        "top_level": {
            "prog": sp.top.prog,
            "actions": [_action_entry(sp.top, a, top_strings.get(id(a), []))
                        for a in sp.top._actions if a is not subparsers],
            "subparsers_dest": subparsers.dest,
        },
        "mutually_exclusive_groups": [
            {"required": g.required, "dests": [a.dest for a in g._group_actions]}
            for g in parser._mutually_exclusive_groups],
        "actions": actions,
    }


def table_text(table: dict) -> str:
    """An option table as committed: JSON with one action per line (a diff shows one flag per line)."""
    head = json.dumps({k: v for k, v in table.items() if k != "actions"}, indent=1, sort_keys=True)
    actions = ",\n  ".join(json.dumps(a, sort_keys=True) for a in table["actions"])
    return f'{head[:-2]},\n "actions": [\n  {actions}\n ]\n}}\n'


# --------------------------------------------------------------------------
# The preflight


def preflight(words: list[str]) -> dict:
    """What `vllm serve WORDS` runs before it touches the device; see the module docstring ("preflight")."""
    import time

    checked: list[str] = []
    seconds: dict[str, float] = {}
    stage = "parser"
    started = time.monotonic()

    release: list[str] = []  # what importlib.metadata says this vLLM is, once the parser is built

    def failed(error: str) -> dict:
        seconds[stage] = round(time.monotonic() - started, 3)
        return {"ok": False, "stage": stage, "error": error, "checked": checked, "seconds": seconds,
                **({"release": release[0]} if release else {})}

    def passed() -> None:
        nonlocal started
        seconds[stage] = round(time.monotonic() - started, 3)
        checked.append(stage)
        started = time.monotonic()

    try:
        sp = ServeParser(default_device=False)
    except Exception as e:  # noqa: BLE001 - vLLM could not even build its parser here
        return failed(f"{type(e).__name__}: {e}")
    release.append(sp.release)
    passed()
    stage = "cache"
    problem = _unwritable_cache_root()
    if problem:
        return failed(problem)
    passed()
    stage = "parse"
    parsed = sp.parse(words)  # argparse's own messages, as `parse` gives them
    if not parsed["ok"]:
        stage = parsed["stage"]
        return failed(parsed["error"])
    sp._reset()  # again, for the namespace object itself (the parse above keeps only its JSON)
    args = sp.top.parse_args(["serve", *words])
    sp.configure_logging_from_args(args)
    sp.cmds[args.subparser].validate(args)
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag  # as ServeSubcommand.cmd does first
    passed()
    checked.append("validate")
    stage = "config"
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext

        config = AsyncEngineArgs.from_cli_args(args).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER)
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError, ValueError, RuntimeError, ...
        return failed(f"{type(e).__name__}: {_first_lines(str(e))}")
    passed()
    stage = "model"
    problem = _unreadable_model_files(config.model_config.model)
    if problem:
        return failed(problem)
    passed()
    stage = "tokenizer"
    try:
        from vllm.renderers import renderer_from_config

        renderer_from_config(config)  # the tokenizer's files, as AsyncLLM reads them before the engine core starts
        config.model_config.get_diff_sampling_param()  # generation_config.json, as the OpenAI server reads it
    except Exception as e:  # noqa: BLE001 - JSONDecodeError, OSError, ValueError from transformers or tokenizers
        where = _unreadable_tokenizer_file(config.model_config.tokenizer) or f"the tokenizer at {config.model_config.tokenizer}"
        return failed(f"{where}: {type(e).__name__}: {_first_lines(str(e))}")
    passed()
    stage = "scheduler"
    try:
        config.scheduler_config.get_scheduler_cls()
    except Exception as e:  # noqa: BLE001 - ModuleNotFoundError, AttributeError, an error in the module
        return failed(f"{type(e).__name__}: {e}")
    passed()
    return {"ok": True, "checked": checked, "seconds": seconds, "release": release[0]}


def _unreadable_model_files(model: str) -> str | None:
    """The first files of a local model directory this process cannot read (the weights are read only after
    the engine core starts, on the device), or None. A hub name (not a directory) is vLLM's to resolve."""
    import os
    import pwd

    if not os.path.isdir(model):
        return None
    unreadable = []
    for path, dirs, files in os.walk(model):
        unreadable += [os.path.join(path, f) for f in sorted(files) if not os.access(os.path.join(path, f), os.R_OK)]
        unreadable += [os.path.join(path, d) for d in sorted(dirs) if not os.access(os.path.join(path, d), os.R_OK | os.X_OK)]
    if not unreadable:
        return None
    who = pwd.getpwuid(os.geteuid()).pw_name
    return (f"{len(unreadable)} of the model's files cannot be read by {who}: {', '.join(unreadable[:3])}"
            f"{' ...' if len(unreadable) > 3 else ''} (make them readable: chmod -R a+rX {model})")


def _unwritable_cache_root() -> str | None:
    """Why vLLM's cache directory cannot be made or written by this process, or None.

    vLLM 0.32.0's engine core writes there at start (its model info cache, torch.compile's cache):
    without it the engine core fails (``PermissionError`` on a home that does not exist).
    """
    import os
    import pwd
    import tempfile

    import vllm.envs as envs

    if os.environ.get("FLATSHARE_PREFLIGHT_SKIP_CACHE") == "1":  # a dry run whose engine home is made at start
        return None
    root = envs.VLLM_CACHE_ROOT
    try:
        if os.path.isdir(root):  # written, as the engine core writes there (the file is removed at once)
            tempfile.TemporaryFile(dir=root).close()
        else:  # made where vLLM would make it: the nearest existing directory must take it (nothing is made)
            parent = os.path.dirname(os.path.abspath(root))
            while not os.path.exists(parent):
                if os.path.islink(parent):  # named for what it is, never for the directory above it
                    raise FileNotFoundError(2, f"cannot make {root}: {parent} is a symbolic link to "
                                               f"{os.readlink(parent)}, which does not exist")
                parent = os.path.dirname(parent)
            if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
                raise PermissionError(13, f"cannot make {root}: {parent} is not a directory it may write")
    except OSError as e:
        who = pwd.getpwuid(os.geteuid()).pw_name
        return (f"{root} (VLLM_CACHE_ROOT, else $XDG_CACHE_HOME/vllm or $HOME/.cache/vllm; HOME is "
                f"{os.environ.get('HOME', 'not set')}) cannot be made or written by {who}: "
                f"{type(e).__name__}: {e.strerror or e}")
    return None


def _unreadable_tokenizer_file(tokenizer: str) -> str | None:
    """The first of a local tokenizer directory's JSON files (transformers' names) that is not JSON, else None:
    transformers' JSONDecodeError does not say which file it read."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
        path = os.path.join(tokenizer, name)
        try:
            with open(path, "rb") as f:
                json.loads(f.read(64 << 20))
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            return path
    return None


def _first_lines(text: str, count: int = 4) -> str:
    """A long message (pydantic's) on one line: its first lines, without pydantic's echo of the input
    (``[type=value_error, input_value=ArgsKwargs(...)``) and its link to its own documentation."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    lines = [re.sub(r"\s*\[type=.*$", "", line) for line in lines if not line.startswith("For further information")]
    return " ".join(lines[:count]) + (" ..." if len(lines) > count else "")


# --------------------------------------------------------------------------
# Entry point


def _read_argv_list(data) -> list[str]:
    if not isinstance(data, list) or not all(isinstance(a, str) for a in data):
        raise Usage("stdin must be a JSON list of strings (the words after `vllm serve`)")
    return data


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in MODES:
        print(f"usage: {os.path.basename(sys.argv[0])} {{{','.join(MODES)}}} < JSON", file=sys.stderr)
        return 2
    mode = argv[0]
    # Keep stdout for our JSON only: vLLM's log handler binds the stream it
    # finds when vllm is imported, so vLLM must see stderr as stdout from the start.
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    try:
        if mode == "options":
            # Defaults as in a clean environment: vLLM reads some from VLLM_* variables.
            for name in [n for n in os.environ if n.startswith("VLLM_") and n != "VLLM_TARGET_DEVICE"]:
                del os.environ[name]
            result: dict | list[dict] = options_table(ServeParser())  # parse-many's is a list
        else:
            try:
                data = json.load(sys.stdin)
            except ValueError as e:
                raise Usage(f"stdin is not JSON: {e}") from None
            if mode == "parse":
                words = _read_argv_list(data)
                result = ServeParser().parse(words)
            elif mode == "preflight":
                result = preflight(_read_argv_list(data))
            else:
                if not isinstance(data, list):
                    raise Usage("stdin must be a JSON list of argv lists")
                lines = [_read_argv_list(x) for x in data]
                sp = ServeParser()
                result = [sp.parse(words) for words in lines]
    except Usage as e:
        print(f"vllm_serve_parse: {e}", file=sys.stderr)
        return 2
    finally:
        sys.stdout = real_stdout
    if mode == "options":
        assert isinstance(result, dict)  # options_table's
        real_stdout.write(table_text(result))
    else:
        json.dump(result, real_stdout, indent=1, sort_keys=True)
        real_stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
