"""The docs say what is true of the code: README.md, CONTRIBUTING.md and docs/**.md.

A reader copies a command from a page, follows a link, greps for a metric; each
must still exist. Checked here, from the code itself, without starting a server:

- every ``flashserve SUBCOMMAND --flag`` in a code span or block is a flag of that
  subcommand's parser (``flashserve.cli.build_parser``), a value given to a flag
  with choices is one of them, a bare ``--flag`` span is a flag of some
  subcommand or repository script, a ``bench/x.py --flag`` (or ``python -m
  training.x --flag``) one that script adds, and a ``| Flag | Default |`` table
  row says the parser's default;
- every ``make TARGET`` is a target of the Makefile;
- every relative link resolves to a file (and its ``#anchor`` to a heading);
  every ``path.py:Name``, ```path.py` (`Name`)`` and ``engine.module.Name``
  names something defined there; every repository path (``kernels/{a,b}.py``
  expanded) and every page named in the text exists;
- every ``flashserve:`` / ``vllm:`` metric name is one the server registers,
  every ``FLASHSERVE_*`` variable is read somewhere, every ``Flashserve*`` alert
  is in the alert rules;
- no page cites the issue tracker (``issue N``, ``#N``, ``item N``): a reader has none.

Each failure names the page and line: ``docs/deploy.md:212: ...``.
`test_each_check_names_the_stale_line` feeds every check a page of stale lines.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import re
import shlex
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import pytest
from docs_helpers import (
    ROOT,
    Code,
    Page,
    anchors,
    block_lines,
    code_spans,
    doc_pages,
    links,
    paragraphs,
)

from flashserve.cli import build_parser

PAGES = doc_pages()
_IDS = [p.name for p in PAGES]


def _report(problems: list[str]) -> None:
    if problems:
        pytest.fail("\n" + "\n".join(problems), pytrace=False)


def _code(page: Page) -> Iterator[Code]:
    yield from code_spans(page)
    yield from block_lines(page)


# --- flashserve SUBCOMMAND --flag -------------------------------------------------------


@cache
def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("flashserve's parser has no subcommands")


def _literal_flags(path: Path) -> frozenset[str]:
    """The ``--flag`` strings a script passes to ``add_argument`` (read with ast, not run)."""
    flags = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            flags.update(
                a.value
                for a in node.args
                if isinstance(a, ast.Constant) and str(a.value).startswith("--")
            )
    return frozenset(flags)


@cache
def _script_flags() -> dict[str, frozenset[str]]:
    """Each repository script with a parser of its own -> its flags."""
    out = {}
    for folder in ("bench", "scripts", "training"):
        for path in (ROOT / folder).rglob("*.py"):
            flags = _literal_flags(path)
            if flags:
                out[path.relative_to(ROOT).as_posix()] = flags
    return out


# Flags of other tools that the pages name bare: docker compose's.
_OTHER_TOOLS = frozenset({"--profile", "--scale"})


@cache
def _all_flags() -> frozenset[str]:
    subs = _subparsers().values()
    flashserve = {s for sub in subs for s in sub._option_string_actions}
    scripts = {f for flags in _script_flags().values() for f in flags}
    return frozenset(flashserve | scripts | _OTHER_TOOLS)


# The command word: first on the line, after a path (.venv/bin/), a shell operator, or
# `docker run IMAGE`; not a value such as `kubectl -n flashserve create`.
_COMMAND = re.compile(r"(?:^|(?<=[/(;&|])\s*|(?<=\s)(?<!-n\s))flashserve\s+([a-z][\w-]*)(.*)$")
_SHELL_END = {"&", "&&", "|", "||", ";", ">", ">>", "2>&1", ")"}
# A value standing for one the reader fills in (KEY, N, /path/..., $(VAR), ...).
_LITERAL = re.compile(r"^[a-z0-9][\w.-]*$")


def _words(rest: str) -> list[str]:
    rest = re.sub(r"\s#.*$", "", rest)  # a shell comment
    try:
        words = shlex.split(rest)
    except ValueError:  # an unbalanced quote in prose
        words = rest.split()
    for i, word in enumerate(words):
        if word in _SHELL_END:
            return words[:i]
    return words


def _command_problems(code: Code) -> Iterator[str]:
    m = _COMMAND.search(code.text)
    if not m:
        return
    sub_name, rest = m.group(1), m.group(2)
    subs = _subparsers()
    if sub_name not in subs:
        yield f"`flashserve {sub_name}`: no such subcommand (there are {sorted(subs)})"
        return
    options = subs[sub_name]._option_string_actions
    words = _words(rest)
    for i, word in enumerate(words):
        if not re.match(r"--[a-z]", word):
            continue
        flag, _, inline = word.partition("=")
        action = options.get(flag)
        if action is None:
            yield f"`flashserve {sub_name} {flag}`: `flashserve {sub_name}` has no such flag"
            continue
        value = inline or (words[i + 1] if i + 1 < len(words) else "")
        if action.choices and _LITERAL.match(value) and value not in action.choices:
            yield (f"`flashserve {sub_name} {flag} {value}`: not one of {sorted(action.choices)}")


def _bare_flag_problems(code: Code) -> Iterator[str]:
    """A span that is only flags (`--nnodes`, `--tensor-parallel-size T`)."""
    if code.block or not code.text.startswith("--"):
        return
    flag = code.text.split()[0].split("=")[0]
    if re.fullmatch(r"--[a-z][\w-]*", flag) and flag not in _all_flags():
        yield f"`{flag}`: not a flag of any flashserve subcommand or repository script"


_SCRIPT = re.compile(r"(?<![\w/.-])((?:bench|scripts|training)/[\w/-]+\.py)(.*)$")
_MODULE = re.compile(r"(?<!\S)-m\s+((?:bench|scripts|training)(?:\.\w+)+)(.*)$")


def _script_problems(code: Code) -> Iterator[str]:
    """`bench/x.py --flag ...` or `python -m training.x --flag` in a block or span: a flag
    that script's parser adds."""
    m = _SCRIPT.search(code.text)
    module = _MODULE.search(code.text)
    if m:
        script, rest = m.group(1), m.group(2)
    elif module:
        script, rest = module.group(1).replace(".", "/") + ".py", module.group(2)
    else:
        return
    if not (ROOT / script).is_file():
        yield f"`{script}`: no such file"
        return
    flags = _script_flags().get(script)
    if flags is None:
        return  # no parser of its own (or one built elsewhere): nothing to hold it to
    for word in _words(rest):
        flag = word.partition("=")[0]
        if re.fullmatch(r"--[a-z][\w-]*", flag) and flag not in flags:
            yield f"`{script} {flag}`: {script} has no such flag"


def _flashserve_commands_and_flags_exist(page: Page) -> list[str]:
    problems = [
        f"{page.where(code.line)}: {problem}"
        for code in _code(page)
        for problem in [
            *_command_problems(code),
            *_bare_flag_problems(code),
            *_script_problems(code),
        ]
    ]
    return problems


def _default_of(flag: str) -> tuple[str, object] | None:
    """(subcommand, default) of the first subcommand, serve first, that has ``flag``."""
    subs = _subparsers()
    for name in ("serve", *sorted(subs)):
        action = subs[name]._option_string_actions.get(flag)
        if action is not None:
            return name, action.default
    return None


def _default_problem(flag: str, cell: str) -> str | None:
    """A table's Default cell against the parser: numbers (``30 s``, ``262144``), ``off``,
    a backticked word; anything else (``torch's``, ``1 2 4 ... --max-num-seqs``) is prose."""
    found = _default_of(flag)
    if found is None:
        return None  # the flag check reports it
    sub, default = found
    number = re.fullmatch(r"`?(\d[\d,]*(?:\.\d+)?)`?(?: s)?", cell)
    if number:
        value = float(number.group(1).replace(",", ""))
        ok = isinstance(default, int | float) and float(default) == value
    elif cell == "off":
        ok = default in (False, None)
    elif re.fullmatch(r"`[\w.-]+`", cell):
        ok = str(default) == cell.strip("`")
    else:
        return None
    if ok:
        return None
    return f"`{flag}`: the table says the default is {cell}, `flashserve {sub}` has {default!r}"


def _flag_table_defaults_match(page: Page) -> list[str]:
    """Rows of a ``| Flag | Default | ... |`` table."""
    problems = []
    in_table = False
    for number, line in enumerate(page.lines, 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            in_table = False
        elif len(cells) >= 2 and cells[0].lower() == "flag" and cells[1].lower() == "default":
            in_table = True
        elif in_table and cells[0].startswith("`--"):
            flag = cells[0].strip("`").split()[0].rstrip("`,")
            problem = _default_problem(flag, cells[1])
            if problem:
                problems.append(f"{page.where(number)}: {problem}")
    return problems


# --- make TARGET ------------------------------------------------------------------------


@cache
def _make_targets() -> frozenset[str]:
    targets: set[str] = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([^\s#:=][^:=]*?)\s*:(?!=)", line)
        if m and not line.startswith("\t"):
            targets.update(t for t in m.group(1).split() if not t.startswith("$("))
    return frozenset(targets - {".PHONY"})


_MAKE = re.compile(r"(?:^|(?<=[\s;&|(]))make((?:\s+[^\s;&|#]+)*)")


def _make_problems(code: Code) -> Iterator[str]:
    for m in _MAKE.finditer(code.text):
        for word in m.group(1).split():
            if word.startswith("-") or "=" in word:
                continue
            if word not in _make_targets():
                known = sorted(_make_targets())
                yield f"`make {word}`: no such Makefile target (there are {known})"


def _make_targets_exist(page: Page) -> list[str]:
    return [f"{page.where(c.line)}: {p}" for c in _code(page) for p in _make_problems(c)]


# --- links and path.py:Name -------------------------------------------------------------

_BY_PATH = {p.path: p for p in PAGES}


@cache
def _anchors_of(path: Path) -> frozenset[str]:
    page = _BY_PATH.get(path) or Page(path, path.read_text(encoding="utf-8").splitlines())
    return frozenset(anchors(page))


def _link_problem(page: Page, target: str) -> str | None:
    if re.match(r"^[a-z][\w+.-]*:", target):  # http:, https:, mailto:
        return None
    path_part, _, anchor = target.partition("#")
    path = (page.path.parent / path_part).resolve() if path_part else page.path
    if not path.exists():
        return f"link ({target}): {path_part} does not exist (relative to {page.name})"
    if anchor and path.suffix == ".md" and anchor not in _anchors_of(path):
        return f"link ({target}): {path.relative_to(ROOT)} has no heading #{anchor}"
    return None


def _relative_links_resolve(page: Page) -> list[str]:
    problems = []
    for line, target in links(page):
        problem = _link_problem(page, target)
        if problem:
            problems.append(f"{page.where(line)}: {problem}")
    return problems


# `engine/config.py:EngineConfig`, `server/app.py` `chat_completions`, and
# `engine/api/protocol.py` (`EngineClient`, `PrefillResult`): a file, then names in it.
_PY_NAME = re.compile(r"(?<![\w/.-])([\w./-]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
_PY_THEN_NAMES = re.compile(
    r"`([\w.-]+/[\w./-]+\.py)`\s+(?:\(((?:`[\w.]+`(?:,\s*|\s+and\s+)?)+)\)|`(\w+(?:\.\w+)?)`)"
)


@cache
def _top_level(path: Path) -> dict[str, ast.AST]:
    return _names_in(ast.parse(path.read_text(encoding="utf-8")).body)


@cache
def _anywhere(path: Path) -> frozenset[str]:
    """Every def and class at any depth (a route inside ``create_app``), every
    parameter (``encoder_only``) and every top-level or class-level name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set(_top_level(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(_names_in(node.body))
        if isinstance(node, ast.arg):
            names.add(node.arg)
    return frozenset(names)


def _names_in(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a block of statements binds: defs, classes, assignments, imports."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                names.update((n.id, node) for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update(((a.asname or a.name).split(".")[0], node) for a in node.names)
        elif isinstance(node, ast.If | ast.Try):  # `if TYPE_CHECKING:`, try/except imports
            names.update(_names_in(node.body))
    return names


def _resolve_py(page: Page, file: str) -> Path | None:
    for base in (ROOT, page.path.parent):
        if (base / file).is_file():
            return (base / file).resolve()
    return None


def _py_name_problem(page: Page, file: str, dotted: str) -> str | None:
    """``file:Name`` or ``file:Class.attr``: a top-level name (and the class's attribute)."""
    path = _resolve_py(page, file)
    if path is None:
        return f"`{file}:{dotted}`: {file} does not exist"
    head, *rest = dotted.split(".")
    node = _top_level(path).get(head)
    if node is None:
        return f"`{file}:{dotted}`: {file} defines no top-level `{head}`"
    if rest and isinstance(node, ast.ClassDef) and rest[0] not in _names_in(node.body):
        return f"`{file}:{dotted}`: class `{head}` in {file} has no `{rest[0]}`"
    return None


def _names_after_file_problems(page: Page, m: re.Match[str]) -> Iterator[str]:
    file = m.group(1)
    path = _resolve_py(page, file)
    if path is None:
        yield f"`{file}`: no such file"
        return
    names = re.findall(r"`([\w.]+)`", m.group(2)) if m.group(2) else [m.group(3)]
    for name in names:
        if not all(part in _anywhere(path) for part in name.split(".")):
            yield f"`{file}` (`{name}`): {file} defines no `{name}`"


def _python_names_resolve(page: Page) -> list[str]:
    problems = []
    for number, line in enumerate(page.lines, 1):
        for m in _PY_NAME.finditer(line):
            problem = _py_name_problem(page, m.group(1), m.group(2))
            if problem:
                problems.append(f"{page.where(number)}: {problem}")
    for first, text in paragraphs(page):
        for m in _PY_THEN_NAMES.finditer(text):
            line = first + text.count("\n", 0, m.start())
            problems += [f"{page.where(line)}: {p}" for p in _names_after_file_problems(page, m)]
    return problems


# `engine.api.errors.RequestError`, `engine.planning.accounting.param_shapes`: a module of
# this repository, then names in it.
_DOTTED = re.compile(
    r"^((?:engine|server|kvstore|kernels|flashserve|training|bench)(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$"
)


def _module_of(parts: list[str]) -> tuple[Path, list[str]] | None:
    """The longest module prefix of ``parts`` below a top-level package, and the rest."""
    for i in range(len(parts), 1, -1):
        base = ROOT.joinpath(*parts[:i])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path, parts[i:]
    return None


def _dotted_problem(text: str) -> str | None:
    m = _DOTTED.match(text)
    if not m:
        return None
    parts = m.group(1).split(".")
    found = _module_of(parts)
    if found is None:
        # `engine.generate(...)`: a variable named like a package, not a module path.
        return None if len(parts) == 2 else f"`{m.group(1)}`: no such module in the repository"
    path, names = found
    missing = [n for n in names if n not in _anywhere(path)]
    if missing:
        return f"`{m.group(1)}`: {path.relative_to(ROOT)} defines no `{missing[0]}`"
    return None


def _dotted_names_resolve(page: Page) -> list[str]:
    problems = []
    for code in code_spans(page):
        problem = _dotted_problem(code.text)
        if problem:
            problems.append(f"{page.where(code.line)}: {problem}")
    return problems


# Folders of this repository: a backticked path under one of them must exist.
_REPO_PATH = re.compile(r"^([\w.-]+)(?:/[\w.*-]+)+/?$")
_TOP_FOLDERS = frozenset(
    p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")
)
# What runs write, git-ignored: named as where output lands, absent in a checkout.
_OUTPUTS = ("bench/results/",)


def _expand_braces(text: str) -> list[str]:
    """`kernels/{a,b}.py` -> `kernels/a.py`, `kernels/b.py` (every group, shell-style)."""
    m = re.search(r"\{([^{}]*)\}", text)
    if not m:
        return [text]
    head, tail = text[: m.start()], text[m.end() :]
    return [p for part in m.group(1).split(",") for p in _expand_braces(head + part + tail)]


# A file named in running text: `bench/quality.py`, design/architecture.md, ../BENCHMARKS.md.
_FILE = re.compile(
    r"(?<![\w/.\[(-])((?:\.\./)*[\w.-]+(?:/[\w.*{},-]+)*\.(?:md|py|yaml|yml|json|sh|toml))\b"
)


def _path_problems(page: Page, text: str) -> Iterator[str]:
    """A path under a folder of this repository must exist (from the root or the page);
    a page (`kvstore.md`, design/api.md) must be one from the page's folder, the root or docs/."""
    for path in _expand_braces(text):
        m = _REPO_PATH.match(path)
        if m and m.group(1) in _TOP_FOLDERS and not path.startswith(_OUTPUTS):
            bases: tuple[Path, ...] = (ROOT, page.path.parent)
        elif path.endswith(".md"):
            bases = (page.path.parent, ROOT, ROOT / "docs")
        else:
            continue
        if not any((b / path).exists() or ("*" in path and any(b.glob(path))) for b in bases):
            shown = path if path == text else f"{path}, from {text}"
            yield f"`{shown}`: no such file or folder in the repository"


def _repository_paths_exist(page: Page) -> list[str]:
    named = [(code.line, (code.text.split() or [""])[0]) for code in code_spans(page)]
    for number, line in enumerate(page.lines, 1):
        named += [(number, m.group(1)) for m in _FILE.finditer(line)]
    problems = {
        f"{page.where(number)}: {problem}"
        for number, text in named
        for problem in _path_problems(page, text)
    }
    return sorted(problems, key=lambda p: int(p.split(":")[1]))


# --- metric names -----------------------------------------------------------------------


@cache
def _registered_metrics() -> frozenset[str]:
    """Every family and sample name a server can expose (every role, vLLM aliases on)."""
    from server.metrics.metrics import ServerMetrics

    names: set[str] = set()
    for role in ("both", "router"):
        metrics = ServerMetrics("m", role=role, vllm_aliases=True)
        for family in metrics.registry.collect():
            names.add(family.name)
            names.update(s.name for s in family.samples)
    # Families with no sample before the first observation still carry their suffixes.
    names.update(f"{n}{s}" for n in set(names) for s in ("_total", "_bucket", "_sum", "_count"))
    return frozenset(names)


_METRIC = re.compile(r"(?<![\w/.-])((?:flashserve|vllm):[A-Za-z_*][\w:*]*)")


def _metric_problem(name: str) -> str | None:
    name = name.rstrip(":")
    known = _registered_metrics()
    if "*" in name:
        if not fnmatch.filter(known, name):
            return f"`{name}`: matches no metric the server registers"
    elif name not in known:
        return f"`{name}`: not a metric the server registers (server/metrics/)"
    return None


def _metric_names_are_registered(page: Page) -> list[str]:
    problems = []
    for number, line in enumerate(page.lines, 1):
        for m in _METRIC.finditer(line):
            problem = _metric_problem(m.group(1))
            if problem:
                problems.append(f"{page.where(number)}: {problem}")
    return problems


# --- environment variables and alerts ---------------------------------------------------


@cache
def _code_text() -> str:
    """What the code, scripts, images, manifests and tests say (not the docs, nor this file)."""
    parts = []
    for folder in ("flashserve", "server", "engine", "kvstore", "kernels", "training", "bench"):
        parts += [p.read_text(encoding="utf-8") for p in (ROOT / folder).rglob("*.py")]
    for folder in ("scripts", "docker", "deploy", "tests"):
        parts += [
            p.read_text(encoding="utf-8", errors="replace")
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and p.suffix not in (".png", ".json") and p != Path(__file__)
        ]
    return "\n".join(parts)


_ENV = re.compile(r"\bFLASHSERVE_[A-Z0-9_]*[A-Z0-9]\b")
_ALERT = re.compile(r"\bFlashserve[A-Z]\w+")
_ALERTS_FILE = "deploy/prometheus/alerts.yaml"


@cache
def _alerts() -> frozenset[str]:
    text = (ROOT / _ALERTS_FILE).read_text()
    return frozenset(re.findall(r"-\s*alert:\s*(\w+)", text))


def _env_and_alerts_exist(page: Page) -> list[str]:
    problems = []
    for number, line in enumerate(page.lines, 1):
        for name in _ENV.findall(line):
            if name not in _code_text():
                problems.append(f"{page.where(number)}: `{name}`: nothing in the code reads it")
        for name in _ALERT.findall(line):
            if name not in _alerts():
                where = page.where(number)
                problems.append(f"{where}: `{name}`: no such alert in {_ALERTS_FILE}")
    return problems


# --- no tracker references --------------------------------------------------------------

# `issue 17`, `issues 15 and 16`, `#25` (not `sglang#28653`, an upstream project's), `item 3`.
_TRACKER = re.compile(r"(?i)\bissues?\s+#?\d+|(?<![\w/&])#\d+\b|\bitems?\s+\d+\b")


def _no_issue_tracker_references(page: Page) -> list[str]:
    problems = [
        f"{page.where(number)}: {m.group(0)!r}: the reader has no issue tracker; "
        "say what changed (and when) instead"
        for number, line in enumerate(page.lines, 1)
        for m in _TRACKER.finditer(line)
    ]
    return problems


# Every check, run on every page (and on the stale page below).
CHECKS = (
    _flashserve_commands_and_flags_exist,
    _flag_table_defaults_match,
    _make_targets_exist,
    _relative_links_resolve,
    _python_names_resolve,
    _dotted_names_resolve,
    _repository_paths_exist,
    _metric_names_are_registered,
    _env_and_alerts_exist,
    _no_issue_tracker_references,
)


@pytest.mark.parametrize("page", PAGES, ids=_IDS)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.lstrip("_"))
def test_page(check: Callable[[Page], list[str]], page: Page) -> None:
    _report(check(page))


def test_the_checks_see_the_pages() -> None:
    """The readers find what the pages hold (a reader that finds nothing passes everything)."""
    readme = next(p for p in PAGES if p.name == "README.md")
    commands = [c for c in _code(readme) if _COMMAND.search(c.text)]
    assert len(commands) >= 5
    assert any("--tensor-parallel-size" in c.text for c in code_spans(readme))
    assert len(list(links(readme))) >= 10
    assert {"serve", "test", "bench"} <= _make_targets()
    assert "--tensor-parallel-size" in _subparsers()["serve"]._option_string_actions
    assert "flashserve:num_requests_running" in _registered_metrics()


# A page as a newcomer might find it after the code moved on: each stale line must be named.
_STALE_PAGE = """\
# Stale

Run `flashserve serve --model tiny --no-such-flag 3` or `flashserve frobnicate`.

```bash
.venv/bin/flashserve serve --role prefill \\
    --kv-dir /tmp/kv --routing nearest
make deploy-everything
```

Bare `--worker-timeout` is a flag; `--not-a-flag-anywhere` is not.

| Flag | Default | What |
|---|---|---|
| `--worker-timeout` | 90 s | stale |
| `--enforce-eager` | off | true |
| `--routing` | `nearest` | stale |

See [the plan](deploy.md#no-such-heading) and [gone](nowhere.md).
`engine/config.py:NoSuchConfig`, `engine/loader/builder.py` (`no_such_arg`),
`engine/no_such_folder/`, `flashserve:no_such_metric_total`, fixed in issue 15 (#25, item 2).
`kernels/{dispatch,no_such_op}.py`, `python -m training.no_such_module --x`.
As design/no-such-page.md and engine/core/no_such_step.py say.
`FLASHSERVE_NO_SUCH_SETTING=1` raises FlashserveNoSuchAlert; `FLASHSERVE_API_KEYS` is real.
`engine.api.errors.NoSuchError`, `engine.no_such.module.Thing`, `engine.generate(request)`.
"""


def test_each_check_names_the_stale_line() -> None:
    page = Page(ROOT / "docs" / "stale.md", _STALE_PAGE.splitlines())
    found = "\n".join(problem for check in CHECKS for problem in check(page))
    expected = [
        "docs/stale.md:3: `flashserve serve --no-such-flag`: `flashserve serve` has no such flag",
        "docs/stale.md:3: `flashserve frobnicate`: no such subcommand",
        "docs/stale.md:6: `flashserve serve --routing nearest`: not one of",
        "docs/stale.md:8: `make deploy-everything`: no such Makefile target",
        "docs/stale.md:11: `--not-a-flag-anywhere`: not a flag of any flashserve subcommand",
        "docs/stale.md:15: `--worker-timeout`: the table says the default is 90 s, "
        "`flashserve serve` has 120.0",
        "docs/stale.md:17: `--routing`: the table says the default is `nearest`, "
        "`flashserve serve` has 'affinity'",
        "docs/stale.md:19: link (deploy.md#no-such-heading): docs/deploy.md has no heading",
        "docs/stale.md:19: link (nowhere.md): nowhere.md does not exist",
        "docs/stale.md:20: `engine/config.py:NoSuchConfig`: engine/config.py defines no top-level",
        "docs/stale.md:20: `engine/loader/builder.py` (`no_such_arg`): engine/loader/builder.py "
        "defines no `no_such_arg`",
        "docs/stale.md:21: `engine/no_such_folder/`: no such file or folder",
        "docs/stale.md:21: `flashserve:no_such_metric_total`: not a metric the server registers",
        "docs/stale.md:21: 'issue 15'",
        "docs/stale.md:21: '#25'",
        "docs/stale.md:21: 'item 2'",
        "docs/stale.md:22: `kernels/no_such_op.py, from kernels/{dispatch,no_such_op}.py`: no such",
        "docs/stale.md:22: `training/no_such_module.py`: no such file",
        "docs/stale.md:23: `design/no-such-page.md`: no such file or folder",
        "docs/stale.md:23: `engine/core/no_such_step.py`: no such file or folder",
        "docs/stale.md:24: `FLASHSERVE_NO_SUCH_SETTING`: nothing in the code reads it",
        "docs/stale.md:24: `FlashserveNoSuchAlert`: no such alert",
        "docs/stale.md:25: `engine.api.errors.NoSuchError`: engine/api/errors.py defines no",
        "docs/stale.md:25: `engine.no_such.module.Thing`: no such module",
    ]
    missing = [e for e in expected if e not in found]
    assert not missing, f"not reported: {missing}\nreported:\n{found}"
    assert "not a flag of any" not in found.replace("--not-a-flag-anywhere`: not a flag", "")
    assert "--kv-dir" not in found and "--enforce-eager" not in found
    assert len(found.splitlines()) == len(expected), found
