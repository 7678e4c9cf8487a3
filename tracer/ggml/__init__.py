"""ggml's number formats and CPU arithmetic, emulated in torch (the `llamacpp` regime).

- `floats`: f32 fused multiply-add, f16/bf16 rounding, the C library's `expf`/`cosf`/`sinf`/`powf`,
  ggml's vectorised polynomial exp and the horizontal-sum orders of its SIMD reductions.
- `quants`: GGUF block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 unpacked; other types dequantized) and
  the activation quantizers Q8_0, Q8_1 and Q8_K.
- `kquants`: the k-quant block formats (Q2_K..Q6_K) as their integer operands.
- `vecdot`: the quantized matrix products, in `ggml_vec_dot_*`'s accumulation order (x86
  AVX2/AVX-512) or accumulated exactly in f64.
- `kmatmul`: which of llama.cpp's k-quant paths (repacked gemm/gemv, tiled, vec_dot) a tensor takes,
  and the product by it (`kquant_kernels`: those paths compiled).
- `ops`: RMSNorm, RoPE, SwiGLU and flash attention as ggml's CPU backend computes them.
- `kernels`: the loops whose order is the point (quantized dot products, flash attention's FMA chains,
  ggml's exp, the Q8 quantizers), compiled by numba.
- `candle`: candle's quantized CPU arithmetic (`preset=candle-q`).
- `strategies`: the strategies `tracer.reimpl.forward` runs for the regime knobs (`weights`, `act_quant`,
  `kv_cache`, `accumulate`, `preset=llamacpp`), and GGUF weights read as stored.
- `quantizer`: llama.cpp's own quantizer and dequantizers (ggml's `ggml_quantize_chunk`, through
  ctypes from the library llama-cpp-python ships).
- `audit`: a GGUF's tensors against llama.cpp's requantization of the model's own weights
  (identical, another legitimate quantization, or damaged), before a regime takes them.

GGUF files themselves are read by `tracer.files.gguffile` (a model-file job, below this package).

Every function is pure, takes and returns torch tensors, and names the ggml source it follows.
"""
