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
       color: #222; max-width: 1120px; margin: 0 auto; padding: 16px 24px 48px; }
h1 { font-size: 20px; margin: 4px 0 2px; }
h2 { font-size: 16px; margin: 28px 0 8px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
.sub { color: var(--muted); margin: 0 0 12px; overflow-wrap: anywhere; }
code, pre, .mono { font-family: ui-monospace, "SF Mono", Menlo, Consolas, monospace; font-size: 12.5px; }
pre { background: #f6f8fa; border: 1px solid var(--line); border-radius: 4px; padding: 8px 10px;
      white-space: pre-wrap; overflow-wrap: anywhere; }
.banner { border-radius: 6px; padding: 12px 16px; color: white; margin: 8px 0 4px; }
.banner .verdict { font-size: 20px; font-weight: 700; letter-spacing: .04em; margin-right: 10px; }
.banner p { margin: 6px 0 0; overflow-wrap: anywhere; }
.banner.match { background: var(--ok); }
.banner.diverged { background: var(--bad); }
.banner.error { background: var(--err); }
.banner code { color: inherit; font-weight: 600; }
.banner a { color: inherit; }
.banner ul.hints { margin: 6px 0 0; padding-left: 20px; }
table.audit tr.differs td { background: #fff3e0; }
table { border-collapse: collapse; margin: 4px 0; }
th, td { padding: 3px 9px; border-bottom: 1px solid #eee; text-align: left; vertical-align: top; }
th { background: #f3f3f3; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.kv th { background: none; color: var(--muted); font-weight: 500; padding-left: 0; }
.grid2 { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; }
.grid2 > div { min-width: 0; }
figure { margin: 10px 0; page-break-inside: avoid; break-inside: avoid; }
figure img { max-width: 100%; height: auto; border: 1px solid var(--line); }
figcaption { color: var(--muted); font-size: 12.5px; }
#points { font-size: 12.5px; width: 100%; }
#points thead th { position: sticky; top: 0; cursor: pointer; }
#points tr.diverged td { background: #fdecea; }
#points tr.first td { background: #f9c9c4; font-weight: 600; }
#points tr.missing td { color: #9a9a9a; background: #f7f7f7; font-style: italic; }
#points tr.block td { border-top: 2px solid #cfcfcf; }
#points td.point { font-family: ui-monospace, Menlo, Consolas, monospace; overflow-wrap: anywhere; }
.ids span { display: inline-block; padding: 0 3px; margin: 1px; border-radius: 3px; background: #f0f0f0; }
.ids span.first { background: var(--bad); color: white; font-weight: 700; }
.ids span.after { background: #fdecea; }
.text { white-space: pre-wrap; overflow-wrap: anywhere; border: 1px solid var(--line);
        border-radius: 4px; padding: 8px 10px; background: #fcfcfc; }
mark { background: #f9c9c4; }
.muted { color: var(--muted); }
ul.notes { margin: 8px 0; padding: 8px 12px 8px 28px; background: #fff8e1; border: 1px solid #f3e0a0;
           border-radius: 4px; overflow-wrap: anywhere; }
.tokens { display: flex; flex-wrap: wrap; gap: 4px; }
.tokcell { display: inline-flex; flex-direction: column; align-items: center; border: 1px solid var(--line);
           border-radius: 4px; padding: 2px 6px; font-size: 12px; }
.tok { white-space: pre; background: #f0f0f0; border-radius: 3px; padding: 0 2px; }
footer { margin-top: 32px; color: var(--muted); font-size: 12px; }
@media print {
  body { max-width: none; padding: 0; font-size: 11px; }
  .banner, #points tr td, .ids span { -webkit-print-color-adjust: exact; print-color-adjust: exact; }
  #points thead { display: table-header-group; }
  #points tr { break-inside: avoid; }
  #points thead th { position: static; }
  .noprint { display: none; }
}
"""

# Click a column header to sort by it (numbers by their raw value); the page works without it.
SORT_SCRIPT = """
document.querySelectorAll("#points thead th").forEach(function (th, col) {
  th.addEventListener("click", function () {
    var body = th.closest("table").tBodies[0], rows = Array.from(body.rows);
    var dir = th.dataset.dir === "asc" ? -1 : 1; th.dataset.dir = dir > 0 ? "asc" : "desc";
    function key(r) {
      var c = r.cells[col]; return c.dataset.v !== undefined ? parseFloat(c.dataset.v) : c.textContent;
    }
    rows.sort(function (a, b) { var x = key(a), y = key(b); return (x > y ? 1 : x < y ? -1 : 0) * dir; });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
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
<h1>tracer report</h1>
<p class="sub">{{ comparison }}</p>

<div class="banner {{ verdict }}">
  <span class="verdict">{{ verdict_label }}</span>
  <span>{{ reference_label }} vs {{ candidate_label }} · fails when {{ tolerance }}</span>
  <p>{{ sentence }}{% if has_first_row %} <a class="noprint" href="#first-divergence">(row)</a>{% endif %}</p>
  {% if hints %}<ul class="hints">{% for hint in hints %}<li>{{ hint }}</li>{% endfor %}</ul>{% endif %}
</div>
{% if regime %}
<h2>Regime view</h2>
<ul>{% for line in regime %}<li>{{ line }}</li>{% endfor %}</ul>
{% if regime_cost %}
<table class="kv">
  <tr><th>where</th><th>the regime's own cost over f32 (largest rel_l2)</th></tr>
  {% for where, cost in regime_cost %}<tr><th>{{ where }}</th><td class="num">{{ cost }}</td></tr>{% endfor %}
</table>
{% endif %}
{% endif %}
{% if notes %}
<ul class="notes">
  {% for note in notes %}<li>{{ note }}</li>{% endfor %}
</ul>
{% endif %}

{% if logits or greedy %}
<h2>Outputs</h2>
<div class="grid2">
  {% if logits %}<div>
  <table class="kv">
    {% for key, value in logits %}<tr><th>{{ key }}</th><td class="num">{{ value }}</td></tr>{% endfor %}
  </table></div>{% endif %}
  {% if greedy %}<div>
  <table class="kv">
    <tr><th>greedy continuation</th><td>{{ greedy.prefix_text }}</td></tr>
  </table></div>{% endif %}
</div>
{% endif %}

{% if figures %}
<h2>Figures</h2>
{% for fig in figures %}
<figure>
  <img src="{{ fig.uri }}" alt="{{ fig.alt }}" width="{{ fig.width }}">
  <figcaption>{{ fig.caption }}</figcaption>
</figure>
{% endfor %}
{% endif %}

{% if greedy %}
<h2>Greedy continuations</h2>
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

{% if rows %}
<h2>Points <span class="muted">({{ rows | length }}, execution order)</span></h2>
<p class="muted noprint">Click a column header to sort. Red rows are out of tolerance, the first
divergence is darker; grey rows were not recorded on one side (never counted as a divergence).</p>
<table id="points">
<thead><tr><th class="num">#</th><th>point</th><th class="num">layer</th><th>shape</th>
<th class="num">max|diff|</th><th class="num">max|ref|</th><th class="num">rel_l2</th>
<th class="num">cosine</th>{% if has_bounds %}\
<th class="num" title="the rel_l2 this point may reach: a multiple of its rounding noise">tolerance</th>{% endif %}\
<th>status</th></tr></thead>
<tbody>
{% for r in rows %}<tr{% if r.css %} class="{{ r.css }}"{% endif %}{% if r.first %} id="first-divergence"{% endif %}>
<td class="num" data-v="{{ r.index }}">{{ r.index }}</td><td class="point">{{ r.point }}</td>
<td class="num">{{ r.layer }}</td><td class="mono">{{ r.shape }}</td>
{% for text, key in r.cells %}<td class="num" data-v="{{ key }}">{{ text }}</td>{% endfor %}
{% if has_bounds %}<td class="num" data-v="{{ r.bound[1] }}">{{ r.bound[0] }}</td>{% endif %}\
<td>{{ r.status }}</td></tr>
{% endfor %}
</tbody>
</table>
{% endif %}

{% if audit %}
<h2>Config audit</h2>
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

<h2>Settings</h2>
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
  <tr><th>tolerance</th><td><code>{{ tolerance }}</code></td></tr>
  {% for key, value in tolerance_params %}<tr><th>{{ key }}</th><td><code>{{ value }}</code></td></tr>{% endfor %}
</table>

<h2>Input</h2>
{% if prompt is not none %}<p>Prompt:</p><pre>{{ prompt }}</pre>{% endif %}
{% if chat %}<p>Fed through the model's chat template\
{% if chat.system is not none %} with a system message{% endif %} ({{ chat.tokens }} tokens):</p>\
<pre>{{ chat.text }}</pre>{% endif %}
<div class="tokens">{% for t in tokens %}<span class="tokcell"><span class="muted">{{ t.index }}</span>\
<span class="mono">{{ t.id }}</span>{% if has_token_texts %}<span class="tok">{{ t.text }}</span>{% endif %}\
</span>{% endfor %}</div>

<h2>Reproduce</h2>
{% if command %}<pre>{{ command }}</pre>{% else %}<p class="muted">No command recorded.</p>{% endif %}

<h2>Environment</h2>
<div class="grid2">
  <table class="kv">{% for key, value in environment %}\
<tr><th>{{ key }}</th><td><code>{{ value }}</code></td></tr>{% endfor %}</table>
  {% if timings %}<table class="kv">{% for key, value in timings %}\
<tr><th>{{ key }}</th><td class="num">{{ value }}</td></tr>{% endfor %}</table>{% endif %}
</div>

<footer>Generated by tracer {{ tracer_version }}. Self-contained: open offline, print, or attach to an issue.</footer>
{% if rows %}<script>{{ script | safe }}</script>{% endif %}
</body>
</html>
"""
