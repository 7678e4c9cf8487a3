"""`tracer` on the command line: a thin map over `tracer.api`.

A mistake the user can make is one line on stderr and exit code 2; `--json -` prints exactly
one JSON object on stdout and nothing else there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from pathlib import Path

from tracer.errors import TracerError
from tracer.families import FAMILIES

DEFAULT_OUT = "tracer-report"
DEFAULT_SWEEP_OUT = "tracer-sweep"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage dump is noise; one line, exit 2, like every user error
        raise TracerError(message)


def _model_and_input(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF model directory (any family tracer traces) or .gguf file "
                                        "(default: bundled SmolLM2-135M-Instruct)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help='text to run (default: "The capital of France is")')
    source.add_argument("--prompt-file", type=Path, help="read the prompt from a UTF-8 file")
    source.add_argument("--tokens", help="comma-separated token ids, for models without a tokenizer")
    parser.add_argument("--variant", action="append", default=[], metavar="K=V[,K=V]",
                        help="candidate knobs, e.g. theta=10000 (repeatable; see `tracer variants`)")
    _chat(parser)


def _chat(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat", action="store_true",
                        help="feed the prompt through the model's chat template, as an instruct model is used")
    parser.add_argument("--system", help="a system message before the prompt (with --chat)")


def _placement(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="where the models run: cpu | cuda | cuda:N | mps (default cpu)")
    parser.add_argument("--stream", action="store_true",
                        help="reimpl reads each block's weights from the files when it runs: one block in memory")
    parser.add_argument("--offload", metavar="DIR", help="hf loads its model through accelerate (device_map=auto): "
                        "what fits in no device's memory is kept in DIR and read when its module runs")
    parser.add_argument("--max-memory", metavar="DEV=SIZE[,...]",
                        help="with accelerate's placement, how far it may fill each device, e.g. cpu=2GiB or "
                             "0=20GiB,cpu=60GiB (the rest goes to --offload)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tracer", description="Find where a Llama port diverges from transformers.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="trace a reference and a candidate, localize the first divergence")
    _model_and_input(run)
    run.add_argument("--reference", default="hf", help="reference engine, see `tracer engines` (default hf)")
    run.add_argument("--candidate", default="reimpl",
                     help="candidate engine: reimpl | hf | file:PATH | ..., see `tracer engines` (default reimpl)")
    run.add_argument("--reference-variant", action="append", default=[], metavar="K=V[,K=V]",
                     help="knobs for the reference side")
    run.add_argument("--regime", metavar="auto|K=V[,K=V]",
                     help="compare in a number-format regime: auto (the one the candidate's runtime and model file "
                          "imply: llama.cpp's CPU arithmetic on its GGUF, a 16-bit dtype) or knobs such as "
                          "weights=q4_1,act_quant=q8_1; the raw f32 view is reported beside it (docs/regimes.md)")
    run.add_argument("--atol", type=float, help="elementwise absolute tolerance (replaces the rel_l2 criterion)")
    run.add_argument("--rtol", type=float, help="elementwise relative tolerance (replaces the rel_l2 criterion)")
    run.add_argument("--greedy", type=int,
                     help="greedy tokens generated on both sides (default 20; 0 for prompts over 128 tokens)")
    run.add_argument("--max-tokens", type=int, help="keep only the first N tokens of the prompt")
    run.add_argument("--no-noise", action="store_true",
                     help="skip the f64 noise-floor run; judge points by the fixed rel_l2 bound (1e-4)")
    run.add_argument("--out", default=DEFAULT_OUT, help=f"report folder (default ./{DEFAULT_OUT})")
    run.add_argument("--no-report", action="store_true", help="write no report folder")
    run.add_argument("--json", metavar="-|FILE", help="write the result as JSON (- for stdout, nothing else there)")
    run.add_argument("--fail-on-divergence", action="store_true", help="exit with code 1 when a point diverges")
    _placement(run)

    cmp = commands.add_parser("compare", help="compare two saved traces (tracer's, or another runtime's dump)")
    cmp.add_argument("reference", help="reference trace file (.safetensors)")
    cmp.add_argument("candidate", help="candidate trace file (.safetensors; candle, llama.cpp, ... names accepted)")
    cmp.add_argument("--aliases", type=Path, metavar="FILE",
                     help='JSON name mapping {"their_name_pattern": "our_point_pattern"}, {i} for the layer')
    cmp.add_argument("--atol", type=float, help="elementwise absolute tolerance (replaces the rel_l2 criterion)")
    cmp.add_argument("--rtol", type=float, help="elementwise relative tolerance (replaces the rel_l2 criterion)")
    cmp.add_argument("--out", default=DEFAULT_OUT, help=f"report folder (default ./{DEFAULT_OUT})")
    cmp.add_argument("--no-report", action="store_true", help="write no report folder")
    cmp.add_argument("--json", metavar="-|FILE", help="write the result as JSON (- for stdout, nothing else there)")
    cmp.add_argument("--fail-on-divergence", action="store_true", help="exit with code 1 when a point diverges")

    rec = commands.add_parser("record", help="save one engine's trace as a safetensors file")
    _model_and_input(rec)
    rec.add_argument("--engine", default="hf", help="the engine to record, see `tracer engines` (default hf)")
    rec.add_argument("-o", "--output", required=True, type=Path, help="trace file to write (.safetensors)")
    _placement(rec)

    var = commands.add_parser("variants", help="list every knob: values, default, engines, what it reproduces")
    var.add_argument("--family", help=f"only the knobs of one model family ({', '.join(FAMILIES)}), with where "
                                      "each first diverges")
    commands.add_parser("engines", help="list every engine: what it records and honours, whether its runtime is installed")

    diag = commands.add_parser("diagnose", help="rank the variant catalogue by resemblance to a trace recorded elsewhere")
    diag.add_argument("trace", type=Path, help="the observed candidate trace (safetensors, with token ids)")
    diag.add_argument("--model", help="the model it ran (default: bundled SmolLM2-135M-Instruct)")
    diag.add_argument("--variants", action="append", metavar="K=V[,K=V][;...]",
                      help="variants to try (default: the catalogue)")
    diag.add_argument("--json", metavar="-|FILE", help="write the ranking as JSON (- for stdout, nothing else there)")
    _placement(diag)

    swp = commands.add_parser("sweep", help="the reference once, then every variant against it (default: one per knob)")
    swp.add_argument("--model", help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    swp_input = swp.add_mutually_exclusive_group()
    swp_input.add_argument("--prompt", help='text to run (default: "The capital of France is")')
    swp_input.add_argument("--prompt-file", type=Path, help="read the prompt from a UTF-8 file")
    swp_input.add_argument("--tokens", help="comma-separated token ids, for models without a tokenizer")
    _chat(swp)
    swp.add_argument("--variants", action="extend", nargs="+", metavar="K=V[,K=V]",
                     help="variants to run (several, or one argument with ';' between them; default: one per knob)")
    swp.add_argument("--reference", default="hf", help="reference engine, see `tracer engines` (default hf)")
    swp.add_argument("--reference-variant", action="append", default=[], metavar="K=V[,K=V]",
                     help="knobs for the reference side")
    swp.add_argument("--candidate", default="reimpl",
                     help="engine the variants run on: reimpl | hf | ..., see `tracer engines` (default reimpl)")
    swp.add_argument("--max-tokens", type=int, help="keep only the first N tokens of the prompt")
    swp.add_argument("--greedy", type=int, default=0, help="greedy tokens per variant, each a forward (default 0)")
    swp.add_argument("--no-noise", action="store_true",
                     help="skip the f64 noise-floor run; judge points by the fixed rel_l2 bound (1e-4)")
    swp.add_argument("--out", default=DEFAULT_SWEEP_OUT, help=f"report folder (default ./{DEFAULT_SWEEP_OUT})")
    swp.add_argument("--no-report", action="store_true", help="write no report folder")
    swp.add_argument("--json", metavar="-|FILE", help="write the sweep as JSON (- for stdout, nothing else there)")
    _placement(swp)

    cfg = commands.add_parser("config", help="how transformers (its family's reading) and candle 0.11 (Llama only) "
                                             "read config.json, and where they differ")
    cfg.add_argument("--model", help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    cfg.add_argument("--resave", default="none", choices=("none", "tf5"),
                     help="first rewrite the config as transformers 5's save_pretrained does")
    cfg.add_argument("--json", metavar="-|FILE", help="write the audit as JSON (- for stdout, nothing else there)")
    return parser


def _prompt_and_tokens(args) -> tuple[str | None, list[int] | None]:
    if args.tokens is not None:
        try:
            return None, [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise TracerError(f"--tokens takes comma-separated integers, got {args.tokens!r}") from None
    if args.prompt_file is not None:
        try:
            return args.prompt_file.read_text(encoding="utf-8"), None
        except (OSError, UnicodeDecodeError) as exc:
            raise TracerError(f"cannot read prompt file {args.prompt_file}: {exc}") from None
    if args.prompt is not None:
        return args.prompt, None
    from tracer.api import DEFAULT_PROMPT

    return DEFAULT_PROMPT, None


def cmd_run(args) -> int:
    import tracer
    from tracer.reports.terminal import terminal_summary

    prompt, tokens = _prompt_and_tokens(args)
    result = tracer.run(
        args.model, prompt, tokens=tokens, reference=args.reference, candidate=args.candidate,
        variant=args.variant, reference_variant=args.reference_variant, atol=args.atol, rtol=args.rtol,
        greedy=args.greedy, out=None if args.no_report else args.out, command=_command_line(),
        noise_floor=not args.no_noise, max_tokens=args.max_tokens, chat=args.chat, system=args.system,
        device=args.device, stream=args.stream, progress=args.json != "-", regime=args.regime,
        offload=args.offload, max_memory=args.max_memory,
    )
    if args.json:
        _write_json(result.to_dict(), args.json)
    if args.json != "-":
        print(terminal_summary(result, None if args.no_report else args.out))
    return _exit_code(result, args)


def cmd_compare(args) -> int:
    import tracer
    from tracer.reports.terminal import terminal_summary

    result = tracer.compare_files(args.reference, args.candidate, atol=args.atol, rtol=args.rtol,
                                  aliases=args.aliases, out=None if args.no_report else args.out,
                                  command=_command_line())
    if args.json:
        _write_json(result.to_dict(), args.json)
    if args.json != "-":
        print(terminal_summary(result, None if args.no_report else args.out))
    return _exit_code(result, args)


def _exit_code(result, args) -> int:
    """1 for a divergence when asked (porting CI); 2 stays for user errors."""
    return 1 if args.fail_on_divergence and result.verdict == "diverged" else 0


def cmd_record(args) -> int:
    import tracer

    prompt, tokens = _prompt_and_tokens(args)
    trace = tracer.record(args.model, tokens if tokens is not None else prompt, engine=args.engine,
                          variant=args.variant, device=args.device, stream=args.stream, chat=args.chat,
                          offload=args.offload, max_memory=args.max_memory,
                          system=args.system)
    trace.save(args.output)
    print(f"{trace.label}: {len(trace)} points on {len(trace.tokens)} tokens -> {args.output}")
    return 0


def cmd_variants(args) -> int:
    from tracer.engines.registry import engines_honouring
    from tracer.variants import KNOBS, PRESETS, knobs_for, variant_text

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
    from tracer.points import FUSED_AWAY

    for entry in ENGINES.values():
        missing = entry.missing_runtime()
        versions = ", ".join(f"{dist} {version}" for dist, version in entry.runtime_versions().items() if version)
        installed = (f"not installed: pip install -e '.[{entry.extra}]'" if missing and entry.extra
                     else f"not installed: {', '.join(missing)}" if missing else f"installed ({versions or 'built in'})")
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
    return 0


def cmd_sweep(args) -> int:
    import tracer
    from tracer.reports.sweep import sweep_markdown

    prompt, tokens = _prompt_and_tokens(args)
    result = tracer.sweep(args.model, prompt, tokens=tokens, variants=args.variants, reference=args.reference,
                          reference_variant=args.reference_variant, candidate=args.candidate, greedy=args.greedy,
                          out=None if args.no_report else args.out, command=_command_line(),
                          progress=args.json != "-", noise_floor=not args.no_noise, max_tokens=args.max_tokens,
                          chat=args.chat, system=args.system, device=args.device, stream=args.stream,
                          offload=args.offload, max_memory=args.max_memory)
    if args.json:
        _write_json(result.to_dict(), args.json)
    if args.json != "-":
        print(sweep_markdown(result), end="")
        print(f"{len(result.rows)} variants in {sum(result.timings.values()):.1f} s"
              + ("" if args.no_report else f"; report: {Path(args.out) / 'sweep.html'}"))
    return 0


def cmd_diagnose(args) -> int:
    import tracer

    result = tracer.diagnose(args.trace, args.model, variants=args.variants or None, device=args.device,
                             stream=args.stream, offload=args.offload, max_memory=args.max_memory,
                             progress=args.json != "-")
    if args.json:
        _write_json(result.to_dict(), args.json)
    if args.json != "-":
        first = result.observed.first_divergence
        print(f"observed: {result.observed.verdict}" + (f", first divergence {first['point']}" if first else ""))
        for rank, entry in enumerate(result.ranking[:5], 1):
            print(f"  {rank}. {entry['variant']:<28} resemblance {entry['score']:.2f}  "
                  f"({entry['verdict']}{', from ' + entry['first_divergence'] if entry['first_divergence'] else ''})")
        if result.best:
            print(f"your trace behaves most like {result.best['variant']}")
    return 0


def cmd_config(args) -> int:
    from tracer.config import audit, load_config
    from tracer.sources import resolve_model

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


if __name__ == "__main__":
    sys.exit(main())
