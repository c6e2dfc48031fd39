"""The size and import limits of issue 34 (item 5), checked as a ratchet against a baseline.

`make lint` runs it: `.venv/bin/python tools/limits.py [-v] [--update-baseline]`.

It reads the source packages: the folders of pyproject.toml's `[tool.setuptools] package-dir`
(schemas/ producer/ projector/ media/ serve/ analytics/ stepstream/), never tests/, bench/ or build/.
A module's name is the one it is installed under (producer/_log.py is `stepstream.producer._log`).

Rules:

module-lines     a module over 500 lines (its line count, as `wc -l` gives it).
class-lines      a class over 400 lines, and
function-lines   a function or method over 80 lines: from its `class`/`def` line to its last line,
                 decorators not counted (its docstring and comments count).
private-import   an import of a private module (a dotted name with a part that starts with `_`)
                 of another package than the importer's. A private module belongs to the package
                 that holds it (`stepstream.storage` to `stepstream.projector`); a
                 module's package is the one it is in (an `__init__` is its own package). So a
                 sibling's private module is fine; a subpackage importing its parent's private
                 module crosses (stepstream.cli importing `stepstream._x`), and so does the
                 parent importing a subpackage's. Every import counts: at module level, inside
                 functions, under `if TYPE_CHECKING:`, `from pkg import _mod`, and the modules a
                 package's lazy `__getattr__` map names (stepstream/lazy.py).
circle           a strongly connected component (two modules or more) of the imports Python runs
                 when a module is imported: those at module level (class bodies too), not those
                 under `if TYPE_CHECKING:` nor inside functions. `import a.b.c` also runs `a` and
                 `a.b`, except the importer's own parent packages (always imported before it);
                 `from a.b import name` runs `a.b`'s `__init__` unless every name is a submodule,
                 and if `a.b` makes `name` lazily (its `__getattr__` map), the module that has it.
                 So a package whose `__init__` imports `_x` is in a circle with `_x` only when
                 `_x` imports names from the package itself at module level.

Exemptions, for generated or table-like code only, each saying why:

    # limits: table -- the codec's field table, one line per Avro field
    # limits: generated -- written by tools/gen_x.py

on the `def` or `class` line, on one of its decorators or on the line just above them exempts that
function or class from its size limit;

    # limits: module -- generated from schemas/avro/*.avsc

in a module's first 10 lines exempts the module, and every class and function in it, from the size
limits. Imports are never exempt. `-v` lists the exemptions honoured.

The baseline, tools/limits-baseline.txt, lists the violations the code had when issue 34 set the
limits, one a line: `module-lines PATH LINES`, `class-lines PATH:Class LINES`, `function-lines
PATH:Class.method LINES`, `private-import PATH -> MODULE`, `circle MODULE MODULE ...`. It is a
ratchet: the check fails on a violation the baseline does not list, on a size above the recorded
one, and on an entry that no longer occurs; a size below the recorded one passes, with a hint to
lower it. `--update-baseline` rewrites the file from the code and only ever shrinks it: it drops
what no longer occurs and lowers the sizes, and refuses while there is a new or grown violation
(fix it, or exempt it if it is a table; adding an entry is a hand edit, for review to see). A
missing baseline file is created with every violation.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

LIMITS = {'module-lines': 500, 'class-lines': 400, 'function-lines': 80}
"""The most lines a module, a class and a function may have (issue 34)."""

KINDS = ('module-lines', 'class-lines', 'function-lines', 'private-import', 'circle')
"""Every kind of violation, in the baseline's order."""

HEADER_LINES = 10
"""A module's `# limits: module` exemption must be in its first lines."""

ROOT = Path(__file__).resolve().parent.parent
BASELINE = Path('tools/limits-baseline.txt')

BASELINE_HEADER = """\
# The violations of tools/limits.py's limits that the code had when issue 34 set them (item 5):
# modules over 500 lines, classes over 400, functions over 80, imports of another package's
# private module, import circles. This file only shrinks: split a module, re-export a name, then
# remove or lower its line here (`tools/limits.py --update-baseline` does that and nothing else).
# Never add a line for new code: fix it, or exempt generated or table-like code with a comment
# (`# limits: table -- why`, see tools/limits.py).
"""

EXEMPTION = re.compile(r'#\s*limits:\s*(?P<kind>\w*)\s*(?:—|--|-|:)?\s*(?P<why>.*?)\s*$')
EXEMPT_DEFINITION = ('table', 'generated')


@dataclass(frozen=True)
class Violation:
    """One broken limit: its baseline key (`kind subject`), its size for the size kinds, and where."""

    kind: str
    subject: str
    size: int | None
    where: str
    what: str

    @property
    def key(self) -> str:
        """The baseline line without the size: what stays the same while the size changes."""
        return f'{self.kind} {self.subject}'

    @property
    def entry(self) -> str:
        """The baseline line."""
        return self.key if self.size is None else f'{self.key} {self.size}'


@dataclass
class Module:
    """One source module, parsed."""

    name: str
    rel: str
    is_package: bool
    source: str
    tree: ast.Module
    lazy: dict[str, tuple[str, int]] = field(default_factory=dict)
    """A package's lazily imported names: name -> (the module that has it, line of the map)."""
    imports: list[Imported] | None = None
    """Its import statements, once `imports_of` has read them."""

    @property
    def package(self) -> str:
        """The package the module is in; an `__init__` is its own."""
        return self.name if self.is_package else self.name.rpartition('.')[0]


@dataclass(frozen=True)
class Imported:
    """One import statement's modules: `base` (the `from` part, or the imported name) and names."""

    line: int
    base: str
    names: tuple[str, ...]
    runs_at_import: bool
    """At module level and not under `if TYPE_CHECKING:`: runs when the module is imported."""
    plain: bool
    """`import base` rather than `from base import names`."""


@dataclass
class Report:
    """What a check found: violations, honoured exemptions, and errors no baseline can excuse."""

    violations: list[Violation] = field(default_factory=list)
    exemptions: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


# --- reading the packages ------------------------------------------------------------------------


def _package_files(root: Path) -> dict[Path, str]:
    """Each module file of the packages pyproject.toml lists -> its package's installed name."""
    with (root / 'pyproject.toml').open('rb') as file:
        config = tomllib.load(file)
    setuptools = config.get('tool', {}).get('setuptools', {})
    base = root / setuptools.get('package-dir', {}).get('', '.')
    files = {}
    for package in setuptools.get('packages', []):
        folder = (base / package.replace('.', '/')).resolve()  # stepstream/producer -> producer/
        for path in folder.glob('*.py'):
            files[path] = package
    return files


def load_modules(root: Path) -> tuple[dict[str, Module], list[str]]:
    """Every module of the source packages by installed name, and the files that do not parse."""
    modules: dict[str, Module] = {}
    errors = []
    for path, package in sorted(_package_files(root).items()):
        dotted = package if path.name == '__init__.py' else f'{package}.{path.stem}'
        rel = path.relative_to(root.resolve()).as_posix()
        source = path.read_text(encoding='utf-8')
        try:
            tree = ast.parse(source, filename=rel)
        except SyntaxError as error:
            errors.append(f'{rel}:{error.lineno}: does not parse: {error.msg}')
            continue
        module = Module(dotted, rel, path.name == '__init__.py', source, tree)
        module.lazy = _lazy_map(module)
        modules[dotted] = module
    return modules, errors


def _lazy_map(module: Module) -> dict[str, tuple[str, int]]:
    """The names a package's PEP 562 `__getattr__` imports on first use, from its literal maps.

    stepstream/lazy.py's maps are a dict literal of strings (`{'Name': 'pkg._module'}`) or
    `dict.fromkeys(('a', 'b'), 'pkg._module')`; any such literal in a package with a module-level
    `__getattr__` counts.
    """
    body = module.tree.body
    has_getattr = any(
        (isinstance(node, ast.FunctionDef) and node.name == '__getattr__')
        or (isinstance(node, ast.Assign) and any(_is_name(t, '__getattr__') for t in node.targets))
        for node in body
    )
    if not module.is_package or not has_getattr:
        return {}
    lazy: dict[str, tuple[str, int]] = {}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                name, target = _str(key), _str(value)
                if name is not None and target is not None:
                    lazy[name] = (target, value.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and _is_name(node.func.value, 'dict')
            and node.func.attr == 'fromkeys'
            and len(node.args) == 2
            and isinstance(node.args[0], ast.Tuple | ast.List)
            and _str(node.args[1]) is not None
        ):
            module_node = node.args[1]
            for key in node.args[0].elts:
                name = _str(key)
                if name is not None:
                    lazy[name] = (_str(module_node) or '', module_node.lineno)
    return lazy


def _is_name(node: ast.AST | None, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _str(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


# --- sizes ---------------------------------------------------------------------------------------


def _comments(module: Module) -> dict[int, str]:
    found: dict[int, str] = {}
    if 'limits:' not in module.source:
        return found
    for token in tokenize.generate_tokens(io.StringIO(module.source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string
    return found


def _statements(node: ast.AST) -> Iterator[ast.AST]:
    """The statements right under `node` (where a def, a class or an import can be), not expressions."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.stmt | ast.excepthandler | ast.match_case):
            yield child


def _definitions(node: ast.AST, prefix: str = '') -> Iterator[tuple[str, ast.AST]]:
    """Every class and function under `node`, with its dotted name (`Class.method.inner`)."""
    for child in _statements(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f'{prefix}{child.name}'
            yield name, child
            yield from _definitions(child, f'{name}.')
        else:
            yield from _definitions(child, prefix)


def check_sizes(module: Module, report: Report) -> None:
    """Modules, classes and functions over their limits, less the exempt ones."""
    comments = _comments(module)
    exemptions: dict[int, tuple[str, str]] = {}
    for line, text in comments.items():
        found = EXEMPTION.match(text)
        if found is None:
            continue
        kind, why = found['kind'], found['why']
        where = f'{module.rel}:{line}'
        if kind not in (*EXEMPT_DEFINITION, 'module'):
            report.errors.append(f'{where}: unknown exemption {kind!r} (table, generated or module)')
        elif not why:
            report.errors.append(f'{where}: an exemption says why: `# limits: {kind} -- why`')
        elif kind == 'module' and line > HEADER_LINES:
            report.errors.append(f'{where}: `# limits: module` goes in the first {HEADER_LINES} lines')
        else:
            exemptions[line] = (kind, why)
    whole = next((e for line, e in exemptions.items() if e[0] == 'module'), None)
    used = {line for line, e in exemptions.items() if e[0] == 'module'}
    size = len(module.source.splitlines())
    if whole is not None:
        report.exemptions.append(f'{module.rel}: module ({size} lines) exempt: {whole[1]}')
    elif size > LIMITS['module-lines']:
        what = f'module has {size} lines (limit {LIMITS["module-lines"]})'
        report.violations.append(Violation('module-lines', module.rel, size, f'{module.rel}:1', what))
    for name, node in _definitions(module.tree):
        assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        exempt = next((line for line in range(first, node.lineno + 1) if line in exemptions), None)
        kind = 'class-lines' if isinstance(node, ast.ClassDef) else 'function-lines'
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        where = f'{module.rel}:{node.lineno}'
        noun = kind.partition('-')[0]
        if exempt is not None:
            used.add(exempt)
            what = f'{noun} {name} ({lines} lines) exempt: {exemptions[exempt][1]}'
            report.exemptions.append(f'{where}: {what}')
        elif whole is None and lines > LIMITS[kind]:
            what = f'{noun} {name} has {lines} lines (limit {LIMITS[kind]})'
            report.violations.append(Violation(kind, f'{module.rel}:{name}', lines, where, what))
    for line in sorted(exemptions.keys() - used):
        report.errors.append(
            f'{module.rel}:{line}: the exemption belongs on a def or class line, or just above it'
        )


# --- imports -------------------------------------------------------------------------------------


def _is_type_checking(test: ast.expr) -> bool:
    return _is_name(test, 'TYPE_CHECKING') or (
        isinstance(test, ast.Attribute) and test.attr == 'TYPE_CHECKING'
    )


def imports_of(module: Module) -> list[Imported]:
    """Every import statement of a module, each with whether it runs when the module is imported."""
    found: list[Imported] = []

    def visit(node: ast.AST, in_function: bool, typing_only: bool) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            runs = not (in_function or typing_only)
            found.extend(_resolve(module, node, runs))
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for statement in node.body:
                visit(statement, in_function, True)
            for statement in node.orelse:
                visit(statement, in_function, typing_only)
        else:
            inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for child in _statements(node):
                visit(child, inner, typing_only)

    if module.imports is None:
        visit(module.tree, False, False)
        module.imports = found
    return module.imports


def _resolve(module: Module, node: ast.Import | ast.ImportFrom, runs: bool) -> list[Imported]:
    if isinstance(node, ast.Import):
        return [Imported(node.lineno, alias.name, (), runs, True) for alias in node.names]
    base = node.module or ''
    if node.level:
        parts = module.package.split('.')
        parent = parts[: len(parts) - (node.level - 1)]
        base = '.'.join([*parent, *([base] if base else [])])
    return [Imported(node.lineno, base, tuple(alias.name for alias in node.names), runs, False)]


def _private_owner(name: str) -> str | None:
    """The package a private module belongs to (the parent of its first private part), or None."""
    parts = name.split('.')
    for i, part in enumerate(parts):
        if part.startswith('_') and not (part.startswith('__') and part.endswith('__')):
            return '.'.join(parts[:i])
    return None


def check_private_imports(module: Module, modules: dict[str, Module], report: Report) -> None:
    """Imports of another package's private modules, including a package's lazy map."""
    roots = {name.partition('.')[0] for name in modules}
    targets: list[tuple[int, str]] = []
    for imported in imports_of(module):
        targets.append((imported.line, imported.base))
        targets.extend(
            (imported.line, f'{imported.base}.{name}')
            for name in imported.names
            if f'{imported.base}.{name}' in modules
        )
    targets.extend((line, target) for target, line in module.lazy.values())
    seen = set()
    for line, target in targets:
        owner = _private_owner(target)
        if owner is None or owner == module.package or target.partition('.')[0] not in roots:
            continue
        if target in seen:
            continue
        seen.add(target)
        what = f'imports {target}, private to {owner} (re-export what it needs from {owner})'
        violation = Violation(
            'private-import', f'{module.rel} -> {target}', None, f'{module.rel}:{line}', what
        )
        report.violations.append(violation)


def import_graph(modules: dict[str, Module]) -> dict[str, dict[str, int]]:
    """Each module's imports that run when it is imported: {importer: {imported: line}}."""
    graph: dict[str, dict[str, int]] = {}
    for name, module in modules.items():
        edges = graph.setdefault(name, {})
        for imported in imports_of(module):
            if not imported.runs_at_import:
                continue
            for target in _executed(name, imported, modules):
                if target in modules and target != name:
                    edges.setdefault(target, imported.line)
    return graph


def _executed(importer: str, imported: Imported, modules: dict[str, Module]) -> Iterator[str]:
    """The modules one import statement runs, as far as they can be part of a circle."""
    parts = imported.base.split('.')
    for i in range(1, len(parts)):
        parent = '.'.join(parts[:i])
        if not importer.startswith(f'{parent}.'):  # the importer's own parents ran before it
            yield parent
    if imported.plain:
        yield imported.base
        return
    package = modules.get(imported.base)
    attributes = [name for name in imported.names if f'{imported.base}.{name}' not in modules]
    if attributes or not importer.startswith(f'{imported.base}.'):
        yield imported.base
    for name in imported.names:
        if f'{imported.base}.{name}' in modules:
            yield f'{imported.base}.{name}'
        elif package is not None and name in package.lazy:
            yield package.lazy[name][0]


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of two modules or more (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def check_circles(modules: dict[str, Module], report: Report) -> None:
    """Every import circle, with the imports that close it."""
    graph = import_graph(modules)
    for component in circles(graph):
        members = set(component)
        edges = [
            (source, target, f'{modules[source].rel}:{line}')
            for source in component
            for target, line in sorted(graph[source].items())
            if target in members
        ]
        what = 'import circle: ' + ', '.join(f'{s} -> {t} ({where})' for s, t, where in edges)
        report.violations.append(Violation('circle', ' '.join(component), None, edges[0][2], what))


def check(root: Path) -> Report:
    """Every limit over the source packages under `root`."""
    report = Report()
    modules, report.errors = load_modules(root)
    for module in modules.values():
        check_sizes(module, report)
        check_private_imports(module, modules, report)
    check_circles(modules, report)
    largest: dict[str, Violation] = {}  # two definitions of one name (an overload, a property's setter)
    for violation in report.violations:
        if violation.key not in largest or (violation.size or 0) > (largest[violation.key].size or 0):
            largest[violation.key] = violation
    report.violations = sorted(largest.values(), key=lambda v: (KINDS.index(v.kind), v.subject))
    return report


# --- the baseline --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One baseline line."""

    line: int
    text: str
    size: int | None


def read_baseline(path: Path) -> tuple[dict[str, Entry], list[str]]:
    """The baseline's entries by key (`kind subject`), and what is wrong with its lines."""
    entries: dict[str, Entry] = {}
    errors = []
    if not path.exists():
        return entries, [f'{path}: no baseline (`tools/limits.py --update-baseline` makes it)']
    for number, raw in enumerate(path.read_text(encoding='utf-8').splitlines(), 1):
        text = raw.strip()
        if not text or text.startswith('#'):
            continue
        kind = text.split()[0]
        key, size = text, None
        if kind in LIMITS:
            key, _, number_text = text.rpartition(' ')
            size = int(number_text) if number_text.isdigit() and ' ' in text else None
            if size is None:
                errors.append(f'{path}:{number}: {kind} ends with its size in lines')
                continue
        elif kind not in KINDS:
            errors.append(f'{path}:{number}: unknown kind {kind!r} (one of {", ".join(KINDS)})')
            continue
        if key in entries:
            errors.append(f'{path}:{number}: repeats line {entries[key].line}')
        entries[key] = Entry(number, text, size)
    return entries, errors


def compare(report: Report, baseline: dict[str, Entry], path: Path) -> tuple[list[str], list[str]]:
    """The ratchet: (failures, hints). New, grown and stale fail; shrunk only hints."""
    failures, hints = [], []
    for violation in report.violations:
        entry = baseline.get(violation.key)
        if entry is None:
            failures.append(f'{violation.where}: {violation.what}: new, not in {path}')
        elif violation.size is not None and entry.size is not None and violation.size > entry.size:
            failures.append(
                f'{violation.where}: {violation.what}: grew, {path}:{entry.line} says {entry.size}'
            )
        elif violation.size is not None and entry.size is not None and violation.size < entry.size:
            hints.append(f'{path}:{entry.line}: now {violation.size}: lower it from {entry.size}')
    current = {violation.key for violation in report.violations}
    for key, entry in baseline.items():
        if key not in current:
            failures.append(f'{path}:{entry.line}: `{entry.text}` no longer occurs: remove it')
    return failures, hints


def update_baseline(report: Report, baseline: dict[str, Entry], path: Path, exists: bool) -> list[str]:
    """Rewrites the baseline from the code; refuses (and says why) where that would let it grow."""
    refused = []
    for violation in report.violations:
        entry = baseline.get(violation.key)
        if exists and entry is None:
            refused.append(f'{violation.where}: {violation.what}: new; fix it, the baseline only shrinks')
        elif exists and entry is not None and (violation.size or 0) > (entry.size or 0):
            refused.append(f'{violation.where}: {violation.what}: grew from {entry.size}; bring it back')
    if refused:
        return refused
    lines = [violation.entry for violation in report.violations]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(BASELINE_HEADER + '\n' + ''.join(f'{line}\n' for line in lines), encoding='utf-8')
    return []


def main(argv: Sequence[str] | None = None) -> int:
    """Checks the limits (exit 1 on a new, grown or stale violation), or updates the baseline."""
    parser = argparse.ArgumentParser(
        description='Size and import limits (issue 34), as a ratchet against a baseline.'
    )
    parser.add_argument('--root', type=Path, default=ROOT, help='the repository (its pyproject.toml)')
    parser.add_argument('--baseline', type=Path, help=f'default: ROOT/{BASELINE}')
    parser.add_argument('--update-baseline', action='store_true', help='rewrite it; it only shrinks')
    parser.add_argument('-v', '--verbose', action='store_true', help='list the exemptions honoured')
    args = parser.parse_args(argv)
    root: Path = args.root.resolve()
    path: Path = args.baseline or root / BASELINE
    shown = _shown(path, root)
    report = check(root)
    if args.verbose:
        for line in report.exemptions:
            print(f'exempt: {line}')
    if report.errors:
        for line in report.errors:
            print(line)
        return 1
    exists = path.exists()
    baseline, errors = read_baseline(path)
    if args.update_baseline:
        refused = update_baseline(report, {} if not exists else baseline, path, exists)
        for line in refused:
            print(line)
        if not refused:
            print(f'limits: {shown} now lists {len(report.violations)} violations')
        return 1 if refused else 0
    failures, hints = compare(report, baseline, shown)
    for line in [*errors, *failures, *hints]:
        print(line)
    if errors or failures:
        print(
            f'limits: {len(errors) + len(failures)} problems (limits: module {LIMITS["module-lines"]}, '
            f'class {LIMITS["class-lines"]}, function {LIMITS["function-lines"]} lines; no private '
            'imports across packages; no import circles). See tools/limits.py; issue 34.'
        )
        return 1
    if hints:
        print(f'limits: ok; lower those lines of {shown} (tools/limits.py --update-baseline)')
    elif args.verbose:
        print(f'limits: ok ({len(report.violations)} known violations in {shown})')
    return 0


def _shown(path: Path, root: Path) -> Path:
    try:
        return path.resolve().relative_to(root)
    except ValueError:
        return path


if __name__ == '__main__':
    sys.exit(main())
