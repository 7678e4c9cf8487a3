"""Every flag of the `tracer` command, declared once: shared argparse parents for the flags several
sub-commands take (inputs, placement, tolerance, report, JSON), and `command_line`, which writes the
command that repeats a run from the same declarations (`run_command`: the `tracer run` line of a Python
`run` call's `Request`). Pure argparse: no torch, no tracer internals above `tracer.pipeline.request`.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from tracer.core.errors import TracerError, did_you_mean, unknown_name
from tracer.model.families import FAMILIES
from tracer.model.knobs import variant_text
from tracer.pipeline.request import DEFAULT_CTX, DEFAULT_PROMPT, FLOORS, GREEDY_STEPS, Request

DEFAULT_OUT = "tracer-report"
DEFAULT_SWEEP_OUT = "tracer-sweep"
TOKENS_HELP = "comma-separated token ids, for models without a tokenizer"


class _Parser(argparse.ArgumentParser):
    """argparse with every mistake as one line (its usage dump is noise), exit 2 like every user error,
    and the closest flag, command or choice named when the word looks like a typo."""

    commands: dict[str, argparse.ArgumentParser] | None = None  # the top parser's sub-commands

    def error(self, message):
        choice = re.search(r"^argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:
            argument, given, choices = choice.group(1), choice.group(2), re.findall(r"'([^']*)'", choice.group(3))
            message = unknown_name("command", given, choices, "`tracer --help`") if argument == "command" else \
                f"{argument}: invalid choice {given!r}; choose from {', '.join(choices)}" + did_you_mean(given, choices)
        raise TracerError(message)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = (self.commands or {}).get(getattr(parsed, "command", None), self)
            flags = [flag for action in command._actions for flag in action.option_strings]  # noqa: SLF001
            unknown = next((word for word in extras if word.startswith("--")), "").partition("=")[0]
            raise TracerError(f"unrecognized arguments: {' '.join(extras)}" + did_you_mean(unknown, flags))
        return parsed


class _Once(argparse.Action):
    """A flag given at most once: a second one is the user's error, not a silent replacement of the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            first = getattr(namespace, self.dest)
            raise TracerError(f"{option_string} given twice ({first!s:.40} and {values!s:.40}): a run takes one "
                              "input; give the flag once")
        setattr(namespace, self.dest, values)


class _Prompts(argparse.Action):
    """--prompt, repeatable: several are a batch's rows (`--batch B`); `Inputs` refuses several without it."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values if given is None else [*([given] if isinstance(given, str) else given),
                                                                    values])


class _Candidates(argparse.Action):
    """--candidate, repeatable: the first one given replaces the default, the next ones join it (a list: several
    are `tracer run`'s triangulation; `tracer.pipeline.request.one_candidate` refuses them elsewhere)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*given, values] if isinstance(given, list) else [values])


def _parent() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(add_help=False)


def _inputs() -> argparse.ArgumentParser:
    """--model, the prompt (or token ids) and the chat template: every command that runs a model."""
    parent = _parent()
    parent.add_argument("--model", help="HF model directory (any family tracer traces) or .gguf file "
                                        "(default: bundled SmolLM2-135M-Instruct)")
    source = parent.add_mutually_exclusive_group()
    source.add_argument("--prompt", action=_Prompts, help=f'text to run (default: "{DEFAULT_PROMPT}"); given B times '
                        "with --batch B, the batch's rows")
    source.add_argument("--prompt-file", action=_Once, type=Path, help="read the prompt from a UTF-8 file")
    source.add_argument("--tokens", action=_Once, help=TOKENS_HELP)
    parent.add_argument("--chat", action="store_true",
                        help="feed the prompt through the model's chat template, as an instruct model is used")
    parent.add_argument("--system", help="a system message before the prompt (with --chat)")
    return parent


def _positions() -> argparse.ArgumentParser:
    parent = _parent()
    parent.add_argument("--position-offset", type=int, default=0, metavar="P",
                        help="the first token's absolute position (default 0): RoPE at far positions, on the engines "
                             "that take positions (`tracer engines`: their \"can\" line names --position-offset)")
    return parent


def _decode() -> argparse.ArgumentParser:
    parent = _parent()
    parent.add_argument("--decode", type=int, default=0, metavar="N",
                        help="after the prompt, decode N tokens one at a time, each engine with its own KV cache, "
                             "every point of every step recorded (`tracer engines`: the engines whose \"can\" line "
                             "names --decode; docs/decode.md)")
    return parent


def _batch() -> argparse.ArgumentParser:
    parent = _parent()
    parent.add_argument("--batch", type=int, default=1, metavar="B",
                        help="run B rows as one left-padded batch with an attention mask: --prompt given B times, "
                             "--tokens '1,2;3,4,5', or one prompt repeated; each row compared with the reference's "
                             "batch-1 run of its prompt (engines: hf, reimpl; docs/batch.md)")
    return parent


def _truncation() -> argparse.ArgumentParser:
    parent = _parent()
    parent.add_argument("--max-tokens", type=int, help="keep only the first N tokens of the prompt (N >= 1)")
    return parent


def _variant() -> argparse.ArgumentParser:
    parent = _parent()
    parent.add_argument("--variant", action="append", default=[], metavar="K=V[,K=V]",
                        help="candidate knobs, e.g. theta=10000 (repeatable; see `tracer variants`)")
    return parent


def _reference() -> argparse.ArgumentParser:
    parent = _parent()
    parent.add_argument("--reference", default="hf", help="reference engine, see `tracer engines` (default hf)")
    parent.add_argument("--reference-variant", action="append", default=[], metavar="K=V[,K=V]",
                        help="knobs for the reference side")
    return parent


def _placement() -> argparse.ArgumentParser:
    parent = _parent()
    parent.add_argument("--device", default="cpu", help="where the models run: cpu | cuda | cuda:N | mps (default cpu)")
    parent.add_argument("--stream", action="store_true",
                        help="hf and reimpl read each block's weights from the files when it runs: one block in "
                             "memory (run: the default past 2 GiB of f32 weights)")
    parent.add_argument("--offload", metavar="DIR", help="hf loads its model through accelerate (device_map=auto): "
                        "what fits in no device's memory is kept in DIR and read when its module runs")
    parent.add_argument("--max-memory", metavar="DEV=SIZE[,...]",
                        help="with accelerate's placement, how far it may fill each device, e.g. cpu=2GiB or "
                             "0=20GiB,cpu=60GiB (the rest goes to --offload)")
    return parent


def _tolerance() -> argparse.ArgumentParser:
    parent = _parent()
    parent.add_argument("--atol", type=float, help="elementwise absolute tolerance (replaces the rel_l2 criterion)")
    parent.add_argument("--rtol", type=float, help="elementwise relative tolerance (replaces the rel_l2 criterion)")
    return parent


def _noise() -> argparse.ArgumentParser:
    parent = _parent()
    parent.add_argument("--no-noise", action="store_true",
                        help="skip the f64 noise-floor run; judge points by the fixed rel_l2 bound (1e-4)")
    parent.add_argument("--floor", choices=FLOORS, default=FLOORS[0],
                        help="cheap (default): an f64 run of the prompt's first quarter, scaled, and the exact floor "
                             "where a verdict rests on it; exact: an f64 run of the whole prompt (docs/floor.md)")
    return parent


def noise_floor_of(args) -> str | None:
    """The run's noise floor: --floor's, None with --no-noise (both given: the user's error)."""
    if args.no_noise and args.floor != FLOORS[0]:
        raise TracerError(f"--floor {args.floor} and --no-noise: the first measures a floor, the second skips it")
    return None if args.no_noise else args.floor


def _json(what: str = "result") -> argparse.ArgumentParser:
    parent = _parent()
    parent.add_argument("--json", metavar="-|FILE", help=f"write the {what} as JSON (- for stdout, nothing else there)")
    return parent


def _report(default: str) -> argparse.ArgumentParser:
    parent = _parent()
    parent.add_argument("--out", default=default, help=f"report folder (default ./{default})")
    parent.add_argument("--no-report", action="store_true", help="write no report folder")
    return parent


def _verdict_exit() -> argparse.ArgumentParser:
    parent = _parent()
    parent.add_argument("--fail-on-divergence", action="store_true", help="exit with code 1 when a point diverges")
    return parent


def build_parser(commands_out: dict | None = None) -> argparse.ArgumentParser:
    """The whole `tracer` parser; `commands_out`, when given, receives each sub-command's parser by name."""
    parser = _Parser(prog="tracer",
                     description="Find where a port of a language model diverges from transformers, layer by layer.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    subs = {} if commands_out is None else commands_out
    parser.commands = subs  # whose flags a typo is compared with

    def command(name: str, help: str, *parents: argparse.ArgumentParser) -> argparse.ArgumentParser:
        subs[name] = commands.add_parser(name, help=help, parents=list(parents))
        return subs[name]

    run = command("run", "trace a reference and a candidate, localize the first divergence",
                  _inputs(), _truncation(), _positions(), _decode(), _batch(), _variant(), _reference(),
                  _run_candidate(), _tolerance(), _noise(), _placement(), _report(DEFAULT_OUT), _json(),
                  _verdict_exit())
    run.add_argument("--no-stream", action="store_true",
                     help="load each side's model whole, whatever its size (not with --stream)")

    command("compare", "compare two saved traces (tracer's, or another runtime's dump)",
            _compared(), _tolerance(), _report(DEFAULT_OUT), _json(), _verdict_exit())

    rec = command("record", "save one engine's trace as a safetensors file (with --batch B, one file per row: "
                  "OUT.row0.safetensors, ...)", _inputs(), _positions(), _decode(), _batch(), _variant(), _placement())
    rec.add_argument("--engine", default="hf", help="the engine to record, see `tracer engines` (default hf)")
    rec.add_argument("-o", "--output", required=True, type=Path, help="trace file to write (.safetensors)")

    var = command("variants", "list every knob: values, default, engines, what it reproduces")
    var.add_argument("--family", help=f"only the knobs of one model family ({', '.join(FAMILIES)}), with where "
                                      "each first diverges")
    command("engines", "list every engine: what it records and honours, whether its runtime is installed")

    diag = command("diagnose", "rank the variant catalogue by resemblance to a trace recorded elsewhere",
                   _decode(), _placement(), _json("ranking"))
    diag.add_argument("trace", type=Path, help="the observed candidate trace (safetensors, with token ids)")
    diag.add_argument("--model", help="the model it ran (default: bundled SmolLM2-135M-Instruct)")
    diag.add_argument("--variants", action="append", metavar="K=V[,K=V][;...]",
                      help="variants to try (default: the catalogue)")

    swp = command("sweep", "the reference once, then every variant against it (default: one per knob)",
                  _inputs(), _truncation(), _decode(), _reference(), _noise(), _placement(),
                  _report(DEFAULT_SWEEP_OUT), _json("sweep"))
    swp.add_argument("--variants", action="extend", nargs="+", metavar="K=V[,K=V]",
                     help="variants to run (several, or one argument with ';' between them; default: one per knob)")
    swp.add_argument("--candidate", default="reimpl", action=_Candidates,
                     help="engine the variants run on: reimpl | hf | ..., see `tracer engines` (default reimpl)")
    swp.add_argument("--greedy", type=int, default=0, help="greedy tokens per variant, each a forward (default 0)")

    qual = command("quality", "how much a candidate loses over a text: llama-perplexity's KL-divergence "
                              "figures, and where the loss is made", _variant(), _reference(), _placement(),
                   _json("figures"))
    qual.add_argument("--model", help="HF model directory or .gguf file; its tokenizer reads the text "
                                      "(default: bundled SmolLM2-135M-Instruct)")
    corpus = qual.add_mutually_exclusive_group(required=True)
    corpus.add_argument("--text", type=Path, metavar="FILE", help="the text, a UTF-8 file (llama-perplexity's -f)")
    corpus.add_argument("--tokens", action=_Once, help=TOKENS_HELP)
    qual.add_argument("--candidate", default="reimpl", action=_Candidates,
                      help="candidate engine: reimpl | hf | llamacpp:PATH.gguf | ..., see `tracer engines` "
                           "(default reimpl)")
    qual.add_argument("-c", "--ctx", type=int,
                      help=f"tokens per chunk, the second half of each scored (llama-perplexity's -c; default "
                           f"{DEFAULT_CTX}, halved until a shorter text fills two chunks, said in a note)")
    qual.add_argument("--chunks", type=int, help="evaluate at most N chunks (default: all the text fills)")
    qual.add_argument("--by-layer", action="store_true",
                      help="also say where the loss is made: each block (and the embedding, final norm, lm_head) "
                           "of the candidate alone in the reference's forward, its share of the KLD "
                           "(docs/quality.md; ~25 forwards per chunk for 30 layers)")
    qual.add_argument("--markdown", metavar="-|FILE", help="write a Markdown summary (- for stdout)")

    cfg = command("config", "how transformers (its family's reading) and candle 0.11 (Llama only) "
                            "read config.json, and where they differ", _json("audit"))
    cfg.add_argument("--model", help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    cfg.add_argument("--resave", default="none", choices=("none", "tf5"),
                     help="first rewrite the config as transformers 5's save_pretrained does")
    return parser


def _run_candidate() -> argparse.ArgumentParser:
    """`tracer run`'s own flags: the candidate, its regime, the greedy continuation."""
    parent = _parent()
    parent.add_argument("--candidate", default="reimpl", action=_Candidates,
                        help="candidate engine: reimpl | hf | file:PATH | ..., see `tracer engines` (default reimpl); "
                             "given several times, all of them on one reference run, who agrees with whom at each "
                             "one's first divergence (each with its own knobs: 'llamacpp[kv_cache=f32]'; "
                             "docs/explain.md, Triangulation)")
    parent.add_argument("--regime", metavar="auto|K=V[,K=V]",
                        help="compare in a number-format regime: auto (the one the candidate's runtime and model file "
                             "imply: llama.cpp's CPU arithmetic on its GGUF, a 16-bit dtype) or knobs such as "
                             "weights=q4_1,act_quant=q8_1; the raw f32 view is reported beside it (docs/regimes.md)")
    parent.add_argument("--greedy", type=int,
                        help="greedy tokens generated on both sides (default 20; 0 for prompts over 128 tokens)")
    return parent


def _compared() -> argparse.ArgumentParser:
    parent = _parent()
    parent.add_argument("reference", help="reference trace file (.safetensors)")
    parent.add_argument("candidate", nargs="+",
                        help="candidate trace file (.safetensors; candle, llama.cpp, ... names accepted); several "
                             "files, one per tensor-parallel rank, or an SGLang dumper directory are merged first")
    parent.add_argument("--shard-layout", type=Path, metavar="FILE",
                        help='JSON {"point or sub-point": "column | column:AXIS | row | replicated"}: how the ranks '
                             "split each point (default: vLLM's and SGLang's modules)")
    parent.add_argument("--aliases", type=Path, metavar="FILE",
                        help='JSON name mapping {"their_name_pattern": "our_point_pattern"}, {i} for the layer')
    return parent


def command_line(command: str, values: dict) -> str:
    """The `tracer COMMAND ...` line that repeats a run, derived from the parser: every flag whose
    value (by its dest, as `values` holds them) differs from its default, in the help's order.
    A list value repeats its flag; True writes a switch; dests absent from `values` stay default."""
    subs: dict = {}
    build_parser(subs)
    words = ["tracer", command]
    for action in subs[command]._actions:  # noqa: SLF001 - argparse lists its actions only there
        if action.dest not in values or not action.option_strings:
            continue
        value = values[action.dest]
        if value is None or value is False or value == action.default or value == []:
            continue
        flag = action.option_strings[-1]
        if action.nargs == 0:  # a switch
            words.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                words += [flag, str(item)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def run_command(request: Request) -> str:
    """The `tracer run` line that repeats a Python `run` call on a model path, for the report: every flag
    whose value differs from its default (`command_line`)."""
    inputs, placement, tolerance, regime = request.inputs, request.placement, request.tolerance, request.regime
    several = len(set(inputs.rows)) > 1  # a batch of different rows: every row on the line
    tokens, prompt = inputs.tokens, inputs.prompt if inputs.prompt != DEFAULT_PROMPT else None
    if several and inputs.tokens is not None:
        tokens = ";".join(",".join(map(str, row)) for row in inputs.rows)
    elif several:
        prompt = list(inputs.rows)
    values = {
        "model": inputs.model,
        "tokens": None if tokens is None else tokens if isinstance(tokens, str) else ",".join(map(str, tokens)),
        "prompt": prompt if inputs.tokens is None else None,
        "chat": inputs.chat, "system": inputs.system,
        "max_tokens": inputs.max_tokens if inputs.tokens is None else None,
        "position_offset": inputs.position_offset, "decode": inputs.decode, "batch": inputs.batch,
        "reference": str(request.reference.engine),
        # a lone candidate's knobs on --variant, as before; a triangulation's each in its own brackets
        "candidate": [side.text for side in request.candidates] or str(request.candidate.engine),
        "reference_variant": [variant_text(request.reference.variant)] if request.reference.variant else [],
        "variant": [variant_text(request.candidate.variant)] if request.candidate and request.candidate.variant else [],
        "atol": tolerance.atol, "rtol": tolerance.rtol,
        "greedy": request.greedy if request.greedy != GREEDY_STEPS else None, "no_noise": not request.noise_floor,
        "floor": request.noise_floor or FLOORS[0],
        "device": placement.device, "stream": placement.stream, "no_stream": placement.stream is False,
        "regime": None if regime is None else regime if isinstance(regime, str) else variant_text(regime),
        "offload": placement.offload,
        "max_memory": ",".join(f"{d}={size}" for d, size in placement.max_memory.items())
        if placement.max_memory else None,
        "out": request.outputs.report, "no_report": request.outputs.report is None,
    }
    return command_line("run", values)
