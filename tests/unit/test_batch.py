"""`--batch B` on a tiny random Llama: rows of different lengths left-padded with an attention mask, one
batched forward per side; each row compared at its real positions with the reference's batch-1 run of its
prompt. hf and reimpl agree bitwise on the batch, both padding knobs are found on the first padded row at
their point with their hint, and the ways to give a batch are parsed or refused in one line."""

from __future__ import annotations

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tracer.cli import main
from tracer.comparison.diff import rel_l2_by_point
from tracer.core.errors import TracerError
from tracer.engines.batch import left_padded
from tracer.engines.load import resolve_and_load
from tracer.files.sources import resolve_source
from tracer.model.points import CONTEXT, PROBS, Q_ROPE, layer_point
from tracer.pipeline.request import Inputs
from tracer.reimpl.forward import Model
from tracer.reports import write_report
from tracer.traces.trace import Trace

ROWS = [TOKENS, TOKENS[:3], TOKENS[1:], TOKENS[2:4]]  # 7, 3, 6, 2 tokens: padding 0, 4, 1, 5


@pytest.fixture(scope="module")
def engines(llama_dir):
    source = resolve_source(str(llama_dir), False)
    return resolve_and_load("hf", source, {}), resolve_and_load("reimpl", source, {})


def test_left_padding_and_positions_as_transformers_generate_counts_them(engines):
    padded = left_padded(ROWS)
    assert padded.padding == (0, 4, 1, 5)
    assert padded.mask[1].tolist() == [0, 0, 0, 0, 1, 1, 1] and padded.ids[1, 4:].tolist() == TOKENS[:3]
    from tracer.model.components.padding import positions_from_mask

    # transformers' generate: attention_mask.cumsum(-1) - 1, padding filled with 0
    assert positions_from_mask(padded.mask.bool())[3].tolist() == [0, 0, 0, 0, 0, 0, 1]


def test_hf_and_reimpl_batches_agree_bitwise_and_rows_have_their_prompts_shapes(engines):
    hf, reimpl = engines
    hf_rows, reimpl_rows = hf.record_batch(ROWS), reimpl.record_batch(ROWS)
    for row, (ours, theirs) in enumerate(zip(reimpl_rows, hf_rows)):
        alone = hf.record(ROWS[row])
        assert ours.points == alone.points and ours.tokens == ROWS[row]
        assert all(ours[p].shape == alone[p].shape for p in alone.points)  # the padding cut off every point
        assert all(torch.equal(ours[p], theirs[p]) for p in theirs.points), row
    # the batch shape alone moves the reference's rounding on the padded rows (other matmul shapes), a little;
    # the unpadded row keeps its own shapes, bitwise so on one thread (more threads may split a batch's
    # matmul otherwise than one row's)
    gaps = [max(rel_l2_by_point(hf.record(ids), row).values()) for ids, row in zip(ROWS, hf_rows)]
    assert gaps[0] == 0.0 if torch.get_num_threads() == 1 else gaps[0] < 1e-6
    assert 0.0 < max(gaps) < 1e-5


def test_a_batch_of_one_is_the_unbatched_forward_bitwise(llama_dir):
    model = Model.from_dir(llama_dir)
    alone, batched = Trace(), Trace()
    logits = model.forward(torch.tensor(TOKENS), alone.tensors.__setitem__)
    padded = left_padded([TOKENS])
    batched_logits = model.forward_batch(padded.ids, padded.mask, batched.tensors.__setitem__)
    assert torch.equal(batched_logits[0], logits)
    assert alone.points == batched.points and all(torch.equal(alone[p], batched[p]) for p in alone.points)


def test_a_padded_batch_matches_row_by_row(llama_dir):
    result = tracer.run(llama_dir, tokens=ROWS, batch=4, progress=False)
    assert result.verdict == "match" and result.row is None
    assert [(row.row, row.padding, row.verdict) for row in result.batch] == [
        (0, 0, "match"), (1, 4, "match"), (2, 1, "match"), (3, 5, "match")]
    assert all(row.points == result.batch[0].points > 30 for row in result.batch)
    assert result.batch[1].batch_floor > 0.0
    # the unpadded row: its own shapes, bitwise on one thread (see the test above)
    assert result.batch[0].batch_floor == 0.0 if torch.get_num_threads() == 1 else result.batch[0].batch_floor < 1e-6
    summary = result.to_dict()
    assert summary["row"] is None and summary["batch"][3]["tokens"] == TOKENS[2:4]
    assert any(note.startswith("batch: 4 rows left-padded to 7 tokens") for note in result.notes)
    assert "--batch 4" in result.command and "1,17,5;" in result.command


@pytest.mark.parametrize("variant, point, hint", [
    ("padding_mask=drop", layer_point(0, PROBS), "attend to its padding"),
    ("batch_positions=arange", layer_point(0, Q_ROPE), "do not start at 0 at its first real token"),
    # candle's -inf mask: a padded query masked from every key is NaN, which reaches the real tokens a layer later
    ("mask=where", layer_point(1, CONTEXT), "turns NaN at model.layers.1.self_attn.context from its padding"),
])
def test_each_padding_knob_is_found_on_the_first_padded_row(llama_dir, variant, point, hint, tmp_path):
    result = tracer.run(llama_dir, tokens=ROWS, batch=4, variant=variant, noise_floor=False, progress=False)
    assert result.verdict == "diverged" and result.row == 1  # row 0 has no padding: nothing to get wrong
    assert [row.verdict for row in result.batch] == ["match", "diverged", "diverged", "diverged"]
    assert result.first_divergence.point == point and hint in result.first_divergence.hints[0]
    assert f"row 1 (4 padded positions) diverged first at {point}" in result.notes[0]
    assert result.tokens == ROWS[1]  # the shown comparison is row 1's: its tokens head the result
    html = (write_report(result, tmp_path / "report") / "report.html").read_text()  # the report renders it as is
    assert "row 1 (4 padded positions) diverged first at" in html


def test_one_prompt_repeated_and_record_by_rows(llama_dir, tmp_path, capsys):
    traces = tracer.record(llama_dir, ROWS[:2], engine="reimpl", batch=2, progress=False)
    assert [trace.tokens for trace in traces] == ROWS[:2]
    assert main(["record", "--model", str(llama_dir), "--engine", "reimpl", "--tokens", "1,17,5", "--batch", "3",
                 "-o", str(tmp_path / "t.safetensors")]) == 0
    saved = [Trace.load(tmp_path / f"t.row{row}.safetensors") for row in range(3)]
    assert all(trace.tokens == [1, 17, 5] for trace in saved)
    # no padding: the same rows (bitwise on one thread; more threads may round a batch's rows apart)
    same = torch.equal if torch.get_num_threads() == 1 else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert all(same(saved[0][p], saved[2][p]) for p in saved[0].points)


def test_how_a_batch_is_given_and_what_is_refused(llama_dir):
    assert Inputs(prompt=["a b", "c"], batch=2).rows == ("a b", "c")
    assert Inputs(tokens="1,2;3", batch=2).rows == ((1, 2), (3,))
    assert Inputs(tokens=[1, 2], batch=3).rows == ((1, 2),) * 3
    assert Inputs(prompt="x", batch=2).rows == ("x", "x")
    refused = [
        (dict(prompt=["a", "b"]), "2 prompts: a run takes one, or several as one batch (--batch 2"),
        (dict(tokens="1,2;3"), "2 prompts"),
        (dict(prompt=["a", "b", "c"], batch=2), "--batch 2 with 3 prompts: give 2 prompts, or one to repeat"),
        (dict(prompt="a", batch=2, decode=2), "--batch with --decode"),
        (dict(prompt="a", batch=0), "--batch must be at least 1"),
    ]
    for keywords, message in refused:
        with pytest.raises(TracerError, match=message.replace("(", r"\(").replace(")", r"\)")):
            Inputs(**keywords)
    with pytest.raises(TracerError, match="--batch 2: the llamacpp engine does not run a padded batch"):
        tracer.run(llama_dir, tokens=ROWS[:2], batch=2, candidate="llamacpp", progress=False)


def test_repeated_prompts_on_the_command_line_and_a_second_tokens(llama_dir, capsys):
    from tracer.arguments import build_parser
    from tracer.cli import inputs_of

    args = build_parser().parse_args(["run", "--prompt", "a b", "--prompt", "c", "--batch", "2"])
    assert inputs_of(args).rows == ("a b", "c")
    assert main(["run", "--model", str(llama_dir), "--prompt", "a", "--prompt", "b"]) == 2
    assert "2 prompts: a run takes one, or several as one batch (--batch 2" in capsys.readouterr().err
    assert main(["run", "--model", str(llama_dir), "--tokens", "1,2;3", "--tokens", "4", "--batch", "2"]) == 2
    assert "--tokens given twice" in capsys.readouterr().err
