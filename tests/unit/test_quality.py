"""`tracer quality`: llama-perplexity's figures (tracer/comparison/perplexity.py) checked against direct
computations on known logits, its chunking on token counts, the run on tiny models (hf against
reimpl), where the loss is made (tracer/pipeline/attribution.py), and the user's mistakes."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import tracer
from tests.conftest import write_tiny_llama
from tracer.cli import main
from tracer.comparison.perplexity import (
    Statistics,
    chunk_tokens,
    exact_kld,
    fitting_ctx,
    nearest_int,
    percentile,
    scored_slice,
    scored_targets,
    stored_log_probs,
    token_figures,
)
from tracer.core.errors import TracerError

CTX = 32
SCORED = CTX - 1 - CTX // 2  # per chunk


# --- the figures on known logits ----------------------------------------------------------------


def logits_pair(rows: int = 300, vocab: int = 200, spread: float = 2.0, noise: float = 0.3, seed: int = 0):
    """Base logits whose log-probabilities all lie above -16, a candidate near them, next tokens."""
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal((rows, vocab)) * spread).astype(np.float32)
    candidate = (base + rng.standard_normal((rows, vocab)) * noise).astype(np.float32)
    return base, candidate, rng.integers(0, vocab, rows)


def log_softmax64(x: np.ndarray) -> torch.Tensor:
    return F.log_softmax(torch.from_numpy(x).double(), dim=-1)


def test_nearest_int_rounds_half_to_even_as_ggml_does():
    assert nearest_int(np.array([0.5, 1.5, 2.5, -0.5, -1.5, 3.49, 65534.6], np.float32)).tolist() == \
        [0, 2, 2, 0, -2, 3, 65535]


def test_stored_log_probs_keep_16_nats_in_16_bits():
    base, _, _ = logits_pair(rows=20, spread=8.0)  # wide enough that many entries fall below -16
    stored = stored_log_probs(base)
    exact = log_softmax64(base).numpy()
    assert (stored.levels.max(axis=1) == 65535).all()  # the top entry is the top level
    above = base > base.max(axis=1, keepdims=True) - 16
    step = stored.scale[:, None].repeat(base.shape[1], axis=1)
    assert (np.abs(stored.log_probs() - exact)[above] <= 0.51 * step[above] + 1e-5).all()
    assert (stored.levels[~above] == 0).all() and (~above).any()


def test_statistics_against_a_direct_computation():
    base, candidate, targets = logits_pair()
    stats = Statistics.of(token_figures(candidate, stored_log_probs(base), targets))
    log_p, log_q = log_softmax64(base), log_softmax64(candidate)
    rows = torch.arange(len(targets))
    kld = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).numpy()  # KL(P ‖ Q) per row
    # every base log-prob is above -16 here, so only the 16-bit storage (half a step of 2.4e-4) separates them
    assert stats.kld.value == pytest.approx(kld.mean(), rel=1e-3)
    assert stats.kld.uncertainty == pytest.approx(kld.std() / math.sqrt(len(kld) - 1), rel=1e-2)
    assert stats.kld_median == pytest.approx(np.median(kld), rel=1e-3)
    assert stats.kld_percentiles["99.0"] == pytest.approx(np.percentile(kld, 99), rel=1e-3)
    assert stats.ppl.value == pytest.approx(math.exp(-log_q[rows, targets].mean().item()), rel=1e-6)
    assert stats.ppl_base.value == pytest.approx(math.exp(-log_p[rows, targets].mean().item()), rel=1e-4)
    assert stats.ppl_diff.value == pytest.approx(stats.ppl.value - stats.ppl_base.value)
    assert stats.same_top.value == (base.argmax(1) == candidate.argmax(1)).mean()
    p_diff = log_q[rows, targets].exp() - log_p[rows, targets].exp()
    assert stats.rms_p_diff.value == pytest.approx(p_diff.pow(2).mean().sqrt().item(), rel=1e-3)
    assert stats.p_diff.value == pytest.approx(p_diff.mean().item(), abs=1e-5)
    assert exact_kld(base, candidate) == pytest.approx(kld, rel=1e-9)


def test_entries_below_minus_16_are_left_out_of_the_kld():
    # five likely tokens and a long tail below -16, which the candidate raises to about -13.6
    rng = np.random.default_rng(2)
    base = np.full((10, 20000), -17.0, dtype=np.float32)
    base[:, :5] = rng.normal(0, 0.5, (10, 5))
    candidate = base.copy()
    candidate[:, 5:] = -12.0
    figures = token_figures(candidate, stored_log_probs(base), rng.integers(0, 5, 10))
    log_p, log_q = log_softmax64(base).numpy(), log_softmax64(candidate).numpy()
    truncated = np.where(log_p > -16, np.exp(log_p) * (log_p - log_q), 0).sum(1)
    assert figures.kld == pytest.approx(truncated, abs=1.3e-4)  # the storage: half a 16/65535 step at most
    assert (truncated - exact_kld(base, candidate) > 5e-4).all()  # the tail's part, left out


def test_identical_logits_differ_only_by_the_16_bit_storage():
    base, _, targets = logits_pair()
    stats = Statistics.of(token_figures(base, stored_log_probs(base), targets))
    assert abs(stats.kld.value) < 1e-6 and stats.same_top.value == 1.0
    assert stats.ppl.value == pytest.approx(stats.ppl_base.value, rel=1e-4)
    assert exact_kld(base, base).max() == 0.0


def test_percentile_is_linear_between_neighbours_as_numpy_s_default():
    values = np.sort(np.random.default_rng(1).random(137).astype(np.float32))
    for fraction in (0.001, 0.1, 0.5, 0.9, 0.999):
        assert percentile(values, fraction) == pytest.approx(np.percentile(values, 100 * fraction), rel=1e-6)
    assert percentile(values, 0) == values[0] and percentile(values, 1) == values[-1]


# --- chunks -------------------------------------------------------------------------------------


def test_chunks_as_llama_perplexity_cuts_them():
    tokens = list(range(100, 407))  # 307 tokens, as tests/data/porting.txt on SmolLM2
    chunks = chunk_tokens(tokens, 128, bos=None)
    assert [len(c) for c in chunks] == [128, 128]  # 307 // 128; the last 51 dropped
    assert chunks[1][0] == 228 and chunks[1][-1] == 355
    with_bos = chunk_tokens(tokens, 128, bos=1)
    assert [c[0] for c in with_bos] == [1, 1] and with_bos[0][1:] == chunks[0][1:]
    assert scored_targets(tokens, 128, 1).tolist() == list(range(100 + 128 + 65, 100 + 256))  # 63 next tokens
    assert len(chunk_tokens(tokens, 64, bos=None, limit=3)) == 3


@pytest.mark.parametrize("count, ctx, message", [(255, 128, "has 255 tokens; -c 128 needs at least 256"),
                                                 (300, 3, "at least 4 tokens")])
def test_too_few_tokens_or_too_small_a_context_is_refused(count, ctx, message):
    with pytest.raises(TracerError, match=message):
        chunk_tokens(list(range(count)), ctx, bos=None)


# --- the run on tiny models ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def soft_model(tmp_path_factory):
    """A tiny random Llama whose final norm is scaled down 10x: its next-token distributions are
    spread like a trained model's (the plain tiny model's logits put every target below -16)."""
    folder = write_tiny_llama(tmp_path_factory.mktemp("quality") / "soft", seed=0)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 0.1
    save_file(tensors, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def tokens():
    generator = random.Random(0)
    return [generator.randrange(97) for _ in range(4 * CTX + 2)]


@pytest.fixture(scope="module")
def theta_quality(soft_model, tokens):
    return tracer.quality(tokens=tokens, model=soft_model, variant="theta=500", ctx=CTX, by_layer=True,
                          progress=False)


def test_a_wrong_theta_loses_and_the_chunks_are_counted(theta_quality, tokens):
    q = theta_quality
    assert q.chunks == 4 and q.tokens == len(tokens) and q.bos is None
    assert q.statistics.count == 4 * SCORED and len(q.lines) == 4
    assert q.lines[-1].kld == q.statistics.kld  # the running line after the last chunk is the final figure
    assert q.statistics.kld.value > 0.01 and q.statistics.same_top.value < 1.0
    assert q.exact_kld.value == pytest.approx(q.statistics.kld.value, rel=1e-3)  # no entry below -16 here
    assert q.statistics.ppl.value > q.statistics.ppl_base.value
    assert "the last 2 tokens fill no whole chunk" in " ".join(q.notes)


def test_where_the_loss_is_made_by_a_wrong_theta(theta_quality):
    layers = theta_quality.layers
    shares = {s.component: s for s in layers.shares}
    assert list(shares) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    for untouched in ("model.embed_tokens", "model.norm", "lm_head"):  # theta changes only the blocks' RoPE
        assert shares[untouched].kld == 0.0 and shares[untouched].same_top == 1.0
    assert shares["model.layers.0"].share > 0.5 and shares["model.layers.1"].share > 0.05
    assert 0.8 < layers.sum_of_shares < 1.3  # about additive: recorded as measured, not forced to 1
    # reimpl is its own emulation, and hf and reimpl agree bitwise on this model
    assert layers.emulated_kld == pytest.approx(layers.total_kld, rel=1e-6) and layers.floor_kld < 1e-9


def test_each_layers_share_is_its_swap_computed_apart_over_every_chunk(theta_quality, soft_model, tokens):
    """Each share recomputed without tracer's model: transformers' Llama as the reference and, with the
    wrong base, as the candidate; block i swapped by a hook that runs the candidate's block on the
    reference's input; KL(P_ref ‖ P_swapped) over the scored half of every chunk, over the candidate's
    whole KLD. A share taken from one chunk alone would differ (the chunks' KLDs differ by far more)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def load(theta=None):
        config = AutoConfig.from_pretrained(soft_model)
        if theta is not None:
            config.rope_parameters["rope_theta"] = theta
        return AutoModelForCausalLM.from_pretrained(soft_model, config=config, dtype=torch.float32,
                                                    attn_implementation="eager").eval()

    reference, candidate = load(), load(theta=500.0)
    inv_freq = candidate.model.rotary_emb.inv_freq
    assert float(inv_freq[1]) == pytest.approx(500.0 ** (-2 / 16))  # head_dim 16: the wrong base took

    def kl(p_logits, q_logits):  # (R, V) -> (R,) in f64
        log_p, log_q = F.log_softmax(p_logits.double(), -1), F.log_softmax(q_logits.double(), -1)
        return (log_p.exp() * (log_p - log_q)).sum(-1)

    def swap(i):
        def hook(module, args, kwargs, output):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            positions = torch.arange(hidden.shape[1])[None]
            own = candidate.model.layers[i](*args, **{**kwargs, "position_embeddings":
                                                     candidate.model.rotary_emb(hidden, positions)})
            return own
        return reference.model.layers[i].register_forward_hook(hook, with_kwargs=True)

    rows, layers = scored_slice(CTX), reference.config.num_hidden_layers
    whole, swapped, per_chunk = [], {i: [] for i in range(layers)}, []
    with torch.no_grad():
        for start in range(0, len(tokens) - CTX + 1, CTX):
            ids = torch.tensor([tokens[start:start + CTX]])
            base = reference(ids, use_cache=False).logits[0, rows]
            whole.append(kl(base, candidate(ids, use_cache=False).logits[0, rows]))
            per_chunk.append(float(whole[-1].mean()))
            for i in range(layers):
                handle = swap(i)
                try:
                    swapped[i].append(kl(base, reference(ids, use_cache=False).logits[0, rows]))  # no cache: one pass
                finally:
                    handle.remove()
    total = float(torch.cat(whole).mean())
    assert len(per_chunk) == 4 and max(per_chunk) > 1.5 * min(per_chunk)  # one chunk alone would not do
    shares = {s.component: s.share for s in theta_quality.layers.shares}
    assert theta_quality.layers.total_kld == pytest.approx(total, rel=1e-5)
    for i in range(layers):
        assert shares[f"model.layers.{i}"] == pytest.approx(float(torch.cat(swapped[i]).mean()) / total, rel=1e-5)


def test_the_same_model_on_both_sides_loses_nothing(soft_model, tokens):
    q = tracer.quality(tokens=tokens, model=soft_model, ctx=CTX, progress=False)
    assert q.exact_kld.value < 1e-9 and abs(q.statistics.kld.value) < 1e-5
    assert q.statistics.same_top.value == 1.0
    assert q.statistics.ppl.value == pytest.approx(q.statistics.ppl_base.value, rel=1e-3)


def test_the_json_markdown_and_terminal_forms(theta_quality, soft_model, tokens, tmp_path, capsys):
    payload = theta_quality.to_dict()
    assert json.loads(json.dumps(payload))["statistics"]["kld"]["value"] == theta_quality.statistics.kld.value
    assert payload["scored"] == 4 * SCORED and len(payload["layers"]["shares"]) == 5
    text = str(theta_quality)
    assert all(len(line) < 100 for line in text.splitlines())
    assert "Mean    KLD:" in text and "Same top p:" in text and "model.layers.0" in text
    assert theta_quality.markdown().startswith("### tracer quality: reimpl[theta=500] against hf")
    out = tmp_path / "q.json"
    code = main(["quality", "--model", str(soft_model), "--tokens", ",".join(map(str, tokens)), "-c", str(CTX),
                 "--variant", "theta=500", "--json", str(out), "--markdown", "-"])
    assert code == 0
    assert capsys.readouterr().out.startswith("### tracer quality")  # --markdown -: stdout holds it alone
    assert json.loads(out.read_text())["statistics"]["same_top"] == payload["statistics"]["same_top"]


def test_a_tokenizer_that_adds_bos_starts_every_chunk_with_it(soft_model, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    folder = tmp_path / "with-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((soft_model / name).read_bytes())
    vocab = {"<unk>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 97)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(folder / "tokenizer.json"))
    words = " ".join(f"w{2 + (7 * i) % 95}" for i in range(2 * CTX + 5))
    q = tracer.quality(words + " <s>", model=folder, ctx=CTX, variant="theta=500", progress=False)
    # BOS, the 69 words, and "<s>" read as plain text: "<", "s", ">" (one token if parsed as the special one)
    assert q.bos == 1 and q.tokens == 1 + (2 * CTX + 5) + 3
    assert q.chunks == 2 and q.statistics.count == 2 * SCORED


def test_without_c_a_short_text_takes_the_largest_context_it_fills_twice_and_says_so(soft_model, tokens):
    """130 tokens fill no two chunks of 512 (llama-perplexity's -c): 64 is the largest power of two they do."""
    q = tracer.quality(tokens=tokens, model=soft_model, progress=False)
    assert len(tokens) == 130 and q.ctx == 64 and q.chunks == 2
    assert q.notes[0] == "-c 64: the text's 130 tokens fill no two chunks of 512, the default (pass -c to choose)"
    assert fitting_ctx(2048, 512) == 512 and fitting_ctx(1023, 512) == 256 and fitting_ctx(7, 512) == 4


# --- mistakes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, message", [
    (["-c", "128"], "has 130 tokens; -c 128 needs at least 256"),
    (["-c", "2"], "-c/--ctx must be at least 4, got 2"),
    (["-c", "32", "--chunks", "0"], "--chunks must be at least 1, got 0"),
    (["-c", "32", "--candidate", "file:nothing.safetensors"], "the file engine cannot give logits"),
    (["-c", "32", "--variant", "layers=1", "--by-layer"], "num_hidden_layers differ"),
])
def test_a_mistake_is_one_line_and_exit_2(extra, message, soft_model, tokens, capsys):
    code = main(["quality", "--model", str(soft_model), "--tokens", ",".join(map(str, tokens)), *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err


def test_a_context_past_the_model_s_positions_is_refused(soft_model):
    ids = [random.Random(1).randrange(97) for _ in range(600)]
    with pytest.raises(TracerError, match="-c 256 is more than the model's 128 positions"):
        tracer.quality(tokens=ids, model=soft_model, ctx=256, progress=False)


def test_a_missing_text_file_is_one_line(tmp_path, capsys):
    assert main(["quality", "--text", str(tmp_path / "absent.txt")]) == 2
    assert "cannot read text file" in capsys.readouterr().err
