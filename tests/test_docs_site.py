"""The documentation site's generated pages (tools/docs_site.py, decision 0063) and the README.

`make check` builds the whole site with `mkdocs build --strict`, which checks every link inside
docs/. What it cannot see is held here: the README (outside the site) stays short and its links
resolve; the API reference names every endpoint the service serves and every model it answers
with, each with its section; and the nav's generated sections list every decision and note.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

pytestmark = [pytest.mark.fast, pytest.mark.once]

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    path = ROOT / 'tools' / 'docs_site.py'
    spec = importlib.util.spec_from_file_location('stepstream_tools_docs_site', path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


site = _load()


def test_the_readme_is_a_first_screen_whose_links_resolve() -> None:
    text = (ROOT / 'README.md').read_text()
    assert len(text.splitlines()) < 200
    for command in ('make run', 'make test', '--agent stepstream.demo:orchestrator'):
        assert command in text, command
    targets = re.findall(r'\]\(([^)\s]+)\)', text)
    assert targets, 'the README links the docs'
    for target in targets:
        if not re.match(r'[a-z]+:', target):
            assert (ROOT / target.partition('#')[0]).exists(), target


def test_the_api_page_names_every_endpoint_and_model_with_its_section() -> None:
    schema = site.openapi()
    page = site.api_markdown(schema)
    operations = [(m, p) for p, item in schema['paths'].items() for m in item if m in site.METHODS]
    assert len(operations) > 20
    for method, path in operations:
        anchor = site._anchor(method, path)
        assert f'### {method.upper()} `{path}` {{#{anchor}}}' in page, (method, path)
        assert f'(#{anchor})' in page, (method, path)
    for name in schema['components']['schemas']:
        assert f'### {name} {{#model-{name.lower()}}}' in page, name
    linked = set(re.findall(r'\]\(#(model-[\w-]+)\)', page))
    defined = set(re.findall(r'\{#(model-[\w-]+)\}', page))
    assert linked and linked <= defined, linked - defined


def test_the_nav_lists_every_decision_and_benchmark_note() -> None:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor('tag:yaml.org,2002:python/', lambda loader, suffix, node: None)
    config = yaml.load((ROOT / 'mkdocs.yml').read_text(), Loader=Loader)
    nav = config['nav']
    docs = ROOT / 'docs'
    site.on_config(type('Config', (), {'nav': nav, 'docs_dir': str(docs)})())
    listed = set(re.findall(r"'([\w/.-]+\.md)'", repr(nav)))
    assert {f'decisions/{p.name}' for p in (docs / 'decisions').glob('0*.md')} <= listed
    assert {f'benchmarks/history/{p.name}' for p in (docs / 'benchmarks' / 'history').glob('*.md')} <= listed
    assert {p.name for p in docs.glob('*.md')} | {'api.md'} <= listed
