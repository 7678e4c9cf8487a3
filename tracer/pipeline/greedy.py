"""Greedy continuations: what each side generates after the prompt, and where they part.

An engine that decodes with its own KV cache (registry `greedy="decode"`: hf, reimpl) generates its
continuation as its users do, with that cache and nothing recorded, so following it costs what
generating it costs; where the two sides part, the step whose argmax flips is run again on both sides,
fed the reference's tokens, with its own cache, and that step alone is recorded and compared
(`flip_step`). Where that decode computes what the engine's forward computes (tracer's own forward with
no cache knob), the other side's continuation is checked first with one forward, and the cache decodes
only from where they part (`generated`). A decode the engine refuses (a regime's own attention, a
sliding window it would run past) takes the uncached path instead.

The uncached path, for the other engines: a side's continuation is what step-by-step decoding without a
cache gives (the whole sequence recomputed each step), obtained cheaply: a guess (a cached decode, or
the other side's continuation) is checked with one forward over the prompt and the guess, and decoding
goes step by step only from the first disagreement, confirmed by that step's own forward. An engine
whose registry entry says `greedy="cached"` is taken at its own cached decode instead (llama.cpp's KV
cache is what its users get).
"""

from __future__ import annotations

from tracer.comparison.result import Greedy
from tracer.comparison.steps import greedy_pick
from tracer.core.errors import TracerError
from tracer.core.progress import detail
from tracer.engines.base import at_positions
from tracer.pipeline.request import GREEDY_STEPS
from tracer.traces.trace import Trace

LONG_PROMPT = 128  # past this, greedy decoding (a whole forward per step and side) is off by default


def default_steps(num_tokens: int) -> int:
    return GREEDY_STEPS if num_tokens <= LONG_PROMPT else 0


def continuation(engine, tokens: list[int], steps: int, guess: list[int] | None = None,
                 offset: int = 0) -> list[int] | None:
    """`steps` greedy tokens after `tokens` (the first at absolute position `offset`); None when the
    engine cannot run a forward.

    `guess` (its own `draft`, or the other side's continuation) saves most of the forwards: one forward
    over the prompt and the guess gives this engine's argmax after every prefix of it, and as long as they agree
    the guess is this engine's continuation too. Two sides that agree cost one forward.
    """
    steps = _fitting(engine, tokens, steps, offset)
    if not engine.entry.logits:
        return None
    if engine.entry.greedy == "cached" and steps > 0:
        return engine.draft(tokens, steps, **at_positions(offset, len(tokens)))
    out: list[int] = []
    checked = False  # `out` ends where a check against the guess found a disagreement
    while len(out) < steps:
        on_guess = guess is not None and len(guess) >= steps and out == guess[:len(out)]
        if on_guess and not checked and len(out) < steps - 1:
            agreeing = agreeing_prefix(engine, tokens, out, guess[:steps], offset)
            if agreeing is None:  # it cannot check a guess: decode step by step
                guess = None
                continue
            out, checked = out + guess[len(out):len(out) + agreeing], True
        else:
            logits = engine.logits(tokens + out, **at_positions(offset, len(tokens) + len(out)))
            if logits is None:
                return None
            out, checked = out + [int(logits[-1].argmax())], False
        detail(f"token {len(out)}/{steps}")
    return out


def generated(engine, tokens: list[int], steps: int, guess: list[int] | None = None,
              offset: int = 0) -> list[int] | None:
    """A side's continuation: its own cached decode where that is its greedy continuation (`decoded`), else
    `continuation`, checking `guess` (the other side's continuation; None: the engine's own `draft`).

    An engine whose cached decode computes what its forward does (`decode_is_forward`: tracer's own forward
    with no cache knob set) checks `guess` first, with one forward over the prompt and the guess, and decodes
    with its cache only from the first token it would pick otherwise: the same tokens for a fraction of the
    steps (a port that parts at token 18 of 20 decodes 3 steps, not 20)."""
    steps = _fitting(engine, tokens, steps, offset)
    if steps > 0 and engine.entry.logits and engine.entry.greedy == "decode":
        agreeing = None
        if guess is not None and len(guess) >= steps and getattr(engine, "decode_is_forward", False):
            agreeing = agreeing_prefix(engine, tokens, [], guess[:steps], offset)
        if agreeing == steps:
            return guess[:steps]
        agreed = guess[:agreeing] if agreeing else []
        if (cached := decoded(engine, tokens + agreed, steps - len(agreed), offset)) is not None:
            return agreed + cached
    guess = guess if guess is not None else draft(engine, tokens, steps, offset)
    return continuation(engine, tokens, steps, guess=guess, offset=offset)


def decoded(engine, tokens: list[int], steps: int, offset: int = 0) -> list[int] | None:
    """`steps` greedy tokens from the engine's own cached decode, nothing recorded; None for an engine
    whose greedy continuation is not its decode, or whose decode refuses this model or variant."""
    if engine.entry.greedy != "decode":
        return None
    try:
        trace = engine.decode(tokens, steps - 1, offset=offset, recorded=())
    except TracerError:  # e.g. a regime's own attention has no cache: the uncached path decodes it
        return None
    fed = [token for step in trace.steps for token in step.tokens]
    return [*fed, greedy_pick(trace.steps[-1] if trace.steps else trace)]


def flip_step(engine, tokens: list[int], reference: list[int], flip: int, offset: int = 0) -> Trace | None:
    """The step whose argmax gives the continuation's `flip`th token (1-based), fed the `reference`
    continuation's tokens and recorded alone: the prefill for the first token, else one cached decode step
    after a prefill of the prompt and the reference's tokens before it (one forward, not a step each: the
    step still reads its keys and values from the engine's own cache, at its own positions). None where the
    engine's greedy continuation is not its decode, or its decode refuses."""
    if engine.entry.greedy != "decode":
        return None
    before = tokens + reference[:max(flip - 2, 0)]
    try:
        if flip == 1:
            return engine.decode(before, 0, offset=offset, recorded=(0,))
        return engine.decode(before, 1, forced=[reference[flip - 2]], offset=offset, recorded=(1,)).steps[0]
    except TracerError:
        return None


def draft(engine, tokens: list[int], steps: int, offset: int = 0) -> list[int] | None:
    """A cached decode to check instead of decoding step by step, where the engine has one."""
    steps = _fitting(engine, tokens, steps, offset)
    if not engine.entry.draft or steps < 2:
        return None
    return engine.draft(tokens, steps, **at_positions(offset, len(tokens)))


def agreeing_prefix(engine, tokens: list[int], done: list[int], guess: list[int], offset: int = 0) -> int | None:
    """How many of `guess`'s tokens after `done` this engine would itself pick, from one forward
    over the prompt and the guess; None if it cannot say (no logits, or the last position's only)."""
    ids = tokens + guess[:-1]
    logits = engine.logits(ids, **at_positions(offset, len(ids)))  # (T + steps - 1, V)
    if logits is None or logits.shape[0] < len(tokens) + len(guess) - 1:
        return None
    picked = logits[len(tokens) - 1 + len(done):].argmax(-1).tolist()  # after each prefix of the guess
    rest = guess[len(done):]
    return next((i for i, (a, b) in enumerate(zip(picked, rest)) if a != b), len(rest))


def summary(reference: list[int] | None, candidate: list[int] | None, detokenize) -> Greedy | None:
    """Both continuations, how long they agree, and their texts (None when a side has none)."""
    if reference is None or candidate is None:
        return None
    same = next((i for i, (a, b) in enumerate(zip(reference, candidate)) if a != b),
                min(len(reference), len(candidate)))
    return Greedy(
        reference=reference, candidate=candidate, steps=len(reference), same_prefix=same,
        first_flip=same + 1 if same < len(reference) else None,
        same_positions=sum(a == b for a, b in zip(reference, candidate)),
        reference_text=detokenize(reference), candidate_text=detokenize(candidate),
    )


def _fitting(engine, tokens: list[int], steps: int, offset: int = 0) -> int:
    """No more steps than the model has positions left."""
    if engine.max_positions is not None:
        return min(steps, engine.max_positions - offset - len(tokens))
    return steps
