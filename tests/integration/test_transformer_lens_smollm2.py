"""A real TransformerLens 4 bridge cache of the bundled SmolLM2 against tracer's hf trace.

TransformerLens is not among the test extras (it pulls wandb, datasets and pyarrow; `pip install -e
'.[bench]'`): this test skips without it. tests/unit/test_transformer_lens.py covers the same names
without TransformerLens.
"""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import tracer
from tests.dumps import transformer_lens_4_names

pytest.importorskip("transformer_lens")


PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def bridge_cache(default_model, tmp_path_factory):
    """The cache written as docs/trace-format.md tells a user to, and its names in order."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory; nothing may try the hub
    hf = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32, attn_implementation="eager")
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    bridge = TransformerBridge.boot_transformers(str(default_model), hf_model=hf, tokenizer=tokenizer, device="cpu")
    ids = tokenizer(PROMPT).input_ids
    with torch.inference_mode():
        _, cache = bridge.run_with_cache(torch.tensor([ids]))
    path = tmp_path_factory.mktemp("tl") / "tl.safetensors"
    # clone: hook_q and attn.q.hook_out are one tensor, and save_file refuses shared storage
    save_file({name: t.detach().clone().contiguous() for name, t in cache.items()}, str(path),
              metadata={"tokens": json.dumps(ids), "runtime": "TransformerLens"})
    return path, list(cache.keys())


def test_the_bridge_names_are_the_ones_the_unit_tests_use(bridge_cache):
    _, names = bridge_cache
    assert names == [name for name, _ in transformer_lens_4_names(30)]  # 1393 names


def test_a_bridge_cache_maps_every_point_and_matches_bitwise(default_model, bridge_cache):
    path, _ = bridge_cache
    reference = tracer.record(default_model, PROMPT, engine="hf", progress=False)
    result = tracer.compare_files(reference, path)
    compared = [p for p in result.points if p.recorded]
    assert result.verdict == "match" and len(compared) == len(reference.points) == 513
    assert max(p.rel_l2 for p in compared) == 0.0  # the bridge runs HF's own modules, unprocessed
    assert not any("match no alias" in note for note in result.notes)
