"""llama-perplexity's KL-divergence figures, computed as it computes them.

llama.cpp's `llama-perplexity --kl-divergence` (tools/perplexity/perplexity.cpp of the llama.cpp
that llama-cpp-python 0.3.36 vendors) is what people who quantize read: mean KL divergence of a
model's next-token distributions from a base model's, how often the two argmaxes agree ("same
top p"), the perplexity of both. This module is its arithmetic, step for step, so that the
figures are its figures for the same logits:

- the text is cut into chunks of `n_ctx` tokens (`tokens // n_ctx` of them; the tail is dropped),
  the first token of each chunk replaced by BOS where the vocabulary adds one, and only the
  second half of each chunk is scored: the logits at positions `n_ctx/2 .. n_ctx-2`, each
  predicting the next token (`n_ctx - 1 - n_ctx/2` tokens per chunk);
- the base model's log-probabilities are kept as llama-perplexity stores them in its
  `--kl-divergence-base` file: per token, a scale and a minimum (f32) and 16 bits per vocabulary
  entry over the top 16 nats (`stored_log_probs`); every base figure is read back from that;
- per scored token (`token_figures`): the candidate's NLL (f32), the base's, the KL divergence
  summed over the vocabulary entries whose base log-probability is above -16 (f32 terms added in
  f64), whether the argmaxes agree (the first maximum on each side), and Δp, the candidate's
  probability of the true next token minus the base's;
- the statistics (`Statistics.of`): sums in f64, means with llama-perplexity's uncertainties,
  its covariance and correlation of the two log-perplexities, median and percentiles of the KLD
  and Δp values taken in f32 as it takes them, RMS Δp, same top p.

f32 steps are computed in f32 (numpy's expf may differ from glibc's by an ulp), f64 steps in f64.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from tracer.core.errors import TracerError

F32, F64 = np.float32, np.float64
LOG_PROB_RANGE = 16  # nats of base log-probability kept; KLD terms below -16 are left out
LEVELS = 65535  # 16-bit levels over that range
# Percentiles llama-perplexity prints, highest first (the median is printed between them).
KLD_PERCENTILES = (0.999, 0.99, 0.95, 0.90, 0.10, 0.05, 0.01, 0.001)
DELTA_P_PERCENTILES = (0.999, 0.99, 0.95, 0.90, 0.75, 0.25, 0.10, 0.05, 0.01, 0.001)
STATISTICS_MIN_COUNT = 100  # llama-perplexity prints no final statistics for fewer scored tokens
MIN_CTX = 4  # the smallest context with a scored token past its first half


def fitting_ctx(tokens: int, default: int) -> int:
    """The context a run given none takes: `default` where the text fills two chunks of it (llama-perplexity's
    minimum), else the largest power of two that does (at least `MIN_CTX`; a shorter text is refused)."""
    ctx = default
    while 2 * ctx > tokens and ctx // 2 >= MIN_CTX:
        ctx //= 2
    return ctx


# --- chunks -------------------------------------------------------------------------------------


def first_scored(n_ctx: int) -> int:
    """The first position of a chunk whose logits are scored (`first = n_ctx/2`)."""
    return n_ctx // 2


def chunk_tokens(tokens: list[int], n_ctx: int, bos: int | None, limit: int | None = None) -> list[list[int]]:
    """The chunks llama-perplexity evaluates: `len(tokens) // n_ctx` windows of `n_ctx` tokens
    (at most `limit`), each with its first token replaced by `bos` (None: the vocabulary adds none).

    Raises:
        TracerError: fewer than 2·n_ctx tokens (llama-perplexity refuses them too), or n_ctx < 4.
    """
    if n_ctx < MIN_CTX:
        raise TracerError(f"the context must be at least {MIN_CTX} tokens (half of it is scored), got {n_ctx}")
    if len(tokens) < 2 * n_ctx:
        raise TracerError(f"the text has {len(tokens)} tokens; -c {n_ctx} needs at least {2 * n_ctx} "
                          f"(llama-perplexity's minimum)")
    count = len(tokens) // n_ctx if limit is None else min(limit, len(tokens) // n_ctx)
    chunks = []
    for i in range(count):
        chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        chunks.append(chunk)
    return chunks


def scored_targets(tokens: list[int], n_ctx: int, chunk: int) -> np.ndarray:
    """The next tokens the scored logits of chunk `chunk` predict (the text's own, never the BOS)."""
    start = chunk * n_ctx
    return np.asarray(tokens[start + first_scored(n_ctx) + 1:start + n_ctx], dtype=np.int64)


def scored_slice(n_ctx: int) -> slice:
    """The positions of a chunk whose logits llama-perplexity scores: n_ctx/2 .. n_ctx - 2."""
    return slice(first_scored(n_ctx), n_ctx - 1)


def scored_rows(logits, n_ctx: int):
    """(n_ctx, V) logits of a chunk -> the (n_ctx - 1 - n_ctx/2, V) rows llama-perplexity scores."""
    return logits[scored_slice(n_ctx)]


# --- the base file ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredLogProbs:
    """Base log-probabilities as llama-perplexity's `--kl-divergence-base` file holds them: per
    token a scale and a minimum, and per vocabulary entry a 16-bit level; the log-probability of
    entry i is `scale * level[i] + min_log_prob`, in f32."""

    scale: np.ndarray  # (N,) f32
    min_log_prob: np.ndarray  # (N,) f32
    levels: np.ndarray  # (N, V) uint16

    def log_probs(self) -> np.ndarray:
        """(N, V) f32, as the KLD pass reads them back."""
        return self.scale[:, None] * self.levels.astype(F32) + self.min_log_prob[:, None]


def nearest_int(values: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: f32 + 1.5·2^23, its low mantissa bits (round half to even), as int32."""
    shifted = (values.astype(F32) + F32(12582912.0)).view(np.int32)
    return (shifted & 0x007FFFFF) - 0x00400000


def log_sum_exp(logits: np.ndarray, max_logit: np.ndarray) -> np.ndarray:
    """(N,) f32: log of the f64 sum of expf(logit - max) over the vocabulary, as llama-perplexity sums it."""
    sum_exp = np.exp(logits - max_logit[:, None]).astype(F64).sum(axis=1)
    return np.log(sum_exp).astype(F32)


def stored_log_probs(logits: np.ndarray) -> StoredLogProbs:
    """(N, V) f32 base logits -> what llama-perplexity writes for them (its `log_softmax` with a
    uint16 output): levels over [max - 16, max] of the logits, 0 below."""
    logits = np.asarray(logits, dtype=F32)
    max_logit = logits.max(axis=1)
    min_logit = np.maximum(logits.min(axis=1), max_logit - F32(LOG_PROB_RANGE))
    min_log_prob = (min_logit - max_logit) - log_sum_exp(logits, max_logit)
    scale = (max_logit - min_logit) / F32(LEVELS)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(scale != 0, F32(1) / scale, F32(0)).astype(F32)
    levels = nearest_int(inv_scale[:, None] * (logits - min_logit[:, None]))
    levels = np.where((logits > min_logit[:, None]) & (scale[:, None] != 0), levels, 0).astype(np.uint16)
    return StoredLogProbs(scale.astype(F32), min_log_prob.astype(F32), levels)


# --- per token ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenFigures:
    """Per scored token, what llama-perplexity's KLD pass computes (`log_softmax` with a base)."""

    nll: np.ndarray  # (N,) f32: the candidate's -log p(next token)
    nll_base: np.ndarray  # (N,) f32: the base's, from its stored log-probabilities
    kld: np.ndarray  # (N,) f64: sum over entries with base log-prob > -16 of p_base·(log p_base - log p)
    p_diff: np.ndarray  # (N,) f32: p(next token) - p_base(next token)
    same_top: np.ndarray  # (N,) bool: the first argmax of the candidate's logits is the base's

    @staticmethod
    def concatenate(parts: list[TokenFigures]) -> TokenFigures:
        return TokenFigures(*(np.concatenate([getattr(p, name) for p in parts]) for name in
                              ("nll", "nll_base", "kld", "p_diff", "same_top")))

    def __len__(self) -> int:
        return len(self.nll)

    def head(self, count: int) -> TokenFigures:
        """The first `count` tokens' figures (the statistics after a chunk)."""
        return TokenFigures(self.nll[:count], self.nll_base[:count], self.kld[:count], self.p_diff[:count],
                            self.same_top[:count])


def token_figures(logits: np.ndarray, base: StoredLogProbs, targets: np.ndarray) -> TokenFigures:
    """(N, V) candidate logits against the base's stored log-probabilities, `targets` (N,) the
    true next tokens: llama-perplexity's per-token KLD-pass figures."""
    logits = np.asarray(logits, dtype=F32)
    if logits.shape != base.levels.shape:
        raise TracerError(f"candidate logits {logits.shape} and base log-probabilities {base.levels.shape} differ "
                          f"in shape (another vocabulary?)")
    rows = np.arange(len(targets))
    max_logit = logits.max(axis=1)
    top = logits.argmax(axis=1)  # the first maximum, as its strict > scan keeps
    shifted_max = max_logit + log_sum_exp(logits, max_logit)  # max_logit += log_sum_exp
    nll = shifted_max - logits[rows, targets]
    base_log_probs = base.log_probs()  # (N, V) f32
    nll_base = -base_log_probs[rows, targets]
    kept = base_log_probs > F32(-LOG_PROB_RANGE)
    terms = np.exp(base_log_probs) * ((base_log_probs - logits) + shifted_max[:, None])  # (N, V) f32
    kld = np.where(kept, terms, F32(0)).astype(F64).sum(axis=1)
    p_diff = np.exp(-nll) - np.exp(-nll_base)
    return TokenFigures(nll.astype(F32), nll_base.astype(F32), kld, p_diff.astype(F32),
                        top == base_log_probs.argmax(axis=1))


class ExactKL:
    """KL(P_ref ‖ Q) per row over the whole vocabulary, from f32 logits in f64, against one
    reference's (N, V) logits whose log-probabilities are taken once: the divergence without
    llama-perplexity's 16-bit storage of the base and its -16 cutoff."""

    def __init__(self, reference_logits: np.ndarray):
        self.log_p = _log_softmax64(reference_logits)  # (N, V) f64
        self.p = np.exp(self.log_p)

    def __call__(self, candidate_logits: np.ndarray) -> np.ndarray:
        """(N,) f64."""
        return (self.p * (self.log_p - _log_softmax64(candidate_logits))).sum(axis=1)


def exact_kld(reference_logits: np.ndarray, candidate_logits: np.ndarray) -> np.ndarray:
    """(N,) f64 KL(P_ref ‖ P_cand) per row (`ExactKL`)."""
    return ExactKL(reference_logits)(candidate_logits)


def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    """(N, V) -> (N, V) f64 log-probabilities."""
    x = np.asarray(logits, dtype=F64)
    top = x.max(axis=1, keepdims=True)
    return x - (top + np.log(np.exp(x - top).sum(axis=1, keepdims=True)))


# --- statistics ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """A value and its uncertainty (one standard error), as llama-perplexity prints `x ± dx`."""

    value: float
    uncertainty: float

    def __post_init__(self):  # plain floats, whatever numpy scalar the sums came as
        object.__setattr__(self, "value", float(self.value))
        object.__setattr__(self, "uncertainty", float(self.uncertainty))

    def to_dict(self) -> dict:
        return asdict(self)


def mean_and_uncertainty(total: float, total2: float, count: int) -> Estimate:
    """llama-perplexity's `mean_and_uncertainty`: the mean and its standard error (0 for 10 or fewer)."""
    if count < 1:
        return Estimate(0.0, 0.0)
    mean = total / count
    spread = total2 / count - mean * mean
    return Estimate(mean, math.sqrt(spread / (count - 1)) if spread > 0 and count > 10 else 0.0)


def covariance(total_a: float, total_b: float, total_ab: float, count: int) -> float:
    """llama-perplexity's covariance of two means (0 below 10 values)."""
    if count < 10:
        return 0.0
    return (total_ab / count - (total_a / count) * (total_b / count)) / (count - 1)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama-perplexity's percentile: linear between neighbours of the sorted f32 values, in f32."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    position = F32(fraction) * F32(len(sorted_values) - 1)
    index = int(position)
    weight = position - F32(index)
    upper = sorted_values[min(index + 1, len(sorted_values) - 1)]
    return float((F32(1) - weight) * sorted_values[index] + weight * upper)


def median(sorted_values: np.ndarray) -> float:
    """The middle value, or 0.5f times the two middle ones' sum (f32)."""
    n = len(sorted_values)
    if n % 2:
        return float(sorted_values[n // 2])
    return float(F32(0.5) * (sorted_values[n // 2] + sorted_values[n // 2 - 1]))


@dataclass(frozen=True)
class Statistics:
    """llama-perplexity's KL-divergence statistics over `count` scored tokens.

    Attributes:
        count: scored tokens.
        ppl, ppl_base: perplexity of the candidate (Q) and of the base, each exp(mean NLL).
        correlation: Cor(ln PPL(Q), ln PPL(base)).
        log_ppl_ratio, ppl_ratio, ppl_diff: ln(PPL(Q)/PPL(base)), PPL(Q)/PPL(base), PPL(Q) - PPL(base).
        kld: mean KL divergence of Q from the base (nats).
        kld_max, kld_median, kld_min, kld_percentiles ({"99.9": ..., ...}): of the per-token KLD values.
        p_diff: mean Δp (a fraction; llama-perplexity prints percent).
        p_diff_max, p_diff_median, p_diff_min, p_diff_percentiles: of the per-token Δp values.
        rms_p_diff: root mean square Δp.
        same_top: the fraction of tokens whose argmax agrees.
    """

    count: int
    ppl: Estimate
    ppl_base: Estimate
    correlation: float
    log_ppl_ratio: Estimate
    ppl_ratio: Estimate
    ppl_diff: Estimate
    kld: Estimate
    kld_max: float
    kld_median: float
    kld_min: float
    kld_percentiles: dict
    p_diff: Estimate
    p_diff_max: float
    p_diff_median: float
    p_diff_min: float
    p_diff_percentiles: dict
    rms_p_diff: Estimate
    same_top: Estimate

    @staticmethod
    def of(figures: TokenFigures) -> Statistics:
        """The statistics of the tokens' figures (sums in f64, order statistics in f32)."""
        count = len(figures)
        if count == 0:
            raise TracerError("no scored tokens")
        nll, nll_base = figures.nll, figures.nll_base
        sums = {
            "nll": nll.astype(F64).sum(), "nll2": (nll * nll).astype(F64).sum(),  # f32 products, f64 sums
            "base": nll_base.astype(F64).sum(), "base2": (nll_base * nll_base).astype(F64).sum(),
            "cross": (nll * nll_base).astype(F64).sum(),
        }
        log_ppl = mean_and_uncertainty(sums["nll"], sums["nll2"], count)
        log_ppl_base = mean_and_uncertainty(sums["base"], sums["base2"], count)
        log_cov = covariance(sums["nll"], sums["base"], sums["cross"], count)
        ppl = Estimate(math.exp(log_ppl.value), math.exp(log_ppl.value) * log_ppl.uncertainty)
        ppl_base = Estimate(math.exp(log_ppl_base.value), math.exp(log_ppl_base.value) * log_ppl_base.uncertainty)
        spreads = log_ppl.uncertainty * log_ppl_base.uncertainty
        ratio_unc = _root(log_ppl.uncertainty ** 2 + log_ppl_base.uncertainty ** 2 - 2.0 * log_cov)
        log_ratio = Estimate(log_ppl.value - log_ppl_base.value, ratio_unc)
        ratio = math.exp(log_ratio.value)
        ppl_cov = ppl.value * ppl_base.value * log_cov
        diff_unc = _root(ppl.uncertainty ** 2 + ppl_base.uncertainty ** 2 - 2.0 * ppl_cov)

        kld_sorted = np.sort(figures.kld.astype(F32))  # kld_values is a vector<float>
        p_sorted = np.sort(figures.p_diff)
        p_diff2 = (figures.p_diff * figures.p_diff).astype(F64)  # f32 product, kept in f64
        mse = mean_and_uncertainty(p_diff2.sum(), (p_diff2 * p_diff2).sum(), count)
        rms = math.sqrt(mse.value)
        same = float(figures.same_top.sum()) / count
        return Statistics(
            count=count, ppl=ppl, ppl_base=ppl_base,
            correlation=log_cov / spreads if spreads else math.nan,
            log_ppl_ratio=log_ratio, ppl_ratio=Estimate(ratio, ratio * ratio_unc),
            ppl_diff=Estimate(ppl.value - ppl_base.value, diff_unc),
            kld=mean_and_uncertainty(figures.kld.sum(), (figures.kld * figures.kld).sum(), count),
            kld_max=float(kld_sorted[-1]), kld_median=median(kld_sorted), kld_min=float(kld_sorted[0]),
            kld_percentiles={_label(f): percentile(kld_sorted, f) for f in KLD_PERCENTILES},
            p_diff=mean_and_uncertainty(figures.p_diff.astype(F64).sum(), p_diff2.sum(), count),
            p_diff_max=float(p_sorted[-1]), p_diff_median=median(p_sorted), p_diff_min=float(p_sorted[0]),
            p_diff_percentiles={_label(f): percentile(p_sorted, f) for f in DELTA_P_PERCENTILES},
            rms_p_diff=Estimate(rms, 0.5 / rms * mse.uncertainty if rms else 0.0),
            same_top=Estimate(same, math.sqrt(same * (1 - same) / (count - 1)) if count > 1 else 0.0),
        )

    def to_dict(self) -> dict:
        return {key: value.to_dict() if isinstance(value, Estimate) else value for key, value in
                ((f.name, getattr(self, f.name)) for f in self.__dataclass_fields__.values())}


@dataclass(frozen=True)
class ChunkLine:
    """llama-perplexity's running line after a chunk: the statistics of every token scored so far."""

    chunk: int  # 1-based, as it prints
    ppl: Estimate
    log_ppl_ratio: Estimate
    kld: Estimate
    rms_p_diff: Estimate
    same_top: Estimate

    @staticmethod
    def after(chunk: int, figures: TokenFigures) -> ChunkLine:
        s = Statistics.of(figures)
        return ChunkLine(chunk, s.ppl, s.log_ppl_ratio, s.kld, s.rms_p_diff, s.same_top)

    def to_dict(self) -> dict:
        return {"chunk": self.chunk, **{name: getattr(self, name).to_dict() for name in
                                        ("ppl", "log_ppl_ratio", "kld", "rms_p_diff", "same_top")}}


def _root(value: float) -> float:
    """sqrt as C computes it: NaN for a negative argument (a rounding-negative variance)."""
    return math.sqrt(value) if value >= 0 else math.nan


def _label(fraction: float) -> str:
    """0.999 -> "99.9", 0.05 -> "5.0": the percentile as llama-perplexity labels it."""
    return f"{100 * fraction:.1f}"
