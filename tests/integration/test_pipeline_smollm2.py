"""One pipeline: a sweep row says what `tracer run --variant V` says; chat templates are fed as
transformers feeds them."""

from __future__ import annotations

import pytest

import tracer
from tracer.model.config import load_config, read_hf
from tracer.pipeline.catalogue import default_variants


def test_every_default_sweep_row_names_the_first_divergence_run_names(default_model):
    variants = default_variants(read_hf(load_config(default_model)))
    assert len(variants) >= 15
    sweep = tracer.sweep(default_model, variants=variants, progress=False)
    for row in sweep.rows:
        result = None
        try:
            result = tracer.run(default_model, variant=row.variant, greedy=0, progress=False)
        except tracer.TracerError as exc:
            assert row.verdict == "error" and row.error == str(exc), row.variant
            continue
        assert row.verdict == result.verdict, row.variant
        in_sweep, alone = row.first_divergence, result.first_divergence
        assert (in_sweep and in_sweep.point) == (alone and alone.point), row.variant
        assert (in_sweep and in_sweep.localized_by) == (alone and alone.localized_by)


def test_chat_feeds_what_transformers_apply_chat_template_gives(default_model, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model))
    for system in (None, "Answer in one word."):
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": "The capital of France is"}]
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        result = tracer.run(default_model, chat=True, system=system, greedy=3, out=tmp_path / "report",
                            progress=False)
        assert result.tokens == expected and result.chat["tokens"] == len(expected)
        assert result.chat["text"].endswith("<|im_start|>assistant\n") and result.verdict == "match"
        page = (tmp_path / "report" / "report.html").read_text()
        assert "chat template" in page and "&lt;|im_start|&gt;assistant" in page
        assert f"chat template ({len(expected)} tokens)" in (tmp_path / "report" / "summary.md").read_text()
    assert len(tracer.run(default_model, chat=True, greedy=0, progress=False).tokens) == 35


def test_chat_without_a_template_or_with_token_ids_is_one_clear_error(default_model, tmp_path):
    import shutil

    bare = tmp_path / "no-template"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (bare / name).symlink_to(default_model / name)
    with pytest.raises(tracer.TracerError, match="has no chat template"):
        tracer.run(bare, chat=True)
    assert shutil.os.path.exists(default_model / "chat_template.jinja")
    with pytest.raises(tracer.TracerError, match="chat templates apply to a prompt, not to token ids"):
        tracer.run(default_model, tokens=[1, 2, 3], chat=True)
    with pytest.raises(tracer.TracerError, match="a system message needs the chat template"):
        tracer.run(default_model, system="hi")
