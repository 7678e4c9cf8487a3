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

DEFAULT_OUT = "tracer-report"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage dump is noise; one line, exit 2, like every user error
        raise TracerError(message)


def _model_and_input(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF Llama directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help='text to run (default: "The capital of France is")')
    source.add_argument("--prompt-file", type=Path, help="read the prompt from a UTF-8 file")
    source.add_argument("--tokens", help="comma-separated token ids, for models without a tokenizer")
    parser.add_argument("--variant", action="append", default=[], metavar="K=V[,K=V]",
                        help="candidate knobs, e.g. theta=10000 (repeatable; see `tracer variants`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tracer", description="Find where a Llama port diverges from transformers.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="trace a reference and a candidate, localize the first divergence")
    _model_and_input(run)
    run.add_argument("--reference", default="hf", help="reference engine: hf | reimpl | file:PATH (default hf)")
    run.add_argument("--candidate", default="reimpl", help="candidate engine: reimpl | hf | file:PATH (default reimpl)")
    run.add_argument("--reference-variant", action="append", default=[], metavar="K=V[,K=V]",
                     help="knobs for the reference side")
    run.add_argument("--atol", type=float, help="elementwise absolute tolerance (replaces the rel_l2 criterion)")
    run.add_argument("--rtol", type=float, help="elementwise relative tolerance (replaces the rel_l2 criterion)")
    run.add_argument("--greedy", type=int, default=20, help="greedy tokens generated on both sides (default 20)")
    run.add_argument("--out", default=DEFAULT_OUT, help=f"report folder (default ./{DEFAULT_OUT})")
    run.add_argument("--no-report", action="store_true", help="write no report folder")
    run.add_argument("--json", metavar="-|FILE", help="write the result as JSON (- for stdout, nothing else there)")

    rec = commands.add_parser("record", help="save one engine's trace as a safetensors file")
    _model_and_input(rec)
    rec.add_argument("--engine", default="hf", choices=("hf", "reimpl"))
    rec.add_argument("-o", "--output", required=True, type=Path, help="trace file to write (.safetensors)")

    commands.add_parser("variants", help="list every knob: values, default, engines, what it reproduces")
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
        progress=args.json != "-",
    )
    if args.json:
        _write_json(result.to_dict(), args.json)
    if args.json != "-":
        print(terminal_summary(result, None if args.no_report else args.out))
    return 0


def cmd_record(args) -> int:
    import tracer

    prompt, tokens = _prompt_and_tokens(args)
    trace = tracer.record(args.model, tokens if tokens is not None else prompt, engine=args.engine,
                          variant=args.variant)
    trace.save(args.output)
    print(f"{trace.label}: {len(trace)} points on {len(trace.tokens)} tokens -> {args.output}")
    return 0


def cmd_variants(args) -> int:
    from tracer.variants import KNOBS

    rows = [("knob", "values", "default", "engines", "reproduces")]
    rows += [(k.name, k.accepted, k.default, ", ".join(k.engines), k.reproduces) for k in KNOBS.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
    return 0


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
COMMANDS = {"run": cmd_run, "record": cmd_record, "variants": cmd_variants}


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
