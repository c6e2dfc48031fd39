"""Turning raw results into figures, the targets table and the printed report.

Pure Python (no stepstream, no pydantic-ai), so `bench.plot` can use the summary in the bench
environment too.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

# Which baseline each variant's added cost is measured against: the one in its own environment.
BASELINE = {
    'stepstream': 'none',
    'stepstream-linger0': 'none',
    'stepstream-no-projector': 'none',
    'harness-memory': 'none-harness-env',
    'harness-sqlite': 'none-harness-env',
    'harness-file': 'none-harness-env',
}
LABELS = {
    'none': 'no persistence (pydantic-ai 2.68)',
    'stepstream': 'stepstream (Tansu, projector running)',
    'stepstream-linger0': 'stepstream, EventLog(linger_ms=0)',
    'stepstream-no-projector': 'stepstream, no projector process',
    'none-harness-env': 'no persistence (pydantic-ai 2.62)',
    'harness-memory': 'harness InMemoryStepStore',
    'harness-sqlite': 'harness SqliteStepStore',
    'harness-file': 'harness FileStepStore',
}


def _quadratic_through_origin(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares `y = c1*x + c2*x^2` (bytes of a run that rewrites its history every step)."""
    s11 = sum(x * x for x, _ in points)
    s12 = sum(x**3 for x, _ in points)
    s22 = sum(x**4 for x, _ in points)
    t1 = sum(x * y for x, y in points)
    t2 = sum(x * x * y for x, y in points)
    det = s11 * s22 - s12 * s12
    return (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det


def _median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def per_step_summary(rows: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """Median over repeats of each (variant, N); truncated reference runs are extrapolated."""
    grouped: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        grouped[(row['variant'], row['n'])].append(row)
    out: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for (variant, n), group in sorted(grouped.items()):
        truncated = any(r['truncated'] for r in group)
        if truncated:
            ms = statistics.median(r['extrapolated_per_step_ms'] for r in group)
        else:
            ms = statistics.median(r['per_step_ms'] for r in group)
        out[variant][n] = {
            'ms': ms,
            'cpu_ms': statistics.median(r['cpu_per_step_ms'] for r in group),
            'record_bytes': _median_of(group, 'record_bytes'),
            'broker_cpu_ms': _median_of(group, 'broker_cpu_per_step_ms'),
            'projector_cpu_ms': _median_of(group, 'projector_cpu_per_step_ms'),
            'bytes': statistics.median(r['bytes'] for r in group),
            'estimated': truncated,
            'steps_done': min(r['steps_done'] for r in group),
            'repeats': len(group),
            'step_ms': group[0]['step_ms'],
        }
    for by_n in out.values():
        # A truncated run's bytes are extrapolated from all of this store's measured (steps, bytes).
        points = [(float(c['steps_done']), float(c['bytes'])) for c in by_n.values()]
        for n, cell in by_n.items():
            if cell['estimated'] and len(points) >= 2:
                c1, c2 = _quadratic_through_origin(points)
                cell['bytes'] = c1 * n + c2 * n * n
    for variant, by_n in out.items():
        base_name = BASELINE.get(variant, '')
        base = out.get(base_name, {})
        for n, cell in by_n.items():
            if n not in base:
                cell['added_ms'] = cell['added_cpu_ms'] = None
                continue
            ours = grouped[(variant, n)]
            theirs = {r['rep']: r for r in grouped[(base_name, n)]}
            if not cell['estimated'] and all(r['rep'] in theirs for r in ours):
                # Paired: each repeat against the baseline run just before it, which cancels
                # the slow drift of a shared machine better than a difference of medians.
                cell['added_ms'] = statistics.median(
                    r['per_step_ms'] - theirs[r['rep']]['per_step_ms'] for r in ours
                )
            else:
                cell['added_ms'] = cell['ms'] - base[n]['ms']
            cell['added_cpu_ms'] = cell['cpu_ms'] - base[n]['cpu_ms']
    return dict(out)


def _get(d: dict[str, Any], *path: Any) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(summary: dict[str, Any], raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets table, with what this run measured."""
    ps = summary.get('per_step', {})
    rows: list[dict[str, Any]] = []
    ss = ps.get('stepstream', {})
    if ss:
        added = {n: c['added_ms'] for n, c in ss.items() if c['added_ms'] is not None}
        at200 = added.get(200)
        ref = {k: _get(ps, k, 200, 'added_ms') for k in ('harness-sqlite', 'harness-file', 'harness-memory')}
        spread = max(added.values()) - min(added.values()) if added else None
        rows.append(
            {
                'figure': 'added wall time per step at N=200 (vs no persistence)',
                'value': at200,
                'unit': 'ms',
                'reference': ref,
                'ratio': _ratio(at200, ref['harness-sqlite']),
                'ratio_to': 'harness SQLite',
                'target': '<= 2 ms, flat from N=50 to N=1000',
                'detail': {str(n): a for n, a in sorted(added.items())},
                'met': at200 is not None and all(a <= 2.0 for a in added.values()) and (spread or 0) <= 1.0,
            }
        )
        b200 = _get(ps, 'stepstream', 200, 'bytes')
        sqlite_b = _get(ps, 'harness-sqlite', 200, 'bytes')
        rows.append(
            {
                'figure': 'bytes written for the N=200 run',
                'value': b200,
                'unit': 'B',
                'reference': {
                    'harness-sqlite': sqlite_b,
                    'harness-file': _get(ps, 'harness-file', 200, 'bytes'),
                    'harness-memory': _get(ps, 'harness-memory', 200, 'bytes'),
                },
                'ratio': _ratio(b200, sqlite_b),
                'ratio_to': 'harness SQLite',
                'target': '<= 1/20 of the SQLite figure',
                'met': b200 is not None and sqlite_b is not None and b200 <= sqlite_b / 20,
            }
        )
    producer = raw.get('producer')
    if producer:
        # The target is about the EventLog as configured by default (no `_linger` suffix).
        keys = [k for k in producer if k.startswith('eventlog_') and k.endswith('_runs')]
        best = max(keys, key=lambda k: producer[k]['records_per_s'])
        value = producer[best]['records_per_s']
        ceiling = producer['raw_aiokafka']['records_per_s']
        rows.append(
            {
                'figure': f'producer records/s, one process ({producer[best]["runs"]} concurrent runs)',
                'value': value,
                'unit': 'records/s',
                'reference': {'raw aiokafka': ceiling},
                'ratio': _ratio(value, ceiling),
                'ratio_to': 'raw aiokafka',
                'target': '>= 30k/s',
                'met': value >= 30_000,
            }
        )
    projector = raw.get('projector')
    if projector:
        rate = projector['rebuild']['records_per_s']
        ceilings = {
            'RocksDB batched puts': projector['rocksdb']['records_per_s'],
            'fastavro decode': projector['decode']['fastavro_records_per_s'],
            'raw consume': projector['raw_consume']['records_per_s'],
        }
        rows.append(
            {
                'figure': 'projector records/s applied',
                'value': rate,
                'unit': 'records/s',
                'reference': ceilings,
                'ratio': _ratio(rate, min(ceilings.values())),
                'ratio_to': 'lowest ceiling',
                'target': '>= 50k/s',
                'met': rate >= 50_000,
            }
        )
        records = projector['rebuild']['records']
        seconds = projector['rebuild']['seconds']
        rows.append(
            {
                'figure': f'rebuild of {records:,} records from offset zero',
                'value': seconds,
                'unit': 's',
                'reference': {'at the lowest ceiling': records / min(ceilings.values())},
                'ratio': _ratio(seconds, records / min(ceilings.values())),
                'ratio_to': 'time at the lowest ceiling',
                'target': '<= 30 s for 1M records',
                'met': seconds * 1_000_000 / records <= 30 if records >= 1_000_000 else None,
            }
        )
    fresh = raw.get('freshness')
    if fresh:
        ceiling = raw.get('freshness_raw', {}).get('p99_ms')
        rows.append(
            {
                'figure': 'freshness p99 (ack -> visible in ProjectionReader)',
                'value': fresh['p99_ms'],
                'unit': 'ms',
                'reference': {'p50': fresh['p50_ms'], 'raw aiokafka p99': ceiling},
                'ratio': _ratio(fresh['p99_ms'], ceiling),
                'ratio_to': 'raw aiokafka ack -> consumed',
                'target': f'<= 100 ms at {fresh["background_records_per_s"]:,.0f} records/s background',
                'met': fresh['p99_ms'] <= 100,
            }
        )
    return rows


def _fmt(value: float | None, unit: str = '') -> str:
    if value is None:
        return 'n/a'
    if unit == 'B':
        return f'{value / 1e6:.3f} MB' if value >= 1e5 else f'{value / 1e3:.1f} KB'
    if unit == 'records/s':
        return f'{value:,.0f}/s'
    if unit == 'ms':
        return f'{value:.2f} ms'
    if unit == 's':
        return f'{value:.1f} s'
    return f'{value:,.3g}'


def _fmt_ratio(ratio: float | None) -> str:
    if ratio is None:
        return ''
    return f'1/{1 / ratio:.1f}' if 0 < ratio < 1 else f'{ratio:.2f}x'


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = '| ' + ' | '.join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + ' |'
    sep = '| ' + ' | '.join('-' * w for w in widths) + ' |'
    body = ['| ' + ' | '.join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + ' |' for r in rows]
    return [line, sep, *body]


def render(summary: dict[str, Any], raw: dict[str, Any]) -> str:
    """Every figure with its ratio to the reference or ceiling, as markdown tables."""
    out: list[str] = []
    ps = summary.get('per_step', {})
    if ps:
        out += ['', '## Workload 1: per-step cost against run length', '']
        ns = sorted({n for by_n in ps.values() for n in by_n})
        rows = []
        for variant in LABELS:
            if variant not in ps:
                continue
            cells = [LABELS[variant]]
            for n in ns:
                c = ps[variant].get(n)
                if c is None:
                    cells.append('')
                    continue
                star = '*' if c['estimated'] else ''
                added = f' (+{c["added_ms"]:.2f})' if c['added_ms'] is not None else ''
                cells.append(f'{c["ms"]:.2f}{added}{star}')
            for n in ns:
                c = ps[variant].get(n)
                if c is None:
                    cells.append('')
                else:
                    cells.append(
                        (_fmt(c['bytes'], 'B') if c['bytes'] else '0') + ('*' if c['estimated'] else '')
                    )
            rows.append(cells)
        headers = ['variant', *[f'ms/step N={n} (+added)' for n in ns], *[f'bytes N={n}' for n in ns]]
        out += _table(headers, rows)
        if any(c['estimated'] for by_n in ps.values() for c in by_n.values()):
            out.append(
                '\n\\* extrapolated from a run stopped at its time budget (per-step time fitted '
                'linearly in the step index, bytes quadratically in N); `--full` runs them to the end.'
            )
        ss_cells = ps.get('stepstream', {})
        if ss_cells:
            stored = ', '.join(f'N={n} {_fmt(c["bytes"], "B")}' for n, c in sorted(ss_cells.items()))
            plain = ', '.join(
                f'N={n} {_fmt(c["record_bytes"], "B")}'
                for n, c in sorted(ss_cells.items())
                if c['record_bytes']
            )
            out.append(f'\nstepstream bytes are the record batches as the broker stores them ({stored}); ')
            out.append(f'the records themselves (value + key + headers, uncompressed): {plain}.')
        cpu_rows = []
        for variant in ('stepstream', 'stepstream-linger0', 'stepstream-no-projector'):
            for n, c in sorted(ps.get(variant, {}).items()):
                parts = [c['added_cpu_ms'], c['broker_cpu_ms'], c['projector_cpu_ms']]
                total = sum(p for p in parts if p is not None)
                text = [f'{p:.2f}' if p is not None else '-' for p in parts]
                cpu_rows.append([LABELS[variant], f'N={n}', *text, f'{total:.2f}', f'{c["added_ms"]:.2f}'])
        if cpu_rows:
            out += ['', 'Where the added time goes: CPU ms per step of each process on the 2 cores:', '']
            headers = [
                'variant',
                'N',
                'agent process (+ vs baseline)',
                'Tansu',
                'projector',
                'sum',
                'added wall',
            ]
            out += _table(headers, cpu_rows)
        nmax = max(ns)
        growth_rows = []
        for variant in ('none', 'stepstream', 'stepstream-no-projector', 'none-harness-env'):
            c = ps.get(variant, {}).get(nmax)
            if c and len(c['step_ms']) >= 200:
                first, last = c['step_ms'][:100], c['step_ms'][-100:]
                growth_rows.append([LABELS[variant], f'{sum(first) / 100:.1f}', f'{sum(last) / 100:.1f}'])
        if growth_rows:
            out += [
                '',
                f'Within the N={nmax} run (first repeat): mean step time of its first and last 100 steps:',
                '',
            ]
            out += _table(['variant', 'first 100 steps, ms', 'last 100 steps, ms'], growth_rows)
        ss = ps.get('stepstream', {})
        ref_rows = []
        for n in ns:
            for ref in ('harness-memory', 'harness-sqlite', 'harness-file'):
                a, b = _get(ss, n, 'added_ms'), _get(ps, ref, n, 'added_ms')
                ba, bb = _get(ss, n, 'bytes'), _get(ps, ref, n, 'bytes')
                if a is None or b is None:
                    continue
                ref_rows.append(
                    [f'N={n}', LABELS[ref], f'{a:.2f} / {b:.2f} ms', _fmt_ratio(_ratio(a, b)),
                     f'{_fmt(ba, "B")} / {_fmt(bb, "B")}', _fmt_ratio(_ratio(ba, bb))]
                )  # fmt: skip
        if ref_rows:
            out += ['', 'stepstream against each reference store (added time per step, bytes per run):', '']
            out += _table(['N', 'reference', 'added ms/step', 'ratio', 'bytes', 'ratio'], ref_rows)
    producer = raw.get('producer')
    if producer:
        out += ['', '## Workload 2: producer throughput', '']
        ceiling = producer['raw_aiokafka']['records_per_s']
        rows = []
        for key, row in producer.items():
            if 'records_per_s' in row:
                rows.append(
                    [key, _fmt(row['records_per_s'], 'records/s'), _fmt_ratio(row['records_per_s'] / ceiling)]
                )
        rtt = producer.get('ack_round_trip')
        if rtt:
            rows.append(
                ['ack round trip p50 / p99 (acks=all)', f'{rtt["p50_ms"]:.2f} / {rtt["p99_ms"]:.2f} ms', '']
            )
        out += _table(['figure', 'value', 'ratio to raw aiokafka'], rows)
        out.append(
            f'\nmean record size {producer["raw_aiokafka"]["mean_record_bytes"]:.0f} B '
            '(value + key + headers)'
        )
    projector = raw.get('projector')
    if projector:
        out += ['', '## Workload 3: projector throughput and rebuild', '']
        rebuild = projector['rebuild']
        fastavro = projector['decode']['fastavro_records_per_s']
        ours = projector['decode']['stepstream_decode_records_per_s']
        lowest = min(
            projector['raw_consume']['records_per_s'], fastavro, projector['rocksdb']['records_per_s']
        )
        rate = rebuild['records_per_s']
        rows = [
            ['fill (raw aiokafka producer)', _fmt(projector['fill']['records_per_s'], 'records/s'), ''],
            ['raw consume (ceiling)', _fmt(projector['raw_consume']['records_per_s'], 'records/s'), ''],
            ['raw fastavro decode (ceiling)', _fmt(fastavro, 'records/s'), ''],
            ['stepstream.schemas.decode', _fmt(ours, 'records/s'), _fmt_ratio(ours / fastavro)],
            [
                'raw RocksDB batched puts (ceiling)',
                _fmt(projector['rocksdb']['records_per_s'], 'records/s'),
                '',
            ],
            ['projector rebuild, records applied', _fmt(rate, 'records/s'), _fmt_ratio(rate / lowest)],
            [f'rebuild time, {rebuild["records"]:,} records', f'{rebuild["seconds"]:.1f} s', ''],
        ]
        out += _table(['figure', 'value', 'ratio to lowest ceiling'], rows)
    fresh = raw.get('freshness')
    if fresh:
        out += ['', '## Workload 4: freshness', '']
        ceiling = raw.get('freshness_raw', {})

        def compared(key: str, label: str) -> list[str]:
            ours, theirs = fresh.get(key), ceiling.get(key)
            text = [f'{v:.1f} ms' if v is not None else 'n/a' for v in (ours, theirs)]
            return [label, *text, _fmt_ratio(_ratio(ours, theirs)) if key != 'max_ms' else '']

        def drift(d: dict[str, Any]) -> str:
            return ' -> '.join(f'{x:.0f}' for x in d['p50_by_5s_ms']) + ' ms' if d else 'n/a'

        rows = [
            compared('p50_ms', 'p50'),
            compared('p99_ms', 'p99'),
            compared('max_ms', 'max'),
            ['p50 per 5 s window', drift(fresh), drift(ceiling), ''],
            ['samples', str(fresh['samples']), str(ceiling.get('samples', 'n/a')), ''],
        ]
        headers = [
            'figure',
            'stepstream (ack -> ProjectionReader)',
            'raw aiokafka (ack -> consumer)',
            'ratio',
        ]
        out += _table(headers, rows)
        out.append(f'\nbackground load {fresh["background_records_per_s"]:,.0f} records/s')
    tgt = summary.get('targets', [])
    if tgt:
        out += ['', '## Targets', '']
        rows = []
        for t in tgt:
            refs = ', '.join(f'{k} {_fmt(v, t["unit"])}' for k, v in t['reference'].items() if v is not None)
            met = {True: 'met', False: 'MISSED', None: 'n/a (scaled down)'}[t['met']]
            ratio = f'{_fmt_ratio(t["ratio"])} of {t["ratio_to"]}' if t['ratio'] is not None else ''
            rows.append([t['figure'], _fmt(t['value'], t['unit']), refs, ratio, t['target'], met])
        out += _table(['figure', 'stepstream', 'reference / ceiling', 'ratio', 'target', ''], rows)
    return '\n'.join(out).lstrip('\n') + '\n'
