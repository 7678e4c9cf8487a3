"""`tracer` on the command line: a thin map over `tracer.api`.

A mistake the user can make is one line on stderr and exit code 2; `--json -` prints exactly
one JSON object on stdout and nothing else there.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
from pathlib import Path

from tracer.arguments import DEFAULT_OUT, DEFAULT_SWEEP_OUT, build_parser  # noqa: F401 - DEFAULT_OUT: re-exported
from tracer.errors import TracerError
from tracer.model.knobs import parse_variant
from tracer.request import (
    DEFAULT_PROMPT,
    RUN_REPORT,
    SWEEP_REPORT,
    Inputs,
    Outputs,
    Placement,
    check_engines,
    check_greedy,
    check_tolerance,
    regime_knobs,
)
from tracer.result import Tolerance


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
                  max_tokens=getattr(args, "max_tokens", None), position_offset=getattr(args, "position_offset", 0))


def placement_of(args) -> Placement:
    return Placement(device=args.device, stream=args.stream, offload=args.offload, max_memory=args.max_memory)


def outputs_of(args, kind: tuple[str, str] = RUN_REPORT) -> Outputs:
    report = getattr(args, "out", None)
    return Outputs(report=None if getattr(args, "no_report", False) else report, json=getattr(args, "json", None),
                   trace=getattr(args, "output", None), kind=kind)


def cmd_run(args) -> int:
    inputs, placement, outputs = inputs_of(args), placement_of(args), outputs_of(args)
    check_tolerance(args.atol, args.rtol)
    variant, reference_variant = parse_variant(args.variant), parse_variant(args.reference_variant)
    check_engines(args.reference, args.candidate, variant, reference_variant)
    check_greedy(args.greedy)
    regime = regime_knobs(args.regime)
    if outputs.report is not None:
        from tracer.reports.drawers import start_drawers

        start_drawers()  # forked while this is one thread with no torch: matplotlib loads beside the run
    from tracer.api import run_values  # every argument checked: only now does torch load
    from tracer.reports.terminal import terminal_summary

    result = run_values(inputs, placement, outputs, reference=args.reference, candidate=args.candidate,
                        variant=variant, reference_variant=reference_variant,
                        tolerance=Tolerance(atol=args.atol, rtol=args.rtol), greedy=args.greedy,
                        noise_floor=not args.no_noise, regime=regime, command=_command_line(),
                        progress=args.json != "-")
    if args.json:
        _write_json(result.to_dict(), args.json)
    if args.json != "-":
        print(terminal_summary(result, outputs.report))
    return _exit_code(result, args)


def cmd_compare(args) -> int:
    import tracer
    from tracer.reports.terminal import terminal_summary

    outputs = outputs_of(args)
    check_tolerance(args.atol, args.rtol)
    result = tracer.compare_files(args.reference, args.candidate, atol=args.atol, rtol=args.rtol,
                                  aliases=args.aliases, out=outputs.report, command=_command_line())
    if args.json:
        _write_json(result.to_dict(), args.json)
    if args.json != "-":
        print(terminal_summary(result, outputs.report))
    return _exit_code(result, args)


def _exit_code(result, args) -> int:
    """1 for a divergence when asked (porting CI); 2 stays for user errors."""
    return 1 if args.fail_on_divergence and result.verdict == "diverged" else 0


def cmd_record(args) -> int:
    inputs, placement, _ = inputs_of(args), placement_of(args), outputs_of(args)
    variant = parse_variant(args.variant)
    check_engines(None, args.engine, variant, {})
    from tracer.api import record_values

    trace = record_values(inputs, placement, args.engine, variant)
    trace.save(args.output)
    print(f"{trace.label}: {len(trace)} points on {len(trace.tokens)} tokens -> {args.output}")
    return 0


def cmd_variants(args) -> int:
    from tracer.engines.registry import engines_honouring
    from tracer.model.families import FAMILIES
    from tracer.model.knobs import KNOBS, PRESETS, knobs_for, variant_text

    if args.family is not None and args.family not in FAMILIES:
        raise TracerError(f"unknown family {args.family!r}; families: {', '.join(FAMILIES)}")
    knobs = knobs_for(args.family) if args.family else list(KNOBS.values())
    rows = [("knob", "values", "default", "engines", "families", "reproduces")]
    rows += [(k.name, k.accepted, k.default, ", ".join(engines_honouring(k.name)),
              "all" if k.families is None else ",".join(k.families),
              k.reproduces) for k in knobs]
    _print_columns(rows)
    if args.family:
        family = FAMILIES[args.family]
        print(f"\n{family.title}: {family.adds}")
        for knob in (k for k in knobs if k.expected):
            print(f"  {knob.representative(None) or knob.name}: first divergence {knob.expected}")
    else:
        print("\nfamilies and their own knobs (`tracer variants --family NAME` for one):")
        _print_columns([(name, family.title, ", ".join(k.name for k in knobs_for(name) if k.families is not None))
                        for name, family in FAMILIES.items()])
    for name, preset in PRESETS.items():
        print(f"\npreset={name} stands for {variant_text(preset)} (explicit knobs override it; Llama only)")
    print("knobs combine: --variant theta=10000,rope=interleaved")
    return 0


def _print_columns(rows: list[tuple]) -> None:
    """Rows of text cells, every column but the last padded to its widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])


def cmd_engines(args) -> int:
    from tracer.engines.registry import ENGINES
    from tracer.model.points import FUSED_AWAY

    for entry in ENGINES.values():
        missing = entry.missing_runtime()
        versions = ", ".join(f"{dist} {version}" for dist, version in entry.runtime_versions().items() if version)
        installed = (f"not installed: pip install -e '.[{entry.extra}]'" if missing and entry.extra
                     else f"not installed: {', '.join(missing)}" if missing
                     else f"installed ({versions or 'built in'})")
        print(f"{entry.usage}: {entry.summary}")
        print(f"  runtime    {installed}")
        print(f"  knobs      {', '.join(entry.honoured) or 'none'}")
        fused = f" but {', '.join(FUSED_AWAY)} under fused attention ({entry.fused_attention})"
        fused = fused if entry.fused_attention else ""
        print(f"  records    every point{fused}")
        abilities = [("local (teacher-forced) errors", entry.local_errors), ("greedy decoding", entry.logits),
                     ("a cached draft", entry.draft), ("streamed weights", entry.stream)]
        print(f"  can        {', '.join(name for name, able in abilities if able) or 'compare only'}")
        print(f"  devices    {', '.join(entry.devices)}")
        print(f"  families   {'all' if entry.families is None else ', '.join(entry.families)}")
    return 0


def cmd_sweep(args) -> int:
    from tracer.catalogue import split_variants

    inputs, placement, outputs = inputs_of(args), placement_of(args), outputs_of(args, SWEEP_REPORT)
    reference_variant = parse_variant(args.reference_variant)
    check_engines(args.reference, args.candidate, {}, reference_variant)
    for text in split_variants(args.variants) if args.variants else []:
        parse_variant(text)  # a knob the candidate cannot honour is that row's error, said in the table
    check_greedy(args.greedy)
    from tracer.api import sweep_values
    from tracer.reports.sweep import sweep_markdown

    result = sweep_values(inputs, placement, outputs, variants=args.variants, reference=args.reference,
                          reference_variant=reference_variant, candidate=args.candidate, greedy=args.greedy,
                          noise_floor=not args.no_noise, command=_command_line(), progress=args.json != "-")
    if args.json:
        _write_json(result.to_dict(), args.json)
    if args.json != "-":
        print(sweep_markdown(result), end="")
        print(f"{len(result.rows)} variants in {sum(result.timings.values()):.1f} s"
              + ("" if outputs.report is None else f"; report: {Path(outputs.report) / 'sweep.html'}"))
    return 0


def cmd_diagnose(args) -> int:
    placement, _ = placement_of(args), outputs_of(args)
    inputs = Inputs(model=args.model)
    if args.variants:
        from tracer.catalogue import split_variants

        for text in split_variants(args.variants):
            check_engines(None, "reimpl", parse_variant(text), {})
    from tracer.api import diagnose_values

    result = diagnose_values(args.trace, inputs, placement, variants=args.variants or None,
                             progress=args.json != "-")
    if args.json:
        _write_json(result.to_dict(), args.json)
    if args.json != "-":
        first = result.observed.first_divergence
        print(f"observed: {result.observed.verdict}" + (f", first divergence {first.point}" if first else ""))
        for rank, entry in enumerate(result.ranking[:5], 1):
            print(f"  {rank}. {entry['variant']:<28} resemblance {entry['score']:.2f}  "
                  f"({entry['verdict']}{', from ' + entry['first_divergence'] if entry['first_divergence'] else ''})")
        if result.best:
            print(f"your trace behaves most like {result.best['variant']}")
    return 0


def cmd_config(args) -> int:
    from tracer.model.config import audit, load_config
    from tracer.sources import resolve_model

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
    return "\n".join(lines)


def _command_line() -> str:
    return shlex.join(["tracer", *sys.argv[1:]])


def _write_json(payload: dict, target: str) -> None:
    text = json.dumps(payload, indent=2)
    if target == "-":
        _STDOUT[0].write(text + "\n")
        return
    try:
        Path(target).write_text(text + "\n")
    except OSError as exc:
        raise TracerError(f"cannot write JSON to {target}: {exc.strerror or exc}") from None


def _error_payload(message: str) -> dict:
    return {"verdict": "error", "error": message, "command": _command_line(),
            "first_divergence": None, "points": [], "logits": None, "greedy": None}


_STDOUT = [sys.stdout]  # the real stdout, kept while library output is redirected to stderr
COMMANDS = {"run": cmd_run, "compare": cmd_compare, "record": cmd_record, "variants": cmd_variants,
            "engines": cmd_engines, "sweep": cmd_sweep, "config": cmd_config, "diagnose": cmd_diagnose}


def main(argv: list[str] | None = None) -> int:
    args = None
    _STDOUT[0] = sys.stdout
    try:
        args = build_parser().parse_args(argv)
        # With --json -, stdout carries the JSON object alone: anything a library prints goes to stderr.
        quiet = getattr(args, "json", None) == "-"
        with contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext():
            return COMMANDS[args.command](args)
    except TracerError as exc:
        message = str(exc)
        print(f"tracer: error: {message}", file=sys.stderr)
        if args is not None and getattr(args, "json", None):
            with contextlib.suppress(TracerError):  # an unwritable --json FILE was said above
                _write_json(_error_payload(message), args.json)
        return 2
    except KeyboardInterrupt:
        print("tracer: interrupted", file=sys.stderr)
        return 130


def console_main() -> int:
    """The `tracer` command: `main` in a process of its own, whose allocator it may tune."""
    from tracer.allocator import reuse_freed_memory

    reuse_freed_memory()
    return main()


if __name__ == "__main__":
    sys.exit(console_main())
