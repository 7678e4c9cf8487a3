"""A model directory written as a GGUF file, the way its user writes one, and cached.

Where the user has llama.cpp's own converter, it runs: ``$TRACER_LLAMACPP_CONVERTER`` (the script
``convert_hf_to_gguf.py`` or a llama.cpp checkout holding it), else one beside the installed
llama-cpp-python (its wheel ships none; a source install may). It runs in a child process, as the user
runs it, with one change where the directory has no tokenizer: its ``set_vocab`` writes
``tokenizer.ggml.model = "no_vocab"`` and the vocabulary's size (llama.cpp loads that; tracer feeds token
ids), where the script itself would stop at the missing file.

Else gguf-py's ``GGUFWriter`` and tensor-name map write the file with the transforms convert_hf_to_gguf.py
applies to each family tracer traces, read from its classes (llama.cpp as llama-cpp-python 0.3.36 vendors
it, ``conversion/{base,llama,qwen,gemma,phi,olmo}.py``): Llama's and Mistral's q/k rows permuted so each
RoPE pair is adjacent, Gemma's norm weights stored as 1 + w, Gemma 2's lm_head dropped, the metadata each
class writes (sliding window, soft-capping, Phi-3's rope dimensions, ...), 1-D tensors and norms in f32,
the matrices in the file type (``auto``: the directory's own bf16/f16, else f16). Always without a
vocabulary. ``tests/unit/test_hf_to_gguf.py`` checks both write the same tensors and metadata.

The file is cached under ``cache_root()/gguf/``, keyed by the SHA-256 of the directory's config and
weights, the converter and the file type (``tracer.files.convert.cached_build``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from tracer.core.errors import TracerError, one_line
from tracer.files import hashes
from tracer.files.convert import CONFIG_FILE, cache_root, cached_build
from tracer.files.weights import check_weight_files

__all__ = ["CONVERTER_ENV", "converted_gguf", "find_converter", "write_gguf"]

CONVERTER_ENV = "TRACER_LLAMACPP_CONVERTER"
SCRIPT = "convert_hf_to_gguf.py"
GGUF_NAME = "model.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
OUTTYPES = ("auto", "f32", "f16", "bf16")
_SAID: set[Path] = set()
GEMMA3_DEFAULTS = dict(max_position_embeddings=131072, num_attention_heads=8, rms_norm_eps=1e-6, head_dim=256,
                       num_key_value_heads=4)

# transformers model_type -> (GGUF architecture, what its convert_hf_to_gguf.py class does beyond the base)
FAMILIES = {
    "llama": ("llama", "llama"), "mistral": ("llama", "llama"), "qwen2": ("qwen2", "base"),
    "qwen3": ("qwen3", "base"), "gemma2": ("gemma2", "gemma2"), "gemma3_text": ("gemma3", "gemma3"),
    "phi3": ("phi3", "phi3"), "olmo2": ("olmo2", "olmo2"),
}


def find_converter() -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py where the user has it: $TRACER_LLAMACPP_CONVERTER, else
    beside the installed llama-cpp-python; None where neither holds one."""
    named = os.environ.get(CONVERTER_ENV)
    if named:
        path = Path(named).expanduser()
        script = path / SCRIPT if path.is_dir() else path
        if not script.is_file():
            raise TracerError(f"${CONVERTER_ENV}={named}: no {SCRIPT} there")
        return script.resolve()
    spec = importlib.util.find_spec("llama_cpp")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        package = Path(folder)
        for place in (package, package / "vendor" / "llama.cpp", package.parent / "vendor" / "llama.cpp"):
            if (place / SCRIPT).is_file():
                return (place / SCRIPT).resolve()
    return None


def converted_gguf(directory: Path, cache_dir=None, outtype: str = "f32") -> Path:
    """The GGUF of a model directory, converted once (cached) and said in one line on stderr."""
    directory = Path(directory).expanduser().resolve()
    config = _config(directory)
    script = find_converter()
    if script is None:
        _architecture(config)  # refused before anything is hashed or written
    check_weight_files(directory)  # a folder without weights: one line, not an empty GGUF
    how = f"llama.cpp's {script}" if script else f"gguf-py's writer (no {SCRIPT} found: ${CONVERTER_ENV})"
    root = cache_root(cache_dir)
    target = root / "gguf" / _cache_name(directory, script, outtype, root)
    cached = (target / GGUF_NAME).is_file()
    build = functools.partial(_build, directory, script=script, outtype=outtype)
    path = cached_build(target, build, progress=False) / GGUF_NAME
    if path not in _SAID:  # once per process: a run asks for its candidate's file more than once
        _SAID.add(path)
        print(f"tracer: GGUF of {directory.name} {'(cached) ' if cached else ''}by {how}: {path}", file=sys.stderr)
    return path


def _build(directory: Path, tmp: Path, *, script: Path | None, outtype: str) -> None:
    if script is None:
        write_gguf(directory, tmp / GGUF_NAME, outtype)
    else:
        run_converter(script, directory, tmp / GGUF_NAME, outtype)


def run_converter(script: Path, directory: Path, target: Path, outtype: str = "auto",
                  vocab: bool | None = None) -> Path:
    """llama.cpp's `script` on `directory`, in a child process (`python -m tracer.files.hf_to_gguf`).
    `vocab`: write the tokenizer (default: where the directory has one), else "no_vocab"."""
    if vocab is None:
        vocab = any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)
    done = subprocess.run([sys.executable, "-m", "tracer.files.hf_to_gguf", str(script), str(directory),
                           str(target), outtype, "vocab" if vocab else "no_vocab"], capture_output=True, text=True)
    if done.returncode != 0 or not target.is_file():
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise TracerError(one_line(f"{SCRIPT} failed on {directory.name}: {lines[-1] if lines else done.returncode}"))
    return target


def _run_here(script: str, directory: str, target: str, outtype: str, vocab: str) -> int:
    """The child: convert_hf_to_gguf.py's own classes on the directory, as its main() runs them."""
    root = Path(script).parent
    sys.path[:0] = [str(root), str(root / "gguf-py")]  # its own gguf-py, as the script takes it
    import gguf  # llama.cpp's own gguf-py, from the path set just above
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class  # the script's classes

    hparams = ModelBase.load_hparams(Path(directory), False)
    model_class = get_model_class(get_model_architecture(hparams, ModelType.TEXT), mmproj=False)
    if vocab == "no_vocab":
        def no_vocab(self):
            self.gguf_writer.add_tokenizer_model("no_vocab")
            if "vocab_size" in self.hparams and self.gguf_writer.arch != "llama":  # LlamaModel writes it itself
                self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])
        model_class.set_vocab = no_vocab
    types = {"auto": "GUESSED", "f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16"}
    model = model_class(Path(directory), getattr(gguf.LlamaFileType, types[outtype]), Path(target))
    model.write()
    return 0


# --- gguf-py's writer -------------------------------------------------------------------------


def write_gguf(directory: Path, target: Path, outtype: str = "auto") -> Path:
    """`directory` as the GGUF convert_hf_to_gguf.py writes for its family, without a vocabulary."""
    import gguf  # gguf-py's writer: a conversion's only
    import torch  # the tensors' transforms, as the converter makes them

    from tracer.files.weights import WeightFiles  # torch: the tensors read

    config = _hparams(Path(directory))
    arch, kind = _architecture(config)
    weights = WeightFiles(directory)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    ftype = _file_type(gguf, weights, outtype)
    writer = gguf.GGUFWriter(str(target), arch)
    # tensors go by their GGUF names (gguf-py's map), where the converter tests the HF ones: the same tensors
    for name in weights:
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise TracerError(f"{directory.name}: tensor {name} has no GGUF name in llama.cpp's {arch}")
        if kind == "gemma2" and new_name == "output.weight":  # Gemma2Model.filter_tensors: llama.cpp ties it
            continue
        tensor = weights[name]
        tensor = tensor.float() if tensor.dtype not in (torch.float16, torch.float32) else tensor
        tensor = _transformed(kind, config, new_name, tensor)
        if kind == "gemma3" and new_name == "token_embd.weight":
            tensor = tensor[:_vocabulary_rows(Path(directory), tensor.shape[0])]
        data = tensor.numpy()
        qtype = (gguf.GGMLQuantizationType.F32 if data.ndim <= 1 or new_name.endswith("_norm.weight")
                 else {gguf.LlamaFileType.ALL_F32: gguf.GGMLQuantizationType.F32,
                       gguf.LlamaFileType.MOSTLY_F16: gguf.GGMLQuantizationType.F16,
                       gguf.LlamaFileType.MOSTLY_BF16: gguf.GGMLQuantizationType.BF16}[ftype])
        writer.add_tensor(new_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    _metadata(gguf, writer, directory, config, arch, kind, ftype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(target)


def _transformed(kind: str, config: dict, gguf_name: str, tensor):
    if kind == "llama" and gguf_name.endswith(("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")):
        # LlamaModel.permute: each head's rows (n_head, 2, D/2) -> (n_head, D/2, 2), RoPE pairs adjacent
        heads = config["num_attention_heads"] if "attn_q." in gguf_name else config["num_key_value_heads"]
        return (tensor.reshape(heads, 2, tensor.shape[0] // heads // 2, *tensor.shape[1:])
                .swapaxes(1, 2).reshape(tensor.shape))
    if kind in ("gemma2", "gemma3") and gguf_name.endswith("norm.weight"):
        return tensor + 1  # Gemma's RMSNorm scales by (1 + w): llama.cpp stores the sum
    return tensor


def _vocabulary_rows(directory: Path, rows: int) -> int:
    """Gemma3Model drops the embedding's rows past its tokenizer's tokens (tokenizer.json's count here;
    a tokenizer.model only llama.cpp's converter reads)."""
    if (directory / "tokenizer.model").is_file():
        raise TracerError(f"{directory.name}: a Gemma 3 with tokenizer.model: set ${CONVERTER_ENV} to llama.cpp's "
                          f"{SCRIPT}")
    if not (directory / "tokenizer.json").is_file():
        return rows
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    return len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"])


def _metadata(gguf, writer, directory: Path, config: dict, arch: str, kind: str, ftype) -> None:
    """The keys convert_hf_to_gguf.py's class writes (ModelBase.prepare_metadata, set_gguf_parameters)."""
    total, shared, expert, count = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, directory, None, total)
    metadata.name = metadata.name or directory.name
    if metadata.size_label is None and total > 0:
        metadata.size_label = gguf.size_label(total, shared, expert, count)
    writer.add_type(gguf.GGUFType.MODEL)
    metadata.set_gguf_meta_model(writer)
    rope = _rope_parameters(config)
    if kind == "gemma3":  # Gemma3Model.set_gguf_parameters: the base's keys, defaults where the config has none
        config = {**GEMMA3_DEFAULTS, **config}
        rope.setdefault("rope_theta", 1_000_000.0)
    if kind == "gemma2":
        _gemma2_parameters(writer, config, ftype)
    elif kind == "phi3":
        _phi3_parameters(writer, config, rope, ftype)
    else:
        _base_parameters(writer, config, rope, ftype)
    if kind == "llama":
        writer.add_vocab_size(config["vocab_size"])
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        writer.add_rope_dimension_count(head_dim)
    if kind == "gemma3":  # the base's keys with Gemma3Model's defaults are above
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        if config.get("sliding_window_pattern") != 1:
            writer.add_sliding_window(config["sliding_window"])
    if kind == "olmo2" and "sliding_window" in config:
        writer.add_sliding_window(config["sliding_window"])
        types = config.get("layer_types")
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in types] if types else
                                          [(i + 1) % 4 != 0 for i in range(config["num_hidden_layers"])])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_tokenizer_model("no_vocab")
    if kind != "llama":
        writer.add_vocab_size(config["vocab_size"])


def _base_parameters(writer, config: dict, rope: dict, ftype) -> None:
    """TextModel.set_gguf_parameters, for the keys a dense family's config holds."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    if "num_key_value_heads" in config:
        writer.add_head_count_kv(config["num_key_value_heads"])
    full = rope.get("full_attention", rope)
    scaling = full.get("rope_type")
    if scaling not in (None, "default"):
        # linear/yarn/llama3/longrope keys or tensors: only llama.cpp's converter writes them
        raise TracerError(f"rope_type {scaling}: tracer's GGUF writer has no rope scaling; "
                          f"set ${CONVERTER_ENV} to llama.cpp's {SCRIPT}")
    if full.get("rope_theta") is not None:
        writer.add_rope_freq_base(full["rope_theta"])
    if rope.get("sliding_attention", {}).get("rope_theta") is not None:
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_file_type(ftype)


def _gemma2_parameters(writer, config: dict, ftype) -> None:
    """Gemma2Model.set_gguf_parameters: no RoPE base (llama.cpp's default 10000), no query_pre_attn_scalar
    (llama.cpp scales queries by 1/sqrt(head_dim), the 27B's by 1/sqrt(hidden/heads))."""
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_file_type(ftype)
    writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])


def _phi3_parameters(writer, config: dict, rope: dict, ftype) -> None:
    """Phi3MiniModel.set_gguf_parameters (its long-context rope factors: only llama.cpp's converter)."""
    if rope.get("long_factor"):
        raise TracerError(f"Phi-3's longrope factors: tracer's GGUF writer has none; set ${CONVERTER_ENV} "
                          f"to llama.cpp's {SCRIPT}")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    writer.add_file_type(ftype)
    writer.add_sliding_window(config.get("sliding_window") or 0)  # 0 tells Phi-4 from Phi-3


def _rope_parameters(config: dict) -> dict:
    """TextModel.__init__'s rope_parameters: the config's, with the top-level keys mirrored in."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "full_attention" in rope or "sliding_attention" in rope:
        return rope
    local = next((config[k] for k in ("local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta",
                                      "rope_local_base_freq") if k in config), None)
    if local is not None:
        rope["sliding_attention"] = {"rope_theta": local}
    for key in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
        if key not in rope and config.get(key) is not None:
            rope[key] = config[key]
    if "rope_type" not in rope and rope.get("type") is not None:
        rope["rope_type"] = rope["type"]
    return rope


def _file_type(gguf, weights, outtype: str):
    """The converter's --outtype; `auto` guesses from the first matrix's dtype as ModelBase does."""
    import torch  # the weights' dtypes

    if outtype not in OUTTYPES:
        raise TracerError(f"GGUF file type {outtype!r}: one of {', '.join(OUTTYPES)}")
    if outtype == "auto":
        first = next((weights.header(name).dtype for name in weights if weights.header(name).dim() >= 2), None)
        outtype = {torch.bfloat16: "bf16", torch.float16: "f16"}.get(first, "f16")
    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16}[outtype]


def _config(directory: Path) -> dict:
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise TracerError(f"{directory}: no {CONFIG_FILE}, not a model directory") from None
    except (OSError, ValueError) as exc:
        raise TracerError(one_line(f"{directory / CONFIG_FILE} is unreadable: {exc}")) from None
    if not isinstance(config, dict):
        raise TracerError(f"{directory / CONFIG_FILE} is not a JSON object")
    return config


def _hparams(directory: Path) -> dict:
    """The config as ModelBase.load_hparams reads it: transformers' config class, its defaults filled in
    (a Llama's head_dim where config.json has none), else config.json as it is."""
    config = _config(directory)
    try:
        from transformers import AutoConfig  # the converter's own reading of the config: a conversion's only

        return AutoConfig.from_pretrained(directory).to_dict()
    except Exception:  # noqa: BLE001 - as the converter, which falls back to config.json on any failure
        return config


def _architecture(config: dict) -> tuple[str, str]:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise TracerError(f"model_type {model_type!r}: tracer has no GGUF writer for it "
                          f"(llama.cpp's: ${CONVERTER_ENV})")
    return FAMILIES[model_type]


def _cache_name(directory: Path, script: Path | None, outtype: str, root: Path) -> str:
    # The directory's content (config, weights), the converter's own bytes and the file type: a
    # retrained model, another llama.cpp or another type each get their own file.
    digest = hashlib.sha256(f"{outtype}\0{hashes.file_hash(script) if script else 'gguf-py'}\0".encode())
    for name, sha256 in hashes.model_contents(directory, root):
        digest.update(f"{name}\0{sha256}\0".encode())
    return f"{directory.name.lower()}-{digest.hexdigest()[:12]}"


if __name__ == "__main__":
    sys.exit(_run_here(*sys.argv[1:]))
