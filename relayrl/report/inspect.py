"""The rollout inspector: ``RUN_DIR/report/inspect.html``, a static self-contained page (the
data embedded as JSON, vanilla JavaScript, nothing fetched) to browse a run's GRPO groups
step by step.

Owns: :func:`inspector_data` (the page's data from ``samples.jsonl``, ``inspect.jsonl`` and
``metrics.jsonl``), :func:`render_inspector`, :func:`build_inspector` and :func:`serve`
(``relayrl inspect --serve``: the page re-built on every request, on loopback, behind a
random key in the path). Every sample shows its reward, advantage, staleness, finish reason
and text; the samples of the groups that ``train.inspect_groups`` recorded show their tokens
coloured by the weight version that produced them (:data:`PALETTE`, version modulo its
length), with behaviour vs proximal logprob on hover. The URL hash holds the view:
``#step=N`` (or ``all``) and ``filter=`` clauses joined by commas: ``FIELD OP NUMBER`` with
FIELD in reward, advantage, staleness, tokens and OP in ``>= <= != > < =``, or a flag
``truncated``, ``replayed`` (trained again by D-ARL), ``interrupted`` (tokens of several
versions), each negated by a leading ``!``.

Imports: the standard library and relayrl.report.logs (nothing from training: the page is
built from any run directory, finished or still running).
"""

from __future__ import annotations

import html
import json
import secrets
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from relayrl.report.logs import load_run, read_jsonl

# light backgrounds that keep black text readable; a token of version v gets PALETTE[v % 10]
PALETTE = (
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#dbdb8d",
    "#9edae5",
    "#d9d9d9",
)
STEP_METRICS = (
    "reward_mean",
    "pass_rate",
    "completed_correct_frac",
    "staleness_mean",
    "staleness_max",
    "mismatch_kl_k3_s0",
)
PAGE = "inspect.html"


def _sample_key(row: dict) -> tuple[int, str, int]:
    return int(row.get("step", 0)), str(row.get("group_id")), int(row.get("sample_index", 0))


def _flat_versions(runs: list[list[int]]) -> list[int]:
    return [v for v, n in runs for _ in range(n)]


def _tokens(row: dict) -> dict[str, Any]:
    """The page's per-token arrays of one ``inspect.jsonl`` row."""
    pieces = row.get("pieces")
    if pieces is None:
        pieces = [f"[{i}]" for i in row.get("ids", [])]
    return {"p": pieces, "v": _flat_versions(row["versions"]), "b": row["behav"], "q": row["prox"]}


def _replayed_steps(rows: list[dict]) -> dict[tuple[str, int], list[int]]:
    """``(group_id, sample_index)`` → the 1-based steps at which D-ARL trained it again."""
    out: dict[tuple[str, int], list[int]] = {}
    for row in rows:
        for gid, index in row.get("replayed", []):
            out.setdefault((str(gid), int(index)), []).append(int(row["step"]) + 1)
    return out


def _sample(row: dict, tokens: dict | None, replayed: list[int]) -> dict[str, Any]:
    stale = None
    if "trainer_version" in row and "version_min" in row:
        stale = row["trainer_version"] - row["version_min"]
    return {
        "i": row.get("sample_index"),
        "reward": row.get("reward"),
        "adv": row.get("advantage"),
        "stale": stale,
        "finish": row.get("finish_reason"),
        "ntok": row.get("completion_tokens"),
        "vmin": row.get("version_min"),
        "vmax": row.get("version_max"),
        "text": row.get("text"),
        "replayed": replayed,
        "tok": tokens,
    }


def _steps(samples: list[dict], inspect_rows: list[dict]) -> dict[int, dict[str, dict]]:
    """step (0-based) → group id → the page's group (prompt and samples, in log order)."""
    tokens = {_sample_key(r): _tokens(r) for r in inspect_rows if "versions" in r}
    replayed = _replayed_steps(inspect_rows)
    steps: dict[int, dict[str, dict]] = {}
    for row in samples:
        step, gid, index = _sample_key(row)
        group = steps.setdefault(step, {}).setdefault(
            gid,
            {
                "id": gid,
                "prompt_id": row.get("prompt_id"),
                "prompt": row.get("prompt_text"),
                "samples": [],
            },
        )
        sample = _sample(row, tokens.get((step, gid, index)), replayed.get((gid, index), []))
        group["samples"].append(sample)
    return steps


def inspector_data(run_dir: Path) -> dict[str, Any]:
    """Everything the page shows, steps 1-based as in ``metrics.jsonl``."""
    logs = load_run(run_dir)
    rows = {int(m["step"]): m for m in logs.metrics if "reward_mean" in m and "step" in m}
    steps = _steps(logs.samples, read_jsonl(run_dir / "inspect.jsonl"))
    return {
        "run": run_dir.name,
        "palette": list(PALETTE),
        "steps": [
            {
                "step": step + 1,
                "version": step,
                "metrics": {k: rows.get(step + 1, {}).get(k) for k in STEP_METRICS},
                "groups": list(groups.values()),
            }
            for step, groups in sorted(steps.items())
        ],
    }


def _json_for_script(data: dict) -> str:
    """JSON safe inside a ``<script>`` element (no ``</script>``, no HTML comment)."""
    text = json.dumps(data, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


STYLE = """
body{font-family:sans-serif;margin:0 auto;max-width:1300px;padding:0 12px;color:#222}
header{position:sticky;top:0;background:#fff;border-bottom:1px solid #ccc;padding:6px 0}
header input[type=text]{width:28em}
.group{border:1px solid #ccc;border-radius:6px;margin:10px 0;padding:6px 10px}
.group h3{margin:2px 0;font-size:15px}
pre{white-space:pre-wrap;margin:2px 0;font-size:13px}
pre.prompt{color:#555;background:#f6f6f6;padding:4px}
table{border-collapse:collapse;width:100%}
td,th{border-top:1px solid #eee;padding:3px 5px;vertical-align:top;font-size:13px;text-align:left}
td.num{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}
.tokens{font-family:monospace;font-size:13px;line-height:1.7;white-space:pre-wrap}
.tok{border-radius:2px;padding:0 1px;margin:0 0.5px}
.legend span{padding:1px 6px;margin-right:4px;border-radius:3px;font-size:12px}
.pos{color:#070}.neg{color:#b00}.muted{color:#888}.metrics{font-size:13px;color:#333}
"""

SCRIPT = r"""
const D = JSON.parse(document.getElementById('data').textContent);
const P = D.palette;
const $ = (id) => document.getElementById(id);
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined && text !== null) e.textContent = text;
  return e;
}
function fmt(x, d) { return x === null || x === undefined ? '—' : Number(x).toFixed(d); }
function state() {
  const h = new URLSearchParams(location.hash.slice(1));
  return {step: h.get('step') || (D.steps.length ? String(D.steps[0].step) : 'all'),
          filter: h.get('filter') || ''};
}
function setState(s) {
  const h = new URLSearchParams();
  h.set('step', s.step);
  if (s.filter) h.set('filter', s.filter);
  location.hash = h.toString();
}
const FIELDS = {reward: s => s.reward, advantage: s => s.adv, staleness: s => s.stale,
                tokens: s => s.ntok};
const FLAGS = {truncated: s => s.finish === 'length', replayed: s => s.replayed.length > 0,
               interrupted: s => s.vmin !== s.vmax};
const OPS = {'>=': (a, b) => a >= b, '<=': (a, b) => a <= b, '!=': (a, b) => a !== b,
             '>': (a, b) => a > b, '<': (a, b) => a < b, '=': (a, b) => a === b};
function parseFilter(text) {
  const tests = [], errors = [];
  for (const raw of text.split(',')) {
    const c = raw.trim();
    if (!c) continue;
    const neg = c.startsWith('!'), name = neg ? c.slice(1).trim() : c;
    if (FLAGS[name]) { tests.push(s => FLAGS[name](s) !== neg); continue; }
    const m = c.match(/^([a-z]+)\s*(>=|<=|!=|>|<|=)\s*(-?[0-9.eE+-]+)$/);
    if (m && FIELDS[m[1]]) {
      const get = FIELDS[m[1]], op = OPS[m[2]], v = Number(m[3]);
      tests.push(s => get(s) !== null && get(s) !== undefined && op(get(s), v));
    } else errors.push(c);
  }
  return {test: s => tests.every(t => t(s)), errors};
}
function tokenSpans(tok, trainerVersion) {
  const box = el('div', {class: 'tokens'});
  tok.p.forEach((piece, i) => {
    const v = tok.v[i], b = tok.b[i], q = tok.q ? tok.q[i] : null;
    let title = 'version ' + v + ' (staleness ' + (trainerVersion - v) + ') · behaviour μ '
      + fmt(b, 4) + ' · proximal π_v ' + fmt(q, 4);
    if (q !== null) title += ' · Δ ' + (q - b >= 0 ? '+' : '') + (q - b).toFixed(4);
    box.appendChild(el('span', {class: 'tok', 'data-version': v,
      'data-behav': b, 'data-prox': q === null ? '' : q,
      style: 'background:' + P[((v % P.length) + P.length) % P.length], title: title}, piece));
  });
  return box;
}
function sampleRow(s, trainerVersion) {
  const tr = el('tr', {class: 'sample', 'data-index': s.i, 'data-reward': s.reward,
    'data-staleness': s.stale, 'data-truncated': s.finish === 'length',
    'data-replayed': s.replayed.length > 0});
  const adv = el('td', {class: 'num ' + (s.adv > 0 ? 'pos' : s.adv < 0 ? 'neg' : '')},
    s.adv === null ? '—' : (s.adv >= 0 ? '+' : '') + fmt(s.adv, 3));
  const versions = s.vmin === s.vmax ? String(s.vmin) : s.vmin + '–' + s.vmax;
  const cells = [el('td', {class: 'num'}, '#' + s.i), el('td', {class: 'num'}, fmt(s.reward, 3)),
    adv, el('td', {class: 'num'}, s.stale), el('td', {}, s.finish || '—'),
    el('td', {class: 'num'}, s.ntok), el('td', {class: 'num'}, versions),
    el('td', {}, s.replayed.length ? 'replayed at ' + s.replayed.join(', ') : '')];
  cells.forEach(c => tr.appendChild(c));
  const text = el('td', {});
  if (s.tok) text.appendChild(tokenSpans(s.tok, trainerVersion));
  else text.appendChild(el('pre', {}, s.text === null || s.text === undefined
    ? '(text not recorded: train.log_text=false)' : s.text));
  tr.appendChild(text);
  return tr;
}
const HEAD = ['sample', 'reward', 'advantage', 'staleness', 'finish', 'tokens', 'versions',
              'D-ARL', 'completion (tokens coloured by weight version when recorded)'];
function groupCard(step, g, shown) {
  const card = el('section', {class: 'group', 'data-group': g.id, 'data-step': step.step});
  const mean = g.samples.reduce((a, s) => a + (s.reward || 0), 0) / g.samples.length;
  card.appendChild(el('h3', {}, 'step ' + step.step + ' · group ' + g.id + ' · prompt '
    + g.prompt_id + ' · mean reward ' + fmt(mean, 3) + ' · ' + shown.length + ' of '
    + g.samples.length + ' samples shown'));
  if (g.prompt !== null && g.prompt !== undefined) card.appendChild(el('pre', {class: 'prompt'}, g.prompt));
  const table = el('table', {}), head = el('tr', {});
  HEAD.forEach(h => head.appendChild(el('th', {}, h)));
  table.appendChild(head);
  shown.forEach(s => table.appendChild(sampleRow(s, step.version)));
  card.appendChild(table);
  return card;
}
function legend(step) {
  const seen = new Set();
  step.groups.forEach(g => g.samples.forEach(s => s.tok && s.tok.v.forEach(v => seen.add(v))));
  const box = el('div', {class: 'legend', id: 'legend'}, seen.size ? 'token versions: ' : '');
  [...seen].sort((a, b) => a - b).forEach(v => box.appendChild(el('span',
    {'data-version': v, style: 'background:' + P[v % P.length]},
    'v' + v + ' (staleness ' + (step.version - v) + ')')));
  return box;
}
function stepMetrics(step) {
  const m = step.metrics, parts = [];
  for (const [k, v] of Object.entries(m)) if (v !== null && v !== undefined)
    parts.push(k + ' ' + (Math.abs(v) < 1e-3 && v !== 0 ? Number(v).toExponential(2) : fmt(v, 3)));
  return el('div', {class: 'metrics'}, 'step ' + step.step + ' (trained at version '
    + step.version + '): ' + parts.join(' · '));
}
function render() {
  const s = state(), f = parseFilter(s.filter), main = $('groups');
  $('step').value = s.step; $('filter').value = s.filter;
  $('errors').textContent = f.errors.length ? 'not understood: ' + f.errors.join(', ') : '';
  main.replaceChildren();
  const steps = s.step === 'all' ? D.steps : D.steps.filter(x => String(x.step) === s.step);
  let groups = 0, samples = 0;
  for (const step of steps) {
    if (s.step !== 'all') { main.appendChild(stepMetrics(step)); main.appendChild(legend(step)); }
    for (const g of step.groups) {
      const shown = g.samples.filter(f.test);
      if (!shown.length || groups >= 200) continue;
      groups += 1; samples += shown.length;
      main.appendChild(groupCard(step, g, shown));
    }
  }
  $('count').textContent = groups + ' groups, ' + samples + ' samples match';
}
function init() {
  $('title').textContent = 'relayrl rollout inspector: ' + D.run;
  const sel = $('step');
  sel.appendChild(el('option', {value: 'all'}, 'all steps'));
  D.steps.forEach(x => sel.appendChild(el('option', {value: String(x.step)}, 'step ' + x.step)));
  sel.onchange = () => setState({step: sel.value, filter: $('filter').value});
  $('filter').onchange = () => setState({step: sel.value, filter: $('filter').value});
  const move = (d) => { const i = D.steps.findIndex(x => String(x.step) === sel.value);
    const j = Math.min(Math.max(i + d, 0), D.steps.length - 1);
    if (D.steps.length) setState({step: String(D.steps[j].step), filter: $('filter').value}); };
  $('prev').onclick = () => move(-1); $('next').onclick = () => move(1);
  window.addEventListener('hashchange', render);
  render();
}
init();
"""

BODY = """<header><h2 id="title"></h2>
<button id="prev">◀</button> <select id="step"></select> <button id="next">▶</button>
filter <input type="text" id="filter" placeholder="reward>0, staleness>=1, !truncated, replayed">
<span id="count" class="muted"></span> <span id="errors" class="neg"></span>
<div class="muted">filter clauses, joined by commas: reward / advantage / staleness / tokens
with &gt;= &lt;= != &gt; &lt; =, or truncated, replayed (trained again by D-ARL),
interrupted (several versions); ! negates. Hover a token for its version and logprobs.</div>
</header><main id="groups"></main>"""


def render_inspector(data: dict[str, Any]) -> str:
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>relayrl inspect: {html.escape(data['run'])}</title><style>{STYLE}</style></head><body>"
        f"{BODY}<script type='application/json' id='data'>{_json_for_script(data)}</script>"
        f"<script>{SCRIPT}</script></body></html>"
    )


def build_inspector(run_dir: str | Path) -> Path:
    """Write ``RUN_DIR/report/inspect.html`` from the run's logs as they are now."""
    run = Path(run_dir)
    data = inspector_data(run)
    out = run / "report"
    out.mkdir(exist_ok=True)
    page = out / PAGE
    page.write_text(render_inspector(data))
    return page


def serve(run_dir: str | Path, port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    """A loopback server answering ``/<key>/`` with the page re-built from the run's logs
    (so a live run shows its newest steps on reload) and 404 on any other path; returns the
    server (call ``serve_forever``) and the page's URL."""
    run, key = Path(run_dir), secrets.token_urlsafe(16)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            if self.path.split("#")[0] not in (f"/{key}/", f"/{key}/{PAGE}"):
                self.send_error(404)
                return
            body = render_inspector(inspector_data(run)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    return server, f"http://127.0.0.1:{server.server_address[1]}/{key}/"
