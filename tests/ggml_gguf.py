"""A tiny Llama directory written as a quantized GGUF (Q4_1 projections, Q8_0 embedding: the
bundled SmolLM2's mix), quantized by the gguf package, plus a copy of the directory whose config
names that file as its source (`tracer_source`), as tracer's own GGUF conversion writes it: what
`weights=gguf` reads."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from tests.tiny_gguf import gguf_tensors, llama_writer


def write_quantized_gguf(model_dir: Path, path: Path, *, projections: str = "q4_1", embedding: str = "q8_0") -> Path:
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer = llama_writer(path, config, head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_tokenizer_model("no_vocab")
    for name, tensor in gguf_tensors(load_file(str(model_dir / "model.safetensors")), config, head_dim).items():
        values = tensor.numpy().astype(np.float32)
        kind = embedding if name == "token_embd.weight" else projections
        if values.ndim == 2:
            qtype = gguf.GGMLQuantizationType[kind.upper()]
            writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sourced_copy(model_dir: Path, gguf_file: Path, target: Path, *, link: bool = False) -> Path:
    """`model_dir` copied to `target` with config.json's tracer_source naming `gguf_file`; `link`:
    the other files symlinked instead of copied (a converted SmolLM2's 540 MB of weights)."""
    shutil.copytree(model_dir, target, copy_function=os.symlink if link else shutil.copy2)
    config = json.loads((target / "config.json").read_text())
    config["tracer_source"] = {"gguf_file": str(gguf_file)}
    (target / "config.json").unlink()  # a link's target stays as it was
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def quantized_models(folder: Path) -> tuple[Path, Path, Path]:
    """(a tiny HF directory, its Q4_1/Q8_0 GGUF, a copy of the directory converted from it) in `folder`."""
    from tests.conftest import write_tiny_llama

    model = write_tiny_llama(folder / "model")
    gguf_file = write_quantized_gguf(model, folder / "tiny-q4_1.gguf")
    return model, gguf_file, sourced_copy(model, gguf_file, folder / "converted")
