"""Chat templates are fed as transformers feeds them (that a sweep row says what `tracer run --variant V`
says is held by tests/integration/test_variants_smollm2.py, on its sweep)."""

from __future__ import annotations

import pytest

import tracer


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
