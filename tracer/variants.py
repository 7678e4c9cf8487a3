"""The variant catalogue: knobs, their values, and which engines honour them.

A variant is an ordered mapping knob -> value, written on the command line as
`theta=10000,attn=sdpa`. This module only parses and validates; each engine applies the knobs it
honours (`tracer.llama.resolve_strategies`, `tracer.hooks.engine`). A knob an engine cannot honour
is an error naming the engines that can, never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tracer.errors import TracerError

DTYPES = ("f32", "bf16", "f16", "f64")


@dataclass(frozen=True)
class Knob:
    name: str
    parse: Callable[[str], Any]  # raises ValueError on a bad value
    accepted: str  # the accepted form, quoted in errors and `tracer variants`
    default: str
    engines: tuple[str, ...]
    reproduces: str


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError(text)
    return value


def _choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in values:
            raise ValueError(text)
        return text

    return parse


KNOBS: dict[str, Knob] = {
    knob.name: knob
    for knob in (
        Knob("theta", _positive_float, "a positive number, e.g. theta=10000", "from config.json",
             ("reimpl", "hf"), "rope_theta silently 10000 (candle's serde default)"),
        Knob("eps", _positive_float, "a positive number, e.g. eps=1e-6", "from config.json",
             ("reimpl", "hf"), "a wrong rms_norm_eps"),
        Knob("attn", _choice("eager", "sdpa"), "eager | sdpa", "eager",
             ("reimpl", "hf"), "the attention implementation (sdpa fuses scores and softmax)"),
        Knob("dtype", _choice(*DTYPES), " | ".join(DTYPES), "f32",
             ("reimpl", "hf"), "the load dtype"),
    )
}


def parse_variant(spec: str | dict | None) -> dict[str, Any]:
    """`"theta=10000,attn=sdpa"` (or a dict, or a list of such strings) -> {"theta": 10000.0, ...}.

    Raises:
        TracerError: unknown knob (listing the valid ones), malformed pair, or bad value
            (quoting the accepted form).
    """
    if not spec:
        return {}
    if isinstance(spec, dict):
        pairs = [(str(k), str(v)) for k, v in spec.items()]
    else:
        texts = [spec] if isinstance(spec, str) else list(spec)
        pairs = [_split_pair(item) for text in texts for item in text.split(",") if item.strip()]
    variant: dict[str, Any] = {}
    for name, text in pairs:
        knob = KNOBS.get(name)
        if knob is None:
            raise TracerError(f"unknown knob {name!r}; valid knobs: {', '.join(KNOBS)}")
        if name in variant:
            raise TracerError(f"knob {name!r} is given twice")
        try:
            variant[name] = knob.parse(text)
        except ValueError:
            raise TracerError(f"bad value {text!r} for knob {name!r}; expected {knob.accepted}") from None
    return variant


def _split_pair(item: str) -> tuple[str, str]:
    name, sep, value = item.strip().partition("=")
    if not sep or not name.strip() or not value.strip():
        raise TracerError(f"bad variant {item.strip()!r}; expected knob=value, e.g. theta=10000")
    return name.strip(), value.strip()


def check_engine(variant: dict, engine: str) -> None:
    """Refuse knobs `engine` cannot honour, naming the engines that can."""
    for name in variant:
        engines = KNOBS[name].engines
        if engine not in engines:
            raise TracerError(
                f"knob {name!r} is not honoured by the {engine} engine; engines that honour it: {', '.join(engines)}"
            )
