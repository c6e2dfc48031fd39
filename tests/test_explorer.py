"""The run explorer in a real Chromium (Debian's, driven by Playwright; no browser is downloaded).

Each test looks at what a person sees: the run listed, the lineage tree, the unknown effect
highlighted, the image drawn, the diff, the lag and the DLQ. Screenshots go to the test's tmp dir.
`make test-explorer` runs this module alone.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from stepstream.embedded import EmbeddedStack
from stepstream.ids import short_id

from served import Served, served_projection

CHROMIUM = os.environ.get('STEPSTREAM_CHROMIUM') or shutil.which('chromium') or '/usr/bin/chromium'
LAUNCH_FLAGS = [
    '--headless',
    '--no-sandbox',
    '--disable-gpu',
    '--disable-quic',
    '--no-first-run',
    '--disable-background-networking',
    '--disable-component-update',
    '--disable-sync',
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.asyncio(loop_scope='module'),
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(),
        reason=f"no Chromium at {CHROMIUM}: `make test` installs Debian's chromium (apt) when it can",
    ),
]

if Path(CHROMIUM).exists():
    from playwright.async_api import Browser, Locator, Page, async_playwright, expect


@pytest_asyncio.fixture(scope='module', loop_scope='module')
async def served(stack: EmbeddedStack, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    settings = stack.settings.replace(
        topic_prefix=f'test-{uuid.uuid4().hex[:12]}',
        partitions=3,
        media_threshold_bytes=2048,
        operator='oncall-alice',
    )
    async with served_projection(settings, tmp_path_factory.mktemp('explorer') / 'projection') as s:
        yield s


@pytest_asyncio.fixture(scope='module', loop_scope='module')
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_FLAGS)
        try:
            yield chromium
        finally:
            await chromium.close()


@pytest_asyncio.fixture(loop_scope='module')
async def page(browser: Browser, served: Served) -> AsyncIterator[Page]:
    context = await browser.new_context(base_url=served.url, viewport={'width': 1280, 'height': 900})
    opened = await context.new_page()
    errors: list[str] = []
    opened.on('pageerror', lambda exc: errors.append(str(exc)))
    opened.on('console', lambda msg: errors.append(msg.text) if msg.type == 'error' else None)
    try:
        yield opened
    finally:
        await context.close()
    assert not errors, errors  # no script error, no resource the page policy refused


async def shot(page: Page, tmp_path: Path, name: str) -> None:
    path = tmp_path / f'{name}.png'
    await page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 0


async def test_runs_are_listed_filtered_and_refreshed_live(
    served: Served, page: Page, tmp_path: Path
) -> None:
    await page.goto('/')
    rows = page.locator('tr.run-row')

    def row(run_id: str) -> Locator:
        return page.locator(f'tr.run-row[data-run-id="{run_id}"]')

    await expect(row(served.crashed_run)).to_be_visible()
    await expect(row(served.orchestrator_run)).to_contain_text('completed')
    await expect(row(served.crashed_run)).to_contain_text('cancelled')
    await shot(page, tmp_path, 'runs')
    counts = await (await page.request.get(served.url.rstrip('/') + '/api/counts')).json()
    total = await rows.count()
    assert sum(counts['by_status'].values()) == total and counts['by_status']['cancelled'] >= 1
    await expect(page.locator('p.counts')).to_contain_text(f'{total} runs')
    await page.locator('p.counts a', has_text='cancelled').click()  # a count links to its filter
    await expect(rows).to_have_count(counts['by_status']['cancelled'])
    await expect(row(served.crashed_run)).to_be_visible()
    await page.goto('/')

    late = await served.add_run('conv-live')  # written after the page loaded: live refresh shows it
    await expect(row(late)).to_be_visible(timeout=15_000)
    await expect(rows.first).to_have_attribute('data-run-id', late)  # newest first

    await page.fill('input[name=agent_name]', 'viewer')
    await page.click('button[type=submit]')
    await expect(rows).to_have_count(1)
    await expect(rows).to_contain_text(short_id(served.image_run))  # the whole in its tooltip
    await expect(rows.locator('a.run-link').first).to_have_attribute('title', served.image_run)


async def test_run_page_shows_lineage_and_timeline(served: Served, page: Page, tmp_path: Path) -> None:
    first, second = served.delegate_runs
    await page.goto(f'/runs/{first}')
    tree = page.locator('ul.tree li.tree-node')
    await expect(tree).to_have_count(3)
    await expect(tree.nth(0)).to_have_attribute('data-run-id', served.orchestrator_run)
    await expect(tree.nth(1)).to_have_class('tree-node depth-1 current')
    await expect(tree.nth(2)).to_have_attribute('data-run-id', second)
    await expect(page.locator('dd.parent')).to_contain_text(short_id(served.orchestrator_run))
    await expect(page.locator('dd.siblings')).to_contain_text(short_id(second))
    await expect(page.locator(f'dd.siblings a[title="{served.orchestrator_run}"]')).to_have_count(
        0
    )  # the parent
    # Two runs of one agent share their start: their links read apart, each whole in its tooltip.
    links = tree.locator('a.run-link')
    assert short_id(first) != short_id(second) and first[:11] == second[:11] == 'researcher-'
    await expect(links).to_have_text([short_id(r) for r in (served.orchestrator_run, first, second)])
    await expect(links.nth(2)).to_have_attribute('title', second)
    await expect(page.locator('.timeline tr.kind-tool_call_started')).to_contain_text('search')
    await expect(page.locator('.timeline tr.kind-tool_call_started .badge')).to_have_text('completed')
    await expect(page.locator('.snapshots .part-tool-return').first).to_contain_text('found 3 documents')
    await shot(page, tmp_path, 'run')

    await page.click(f'ul.tree a[title="{served.orchestrator_run}"]')
    await expect(page.locator('dd.children')).to_contain_text(short_id(second))
    await expect(page.locator(f'dd.siblings a[title="{second}"]')).to_have_count(0)  # a child, not a sibling
    delegates = page.locator('table.spans tr.span-tool .delegate a.run-link')  # each call, its child
    await expect(delegates).to_have_text([short_id(first), short_id(second)])
    await delegates.first.click()
    await expect(page.locator('dd.parent')).to_contain_text(short_id(served.orchestrator_run))


async def test_a_crashed_run_highlights_its_unknown_effect(
    served: Served, page: Page, tmp_path: Path
) -> None:
    await page.goto(f'/runs/{served.crashed_run}')
    unknown = page.locator('section.unknown .unknown-effect')
    await expect(unknown).to_be_visible()
    await expect(unknown.locator('.idempotency-key')).to_have_text('announce:#releases')
    await expect(unknown.locator('.effect-summary')).to_have_text('posts to Slack')
    started = page.locator('.timeline tr.event.unknown-row')
    await expect(started).to_contain_text('send_announcement')
    await expect(started.locator('.effect-unknown')).to_have_text('unknown_after_crash')
    color = await unknown.evaluate("e => getComputedStyle(e.closest('section')).borderTopColor")
    assert color == 'rgb(179, 38, 30)'  # drawn in the alarm colour, not just present in the DOM
    await expect(page.locator('.total-tool .total-in-doubt')).to_have_text(
        '1 call in doubt (started, never ended)'
    )
    # The call in doubt is a bar open to the waterfall's right edge, hatched and labelled.
    row = page.locator('table.spans tr.span-unknown_after_crash')
    await expect(row.locator('.in-doubt-note')).to_be_visible()
    await expect(row.locator('.span-took')).to_have_text('no end')
    bar, drawn = row.locator('svg.bar'), row.locator('rect.in-doubt-bar')
    outer, inner = await bar.bounding_box(), await drawn.bounding_box()
    assert outer is not None and inner is not None and inner['width'] >= 0.08 * outer['width']
    assert abs((inner['x'] + inner['width']) - (outer['x'] + outer['width'])) < 1
    assert (await drawn.evaluate('e => getComputedStyle(e).fill')).startswith('url(')
    await shot(page, tmp_path, 'crashed-run')

    await page.click('nav a:text("Unresolved")')
    row = page.locator(f'table.unresolved tr[data-run-id="{served.crashed_run}"]')
    await expect(row).to_contain_text('announce:#releases')
    await shot(page, tmp_path, 'unresolved')


async def test_a_live_call_and_a_crashed_call_read_apart_and_only_the_crashed_one_can_be_resolved(
    served: Served, page: Page, tmp_path: Path
) -> None:
    async with served.live_call('billing-live') as live:
        await page.goto('/unresolved')
        crashed_row = page.locator(f'table.unresolved tr[data-run-id="{served.crashed_run}"]')
        live_row = page.locator(f'table.unresolved tr[data-run-id="{live}"]')
        await expect(crashed_row.locator('.badge')).to_have_text('unknown_after_crash')
        await expect(live_row.locator('.badge')).to_have_text('in_flight')
        await expect(live_row).to_have_class('in-flight-row')
        crashed_colour = await crashed_row.locator('.badge').evaluate(
            'e => getComputedStyle(e).backgroundColor'
        )
        live_colour = await live_row.locator('.badge').evaluate('e => getComputedStyle(e).backgroundColor')
        assert crashed_colour != live_colour  # drawn apart, not only labelled apart
        await shot(page, tmp_path, 'live-and-crashed')

        await page.goto(f'/runs/{live}')
        await expect(page.locator('section.in-flight .in-flight-effect')).to_contain_text('send_invoice')
        await expect(page.locator('table.effects tr.effect .badge')).to_have_text('in_flight')
        await expect(page.locator('form.resolve')).to_have_count(0)  # nothing to resolve while it runs
        await expect(page.locator('section.unknown')).to_have_count(0)
        await shot(page, tmp_path, 'live-run')

        await page.goto(f'/runs/{served.crashed_run}')
        await expect(page.locator('section.unknown form.resolve')).to_have_count(1)
        await expect(page.locator('section.in-flight')).to_have_count(0)
    await page.goto(f'/runs/{live}')
    await expect(page.locator('table.effects tr.effect .badge')).to_have_text('completed')


async def test_an_offloaded_image_is_drawn(served: Served, page: Page, tmp_path: Path) -> None:
    await page.goto(f'/runs/{served.image_run}')
    image = page.locator('img.media-image')
    await expect(image).to_be_visible()
    assert (await image.get_attribute('src') or '').startswith('/api/media/')
    await page.wait_for_function("() => document.querySelector('img.media-image').complete")
    assert await image.evaluate('img => img.naturalWidth') == 48
    await shot(page, tmp_path, 'image')


async def test_two_snapshots_are_compared(served: Served, page: Page, tmp_path: Path) -> None:
    await page.goto(f'/runs/{served.orchestrator_run}')
    await page.click('a.diff-link')
    await expect(page.locator('.diff-equal')).to_contain_text('the same')
    changed = page.locator('.diff-row:not(.diff-equal)')
    await expect(changed.last.locator('.diff-right')).to_contain_text('answered after 2 tool calls')
    await expect(changed.last.locator('.diff-left')).not_to_contain_text('answered after 2 tool calls')
    # The request both snapshots hold, stamped later by Pydantic AI: the differing fields are named.
    replaced = page.locator('.diff-replace')
    await expect(replaced.locator('.diff-left .changed-fields .field-path').first).to_have_text('timestamp')
    stamped = replaced.locator('.diff-right .changed-fields ins').first
    await expect(stamped).to_have_text(re.compile(r'^\d{4}-'))
    await shot(page, tmp_path, 'diff')


async def test_status_shows_lag_per_partition_and_the_dlq(served: Served, page: Page, tmp_path: Path) -> None:
    await served.settle()
    await page.goto('/status')
    await expect(page.locator('table.lag tbody tr')).to_have_count(6)
    await expect(page.locator('.total-lag')).to_have_text('0')
    # The test's own projector applies every shard: its pid, and when it last committed.
    await expect(page.locator('table.lag td.projector').first).to_have_text(f'pid {os.getpid()}')
    await expect(page.locator('.no-projector')).to_have_count(0)
    letter = page.locator('table.dlq tr.dead-letter')
    await expect(letter).to_have_count(1)
    await expect(letter.locator('.reason')).to_have_text('not_a_record')
    await shot(page, tmp_path, 'status')


async def test_resolving_an_unknown_effect_changes_the_page(
    served: Served, page: Page, tmp_path: Path
) -> None:
    run_id = await served.add_crashed_run('publisher-resolve-page')
    await page.goto(f'/runs/{run_id}')
    unknown = page.locator('section.unknown .unknown-effect')
    await expect(unknown).to_be_visible()
    row = page.locator('table.effects tr.effect')
    await expect(row.locator('.badge')).to_have_text('unknown_after_crash')

    await unknown.locator('input[value=did_not_happen]').check()
    await unknown.locator('textarea[name=note]').fill('no announcement in #releases; safe to retry')
    await shot(page, tmp_path, 'resolve-form')
    await unknown.locator('button[type=submit]').click()

    confirmed = page.locator('.decided.resolved')  # the page that answers says what was recorded
    await expect(confirmed.locator('.decision-recorded .resolution')).to_have_text('did not happen')
    await expect(confirmed.locator('.decision-recorded .resolution-note')).to_have_text(
        'no announcement in #releases; safe to retry'
    )
    await expect(confirmed.locator('.recorded-by')).to_have_text('oncall-alice')
    await expect(confirmed.locator('.resolved-effect .badge')).to_have_text('resolved')
    await shot(page, tmp_path, 'resolution-recorded')
    await page.click('a.back-to-run')

    await expect(page.locator('section.unknown')).to_have_count(0)  # no longer highlighted
    await expect(row.locator('.badge')).to_have_text('resolved')
    await expect(row).not_to_have_class('effect unknown-row')
    await expect(row.locator('.resolution')).to_have_text('did not happen')
    await expect(row.locator('.resolved-by')).to_have_text('oncall-alice')
    await expect(row.locator('.resolution-note')).to_have_text('no announcement in #releases; safe to retry')
    timeline = page.locator('section.timeline tr.answer-resolution')  # and in the timeline, at its time
    await expect(timeline.locator('.resolution')).to_have_text('did not happen')
    await shot(page, tmp_path, 'resolved')

    await page.goto('/unresolved')
    await expect(page.locator(f'table.unresolved tr[data-run-id="{served.crashed_run}"]')).to_be_visible()
    await expect(page.locator(f'table.unresolved tr[data-run-id="{run_id}"]')).to_have_count(0)


@pytest_asyncio.fixture(scope='module', loop_scope='module')
async def variety(served: Served) -> dict[str, str]:
    """A failed run, a long priced run and a resolved effect, added once for the tests below."""
    return await served.add_variety()


async def test_the_run_page_says_what_each_step_took_and_cost(
    served: Served, variety: dict[str, str], page: Page, tmp_path: Path
) -> None:
    await page.goto(f'/runs/{variety["long"]}')
    await expect(page.locator('.total-tokens')).to_have_text('2925 / 260')  # 26 responses: 100+i in, 10 out
    await expect(page.locator('.total-cost')).to_have_text(re.compile(r'^\$0\.031[89]$'))  # 3185 x $0.00001
    await expect(page.locator('.total-model')).to_contain_text('in 26 request(s)')
    await expect(page.locator('.total-tool')).to_contain_text('in 25 call(s)')
    await expect(page.locator('.total-duration')).to_have_text(re.compile(r'^\d+(\.\d+)? (ms|s)$'))
    models, tools = page.locator('table.spans tr.span-model'), page.locator('table.spans tr.span-tool')
    await expect(models).to_have_count(26)
    await expect(tools).to_have_count(25)
    first_model = models.first
    await expect(first_model.locator('.span-what')).to_contain_text('priced-model')
    await expect(first_model.locator('.tokens')).to_have_text('100 in / 10 out')
    await expect(first_model.locator('.cost')).to_have_text('$0.0011')
    await expect(first_model.locator('.span-took')).to_have_text(re.compile(r'^\d+\.\d ms$'))
    third = page.locator('table.spans tr[data-tool-call-id="call-2"]')
    await expect(third.locator('.tool-args')).to_contain_text('"n": 3')
    await expect(third.locator('.tool-result')).to_contain_text('step 3 done')
    width = float(await third.locator('svg.bar rect').get_attribute('width') or 0)
    x = float(await third.locator('svg.bar rect').get_attribute('x') or 0)
    assert width > 0 and 0 < x < 1000  # a bar placed on the run's clock
    times = await page.locator('.timeline tbody tr td:nth-child(2) time').all_inner_texts()
    assert times and all(re.search(r'\d\d:\d\d:\d\d\.\d{3}$', t) for t in times)  # milliseconds
    await shot(page, tmp_path, 'run-page')

    await page.goto(f'/runs/{variety["failed"]}')
    failed = page.locator('table.spans tr.span-tool')
    await expect(failed).to_have_class(re.compile(r'\bspan-failed\b'))
    await expect(failed.locator('.tool-args')).to_contain_text('"amount_cents": 4200')
    await expect(failed.locator('.span-detail .error')).to_contain_text('card declined for 4200 cents')
    await expect(page.locator('.total-tool')).to_contain_text('1 failed')

    await page.goto(f'/runs/{served.crashed_run}')
    in_doubt = page.locator('table.spans tr.span-tool')
    await expect(in_doubt).to_have_class(re.compile(r'\bspan-unknown_after_crash\b'))
    await expect(in_doubt.locator('.span-took')).to_have_text('no end')
    order = await page.eval_on_selector_all('main > section', 'els => els.map(e => e.className)')
    assert order.index('unknown') < order.index('waterfall')  # the in-doubt effects come first,
    first = await page.evaluate(  # before the totals too
        "document.querySelector('section.unknown').compareDocumentPosition(document.querySelector('dl.totals'))"
    )
    assert first & 4  # DOCUMENT_POSITION_FOLLOWING: the totals follow the in-doubt effects


async def test_the_runs_list_nests_delegates_and_reads_at_800_px(
    served: Served, variety: dict[str, str], page: Page, tmp_path: Path
) -> None:
    await page.set_viewport_size({'width': 800, 'height': 900})
    await page.goto('/')
    rows = page.locator('tr.run-row')
    ids = [await r.get_attribute('data-run-id') for r in await rows.all()]
    depths = [await r.get_attribute('data-depth') for r in await rows.all()]
    parent = ids.index(served.orchestrator_run)
    assert ids[parent + 1 : parent + 3] == served.delegate_runs  # under their parent, in order
    assert depths[parent] == '0' and depths[parent + 1 : parent + 3] == ['1', '1']
    long = page.locator(f'tr.run-row[data-run-id="{variety["long"]}"]')
    await expect(long.locator('.run-cost')).to_have_text(re.compile(r'^\$0\.031[89]$'))
    await expect(long.locator('.run-tokens')).to_have_text('2925/260')
    await expect(long.locator('.run-duration')).to_have_text(re.compile(r' (ms|s)$'))
    overflow = await page.evaluate('document.documentElement.scrollWidth')
    assert overflow <= 800, overflow  # no sideways scrolling at 800 px
    heights = await page.eval_on_selector_all('tr.run-row', 'rows => rows.map(r => r.offsetHeight)')
    assert max(heights) < 40, heights  # one line per run: long ids do not wrap
    # Two delegates of one agent, started together, share their start: their links still read apart.
    shown = [await rows.nth(parent + i).locator('a.run-link').first.inner_text() for i in (1, 2)]
    assert shown == [short_id(r) for r in served.delegate_runs] and shown[0] != shown[1]
    await shot(page, tmp_path, 'runs-800')

    await page.click('a.view-toggle')  # the flat view: every run in its own place, newest first
    await expect(rows.first).to_be_visible()
    flat = [await r.get_attribute('data-depth') for r in await rows.all()]
    assert set(flat) == {'0'} and len(flat) == len(ids)


SERVER_ERROR_SIGNS = ('Internal Server Error', 'Traceback (most recent call last)', 'jinja2.exceptions')


async def test_every_link_from_the_runs_list_answers(
    served: Served, variety: dict[str, str], page: Page
) -> None:
    """A crawler: from the runs list, follow every same-origin link (pages, API, media), breadth first.

    The projection holds the demo-like runs (an orchestrator, its delegates, a cancelled publisher
    with an unknown effect), an image, a failed run, a long run and a resolved effect. Every
    response must be a 200 and no page may show a server error.
    """
    origin = served.url.rstrip('/')
    queue, seen = ['/'], {'/'}
    failures: list[str] = []
    kinds: set[str] = set()
    while queue:
        path = queue.pop(0)
        response = await page.request.get(origin + path)
        body = await response.text()
        if response.status != 200:
            failures.append(f'{path}: {response.status} {body[:200]}')
            continue
        if any(sign in body for sign in SERVER_ERROR_SIGNS):
            failures.append(f'{path}: shows a server error')
            continue
        kinds.add(_kind(path))
        if not response.headers.get('content-type', '').startswith('text/html'):
            continue
        await page.goto(path)  # drawn in the browser too: scripts run, images load
        hrefs = await page.eval_on_selector_all('a[href], img[src]', 'els => els.map(e => e.href || e.src)')
        for href in hrefs:
            if not href.startswith(origin + '/'):
                continue
            link = href[len(origin) :].split('#', 1)[0]
            if link and link not in seen:
                seen.add(link)
                queue.append(link)
    assert not failures, failures
    for run_id in (*variety.values(), served.orchestrator_run, served.image_run, served.crashed_run):
        assert f'/runs/{run_id}' in seen, run_id
    expected = {
        'runs',
        'run',
        'snapshot',
        'diff',
        'conversation',
        'unresolved',
        'status',
        'api',
        'docs',
        'media',
    }
    assert expected <= kinds, expected - kinds

    await page.goto('/docs')  # Swagger UI, from this service's own files, draws the schema
    await expect(page.locator('.swagger-ui .info .title')).to_contain_text('stepstream')
    await expect(page.locator('.opblock-summary-path[data-path="/api/runs"]').first).to_be_visible()


def _kind(path: str) -> str:
    """Which kind of page a path is, for the crawler's account of what it reached."""
    if path.startswith('/api/media/'):
        return 'media'
    if path.startswith(('/api/', '/openapi.json')):
        return 'api'
    if path.startswith('/?conversation_id='):
        return 'conversation'
    if path in ('/', '') or path.startswith('/?'):
        return 'runs'
    if '/snapshots/' in path:
        return 'snapshot'
    if path.startswith('/runs/') and '/diff' in path:
        return 'diff'
    if path.startswith('/runs/'):
        return 'run'
    return path.strip('/').split('/')[0].split('?')[0]


async def test_a_broken_chain_is_badged_filtered_and_counted(served: Served, page: Page) -> None:
    """A run whose second record links to nothing it holds: its page, the list's filter and count say so."""
    from datetime import UTC, datetime

    from stepstream.schemas import StepEvent

    run_id = f'forged-{uuid.uuid4().hex[:8]}'
    now = datetime.now(UTC)
    started = StepEvent(run_id=run_id, seq=0, writer_id='forger', timestamp=now, kind='run_started')
    ended = StepEvent(
        run_id=run_id, seq=1, writer_id='forger', timestamp=now, kind='run_completed', prev_hash='0' * 64
    )
    for record in (started, ended):
        await served.log.append(record)
    await served.settle()

    await page.goto(f'/runs/{run_id}')
    await expect(page.locator('h1 .chain-broken')).to_have_text('chain broken at seq 1')
    await page.goto(f'/runs/{served.orchestrator_run}')
    await expect(page.locator('h1 .chain-intact')).to_have_text('chain intact')
    await page.goto('/')
    await page.locator('p.counts a.broken-chains').click()  # the count links to the filter
    await expect(page.locator('tr.run-row')).to_have_count(1)
    await expect(page.locator(f'tr.run-row[data-run-id="{run_id}"] .chain-broken')).to_be_visible()
    answer = await (await page.request.get(served.url.rstrip('/') + '/api/runs?chain=broken')).json()
    assert [r['run_id'] for r in answer['runs']] == [run_id]
    assert (answer['runs'][0]['chain'], answer['runs'][0]['chain_break_seq']) == ('broken', 1)


async def test_a_waiting_call_is_listed_decided_by_a_form_and_leaves_the_list(
    served: Served, browser: Browser, page: Page, tmp_path: Path
) -> None:
    from deferred_runs import run_until_waiting

    run_id = 'refunds-waiting-page'
    await run_until_waiting(served.log, run_id)
    await served.settle()
    await page.goto('/')
    await page.locator('p.counts a.waiting-count', has_text='waiting for approval').click()
    row = page.locator(f'table.waiting tr.waiting-row[data-run-id="{run_id}"]')
    await expect(row).to_have_count(1)
    await expect(row).to_have_attribute('data-tool-call-id', 'call-refund')
    await expect(row.locator('.waiting-args')).to_contain_text('<b>charged twice</b>')  # markup as text
    await expect(row.locator('.waiting-args b')).to_have_count(0)
    await shot(page, tmp_path, 'waiting')

    await row.locator('details.decide summary').click()
    approve = row.locator('form.approve')
    await approve.locator('textarea[name=args]').fill('{"amount": 100, "reason": "partial refund"}')
    await approve.locator('input[name=note]').fill('the customer agreed to 100')
    await approve.locator('button[type=submit]').click()
    await expect(page.locator('h1')).to_have_text('Decision recorded')
    recorded = page.locator('.decision-recorded')
    await expect(recorded.locator('.resolution')).to_have_text('approved')
    await expect(recorded.locator('.resolved-by')).to_have_text('oncall-alice')
    await expect(recorded.locator('.decision-args')).to_contain_text('partial refund')
    await expect(page.locator('.decided-by .recorded-by')).to_have_text('oncall-alice')  # no name given
    await shot(page, tmp_path, 'decided')
    await page.click('a.back-to-waiting')
    await expect(
        page.locator(f'tr.waiting-row[data-run-id="{run_id}"][data-tool-call-id="call-refund"]')
    ).to_have_count(0)
    await expect(page.locator(f'tr.waiting-row[data-run-id="{run_id}"]')).to_have_count(2)

    # The run page decides too; a form decided elsewhere meanwhile answers with the decision that stands.
    await page.goto(f'/runs/{run_id}')
    export = page.locator('.deferred-effect[data-tool-call-id="call-export"] form.complete')
    await export.locator('textarea[name=value]').fill('{"rows": 3}')
    await export.locator('input[name=by]').fill('dana')
    await export.locator('button[type=submit]').click()
    await expect(page.locator('.decision-recorded .decision-result')).to_have_text('{"rows":3}')
    await expect(page.locator('.decided-by .recorded-by')).to_have_text('dana')
    # (its own context: the 409 page is an answer, but Chromium logs the status as a console error)
    context = await browser.new_context(base_url=served.url, viewport={'width': 1280, 'height': 900})
    try:
        stale = await context.new_page()
        await stale.goto(f'/runs/{run_id}')
        ask = stale.locator('.deferred-effect[data-tool-call-id="call-ask"] form.complete')
        await ask.locator('textarea[name=value]').fill('the visa card')
        answered = await stale.request.post(
            f'/api/runs/{run_id}/calls/call-ask/complete',
            data={'result': 'the debit card', 'operator': 'bob'},
        )
        assert answered.status == 201
        await ask.locator('button[type=submit]').click()
        await expect(stale.locator('h1')).to_have_text('Not recorded: the call does not wait')
        await expect(stale.locator('.decision-standing .resolved-by')).to_have_text('bob')
        await shot(stale, tmp_path, 'decision-conflict')
    finally:
        await context.close()
    await page.goto('/deferred')
    await expect(page.locator(f'tr.waiting-row[data-run-id="{run_id}"]')).to_have_count(0)
    # The run's timeline has each decision at its time, by whom, standing (the refused form wrote none).
    await page.goto(f'/runs/{run_id}')
    answers = page.locator('section.timeline tr.answer')
    await expect(answers).to_have_count(3)
    await expect(answers.locator('.answer-stands')).to_have_count(3)
    await expect(page.locator('tr.answer[data-tool-call-id="call-export"] .resolved-by')).to_have_text('dana')
