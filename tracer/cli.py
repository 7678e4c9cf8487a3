"""`tracer` on the command line: a thin map over the pipeline's commands (`tracer.pipeline.commands`),
which the API's functions call too.

Each command's flags become its `Request` (`tracer.pipeline.request`), checked as it is built, before
torch loads. A mistake the user can make is one line on stderr and exit code 2; `--json -` prints
exactly one JSON object on stdout and nothing else there.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
from pathlib import Path

from tracer.arguments import DEFAULT_OUT, DEFAULT_SWEEP_OUT, build_parser, noise_floor_of  # noqa: F401 - DEFAULT_OUT: re-exported
from tracer.comparison.result import Tolerance
from tracer.core.allocator import reuse_freed_memory
from tracer.core.errors import TracerError, printable, unknown_name
from tracer.engines.registry import ABSENT, DIFFERS, MATCH, NOT_YET, check_engine, engines_honouring, registered
from tracer.files.sources import resolve_model
from tracer.model.config import audit, load_config
from tracer.model.families import FAMILIES
from tracer.model.knobs import KNOBS, PRESETS, knobs_for, variant_text
from tracer.model.points import FUSED_AWAY
from tracer.pipeline.request import (
    DEFAULT_PROMPT,
    RUN_REPORT,
    SWEEP_REPORT,
    Inputs,
    Outputs,
    Placement,
    Request,
    Side,
    candidate_sides,
    check_tolerance,
    one_candidate,
    sweep_candidate,
    writable_file,
)
from tracer.reports.drawers import start_drawers, stop_drawers
from tracer.reports.terminal import (
    command_lines,
    sweep_summary,
    table,
    terminal_summary,
    terminal_width,
    wrap,
    wrapped,
)


def inputs_of(args) -> Inputs:
    """The `Inputs` value of a command's flags (the prompt file read here, a bad one said in one line)."""
    prompt = args.prompt
    if args.prompt_file is not None:
        try:
            prompt = args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TracerError(f"cannot read prompt file {args.prompt_file}: {getattr(exc, 'strerror', None) or exc}") \
                from None
    return Inputs(model=args.model, prompt=DEFAULT_PROMPT if prompt is None and args.tokens is None else prompt,
                  tokens=args.tokens, chat=args.chat, system=args.system,
                  max_tokens=getattr(args, "max_tokens", None), position_offset=getattr(args, "position_offset", 0),
                  decode=getattr(args, "decode", 0), batch=getattr(args, "batch", 1))


def placement_of(args, by_size: bool = True) -> Placement:
    """The `Placement` of a command's flags; without --stream or --no-stream, streaming is chosen by the model's
    size where the command prepares a reference (`by_size`: run, sweep, diagnose), else off (record, quality)."""
    if args.stream and getattr(args, "no_stream", False):
        raise TracerError("--stream and --no-stream contradict each other; give one")
    stream = True if args.stream else False if getattr(args, "no_stream", False) or not by_size else None
    return Placement(device=args.device, stream=stream, offload=args.offload, max_memory=args.max_memory)


def outputs_of(args, kind: tuple[str, str] = RUN_REPORT) -> Outputs:
    report = getattr(args, "out", None)
    return Outputs(report=None if getattr(args, "no_report", False) else report, json=getattr(args, "json", None),
                   trace=getattr(args, "output", None), kind=kind)


def cmd_run(args) -> int:
    inputs, placement, outputs = inputs_of(args), placement_of(args), outputs_of(args)
    check_tolerance(args.atol, args.rtol)
    one, several = candidate_sides(args.candidate, args.variant)
    request = Request(inputs, placement, Side.of(args.reference, args.reference_variant), one, outputs,
                      Tolerance(atol=args.atol, rtol=args.rtol), greedy=args.greedy, noise_floor=noise_floor_of(args),
                      regime=args.regime, command=_command_line(), progress=args.json != "-", candidates=several)
    if outputs.report is not None:
        start_drawers()  # forked while this is one thread with no torch: matplotlib loads beside the run
    from tracer.pipeline import commands  # torch loads only now, every argument checked

    result = commands.run(request)
    if args.json:
        _write_json(result.to_dict(), args.json)
    if args.json != "-":
        print(terminal_summary(result, outputs.report))
    return _exit_code(result, args)


def cmd_compare(args) -> int:
    outputs = outputs_of(args)
    check_tolerance(args.atol, args.rtol)
    candidate = args.candidate[0] if len(args.candidate) == 1 else args.candidate
    from tracer.pipeline import commands  # torch loads only now, every argument checked

    result = commands.compare_files(args.reference, candidate, tolerance=Tolerance(atol=args.atol, rtol=args.rtol),
                                    aliases=args.aliases, outputs=outputs, command=_command_line(),
                                    shard_layout=args.shard_layout)
    if args.json:
        _write_json(result.to_dict(), args.json)
    if args.json != "-":
        print(terminal_summary(result, outputs.report))
    return _exit_code(result, args)


def _exit_code(result, args) -> int:
    """1 for a divergence when asked (porting CI): a triangulation's verdict is "diverged" when any candidate
    diverges from the reference, whichever side is the odd one; 2 stays for user errors."""
    return 1 if args.fail_on_divergence and result.verdict == "diverged" else 0


def cmd_record(args) -> int:
    inputs, placement, outputs = inputs_of(args), placement_of(args, by_size=False), outputs_of(args)
    request = Request(inputs, placement, Side.of(args.engine, args.variant), outputs=outputs)
    from tracer.pipeline import commands  # torch loads only now, every argument checked

    trace = commands.record(request)
    if inputs.batch > 1:  # one file per row: OUT.row0.safetensors, ...
        output = Path(args.output)
        for row, one in enumerate(trace):
            path = one.save(output.with_name(f"{output.stem}.row{row}{output.suffix}"))
            print(f"{one.label}: row {row}, {len(one)} points on {len(one.tokens)} tokens -> {path}")
        return 0
    trace.save(args.output)
    steps = f" and {len(trace.steps)} decode steps" if trace.steps else ""
    print(f"{trace.label}: {len(trace)} points on {len(trace.tokens)} tokens{steps} -> {args.output}")
    return 0


def cmd_variants(args) -> int:
    if args.family is not None and args.family not in FAMILIES:
        raise TracerError(unknown_name("family", args.family, FAMILIES, "`tracer variants`"))
    knobs = knobs_for(args.family) if args.family else list(KNOBS.values())
    rows = [(k.name, k.accepted, ", ".join(engines_honouring(k.name))) for k in knobs]
    only = {k.name: "" if k.families is None or args.family else f" · {', '.join(k.families)} only" for k in knobs}
    lines = table(("knob", "values", "engines"), rows,
                  details=[f"default {k.default}{only[k.name]} · reproduces {k.reproduces}" for k in knobs])
    if args.family:
        family = FAMILIES[args.family]
        lines += ["", f"{family.title}: {family.adds}"]
        lines += [f"  {knob.representative(None) or knob.name}: first divergence {knob.expected}"
                  for knob in knobs if knob.expected]
    else:
        lines += ["", "families and their own knobs (`tracer variants --family NAME` for one):"]
        lines += table(("family", "", "its own knobs"),
                       [(name, family.title, ", ".join(k.name for k in knobs_for(name) if k.families is not None))
                        for name, family in FAMILIES.items()])
    lines.append("")
    lines += [f"preset={name} stands for {variant_text(preset)} (explicit knobs override it; Llama only)"
              for name, preset in PRESETS.items()]
    lines.append("knobs combine: --variant theta=10000,rope=interleaved")
    print(wrapped(lines))
    return 0


def cmd_engines(args) -> int:
    lines = table(("engine", "runtime", "devices"),
                  [(e.usage, _runtime(e), ", ".join(e.devices)) for e in registered().values()])
    lines += ["", *_matrix_lines()]
    for entry in registered().values():
        fused = f" but {', '.join(FUSED_AWAY)} under fused attention ({entry.fused_attention})"
        abilities = [("local (teacher-forced) errors", entry.local_errors), ("greedy decoding", entry.logits),
                     ("a cached draft", entry.draft), ("streamed weights", entry.stream),
                     ("--decode", entry.decode), ("--position-offset", entry.positions), ("--batch", entry.batch)]
        lines += ["", *wrap(f"{entry.usage}: {entry.summary}"), *_runtime_lines(entry)]
        for key, value in (("knobs", ", ".join(entry.honoured) or "none"),
                           ("records", f"every point{fused if entry.fused_attention else ''}"),
                           ("can", ", ".join(name for name, able in abilities if able) or "compare only")):
            lines += wrap(f"  {key:<9}{value}", hang=9)
    print("\n".join(lines))
    return 0


def _matrix_lines() -> list[str]:
    """`tracer engines`' engine × family matrix (each engine's registry entry, cell by cell), then what
    each cell that is neither a match nor not yet says."""
    engines = registered().values()
    lines = []
    for group in _family_groups(engines):  # as many families side by side as the terminal holds
        lines += table(("engine × family", *group), [(e.usage, *(e.cell(family) for family in group))
                                                     for e in engines])
    lines += wrap(f"{MATCH}: traced point for point · {DIFFERS}: traced, the runtime computes it otherwise by "
                  f"its own design · {ABSENT}: the runtime has no such model · {NOT_YET}: refused until its cell "
                  "matches", hang=2)
    for entry in engines:
        for family in FAMILIES:
            for difference in entry.differences_on(family):
                when = f" ({difference.condition})" if difference.condition else ""
                lines += wrap(f"  {entry.name} × {family}: {DIFFERS} at {difference.point}{when}: {difference.what}",
                              hang=4)
            if entry.cell(family) == ABSENT:
                lines += wrap(f"  {entry.refusal(family)}", hang=4)
    return lines


def _family_groups(engines) -> list[list[str]]:
    """The families in registration order, cut into groups whose columns fit the terminal's width beside
    the engines' column (a cell's longest word never wraps)."""
    width, first = terminal_width(), max(len("engine × family"), *(len(e.usage) for e in engines))
    groups, used = [[]], first
    for family in FAMILIES:
        words = [family, *(word for e in engines for word in e.cell(family).split())]
        column = 2 + max(map(len, words))
        if groups[-1] and used + column > width:
            groups.append([])
            used = first
        groups[-1].append(family)
        used += column
    return groups


def _runtime(entry) -> str:
    versions = ", ".join(f"{dist} {version}" for dist, version in entry.runtime_versions().items() if version)
    return "not installed" if entry.missing_runtime() else versions or "built in"


def _runtime_lines(entry) -> list[str]:
    """`tracer engines`' runtime line; a missing one with the README's install command, on lines of its
    own (split where a shell joins them) when it does not fit beside the words."""
    if not entry.missing_runtime():
        return wrap(f"  runtime  installed ({_runtime(entry)})", hang=9)
    said = "  runtime  not installed" + (f" ({entry.install_note})" if entry.install_note else "") + ":"
    if len(f"{said} {entry.install}") <= terminal_width():
        return [f"{said} {entry.install}"]
    return [*wrap(said, hang=9), *command_lines(entry.install, indent=" " * 11)]


def cmd_sweep(args) -> int:
    inputs, placement, outputs = inputs_of(args), placement_of(args), outputs_of(args, SWEEP_REPORT)
    request = Request(inputs, placement, Side.of(args.reference, args.reference_variant),
                      sweep_candidate(args.candidate), outputs, greedy=args.greedy,
                      noise_floor=noise_floor_of(args), variants=args.variants, command=_command_line(),
                      progress=args.json != "-")
    from tracer.pipeline import commands  # torch loads only now, every argument checked

    result = commands.sweep(request)
    if args.json:
        _write_json(result.to_dict(), args.json)
    if args.json != "-":
        print(sweep_summary(result, outputs.report))
    return 0


def cmd_diagnose(args) -> int:
    placement, _ = placement_of(args), outputs_of(args)
    request = Request(Inputs(model=args.model, decode=args.decode), placement, variants=args.variants,
                      progress=args.json != "-")
    for knobs in request.variants or ():
        check_engine(knobs, "reimpl")  # the variants run on tracer's model: a knob it cannot honour, said now
    from tracer.pipeline import commands  # torch loads only now, every argument checked

    result = commands.diagnose(request, args.trace)
    if args.json:
        _write_json(result.to_dict(), args.json)
    if args.json != "-":
        first = result.observed.first_divergence
        lines = [f"observed: {result.observed.verdict}" + (f", first divergence {first.point}" if first else "")]
        lines += table(("", "variant", "resemblance", "its verdict"),
                       [(f"{rank}.", entry["variant"], f"{entry['score']:.2f}", entry["verdict"] + (
                           f", from {entry['first_divergence']}" if entry["first_divergence"] else ""))
                        for rank, entry in enumerate(result.ranking[:5], 1)])
        if result.best:
            lines.append(f"your trace behaves most like {result.best['variant']}")
        elif result.ranking:
            lines.append("no planted mistake reproduces it: the closest ones change nothing on this model")
        print(wrapped(lines))
    return 0


def cmd_quality(args) -> int:
    placement = placement_of(args, by_size=False)
    outputs_of(args)
    if args.markdown not in (None, "-"):
        writable_file(args.markdown, "--markdown")
    if args.json == "-" and args.markdown == "-":
        raise TracerError("--json - and --markdown - both want stdout: write one of them to a file")
    text = None
    if args.text is not None:
        try:
            text = args.text.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TracerError(f"cannot read text file {args.text}: {getattr(exc, 'strerror', None) or exc}") from None
    request = Request(Inputs(model=args.model, prompt=text, tokens=args.tokens), placement,
                      Side.of(args.reference, args.reference_variant),
                      Side.of(one_candidate(args.candidate, "quality"), args.variant),
                      command=_command_line(), progress=args.json != "-" and args.markdown != "-")
    from tracer.pipeline import commands  # torch loads only now, every argument checked
    from tracer.reports.quality import quality_markdown, quality_text  # jinja2, for Markdown: quality's only

    result = commands.quality(request, ctx=args.ctx, chunks=args.chunks, by_layer=args.by_layer,
                              text_name=args.text.name if args.text else "<tokens>")
    summary = result.to_dict()
    if args.json:
        _write_json(summary, args.json)
    if args.markdown:
        _write_text(quality_markdown(summary), args.markdown)
    if "-" not in (args.json, args.markdown):
        print(quality_text(summary))
    return 0


def cmd_config(args) -> int:
    outputs_of(args)

    report = audit(load_config(resolve_model(args.model, progress=args.json != "-")), args.resave)
    if args.json:
        _write_json(report, args.json)
    if args.json != "-":
        print(_audit_text(report))
    return 0


def _audit_text(report: dict) -> str:
    lines = [] if report["resave"] == "none" else [f"config as re-saved by transformers 5 (resave={report['resave']})"]
    for name, entry in report["readers"].items():
        lines.append(f"{name} reader:")
        if entry["error"]:
            lines.append(f"  error: {entry['error']}")
        lines.append(f"  reads      {', '.join(entry['reads']) or '-'}")
        defaulted = ", ".join(f"{k}={json.dumps(v)}" for k, v in entry["defaulted"].items())
        lines.append(f"  defaults   {defaulted or '-'}")
        lines.append(f"  ignores    {', '.join(entry['ignored']) or '-'}")
    differences = report["differences"]
    lines.append("readers differ on: " + ("; ".join(
        f"{key} " + ", ".join(f"{reader} {json.dumps(value)}" for reader, value in values.items())
        for key, values in differences.items()) if differences else "nothing"))
    return "\n".join(piece for line in lines for piece in wrap(line, hang=11 if line.startswith("  ") else 4))


def _command_line() -> str:
    return shlex.join(["tracer", *sys.argv[1:]])


def _write_json(payload: dict, target: str) -> None:
    text = json.dumps(payload, indent=2)
    if target == "-":
        _STDOUT[0].write(text + "\n")
        return
    try:
        Path(target).write_text(text + "\n")
    except (OSError, ValueError) as exc:  # ValueError: a name no file can have (a NUL byte)
        raise TracerError(f"cannot write JSON to {target}: {getattr(exc, 'strerror', None) or exc}") from None


def _write_text(text: str, target: str) -> None:
    if target == "-":
        _STDOUT[0].write(text)
        return
    try:
        Path(target).write_text(text)
    except (OSError, ValueError) as exc:  # ValueError: a name no file can have (a NUL byte)
        raise TracerError(f"cannot write {target}: {getattr(exc, 'strerror', None) or exc}") from None


def _error_payload(message: str) -> dict:
    return {"verdict": "error", "error": message, "command": _command_line(),
            "first_divergence": None, "points": [], "logits": None, "greedy": None}


_STDOUT = [sys.stdout]  # the real stdout, kept while library output is redirected to stderr
COMMANDS = {"run": cmd_run, "compare": cmd_compare, "record": cmd_record, "variants": cmd_variants,
            "engines": cmd_engines, "sweep": cmd_sweep, "config": cmd_config, "diagnose": cmd_diagnose,
            "quality": cmd_quality}


def main(argv: list[str] | None = None) -> int:
    args = None
    _STDOUT[0] = sys.stdout
    try:
        args = build_parser().parse_args(argv)
        # With --json -, stdout carries the JSON object alone: anything a library prints goes to stderr.
        quiet = "-" in (getattr(args, "json", None), getattr(args, "markdown", None))
        with contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext():
            return COMMANDS[args.command](args)
    except TracerError as exc:
        message = printable(str(exc))
        print(f"tracer: error: {message}", file=sys.stderr)
        if args is not None and getattr(args, "json", None):
            with contextlib.suppress(TracerError):  # an unwritable --json FILE was said above
                _write_json(_error_payload(message), args.json)
        return 2
    except KeyboardInterrupt:
        print("tracer: interrupted", file=sys.stderr)
        return 130
    finally:
        stop_drawers()  # those a failed run never handed its report to


def console_main() -> int:
    """The `tracer` command: `main` in a process of its own, whose allocator it may tune."""
    reuse_freed_memory()
    return main()


if __name__ == "__main__":
    sys.exit(console_main())
