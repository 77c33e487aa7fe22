"""The layout is the architecture: where each piece runs, and what it may import (docs/architecture.md, "Layout")."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "flatshare_ops"


def _imports(path: Path) -> set[str]:
    """Absolute module names a file imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("part", ["node", "check", "common"])
def test_node_check_and_common_never_import_the_operators_side_or_the_renderer(part):
    offenders = {}
    for path in sorted((PACKAGE / part).rglob("*.py")):
        bad = sorted(n for n in _imports(path)
                     if n.startswith(("flatshare_ops.control", "flatshare_ops.render", "flatshare_ops.cli",
                                      "flatshare_ops.config", "flatshare_ops.sandbox")))
        if bad:
            offenders[str(path.relative_to(REPO))] = bad
    assert offenders == {}


@pytest.mark.parametrize("part, other", [("check", "node"), ("node", "check")])
def test_serving_check_and_the_nodes_side_never_import_each_other(part, other):
    """check/ reaches systemd through common/systemd.py, as node/ does, and the switch runs serving-check as a
    program (node/serving_check.py), reading its report as data (common/serving_report.py): neither depends on
    the other's code."""
    offenders = {str(p.relative_to(REPO)): sorted(n for n in _imports(p) if n.startswith(f"flatshare_ops.{other}"))
                 for p in sorted((PACKAGE / part).rglob("*.py"))}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_operators_side_reads_no_sentence_a_node_prints():
    """What a node says reaches the operator's side as fields (common/protocol.py; a command that cannot answer
    sends a ``CommandError``): nothing in control/ or cli/ tests the node's stderr for words, strips its
    ``flatshare-node:`` prefix or looks for argparse's English."""
    forms = [re.compile(r"\bin\s+[\w.]*errors\b(?!\()"), re.compile(r"errors\s*\.\s*(startswith|endswith|find|split)\("),
             re.compile(r"""removeprefix\(\s*f?["']flatshare-node"""), re.compile(r"invalid choice")]
    found = [f"{path.relative_to(REPO)}:{number}: {text.strip()}"
             for part in ("control", "cli") for path in sorted((PACKAGE / part).rglob("*.py"))
             for number, text in enumerate(path.read_text().splitlines(), 1) if any(f.search(text) for f in forms)]
    assert found == []


def test_common_imports_only_the_standard_library():
    modules = sorted(f"flatshare_ops.common.{p.stem}" for p in (PACKAGE / "common").glob("*.py")
                     if p.stem not in ("__init__", "vllm_serve_parse"))
    code = ("import sys\nbefore = set(sys.modules)\n" + "".join(f"import {m}\n" for m in modules) +
            "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
            "print(sorted(n for n in new if n not in sys.stdlib_module_names and n != 'flatshare_ops'))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_each_step_is_defined_once_and_the_plan_reads_the_table():
    from flatshare_ops.node import plan, steps

    names = [s.name for s in steps.STEPS]
    assert len(names) == len(set(names))
    assert set(plan.ALWAYS) <= set(names)
    for cls_steps in plan._CLASS_STEPS.values():  # noqa: SLF001 (the plan's rules as data)
        assert set(cls_steps) <= set(names)
    assert all(callable(s.run) and s.description for s in steps.STEPS)


#: Where a word of the protocol's vocabularies means something else: (file under flatshare_ops/, scope: a function,
#: class or module-level name around it, "*" for the whole file; the word, "*" for any) -> what it means there.
OTHER_MEANINGS = {
    ("check/run.py", "*", "release"): "the name of serving-check's finding on the node's release lock and journal",
    ("check/cli.py", "_main", "release"): "the name of serving-check's finding on the node's release lock and journal",
    ("check/cli.py", "_parser", "serving-check"): "the program's name",
    ("render/dashboard.py", "*", "serving-check"): "a panel's title (the program's report)",
    ("cli/sandbox.py", "*", "running"): "systemd's SystemState of a sandbox machine",
    ("node/steps.py", "_wait_ready", "failed"): "systemd's ActiveState of the engine",
    ("control/bootstrap.py", "*", "done"): "the status column of bootstrap's lines, for people",
    ("control/analysis.py", "Verdict", "inconclusive"): "a measurement's verdict, which the node never reads",
    ("control/analysis.py", "Action", "rollback"): "what the rollout does with an analysis, which the node never reads",
    ("control/analysis.py", "_TALLY_WORDS", "*"): "how many measurements had each verdict, in words for people",
    ("control/rollout.py", "document", "done"): "what exit code 0 means in --json (the run did what it was asked)",
    ("control/summary.py", "COLUMNS", "analysis"): "a column of the rollout's summary, and the field it shows",
    ("node/plan.py", "CHANGE_CLASSES", "drain-voice"): "a change class (X-Flatshare-Change=drain-voice), not a step",
}


def _protocol_words() -> dict[str, list[str]]:
    """Each word of common/protocol.py's vocabularies -> the names of the enums it is a value of."""
    from enum import StrEnum

    from flatshare_ops.common import protocol

    words: dict[str, list[str]] = {}
    for thing in vars(protocol).values():
        if isinstance(thing, type) and issubclass(thing, StrEnum) and thing.__module__ == protocol.__name__:
            for member in thing:
                words.setdefault(member.value, []).append(thing.__name__)
    return words


def _words_used(path: Path, words: dict[str, list[str]]) -> list[tuple[int, str, str, tuple[str, ...]]]:
    """(line, word, how it is used, the scopes around it: ``"*"`` then the outermost first) for each string constant
    of ``path`` that is a protocol word where it is used as one: compared (``==``, ``!=``, ``in`` a tuple, set or
    list of constants; not ``"release" in report``, a key), a dict's value, the keys of a dict that maps words (two
    or more keys of one vocabulary; a single word among other keys names a document's field: ``release``,
    ``analysis``), a call's argument (not an attribute's or a key's name: ``getattr``, ``.get``, ``text_field``;
    not a decorator's: a command's name), a ``Literal[...]``, a parameter's default, an assigned value (a constant,
    a tuple, set or list of them, either branch of a conditional)."""

    def constants(node: ast.AST) -> list[ast.Constant]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in words:
            return [node]
        if isinstance(node, (ast.Tuple, ast.Set, ast.List)):
            return [c for element in node.elts for c in constants(element)]
        if isinstance(node, ast.IfExp):
            return constants(node.body) + constants(node.orelse)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("frozenset", "set", "tuple"):
            return [c for argument in node.args for c in constants(argument)]
        return []

    def mapping(keys: list[ast.Constant]) -> bool:
        vocabularies = [name for key in keys for name in words[str(key.value)]]
        return any(vocabularies.count(name) > 1 for name in vocabularies)

    found: list[tuple[int, str, str, tuple[str, ...]]] = []

    class Visitor(ast.NodeVisitor):
        def __init__(self) -> None:
            self.scopes = ["*"]

        def visit_FunctionDef(self, node):  # noqa: N802 (ast.NodeVisitor's names)
            self.scopes.append(node.name)
            for child in ast.iter_child_nodes(node):
                if child not in node.decorator_list:  # ``@app.command("release")``: a command's name
                    self.visit(child)
            self.scopes.pop()

        visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

        def note(self, nodes, how: str) -> None:
            found.extend((c.lineno, str(c.value), how, tuple(self.scopes)) for c in nodes)

        def visit_Assign(self, node):  # noqa: N802
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            named = len(self.scopes) == 1 and isinstance(targets[0], ast.Name)
            if named:
                self.scopes.append(targets[0].id)
            self.note(constants(node.value), "assigned")
            self.generic_visit(node)
            if named:
                self.scopes.pop()

        def visit_AnnAssign(self, node):  # noqa: N802
            if node.value is not None:
                self.visit_Assign(node)
            else:
                self.generic_visit(node)

        def visit_Compare(self, node):  # noqa: N802
            for left, op, right in zip((node.left, *node.comparators), node.ops, node.comparators):
                if not isinstance(op, (ast.In, ast.NotIn)):  # ``"release" in report``: a key, a field's name
                    self.note(constants(left), "compared")
                self.note(constants(right), "compared")
            self.generic_visit(node)

        def visit_Dict(self, node):  # noqa: N802
            keys = [c for k in node.keys if k is not None for c in constants(k)]
            if mapping(keys):
                self.note(keys, "a dict's key")
            for value in node.values:
                self.note(constants(value), "a dict's value")
            self.generic_visit(node)

        def visit_Call(self, node):  # noqa: N802
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            names = {1} if name in ("getattr", "hasattr", "setattr") or name.endswith("_field") else \
                {0} if name in ("get", "pop", "setdefault") else set()
            for index, argument in enumerate(node.args):
                if index not in names:
                    self.note(constants(argument), "an argument")
            for keyword in node.keywords:
                self.note(constants(keyword.value), "an argument")
            self.generic_visit(node)

        def visit_Subscript(self, node):  # noqa: N802
            name = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
            if name == "Literal":
                self.note(constants(node.slice), "a Literal")
            self.generic_visit(node)

        def visit_arguments(self, node):  # noqa: N802
            for default in (*node.defaults, *node.kw_defaults):
                if default is not None:
                    self.note(constants(default), "a default")
            self.generic_visit(node)

    Visitor().visit(ast.parse(path.read_text()))
    return sorted(set(found))


def test_no_module_outside_common_defines_or_spells_a_protocol_word():
    """Every kind, mode, phase, step, result, state and refusal that crosses between the operator's side and a node
    (or into the node's files) is a member of one enum in common/protocol.py: no other module spells one of its
    words where it uses it as one (sandbox/, the stand-ins, counts "refused" and "failed" calls of its own), but
    where the word means something else (:data:`OTHER_MEANINGS`, each with what it means there)."""
    words = _protocol_words()
    assert {"released", "rolled back", "failed", "abandoned", "release", "repair", "deciding", "busy", "pending",
            "undo-rollout", "drain-voice", "passed", "interrupted"} <= set(words)
    spelled, allowed = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(("common/", "sandbox/")):
            continue
        for line, word, how, scope in _words_used(path, words):
            meant = next((key for key in OTHER_MEANINGS if key[0] == relative and key[1] in scope
                          and key[2] in (word, "*")), None)
            if meant is not None:
                allowed.add(meant)
                continue
            where = ".".join(scope[1:]) or "the module"
            spelled.append(f"flatshare_ops/{relative}:{line}: {word!r} ({how}, in {where}; a word of "
                           f"{' and '.join(words[word])}): use common/protocol.py's member")
    assert not spelled, "\n".join(spelled)
    assert allowed == set(OTHER_MEANINGS), f"no longer needed: {sorted(set(OTHER_MEANINGS) - allowed)}"


def test_the_architecture_documents_layout_names_every_module_under_its_folder():
    readme = (REPO / "docs/architecture.md").read_text()
    section = readme[readme.index("## Layout"):]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    # Each folder's bullet: from "- `flatshare_ops/FOLDER/`" to the next bullet.
    bullets = {}
    for bullet in section.split("\n- ")[1:]:
        if bullet.startswith("`flatshare_ops/"):
            bullets[bullet.split("`")[1].rstrip("/")] = bullet
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(REPO)
        if path.name in ("__init__.py", "__main__.py") or "sandbox" in relative.parts:
            continue
        folder = "/".join(relative.parts[:-1])
        where = section if folder == "flatshare_ops" else bullets.get(folder, "")  # top-level: anywhere
        if f"`{path.name}`" not in where and f"`{folder}/{path.name}`" not in where:
            missing.append(str(relative))
    assert not missing, f"docs/architecture.md's Layout section does not name: {missing}"


def test_a_release_ships_exactly_what_the_node_runs():
    """The switcher a release ships (control/bundle.py) holds every module the node's side can import (the
    closure of node/cli.py and node/entry.py's imports, function-level ones included, and of check/cli.py's:
    serving-check, the program the switch's serving-check step runs), and nothing else."""
    import base64
    import io
    import zipfile

    from flatshare_ops.control.bundle import PACKAGE, switcher

    def file_of(module: str) -> Path | None:
        path = REPO / Path(*module.split("."))
        return path / "__init__.py" if (path / "__init__.py").exists() else (
            path.with_suffix(".py") if path.with_suffix(".py").exists() else None)

    needed, todo = set(), ["flatshare_ops.node.cli", "flatshare_ops.node.entry", "flatshare_ops.node.__main__",
                            "flatshare_ops.check.cli"]
    while todo:
        module = todo.pop()
        path = file_of(module)
        if path is None or path in needed:
            continue
        needed.add(path)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += [n for n in _imports(path) if n.startswith("flatshare_ops")]
    data = base64.b64decode(switcher(PACKAGE)["zip_b64"])
    names = set(zipfile.ZipFile(io.BytesIO(data)).namelist())
    wanted = {f"flatshare_ops/{p.relative_to(PACKAGE).as_posix()}" for p in needed}
    wanted |= {f"flatshare_ops/common/{p.relative_to(PACKAGE / 'common').as_posix()}"
               for p in (PACKAGE / "common").rglob("*") if p.is_file() and p.suffix in (".py", ".json")
               and "__pycache__" not in p.parts}  # the engine venv's parse script and vLLM's option tables
    assert not wanted - names, f"not shipped: {sorted(wanted - names)}"
    python = {n for n in names if n.endswith(".py")}
    extra = python - wanted
    assert not extra, f"shipped but never run by the node: {sorted(extra)}"
    assert not [n for n in names if n.split("/")[1] in ("sandbox", "control", "render", "config", "cli.py")]


def test_each_test_module_brings_up_sandboxes_only_on_its_own_loopback_blocks():
    """Modules run at once in different test processes: a block shared by two would put two sandboxes on one
    address (tests/conftest.py, "loopback addresses"). And no module brings a sandbox up on addresses of its own
    making: every `up(...)` in the tests takes them from loopback_pair or loopback_nodes."""
    import re

    from conftest import BLOCKS

    wrong, literal = [], []
    for path in sorted((REPO / "tests").glob("*.py")):
        text = path.read_text()
        for block in re.findall(r"loopback_(?:pair|nodes)\((\d+)\b", text):
            if BLOCKS.get(int(block)) != path.stem:
                wrong.append(f"{path.name}: loopback_pair({block}) is {BLOCKS.get(int(block), 'not registered')}'s")
        literal += [f"{path.name}: {m}" for m in re.findall(r"""ADDRESSES\s*=\s*\{[^}]*127\.[^}]*\}""", text)]
    assert not wrong and not literal, wrong + literal


def test_parallel_test_processes_keep_each_group_in_one_process(tmp_path):
    """make test's `-n N --dist loadgroup` sends each group whole to one process (tests/conftest.py); with a
    pytest whose ids xdist cannot rewrite (9.2), the groups were silently lost and a module's fleet came up in
    every process. Two small groups of three tests, four processes: each group's tests report one process."""
    import re

    (tmp_path / "test_grouped.py").write_text(
        "import pytest\n"
        + "".join(f"@pytest.mark.xdist_group('{g}')\n@pytest.mark.parametrize('i', range(3))\ndef test_{g}(i):\n"
                  "    pass\n" for g in ("one", "two")))
    result = subprocess.run([sys.executable, "-m", "pytest", "-n", "4", "--dist", "loadgroup", "-v", "-p",
                             "no:cacheprovider", "-c", "/dev/null", str(tmp_path)], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    workers = {g: set(re.findall(rf"\[(gw\d+)\] .*PASSED .*test_{g}\[", result.stdout)) for g in ("one", "two")}
    assert all(len(w) == 1 for w in workers.values()), (workers, result.stdout)


def test_ruff_finds_nothing_on_the_whole_tree():
    """ruff (pinned in requirements-dev.lock, configured in pyproject.toml) checks every Python file of the
    checkout: unused imports and names, undefined names, f-strings without a placeholder, ambiguous names."""
    from conftest import BIN

    result = subprocess.run([str(BIN / "ruff"), "check", "--output-format", "concise", "--no-cache", str(REPO)],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_switcher_says_its_generation_as_data_and_the_entry_point_reads_only_that(tmp_path):
    """The zip a release ships describes itself in one JSON member (common/protocol.py ``SWITCHER_DESCRIPTION``):
    the shipped code's own GENERATION. The node's entry point reads that member, never the code's source."""
    import base64
    import io
    import json
    import zipfile

    from flatshare_ops.common.protocol import GENERATION, SWITCHER_DESCRIPTION
    from flatshare_ops.control.bundle import PACKAGE, switcher
    from flatshare_ops.node.entry import switcher_generation

    shipped = zipfile.ZipFile(io.BytesIO(base64.b64decode(switcher(PACKAGE)["zip_b64"])))
    assert json.loads(shipped.read(SWITCHER_DESCRIPTION)) == {"generation": GENERATION}
    assert switcher_generation(shipped) == GENERATION

    def archive(members: dict[str, bytes]) -> zipfile.ZipFile:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as out:
            for name, data in members.items():
                out.writestr(name, data)
        return zipfile.ZipFile(io.BytesIO(buffer.getvalue()))

    # The source saying another generation is not read: only the description counts.
    source = shipped.read("flatshare_ops/common/protocol.py")
    assert switcher_generation(archive({"flatshare_ops/common/protocol.py": source.replace(
        f"\nGENERATION = {GENERATION}\n".encode(), b"\nGENERATION = 99\n"), SWITCHER_DESCRIPTION: b'{"generation": 3}'})) == 3
    assert switcher_generation(archive({"flatshare_ops/common/protocol.py": source})) == 1  # no description
    # A breaker's cases too: nested past any bound (json.loads raised RecursionError), a 4,000-digit or a negative
    # generation, a description of megabytes.
    for damaged in (b"{", b"[2]", b'{"generation": "2"}', b'{"generation": true}', b"[" * 100000,
                    b'{"generation": ' + b"9" * 4000 + b"}", b'{"generation": -2}', b'{"generation": 0}',
                    b'{"generation": 2, "x": "' + b"y" * 5000 + b'"}'):
        with pytest.raises(ValueError):
            switcher_generation(archive({SWITCHER_DESCRIPTION: damaged}))


def test_mypy_finds_nothing_on_the_whole_tree(tmp_path):
    """mypy (pinned in requirements-dev.lock, configured in pyproject.toml's [tool.mypy]) type-checks the package,
    the tests, the benchmarks and the scripts with its default checks and pydantic's plugin (about 10 s). Its
    cache goes to tmp_path: nothing is left in the checkout."""
    from conftest import BIN

    result = subprocess.run([str(BIN / "mypy"), "--no-incremental", "--cache-dir", str(tmp_path / "mypy-cache")],
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_kept_switchers_files_a_killed_write_left_are_removed_when_it_is_made_again(tmp_path):
    # A write killed half-way leaves its file beside its place (node/entry.py _write): removed once past
    # LEFTOVER_S when the zip that runs is made again; one written now (another command's) is never touched.
    import hashlib
    import json
    import os
    import time

    from flatshare_ops.control.bundle import PACKAGE, switcher
    from flatshare_ops.node.entry import LEFTOVER_S, keep

    shipped = switcher(PACKAGE)
    run = keep(tmp_path, shipped)
    directory = run.parent
    old, new = directory / f".{run.name}.killed", directory / f".{run.name}.writing"
    for path in (old, new):
        path.write_bytes(b"half")
    os.utime(old, (time.time() - LEFTOVER_S - 60,) * 2)
    (directory / "run.json").write_text("{")  # damaged: made again
    assert keep(tmp_path, shipped) == run
    assert not old.exists() and new.exists()
    note = json.loads((directory / "run.json").read_text())
    assert note["sha256"] == hashlib.sha256(run.read_bytes()).hexdigest()


def test_a_command_running_from_a_kept_switcher_goes_on_while_another_makes_its_zip_again(tmp_path):
    # Python's zipimport reads each module at the offsets it read from the zip at the first import: the zip a
    # command runs from must hold the same bytes until it ends, whatever another command makes meanwhile (a zip
    # made again by another interpreter, after an upgrade, differs). Each zip that runs is named by its sha256
    # (run-SHA256.zip) and, once whole, never written again.
    import hashlib
    import json
    import os
    import subprocess
    import sys

    from flatshare_ops.control.bundle import PACKAGE, switcher
    from flatshare_ops.node.entry import keep

    run = keep(tmp_path, switcher(PACKAGE))
    before, inode = run.read_bytes(), run.stat().st_ino
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import flatshare_ops.node.cli; sys.stdin.readline(); "
            "import flatshare_ops.node.switch, flatshare_ops.node.preflight; "
            "print(flatshare_ops.node.switch.__file__)")
    command = subprocess.Popen([sys.executable, "-c", code, str(run)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        (run.parent / "run.json").write_text("{")  # damaged: the next command makes the zip that runs again
        again = ("import sys; from pathlib import Path; from flatshare_ops.control.bundle import PACKAGE, switcher; "
                 "from flatshare_ops.node.entry import keep; print(keep(Path(sys.argv[1]), switcher(PACKAGE)))")
        made = subprocess.run([sys.executable, "-c", again, str(tmp_path)], capture_output=True, text=True,
                              env=dict(os.environ), timeout=120)
        assert made.returncode == 0, made.stderr
    finally:
        out, err = command.communicate("go\n", timeout=120)
    assert command.returncode == 0, err
    assert out.strip().startswith(str(run)), out
    # The zip it ran from was never written again (the same file, the same bytes), and run.json names a whole one.
    assert (run.stat().st_ino, run.read_bytes()) == (inode, before)
    named = json.loads((run.parent / "run.json").read_text())["sha256"]
    assert hashlib.sha256((run.parent / f"run-{named}.zip").read_bytes()).hexdigest() == named


def test_a_switcher_that_unpacks_past_its_bound_is_refused_and_nothing_is_kept(tmp_path):
    # A breaker's case: a 300 KB zip holding 300 MB (a description of zeros) was unpacked onto the node and run (and would be compiled now).
    import base64
    import hashlib
    import io
    import zipfile

    from flatshare_ops.node.entry import MAX_UNPACKED_BYTES, keep

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as out:
        out.writestr("flatshare_ops/__init__.py", b"")
        out.writestr("flatshare_ops/padding.py", b"#" * (MAX_UNPACKED_BYTES + 1))
    data = buffer.getvalue()
    assert len(data) < 1 << 20  # small to ship, large unpacked
    with pytest.raises(ValueError, match="unpacked, more than 64 MiB"):
        keep(tmp_path, {"sha256": hashlib.sha256(data).hexdigest(), "zip_b64": base64.b64encode(data).decode()})
    assert not (tmp_path / ".switchers").exists()


def _kept_active(tmp_path):
    """A releases directory whose active release names this checkout's switcher, kept: (releases, its directory)."""
    import os

    from flatshare_ops.control.bundle import PACKAGE, switcher
    from flatshare_ops.node.entry import keep

    releases = tmp_path / "releases"
    shipped = switcher(PACKAGE)
    run = keep(releases, shipped)
    stored = releases / "0000000000000001"
    stored.mkdir()
    (stored / "switcher").write_text(shipped["sha256"] + "\n")
    os.symlink(stored.name, releases / "current")
    return releases, run.parent


def test_vllms_option_tables_are_read_from_the_zip_a_switcher_runs_from(tmp_path):
    # A breaker's case: from a zip, a missing table is an OSError of no errno (not FileNotFoundError), and a
    # release naming a vLLM without a table ended in "unexpected OSError" on the node instead of its preflight.
    import subprocess
    import sys

    from flatshare_ops.control.bundle import PACKAGE, switcher
    from flatshare_ops.node.entry import keep

    run = keep(tmp_path, switcher(PACKAGE))
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); from flatshare_ops.common import vllm_argv; "
            "assert vllm_argv.__file__.startswith(sys.argv[1]); said = []\n"
            "try:\n    vllm_argv.flag_name('max_num_seqs', '0.34.0')\nexcept ValueError as err:\n    said.append(str(err))\n"
            "print(json.dumps([vllm_argv.known_releases(), vllm_argv.flag_name('max_num_seqs'), said]))")
    done = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    releases, flag, said = json.loads(done.stdout)
    assert releases == sorted(p.stem for p in (PACKAGE / "common/vllm_options").glob("*.json"))
    assert flag == "--max-num-seqs"
    assert len(said) == 1 and said[0].startswith("no option table for vLLM 0.34.0"), said


def test_commands_at_once_on_a_kept_switcher_whose_directory_is_a_link_all_run_it(tmp_path):
    # A breaker's case: 16 commands at once, each moving "the damaged directory" aside, moved each other's fresh
    # directory aside: some ran the installed code (a note on stderr), one with no note, and a partial directory
    # was left behind. One command at a time makes a switcher's files (.switchers/.making).
    import shutil
    import subprocess
    import sys

    releases, directory = _kept_active(tmp_path)
    code = ("import sys; from pathlib import Path; from flatshare_ops.node.entry import active_switcher; "
            "sys.stdin.readline(); print(active_switcher(Path(sys.argv[1])))")
    for round_ in range(4):  # the race needs commands that meet: several rounds, each started at one go
        elsewhere = tmp_path / f"copy-{round_}"
        shutil.copytree(directory, elsewhere)
        shutil.rmtree(directory)
        directory.symlink_to(elsewhere)
        commands = [subprocess.Popen([sys.executable, "-c", code, str(releases)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(12)]
        for command in commands:  # all started and waiting: told to go at once
            assert command.stdin is not None
            command.stdin.write("go\n")
            command.stdin.flush()
        said = [c.communicate(timeout=120) for c in commands]
        assert all(c.returncode == 0 for c in commands), said
        assert all(out.strip().startswith(str(directory / "run-")) and not err for out, err in said), [
            s for s in said if not s[0].strip().startswith(str(directory / "run-")) or s[1]]
        assert directory.is_dir() and not directory.is_symlink()
        assert not list(releases.glob(".switchers/.damaged-*"))


@pytest.mark.parametrize("damage", ["fifo", "not a sha256", "a directory"])
def test_an_active_release_whose_switcher_note_is_damaged_runs_the_installed_code_and_says_so(tmp_path, capsys,
                                                                                                  damage):
    import os
    import shutil

    from flatshare_ops.node.entry import active_switcher

    releases, _ = _kept_active(tmp_path)
    note = releases / "current" / "switcher"
    note.unlink()
    if damage == "fifo":
        os.mkfifo(note)
    elif damage == "a directory":
        note.mkdir()
    else:
        note.write_text("0" * 63 + "\n")
    assert active_switcher(releases) is None
    err = capsys.readouterr().err
    assert str(note) in err and "running the installed flatshare-ops instead" in err, err
    shutil.rmtree(releases, ignore_errors=True)
