"""How long a page of conversations takes on a projection of many runs (issue 50, item 4).

```sh
.venv/bin/python -m bench.conversation_pages 100000                   # build and time
.venv/bin/python -m bench.conversation_pages 1000000 --keep /tmp/conv-1m --json conversations.json
```

The projection: RUNS synthetic completed one-call runs (`bench.synthetic.plan_run`, about ten
records each; `bench.run_pages.apply_wires`' layout: three shards, batches of 5,000 through the
projector's `Applier`), RUNS_PER_CONVERSATION (10) runs per conversation, so a million runs make a
hundred thousand conversations. Run `i` is of conversation `i // 10` and starts `i % 10` seconds
after the others' start: a conversation's runs fall in all three shards at different times, so a
listing meets the older entries of a conversation in the other shards and skips them, the case
that costs the most. (Records are made from ten templates, one per place in a conversation,
re-keyed by replacing the run and conversation ids' bytes: every id has the same length.) One
conversation in ARCHIVED_EVERY (20) is archived, by a `conversation_marked` record keyed by its
latest run, as `stepstream conversation archive` writes it.

Each figure is the median of 15 after one warm-up: `search_conversations` (a word every
conversation's prompts hold, a word none does, and both: the rarest word is walked),
`list_conversations` (the first page of 50, the page after the middle conversation, through a
cursor; the first page of the archived ones and of the others), `get_conversation`, and
`GET /api/conversations` (first page, after a cursor) of the service (`serve.app_for`, uvicorn in
this loop) over the same shards. Every page is checked
against what it must hold, every request must be answered 200. The first line says which
stepstream it imported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import stepstream
from bench.run_pages import PARTITIONS, apply_wires, http_figures, median_ms, open_shards, refusing_address
from bench.synthetic import Wire, plan_run, run_id, to_wire
from stepstream import Settings
from stepstream.producer import conversation_mark
from stepstream.readmodel import ProjectionReader, encode_conversation_cursor
from stepstream.serve import app_for, running

RUNS_PER_CONVERSATION = 10
SEARCH_ALL = 'records'
"""A word of every run's first prompt (`plan_run`'s 'Look up the records.')."""
PAGE = 50
ARCHIVED_EVERY = 20
"""One conversation in this many is archived."""
PREFIX = 'conv'
START = datetime(2026, 12, 1, tzinfo=UTC)


def conversation_id(index: int) -> str:
    """The conversation of run `index` (every id has the same length)."""
    return f'conversation-{index // RUNS_PER_CONVERSATION:09d}'


def wires(settings: Settings, runs: int) -> Iterator[Wire]:
    """The records of `runs` one-call runs, RUNS_PER_CONVERSATION to a conversation."""
    template_run, template_conversation = run_id(PREFIX, 0), conversation_id(0)
    templates = []
    for place in range(RUNS_PER_CONVERSATION):
        start = START + timedelta(seconds=place)
        planned = plan_run(template_run, 1, start=start, conversation_id=template_conversation)
        templates.append([to_wire(p.record, settings) for p in planned])
    old_run, old_conversation = template_run.encode(), template_conversation.encode()
    mark = conversation_mark(run_id=template_run, conversation_id=template_conversation, archived=True)
    archive = to_wire(replace(mark, timestamp=START + timedelta(days=1)), settings)
    for index in range(runs):
        new_run, new_conversation = run_id(PREFIX, index).encode(), conversation_id(index).encode()
        for w in templates[index % RUNS_PER_CONVERSATION]:
            value = w.value.replace(old_run, new_run).replace(old_conversation, new_conversation)
            yield Wire(w.topic, new_run, value, w.headers)
        if index % RUNS_PER_CONVERSATION == RUNS_PER_CONVERSATION - 1 and archived(index):
            value = archive.value.replace(old_run, new_run).replace(old_conversation, new_conversation)
            yield Wire(archive.topic, new_run, value, archive.headers)


def archived(index: int) -> bool:
    """Whether the conversation of run `index` is archived."""
    return (index // RUNS_PER_CONVERSATION) % ARCHIVED_EVERY == 0


def build(root: Path, runs: int) -> float:
    """The projection under `root`; the seconds it took to apply."""
    settings = Settings(topic_prefix=PREFIX)
    began = time.perf_counter()
    apply_wires(root, settings, wires(settings, runs))
    return time.perf_counter() - began


def measure(root: Path, runs: int) -> dict[str, float]:
    """Each read's median over the projection at `root`, each answer checked."""
    conversations = runs // RUNS_PER_CONVERSATION
    shards = open_shards(root)
    reader = ProjectionReader(shards, partitions=PARTITIONS)
    try:
        middle = conversation_id((conversations // 2) * RUNS_PER_CONVERSATION)
        found = asyncio.run(reader.get_conversation(middle))
        if found is None or found.runs != RUNS_PER_CONVERSATION:
            raise RuntimeError(f'{middle}: {found}')
        cursor = found.cursor

        async def first() -> Any:
            page = await reader.list_conversations(limit=PAGE)
            if len(page) != min(PAGE, conversations) or len({c.conversation_id for c in page}) != len(page):
                raise RuntimeError(f'first page: {len(page)} conversations')
            return page

        async def after() -> Any:
            page = await reader.list_conversations(limit=PAGE, after=cursor)
            if len(page) != min(PAGE, conversations // 2) or page[0].cursor >= cursor:
                raise RuntimeError(f'the page after {middle}: {len(page)} conversations')
            return page

        archived_ones = sum(1 for c in range(conversations) if archived(c * RUNS_PER_CONVERSATION))
        how_many = {True: archived_ones, False: conversations - archived_ones}

        async def filtered(flag: bool) -> Any:
            page = await reader.list_conversations(limit=PAGE, archived=flag)
            if len(page) != min(PAGE, how_many[flag]) or any(c.archived != flag for c in page):
                raise RuntimeError(f'the first page archived={flag}: {len(page)} conversations')
            return page

        async def search(words: str, expected: int) -> Any:
            page = await reader.search_conversations(words, limit=PAGE)
            if len(page) != expected:
                raise RuntimeError(f'search {words!r}: {len(page)} conversations, not {expected}')
            return page

        every = min(PAGE, conversations)
        figures = {
            f'search_conversations {SEARCH_ALL!r} (every one matches), first page': median_ms(
                lambda: search(SEARCH_ALL, every)
            ),
            "search_conversations 'nope' (no entry)": median_ms(lambda: search('nope', 0)),
            f"search_conversations '{SEARCH_ALL} nope' (every conversation holds one word, none the other)": (
                median_ms(lambda: search(f'{SEARCH_ALL} nope', 0))
            ),
            f'list_conversations, first page ({PAGE})': median_ms(first),
            f'list_conversations, the page after the middle one ({conversations // 2:,} newer)': (
                median_ms(after)
            ),
            f'list_conversations, archived, first page (1 in {ARCHIVED_EVERY} is)': median_ms(
                lambda: filtered(True)
            ),
            'list_conversations, not archived, first page': median_ms(lambda: filtered(False)),
            'get_conversation': median_ms(lambda: reader.get_conversation(middle)),
        }
    finally:
        for shard in shards.values():
            shard.close()
    figures.update(asyncio.run(_serve(root, encode_conversation_cursor(cursor))))
    return figures


async def _serve(root: Path, cursor: str) -> dict[str, float]:
    shards = open_shards(root)
    reader = ProjectionReader(shards, partitions=PARTITIONS)
    try:
        with refusing_address() as broker:
            settings = Settings(topic_prefix=PREFIX, bootstrap_servers=broker)
            async with running(app_for(settings, reader=reader), port=0) as served:
                return await http_figures(
                    served.url,
                    {
                        'GET /api/conversations': ('/api/conversations', {}),
                        'GET /api/conversations after a cursor': ('/api/conversations', {'after': cursor}),
                        'GET /conversations (the explorer page)': ('/conversations', {}),
                    },
                )
    finally:
        for shard in shards.values():
            shard.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog='python -m bench.conversation_pages', description=__doc__.split('\n')[0]
    )
    parser.add_argument('runs', type=int, nargs='?', default=100_000)
    parser.add_argument('--keep', type=Path, help='build the projection here, or reuse the one built here')
    parser.add_argument('--json', type=Path, help='also write every figure to this file')
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    print(f'stepstream from {Path(stepstream.__file__).parent}')
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch)
        figures: dict[str, float] = {}
        if not (root / '0').exists():
            seconds = build(root, args.runs)
            figures['build (s)'] = round(seconds, 1)
            print(f'built {args.runs:,} runs in {seconds:.0f} s ({args.runs / seconds:,.0f} runs/s)')
        figures.update(measure(root, args.runs))
    for name, value in figures.items():
        print(f'{name:<60} {value:>10.2f}')
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == '__main__':
    main()
