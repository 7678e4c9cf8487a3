"""Greedy continuations: checking the other side's continuation in one forward must give exactly
what decoding step by step gives, in fewer forwards."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TOKENS
from tracer.engines.load import resolve_and_load
from tracer.engines.registry import ENGINES
from tracer.pipeline.greedy import continuation as greedy_continuation
from tracer.pipeline.greedy import draft, summary

STEPS = 8


class Counting:
    """An engine wrapper that counts forwards (calls to `logits`)."""

    def __init__(self, engine):
        self.engine, self.forwards = engine, 0
        self.entry, self.max_positions = engine.entry, engine.max_positions

    def logits(self, tokens):
        self.forwards += 1
        return self.engine.logits(tokens)


@pytest.mark.parametrize("variant", [{}, {"theta": 500.0}, {"eps": 1e-2}, {"kv_repeat": "tile"}, {"logits": "last"},
                                     {"dtype": "bf16"}])
def test_a_guess_gives_the_step_by_step_continuation(tiny_llama, variant):
    model = tiny_llama()
    reference = greedy_continuation(resolve_and_load("hf", model, {}), TOKENS, STEPS)
    candidate = resolve_and_load("reimpl", model, variant)
    stepwise, guessed = Counting(candidate), Counting(candidate)
    expected = greedy_continuation(stepwise, TOKENS, STEPS)
    assert greedy_continuation(guessed, TOKENS, STEPS, guess=reference) == expected
    assert stepwise.forwards == STEPS
    if expected == reference and "logits" not in variant:
        assert guessed.forwards == 1  # agreeing sides: one forward instead of STEPS
    assert guessed.forwards <= STEPS + 1


class RuleEngine:
    """Next token = a fixed rule of the prefix; a forward over more than `long` tokens picks
    another token at position `odd_row`, as a longer sequence rounding differently at a near-tie would."""

    entry = ENGINES["reimpl"]  # an engine with logits, decoded step by step
    max_positions = None
    vocab = 11

    def __init__(self, long: int, odd_row: int):
        self.long, self.odd_row, self.forwards = long, odd_row, 0

    @staticmethod
    def rule(prefix):
        return (sum(prefix) * 7 + len(prefix)) % RuleEngine.vocab

    def logits(self, tokens):
        self.forwards += 1
        picks = [self.rule(tokens[:i + 1]) for i in range(len(tokens))]
        if len(tokens) > self.long:
            picks[self.odd_row] = (picks[self.odd_row] + 1) % self.vocab
        return torch.nn.functional.one_hot(torch.tensor(picks), self.vocab).float()


def test_a_disagreement_seen_only_in_the_long_forward_is_confirmed_step_by_step():
    prompt = [3, 1, 4]
    truth = greedy_continuation(RuleEngine(long=10**6, odd_row=0), prompt, STEPS)
    engine = RuleEngine(long=len(prompt) + 2, odd_row=len(prompt) + 1)  # row of step 3
    assert greedy_continuation(engine, prompt, STEPS, guess=truth) == truth
    # one check (disagrees at step 3), the step's own forward (agrees), one more check: 3 forwards
    assert engine.forwards == 3


def test_a_real_disagreement_is_decoded_from_there():
    prompt = [3, 1, 4]
    truth = greedy_continuation(RuleEngine(long=10**6, odd_row=0), prompt, STEPS)
    wrong_guess = truth[:2] + [(truth[2] + 5) % RuleEngine.vocab] + truth[3:]
    engine = RuleEngine(long=10**6, odd_row=0)
    assert greedy_continuation(engine, prompt, STEPS, guess=wrong_guess) == truth
    assert engine.forwards == 1 + (STEPS - 2)  # the check, then steps 3..8 one by one


def test_the_reference_checks_its_cached_decode_in_one_forward(tiny_llama):
    engine = resolve_and_load("hf", tiny_llama(), {})
    stepwise = greedy_continuation(engine, TOKENS, STEPS)
    guess = draft(engine, TOKENS, STEPS)
    assert guess == stepwise
    counting = Counting(engine)
    assert greedy_continuation(counting, TOKENS, STEPS, guess=guess) == stepwise
    assert counting.forwards == 1


def test_the_summary_says_where_the_continuations_part_only_when_they_do():
    def words(ids):
        return " ".join(map(str, ids))

    same = summary([1, 2, 3], [1, 2, 3], words)
    assert (same.same_prefix, same.first_flip, same.same_positions) == (3, None, 3)
    assert "first_flip_divergence" not in same.to_dict()
    parted = summary([1, 2, 3], [1, 5, 3], words)
    assert (parted.same_prefix, parted.first_flip, parted.same_positions) == (1, 2, 2)
    assert parted.to_dict()["first_flip_divergence"] is None  # the pipeline compares the sides at that step
    assert parted.to_dict()["candidate_text"] == "1 5 3"
