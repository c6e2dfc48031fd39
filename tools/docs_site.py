"""MkDocs hooks for the documentation site (mkdocs.yml names this file under `hooks:`).

`mkdocs build` alone makes the whole site (decision 0063):

- the nav's "Decisions" section and the benchmarks' "History" section list every file of
  docs/decisions/ and docs/benchmarks/history/, so a new decision or note is in the nav by itself
  (and strict mode, which refuses a page outside the nav, cannot be tripped by one);
- `decisions/index.md` is generated: each decision's number and title;
- the API's reference is generated from the FastAPI application `stepstream serve` runs (`create_app`):
  `api/openapi.json`, the schema as the service serves it at `/openapi.json`, and `api.md`, every
  endpoint and response model in markdown, so the page needs no script of its own and cannot
  drift from the code.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
DECISIONS = 'decisions'
HISTORY = 'benchmarks/history'
METHODS = ('get', 'post', 'put', 'patch', 'delete')


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Fill the nav's "Decisions" and "History" sections from the files in their folders."""
    docs = Path(config.docs_dir)
    decisions = sorted((docs / DECISIONS).glob('0*.md'))
    _extend(config.nav, 'Decisions', [f'{DECISIONS}/{p.name}' for p in decisions])
    notes = [p.name for p in (docs / HISTORY).glob('*.md') if p.name != 'README.md']
    _extend(config.nav, 'History', [f'{HISTORY}/{name}' for name in sorted(notes, key=_note_order)])
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated pages: the decisions' index, the API reference and its OpenAPI JSON."""
    schema = openapi()
    files.append(File.generated(config, 'api/openapi.json', content=json.dumps(schema, indent=2) + '\n'))
    files.append(File.generated(config, 'api.md', content=api_markdown(schema)))
    docs = Path(config.docs_dir)
    files.append(File.generated(config, f'{DECISIONS}/index.md', content=decisions_index(docs / DECISIONS)))
    return files


def _extend(nav: Any, title: str, pages: list[str]) -> None:
    """Append `pages` to every nav section called `title`, after what mkdocs.yml lists there."""
    for item in nav or []:
        if isinstance(item, dict):
            for name, value in item.items():
                if isinstance(value, list):
                    if name == title:
                        value.extend(page for page in pages if page not in value)
                    else:
                        _extend(value, title, pages)


def _note_order(name: str) -> tuple[int, str]:
    """Dated notes first (as written), then the issues by number, then the rest by name."""
    issue = re.fullmatch(r'issue-(\d+)\.md', name)
    return (1, f'{int(issue.group(1)):06d}') if issue else (0 if name[:1].isdigit() else 2, name)


def decisions_index(folder: Path) -> str:
    """The decisions as a list: number and title (linked), from each file's heading."""
    lines = [
        '# Decisions',
        '',
        'Each decision records a choice: its context, what was decided, and what it costs. They are',
        'numbered in the order they were taken; a later one may refine an earlier one, and says so.',
        '',
        '| # | decision |',
        '| --- | --- |',
    ]
    for path in sorted(folder.glob('0*.md')):
        heading = next((line for line in path.read_text().splitlines() if line.startswith('# ')), path.stem)
        title = re.sub(r'^#\s*\d{4}\s*[:\u2014\u2013-]?\s*', '', heading).strip()
        lines.append(f'| {path.name[:4]} | [{_cell(title)}]({path.name}) |')
    return '\n'.join(lines) + '\n'


def openapi() -> dict[str, Any]:
    """The OpenAPI schema of the application `stepstream serve` runs, built without a projection."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # this checkout's code, whatever the environment installed
    from stepstream.readmodel import ProjectionReader
    from stepstream.serve import Source, create_app
    from stepstream.settings import Settings
    from stepstream.storage import MemoryShard

    # Building the schema reads only the routes and models: the source, an empty projection in
    # memory with the default settings, is never asked anything.
    source = Source(Settings.from_env({}), ProjectionReader(MemoryShard(), partitions=1), None)
    return create_app(source).openapi()


def api_markdown(schema: dict[str, Any]) -> str:
    """Every endpoint of `schema` (its parameters, body and responses) and every model, as markdown."""
    info = schema['info']
    lines = [
        '# The HTTP API',
        '',
        f'{info.get("summary", "")} `stepstream serve` serves it beside the run explorer',
        '([The explorer and the API](explorer.md)); a running service gives this schema at',
        '`/openapi.json` and Swagger UI at `/docs`. This page is generated from the application',
        'itself when the site is built (decision [0063](decisions/0063-docs-site.md)), and so is',
        f'[the OpenAPI document](api/openapi.json) (OpenAPI {schema.get("openapi", "")}, API version',
        f'{info.get("version", "")}).',
        '',
        '## Endpoints',
        '',
        '| method | path | what it answers |',
        '| --- | --- | --- |',
    ]
    operations = [
        (method, path, op)
        for path, item in schema['paths'].items()
        for method, op in item.items()
        if method in METHODS
    ]
    for method, path, op in operations:
        summary = _cell(op.get('summary', ''))
        lines.append(f'| {method.upper()} | [`{path}`](#{_anchor(method, path)}) | {summary} |')
    for method, path, op in operations:
        lines += ['', f'### {method.upper()} `{path}` {{#{_anchor(method, path)}}}', '']
        lines += [f'**{op.get("summary", "")}**', '']
        if op.get('description'):
            lines += [op['description'].strip(), '']
        lines += _parameters(op.get('parameters', []))
        body = op.get('requestBody')
        if body:
            shown = ', '.join(_type(media['schema']) for media in body['content'].values())
            lines += [f'**Request body**{" (required)" if body.get("required") else ""}: {shown}', '']
        lines += ['| status | meaning | body |', '| --- | --- | --- |']
        for status, response in sorted(op.get('responses', {}).items()):
            media = response.get('content', {}).values()
            bodies = ', '.join(_type(m['schema']) for m in media if 'schema' in m)
            lines.append(f'| {status} | {_cell(response.get("description", ""))} | {bodies or "—"} |')
    lines += ['', '## Models']
    for name, model in sorted(schema.get('components', {}).get('schemas', {}).items()):
        lines += ['', f'### {name} {{#{_model_anchor(name)}}}', '']
        if model.get('description'):
            lines += [model['description'].strip(), '']
        required = set(model.get('required', []))
        properties = model.get('properties', {})
        if properties:
            lines += ['| field | type | required | description |', '| --- | --- | --- | --- |']
            lines += [
                f'| `{field}` | {_type(prop)} | {"yes" if field in required else ""} | '
                f'{_cell(prop.get("description", ""))} |'
                for field, prop in properties.items()
            ]
        elif 'enum' in model or 'type' in model:
            lines.append(f'Type: {_type(model)}')
    return '\n'.join(lines) + '\n'


def _parameters(parameters: list[dict[str, Any]]) -> list[str]:
    """The table of an operation's path, query and header parameters (none: no table)."""
    if not parameters:
        return []
    rows = ['| parameter | in | type | required | description |', '| --- | --- | --- | --- | --- |']
    for p in parameters:
        described = p.get('description') or p.get('schema', {}).get('description', '')
        default = p.get('schema', {}).get('default')
        if default is not None:
            described = f'{described} (default `{json.dumps(default)}`)'.strip()
        rows.append(
            f'| `{p["name"]}` | {p["in"]} | {_type(p.get("schema", {}))} '
            f'| {"yes" if p.get("required") else ""} | {_cell(described)} |'
        )
    return [*rows, '']


def _type(schema: dict[str, Any]) -> str:
    """A schema as a short type: a model links to its section, `null` reads as optional."""
    if '$ref' in schema:
        name = schema['$ref'].rsplit('/', 1)[-1]
        return f'[{name}](#{_model_anchor(name)})'
    for key in ('anyOf', 'oneOf', 'allOf'):
        if key in schema:
            return ' \\| '.join(_type(s) for s in schema[key])
    if 'enum' in schema:
        return ' \\| '.join(f'`{json.dumps(v)}`' for v in schema['enum'])
    if 'const' in schema:
        return f'`{json.dumps(schema["const"])}`'
    kind = schema.get('type')
    if kind == 'array':
        if 'prefixItems' in schema:
            return f'[{", ".join(_type(s) for s in schema["prefixItems"])}]'
        return f'array of {_type(schema.get("items", {}))}'
    if kind == 'object' and isinstance(schema.get('additionalProperties'), dict):
        return f'object of {_type(schema["additionalProperties"])}'
    if kind is None:
        return 'any JSON'
    return f'{kind} ({schema["format"]})' if 'format' in schema else str(kind)


def _anchor(method: str, path: str) -> str:
    """The id of an endpoint's section: `get-api-runs-run_id` for GET /api/runs/{run_id}."""
    return f'{method}-' + re.sub(r'[^a-z0-9_]+', '-', path.lower()).strip('-')


def _model_anchor(name: str) -> str:
    """The id of a model's section (apart from the endpoints': `model-run`)."""
    return f'model-{name.lower()}'


def _cell(text: str) -> str:
    """`text` on one line of a markdown table."""
    return ' '.join(text.split()).replace('|', '\\|')
