"""Unit tests for tracer.files.tokenizer: tokenizing without transformers, empty prompts, damaged files.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracer.core.errors import TracerError
from tracer.files import tokenizer

REPO = Path(__file__).resolve().parents[2]


def write_tiny_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.save(str(folder / "tokenizer.json"))


# --------------------------------------------------------------------------- tokenizer


def test_tokenize_without_tokenizer(tmp_path):
    with pytest.raises(TracerError) as err:
        tokenizer.tokenize(tmp_path, "hello")
    assert str(err.value) == f"model {tmp_path} has no tokenizer.json; pass token ids with --tokens"
    assert tokenizer.detokenize(tmp_path, [1, 2]) is None


def test_tokenize_empty_prompt(tmp_path):
    write_tiny_tokenizer(tmp_path)
    with pytest.raises(TracerError, match="^empty prompt$"):
        tokenizer.tokenize(tmp_path, "")


def test_tokenize_roundtrip(tmp_path):
    write_tiny_tokenizer(tmp_path)
    assert tokenizer.tokenize(tmp_path, "hello world") == [1, 2]
    assert tokenizer.tokenize(tmp_path, "hello mars") == [1, 0]
    assert tokenizer.detokenize(tmp_path, [1, 2]) == "hello world"


def test_tokenize_broken_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TracerError, match="^cannot read tokenizer "):
        tokenizer.tokenize(tmp_path, "hello")


def test_tokenize_path_never_imports_transformers(tmp_path):
    write_tiny_tokenizer(tmp_path)
    script = (
        "import sys\n"
        "from tracer.files.tokenizer import tokenize, detokenize\n"
        f"assert tokenize({str(tmp_path)!r}, 'hello world') == [1, 2]\n"
        f"detokenize({str(tmp_path)!r}, [1])\n"
        "assert 'transformers' not in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=60)
