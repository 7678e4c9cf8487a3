"""The report page: one Jinja2 template with inline CSS and an optional tiny sort script.

Kept as a Python string rather than a package data file so that every kind of install
(editable, wheel, zipapp) finds it without package-data configuration. The page must stand
alone: no URL of any kind, images arrive as data URIs, and it reads fine with scripts off.
"""

import jinja2

# The one template environment of every HTML view: autoescaped (every model path, variant, prompt
# and error a user gives is escaped), strict about undefined names.
ENV = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


CSS = """
:root { --ok: #2e7d32; --bad: #c62828; --err: #6d4c41; --muted: #6b6b6b; --line: #ddd; }
* { box-sizing: border-box; }
body { font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color: #222; max-width: 1320px; margin: 0 auto; padding: 10px 24px 40px; }
header.top { display: flex; flex-wrap: wrap; align-items: baseline; gap: 4px 16px; }
h1 { font-size: 19px; margin: 2px 0; }
header.top .sub { margin: 0; flex: 1 1 400px; }
nav { font-size: 13px; }
nav a { color: #1f5fa8; margin-left: 10px; text-decoration: none; }
h2 { font-size: 16px; margin: 22px 0 8px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
h3 { font-size: 14px; margin: 10px 0 4px; }
.sub { color: var(--muted); overflow-wrap: anywhere; }
code, pre, .mono { font-family: ui-monospace, "SF Mono", Menlo, Consolas, monospace; font-size: 12.5px; }
pre { background: #f6f8fa; border: 1px solid var(--line); border-radius: 4px; padding: 6px 10px; margin: 2px 0 8px;
      white-space: pre-wrap; overflow-wrap: anywhere; }
.banner { border-radius: 6px; padding: 10px 16px; color: white; margin: 8px 0; }
.banner .verdict { font-size: 20px; font-weight: 700; letter-spacing: .04em; margin-right: 10px; }
.banner p { margin: 6px 0 0; overflow-wrap: anywhere; }
.banner.match { background: var(--ok); }
.banner.diverged { background: var(--bad); }
.banner.error { background: var(--err); }
.banner code { color: inherit; font-weight: 600; }
.banner a { color: inherit; }
.banner ul.hints { margin: 6px 0 0; padding-left: 20px; }
.glance { display: grid; grid-template-columns: minmax(0, 800px) minmax(0, 1fr); gap: 20px; align-items: start; }
.glance figure { margin: 0; }
.glance table.kv td { overflow-wrap: anywhere; }
.glance .next { margin-top: 10px; }
.glance .next p { margin: 6px 0 2px; }
table.audit tr.differs td { background: #fff3e0; }
table { border-collapse: collapse; margin: 4px 0; }
th, td { padding: 3px 9px; border-bottom: 1px solid #eee; text-align: left; vertical-align: top; }
th { background: #f3f3f3; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.kv th { background: none; color: var(--muted); font-weight: 500; padding-left: 0; white-space: nowrap; }
.grid2 { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; }
.grid3 { display: grid; grid-template-columns: 1fr 1fr 1fr; gap: 16px; }
.grid2 > div, .grid3 > div { min-width: 0; }
figure { margin: 10px 0; page-break-inside: avoid; break-inside: avoid; }
figure img { max-width: 100%; height: auto; border: 1px solid var(--line); }
figcaption { color: var(--muted); font-size: 12.5px; }
table.points { font-size: 12.5px; width: 100%; }
table.points td, table.points th { padding: 1px 8px; line-height: 1.35; }
p.pairs { display: flex; flex-wrap: wrap; gap: 2px 18px; margin: 4px 0; overflow-wrap: anywhere; }
table.points thead th { position: sticky; top: 0; cursor: pointer; }
table.points tr.diverged td { background: #fdecea; }
table.points tr.first td { background: #f9c9c4; font-weight: 600; }
table.points tr.nonfinite td { background: #f4b6b0; }
table.points tr.missing td { color: #9a9a9a; background: #f7f7f7; font-style: italic; }
table.points tr.block td { border-top: 2px solid #cfcfcf; }
table.points td.point { font-family: ui-monospace, Menlo, Consolas, monospace; overflow-wrap: anywhere; }
table.points td.why { color: var(--muted); }
table.points.nowrap td.point { white-space: nowrap; }
details.all { margin: 10px 0; }
details.all > summary { cursor: pointer; font-weight: 600; margin: 6px 0; }
.filters { margin: 6px 0; display: flex; gap: 12px; align-items: center; flex-wrap: wrap; }
.filters input[type=search] { width: 320px; padding: 3px 6px; }
.ids span { display: inline-block; padding: 0 3px; margin: 1px; border-radius: 3px; background: #f0f0f0; }
.ids span.first { background: var(--bad); color: white; font-weight: 700; }
.ids span.after { background: #fdecea; }
.text { white-space: pre-wrap; overflow-wrap: anywhere; border: 1px solid var(--line);
        border-radius: 4px; padding: 6px 10px; background: #fcfcfc; }
mark { background: #f9c9c4; }
.muted { color: var(--muted); }
ul.notes { margin: 8px 0; padding: 8px 12px 8px 28px; background: #fff8e1; border: 1px solid #f3e0a0;
           border-radius: 4px; overflow-wrap: anywhere; }
ul.regime { margin: 4px 0; padding-left: 20px; overflow-wrap: anywhere; }
.tokens { display: flex; flex-wrap: wrap; gap: 4px; }
.tokcell { display: inline-flex; flex-direction: column; align-items: center; border: 1px solid var(--line);
           border-radius: 4px; padding: 1px 5px; font-size: 12px; }
.tok { white-space: pre; background: #f0f0f0; border-radius: 3px; padding: 0 2px; }
footer { margin-top: 28px; color: var(--muted); font-size: 12px; }
@media (max-width: 1000px) { .glance, .grid2, .grid3 { grid-template-columns: minmax(0, 1fr); } }
@media print {
  body { max-width: none; padding: 0; font-size: 11px; }
  .banner, table.points tr td, .ids span { -webkit-print-color-adjust: exact; print-color-adjust: exact; }
  table.points thead { display: table-header-group; }
  table.points tr { break-inside: avoid; }
  table.points thead th { position: static; }
  .noprint, nav, .filters { display: none; }
}
"""

# The page's one script (it works without it): click a column header to sort by it (numbers by their
# raw value); type in the filter box or pick a status to show only the matching rows of the full table.
SCRIPT = """
document.querySelectorAll("table.points thead th").forEach(function (th) {
  th.addEventListener("click", function () {
    var col = th.cellIndex, body = th.closest("table").tBodies[0], rows = Array.from(body.rows);
    var dir = th.dataset.dir === "asc" ? -1 : 1; th.dataset.dir = dir > 0 ? "asc" : "desc";
    function key(r) {
      var c = r.cells[col]; return c.dataset.v !== undefined ? parseFloat(c.dataset.v) : c.textContent;
    }
    rows.sort(function (a, b) { var x = key(a), y = key(b); return (x > y ? 1 : x < y ? -1 : 0) * dir; });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
(function () {
  var text = document.getElementById("filter-text"), status = document.getElementById("filter-status");
  var table = document.getElementById("all-points"), count = document.getElementById("filter-count");
  if (!text || !table) { return; }
  function apply() {
    var words = text.value.toLowerCase().split(/\\s+/).filter(Boolean), wanted = status.value, shown = 0;
    Array.from(table.tBodies[0].rows).forEach(function (r) {
      var name = r.cells[1].textContent.toLowerCase();
      var ok = words.every(function (w) { return name.indexOf(w) >= 0; }) &&
               (wanted === "" || r.classList.contains(wanted));
      r.hidden = !ok; if (ok) { shown += 1; }
    });
    count.textContent = shown + " shown";
  }
  text.addEventListener("input", apply);
  status.addEventListener("change", apply);
})();
"""

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" \
content="default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>tracer: {{ verdict_label }} — {{ comparison }}</title>
<style>{{ css | safe }}</style>
</head>
<body>
<header class="top">
<h1>tracer report</h1>
<p class="sub">{{ comparison }}</p>
<nav class="noprint">{% for anchor, title in sections %}<a href="#{{ anchor }}">{{ title }}</a>{% endfor %}</nav>
</header>

<div class="banner {{ verdict }}" id="verdict">
  <span class="verdict">{{ verdict_label }}</span>
  <span>{{ reference_label }} vs {{ candidate_label }} · fails when {{ tolerance }}</span>
  <p>{{ sentence }}{% if has_first_row %} <a class="noprint" href="#first-divergence">(row)</a>{% endif %}</p>
  {% if hints %}<ul class="hints">{% for hint in hints %}<li>hint: {{ hint }}</li>{% endfor %}</ul>{% endif %}
</div>

<div class="glance">
  {% if curve %}<figure>
    <img src="{{ curve.uri }}" alt="{{ curve.alt }}" width="{{ curve.width }}" id="curve">
    <figcaption>{{ curve.caption }}</figcaption>
  </figure>{% else %}<div></div>{% endif %}
  <div>
    {% if facts %}<table class="kv" id="facts">
      {% for key, value in facts %}<tr><th>{{ key }}</th><td>{{ value }}</td></tr>{% endfor %}
    </table>{% endif %}
    {% if steps %}<div class="next" id="next">
      <h3>Next</h3>
      {% for what, command in steps %}<p>{{ what }}:</p><pre>{{ command }}</pre>{% endfor %}
    </div>{% endif %}
  </div>
</div>
{% if notes %}
<ul class="notes">
  {% for note in notes %}<li>{{ note }}</li>{% endfor %}
</ul>
{% endif %}

{% if step_map %}
<h2 id="decode-steps">Decode steps × layers</h2>
{{ step_map | safe }}
{% endif %}

{% if routing_map %}
<h2 id="routing">Routing: layers × tokens</h2>
{{ routing_map | safe }}
{% endif %}

{% if regime %}
<h2 id="regime">Regime view</h2>
<ul class="regime">{% for line in regime %}<li>{{ line }}</li>{% endfor %}</ul>
{% if regime_cost %}
<table class="kv">
  <tr><th>where</th><th>the regime's own cost over f32 (largest rel_l2)</th></tr>
  {% for where, cost in regime_cost %}<tr><th>{{ where }}</th><td class="num">{{ cost }}</td></tr>{% endfor %}
</table>
{% endif %}
{% endif %}

{% if figures %}
<h2 id="figures">Where the error is made</h2>
{% for fig in figures %}
<figure>
  <img src="{{ fig.uri }}" alt="{{ fig.alt }}" width="{{ fig.width }}">
  <figcaption>{{ fig.caption }}</figcaption>
</figure>
{% endfor %}
{% endif %}

{% macro points_table(id, rows, why) %}
<table class="points" id="{{ id }}">
<thead><tr><th class="num">#</th><th>point</th><th class="num">layer</th><th>shape</th>
<th class="num">max|diff|</th><th class="num">max|ref|</th><th class="num">rel_l2</th>\
{% if has_local %}<th class="num" title="rel_l2 with its block rerun on the reference's inputs: the error made \
here, not inherited">local rel_l2</th>{% endif %}\
{% if has_bounds %}<th class="num" title="the rel_l2 this point may reach: a multiple of its rounding noise">\
tolerance</th>{% endif %}<th>status</th>{% if why %}<th>shown because</th>{% endif %}</tr></thead>
<tbody>
{% for r in rows %}<tr{% if r.css %} class="{{ r.css }}"{% endif %}\
{% if why and r.first %} id="first-divergence"{% endif %}>
<td class="num" data-v="{{ r.index }}">{{ r.index }}</td><td class="point">{{ r.point }}</td>
<td class="num">{{ r.layer }}</td><td class="mono">{{ r.shape }}</td>
{% for text, key in r.cells %}<td class="num" data-v="{{ key }}">{{ text }}</td>{% endfor %}
{% if has_local %}<td class="num" data-v="{{ r.local[1] }}">{{ r.local[0] }}</td>{% endif %}\
{% if has_bounds %}<td class="num" data-v="{{ r.bound[1] }}">{{ r.bound[0] }}</td>{% endif %}\
<td>{{ r.status }}</td>{% if why %}<td class="why">{{ r.why }}</td>{% endif %}</tr>
{% endfor %}
</tbody>
</table>
{% endmacro %}
{% if rows %}
<h2 id="points">Points <span class="muted">({{ key_rows | length }} of {{ rows | length }}: around the first \
divergence, the worst of each layer, NaN/Inf; all of them below and in points.csv)</span></h2>
<p class="muted noprint">Red rows are out of tolerance, the first divergence darker; grey rows were not
recorded on one side (never counted as a divergence). Click a column header to sort.</p>
{{ points_table("key-points", key_rows, true) }}
<details class="all" id="all">
<summary>All {{ rows | length }} points, in execution order</summary>
<div class="filters noprint">
  <input type="search" id="filter-text" placeholder="filter by name: q_rope, layers.3., mlp" aria-label="filter points">
  <select id="filter-status" aria-label="status">
    <option value="">every status</option><option value="diverged">diverged</option>
    <option value="ok">within tolerance</option><option value="missing">not recorded</option>
    <option value="nonfinite">NaN/Inf</option>
  </select>
  <span class="muted" id="filter-count"></span>
</div>
{{ points_table("all-points", rows, false) }}
</details>
{% endif %}

{% if audit %}
<h2 id="audit">Config audit</h2>
{% if audit.readers %}
{% if audit.resave %}<p class="muted">config.json as read after re-saving: \
<code>{{ audit.resave }}</code></p>{% endif %}
{% if audit.differences %}
<table class="audit">
<thead><tr><th>spec value</th>{% for name in audit.reader_names %}<th>{{ name }} reader</th>{% endfor %}</tr></thead>
<tbody>{% for key, values in audit.differences %}<tr class="differs"><td><code>{{ key }}</code></td>\
{% for value in values %}<td><code>{{ value }}</code></td>{% endfor %}</tr>{% endfor %}</tbody>
</table>
{% else %}<p>The readers agree on every spec value.</p>{% endif %}
<div class="grid2">
  {% for reader in audit.readers %}
  <div>
    <h3>{{ reader.name }} reader</h3>
    <table class="kv">
      {% if reader.error %}<tr><th>error</th><td>{{ reader.error }}</td></tr>{% endif %}
      <tr><th>reads</th><td>{% for key in reader.reads %}<code>{{ key }}</code>{% if not loop.last %}, {% endif %}\
{% else %}<span class="muted">none</span>{% endfor %}</td></tr>
      <tr><th>defaulted</th><td>{% for key, value in reader.defaulted %}<code>{{ key }}={{ value }}</code>\
{% if not loop.last %}, {% endif %}{% else %}<span class="muted">none</span>{% endfor %}</td></tr>
      <tr><th>ignored</th><td>{% for key in reader.ignored %}<code>{{ key }}</code>{% if not loop.last %}, {% endif %}\
{% else %}<span class="muted">none</span>{% endfor %}</td></tr>
    </table>
  </div>
  {% endfor %}
</div>
{% else %}<pre>{{ audit.raw }}</pre>{% endif %}
{% endif %}

{% if greedy %}
<h2 id="greedy">Greedy continuations</h2>
<div class="grid2">
  {% for side in greedy.sides %}
  <div>
    <h3>{{ side.label }} <span class="muted">({{ side.role }})</span></h3>
    <div class="text">{{ side.common }}{% if side.rest %}<mark>{{ side.rest }}</mark>{% endif %}</div>
    <p class="ids mono">{% for tok in side.ids %}<span{% if tok.css %} class="{{ tok.css }}"{% endif %}\
{% if tok.css == 'first' %} title="first differing token"{% endif %}>{{ tok.id }}</span>{% endfor %}</p>
  </div>
  {% endfor %}
</div>
{% endif %}

<h2 id="reproduce">Reproduce</h2>
{% if command %}<pre>{{ command }}</pre>{% else %}<p class="muted">No command recorded.</p>{% endif %}
<div class="grid2">
  {% for side in sides %}
  <div>
    <h3>{{ side.role }}: <code>{{ side.label }}</code></h3>
    <table class="kv">
      <tr><th>engine</th><td><code>{{ side.engine }}</code></td></tr>
      {% if side.device %}<tr><th>device</th><td><code>{{ side.device }}</code></td></tr>{% endif %}
      {% if side.runtime %}<tr><th>runtime</th><td><code>{{ side.runtime }}</code></td></tr>{% endif %}
      <tr><th>variant</th><td>{% for key, value in side.variant %}<code>{{ key }}={{ value }}</code>\
{% if not loop.last %}, {% endif %}{% else %}<span class="muted">none (defaults)</span>{% endfor %}</td></tr>
    </table>
  </div>
  {% endfor %}
</div>
<table class="kv">
  <tr><th>model</th><td><code>{{ model }}</code></td></tr>
  <tr><th>tolerance</th><td><code>{{ tolerance }}</code>{% for key, value in tolerance_params %} \
<span class="muted">{{ key }}</span> <code>{{ value }}</code>{% endfor %}</td></tr>
  {% if noise_floor %}<tr><th>noise floor</th><td>{{ noise_floor }}</td></tr>{% endif %}
  {% if prompt is not none %}<tr><th>prompt</th><td><pre>{{ prompt }}</pre></td></tr>{% endif %}
</table>
{% if chat %}<p>Fed through the model's chat template\
{% if chat.system is not none %} with a system message{% endif %} ({{ chat.tokens }} tokens):</p>\
<pre>{{ chat.text }}</pre>{% endif %}
<div class="tokens">{% for t in tokens %}<span class="tokcell"><span class="muted">{{ t.index }}</span>\
<span class="mono">{{ t.id }}</span>{% if has_token_texts %}<span class="tok">{{ t.text }}</span>{% endif %}\
</span>{% endfor %}</div>

<h2 id="environment">Environment</h2>
<p class="pairs">{% for key, value in environment %}<span><span class="muted">{{ key }}</span> \
<code>{{ value }}</code></span>{% endfor %}</p>
{% if timings %}<p class="pairs"><span class="muted">seconds:</span>{% for key, value in timings %}\
<span><span class="muted">{{ key }}</span> {{ value }}</span>{% endfor %}</p>{% endif %}

<footer>Generated by tracer {{ tracer_version }}. Self-contained: open offline, print, or attach to an issue.</footer>
{% if rows %}<script>{{ script | safe }}</script>{% endif %}
</body>
</html>
"""


# A triangulation's page (`tracer.reports.html.render_triangulation_html`): the sides, each candidate against the
# reference with a link to its own report, the odd one, and one agreement matrix per point shown.
TRIANGULATION_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" \
content="default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>tracer: {{ verdict_label }} — {{ title }}</title>
<style>{{ css | safe }}
td.agree { color: var(--ok); } td.differ { color: var(--bad); font-weight: 600; } td.blank { border: none; }
</style>
</head>
<body>
<header class="top">
<h1>tracer triangulation</h1>
<p class="sub">{{ title }}</p>
<nav class="noprint"><a href="#sides">sides</a><a href="#agreement">agreement</a><a href="#reproduce">reproduce</a>\
<a href="#environment">environment</a></nav>
</header>

<div class="banner {{ verdict }}" id="verdict">
  <span class="verdict">{{ verdict_label }}</span>
  <p>{{ sentence }}</p>
  {% if odd %}<p><b>{{ odd }}</b></p>{% endif %}
</div>

<h2 id="sides">Each candidate against the reference</h2>
<p class="muted">A point fails when {{ tolerance }}.</p>
<table>
<thead><tr><th></th><th>side</th><th>role</th><th>against the reference</th><th>its report</th></tr></thead>
<tbody>{% for side in sides %}<tr><td><b>{{ side.letter }}</b></td><td><code>{{ side.name }}</code></td>\
<td>{{ side.what }}</td><td>{{ side.against }}</td>\
<td>{% if side.link %}<a href="{{ side.link }}">report.html</a>{% endif %}</td></tr>
{% endfor %}</tbody>
</table>

<h2 id="agreement">Who agrees with whom</h2>
<p class="muted">Each cell is the rel_l2 of its row's side against its column's: ✓ within the bound, ✗ beyond it, \
— where a side did not record the point.</p>
{% for row in rows %}
<h3>at <code>{{ row.point }}</code>{{ row.rest }}</h3>
<p class="muted">{{ row.floor }}{% if row.odd %}; odd one here: <code>{{ row.odd }}</code>{% endif %}</p>
<table class="agreement">
<thead><tr>{% for head in row.header %}<th>{{ head }}</th>{% endfor %}</tr></thead>
<tbody>{% for cells in row.cells %}<tr>{% for c in cells %}<td class="num {{ c.css }}">{{ c.text }}</td>\
{% endfor %}</tr>
{% endfor %}</tbody>
</table>
{% for line in row.missing %}<p class="muted">not recorded: {{ line }}</p>{% endfor %}
{% endfor %}
{% if notes %}<h2 id="notes">Notes</h2>
<ul>{% for note in notes %}<li>{{ note }}</li>{% endfor %}</ul>{% endif %}

<h2 id="reproduce">Reproduce</h2>
{% if command %}<pre>{{ command }}</pre>{% else %}<p class="muted">No command recorded.</p>{% endif %}
<table class="kv">
  <tr><th>model</th><td><code>{{ model }}</code></td></tr>
  {% if prompt is not none %}<tr><th>prompt</th><td><pre>{{ prompt }}</pre></td></tr>{% endif %}
  <tr><th>token ids</th><td><code>{{ tokens }}</code></td></tr>
</table>

<h2 id="environment">Environment</h2>
<p class="pairs">{% for key, value in environment %}<span><span class="muted">{{ key }}</span> \
<code>{{ value }}</code></span>{% endfor %}</p>
{% if timings %}<p class="pairs"><span class="muted">seconds:</span>{% for key, value in timings %}\
<span><span class="muted">{{ key }}</span> {{ value }}</span>{% endfor %}</p>{% endif %}

<footer>Generated by tracer {{ tracer_version }}. Self-contained: open offline, print, or attach to an issue.</footer>
</body>
</html>
"""
