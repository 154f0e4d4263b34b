// The single place where ridgefill op schemas are declared.
//
// Importing the compiled module `ridgefill_runtime._C` runs these static
// registrations; device kernels are attached elsewhere with
// TORCH_LIBRARY_IMPL (csrc/<op>.cu for CUDA, csrc/cpu/<op>_cpu.cpp for the ops
// with a compiled CPU kernel) and the remaining CPU kernels / fake (meta)
// implementations from Python (ridgefill_runtime/ops/<op>.py).
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(ridgefill, m) {
  // y = (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype) * weight, over the last
  // dim; fp32 accumulation; weight is 1-D of size x.size(-1), same dtype as x.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // A head's RMSNorm (skipped when weight is None) then its rotate-half RoPE, per head row:
  // x [N, H, D] float32 (rows at any stride, heads contiguous), cos/sin [N, 1, D / 2]. CPU only
  // (cpu/rms_norm_cpu.cpp); reference ridgefill_runtime/ops/norm_rope.py.
  m.def("rms_norm_rope(Tensor x, Tensor? weight, Tensor cos, Tensor sin, float eps) -> Tensor");
  // A residual add around RMSNorm (CPU only, float32; reference and kernel beside rms_norm's):
  // sum = residual + (weight is None ? y : rms_norm(y, weight)) [N, d]; normed = rms_norm(sum, next_weight)
  // ([0] when next_weight is None).
  m.def("rms_norm_add(Tensor y, Tensor? weight, Tensor residual, Tensor? next_weight, float eps) -> (Tensor, Tensor)");

  // RidgeFill map application, W8A16: y = x @ (qweight * scales).T + bias in
  // x's dtype (fp32 accumulation). x [M, d_in] (float32/bfloat16/float16);
  // qweight int8 [d_out, d_in]; scales bfloat16 [d_out, d_in / 128] (one per
  // 128 weights of a row); bias bfloat16 [d_out] or None. int8_map_gemm.cu.
  m.def("int8_map_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");

  // Weight-only linear over group-quantized weights kept packed (GGUF's Q8_0,
  // Q4_0, Q4_1, Q4_K, Q6_K re-expressed without changing a value): y [M, n]
  // float32 = x [M, K] float32 @ W.T, W[r, k] = q * scale + min per group of
  // `group` k. data uint8 [P, K / 2, 16] (bits 4) or int8 [P, K, 16] (bits 8) in
  // panels of 16 rows; scale float16/float32 [P, K / group, 16]; min the same or
  // empty. Layout and reference: ridgefill_runtime/ops/packed_linear.py; CPU
  // kernel csrc/cpu/packed_linear.cpp, CUDA kernel csrc/packed_linear.cu.
  m.def("packed_linear(Tensor x, Tensor data, Tensor scale, Tensor min, int bits, int group, int n) -> Tensor");
  // The same (CPU only) with x's whole 16-row blocks multiplied in bfloat16 where the CPU has
  // AVX512-BF16, for gemm_dtype = bfloat16 decode batches; other rows as packed_linear.
  m.def("packed_linear_bf16(Tensor x, Tensor data, Tensor scale, Tensor min, int bits, int group, int n) -> Tensor");
  // The same weight dequantized, transposed: W.T float32 [K, P * 16] (rows past n
  // zero), each value computed as packed_linear computes it. For many-row calls
  // (prefill chunks), where a float32 BLAS GEMM beats dequantizing in registers.
  m.def("packed_dequantize_t(Tensor data, Tensor scale, Tensor min, int bits, int group, int n) -> Tensor");
  // W.T as bfloat16 (CPU only): packed_dequantize_t's values rounded to nearest even, for gemm_dtype = bfloat16.
  m.def("packed_dequantize_t_bf16(Tensor data, Tensor scale, Tensor min, int bits, int group, int n) -> Tensor");

  // Attention of an arbitrary subset of prompt rows over the paged KV cache.
  // q [R, H, D]; row i is sequence q_seq[i] (int32) at position q_pos[i]
  // (int64) and sees that sequence's keys 0..q_pos[i], or, with a sliding
  // window (window > 0; Gemma 3's local layers), only the keys j with
  // q_pos[i] - j < window (keys before that are never read); k_slab/v_slab
  // [S, Hkv, D]; block_tables int32 [B, max_blocks]; context_lens int32 [B].
  // Returns out [R, H, D] and, if return_key_mass, key_mass float32
  // [B, max_blocks * block_size] (probability each key receives, summed over
  // the sequence's rows and all heads), else an empty float32 [0].
  // window is last with a default so that callers without it keep working.
  // CUDA: scattered_rows_attention.cu. CPU: cpu/scattered_rows_attention_cpu.cpp
  // (the batched paged attention of every decode / prefill-chunk / scattered
  // row in one call; split-KV for few long rows; AVX-512/AVX2 picked at run time).
  m.def(
      "scattered_rows_attention(Tensor q, Tensor q_seq, Tensor q_pos, Tensor k_slab, Tensor v_slab, "
      "Tensor block_tables, Tensor context_lens, int block_size, float scale, bool return_key_mass, "
      "int window=0) -> (Tensor, Tensor)");
  // The same over an int8 K/V cache (cache.kv_dtype = "int8"): q float32, k_slab/v_slab int8 [S, Hkv, D],
  // k_scale/v_scale float32 [S, Hkv]; key row (slot, h) is float(k_slab[slot, h]) * k_scale[slot, h].
  // CPU only (cpu/scattered_rows_attention_cpu.cpp); out is float32.
  m.def(
      "scattered_rows_attention_int8(Tensor q, Tensor q_seq, Tensor q_pos, Tensor k_slab, Tensor v_slab, "
      "Tensor k_scale, Tensor v_scale, Tensor block_tables, Tensor context_lens, int block_size, float scale, "
      "bool return_key_mass, int window=0) -> (Tensor, Tensor)");
  // The int8 K/V cache's write: k, v float32 [N, Hkv, D] quantized into k_slab/v_slab[slots] with one
  // float32 scale per row in k_scale/v_scale[slots] (cpu/int8_kv_cpu.cpp; ridgefill_runtime/cache/int8_kv.py).
  m.def(
      "int8_kv_write(Tensor(a!) k_slab, Tensor(b!) v_slab, Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor slots, "
      "Tensor k, Tensor v) -> ()");

  // Gated DeltaNet, Qwen3-Next convention (see ridgefill_runtime/ops/gdn.py).
  // q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; states float32
  // [B, Hv, Dk, Dv]. Returns (o [B, T, Hv, Dv] in q's dtype, final state).
  m.def(
      "gdn_chunk(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? initial_state, "
      "bool use_qk_l2norm) -> (Tensor, Tensor)");
  // One decode token: q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv].
  m.def(
      "gdn_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor state, bool use_qk_l2norm) "
      "-> (Tensor, Tensor)");
  // Filled rows: the state update only, no output (no q).
  m.def(
      "gdn_state_update(Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? initial_state, "
      "bool use_qk_l2norm) -> Tensor");

  // RIPE (seed 001, Eq. 9): one loop's attention for a block of Tq query
  // tokens per sequence, over planes the caller gathered. q [B, Tq, H, D],
  // query a at position t = t0 + a; block_k/block_v [B, Tq, Hkv, D] (the
  // block's own K/V at this loop); deep_k/deep_v [B, T, Hkv, D] (far plane by
  // position); ring_k/ring_v [B, C, Hkv, D] (near plane, position j at slot
  // j % C); cache_lens int32 [B] = t0. Key j <= t reads block[j - t0] if
  // j >= t0, ring[j % C] if t - j <= window, else deep[j]; C >= window when
  // window > 0. Layout and policy: ridgefill_runtime/ops/ripe_attention.py.
  // ripe_attention.cu.
  m.def(
      "ripe_attention(Tensor q, Tensor block_k, Tensor block_v, Tensor deep_k, Tensor deep_v, "
      "Tensor ring_k, Tensor ring_v, Tensor cache_lens, int window, float scale) -> Tensor");
}

// A bare Python module: the ops live in torch.ops.ridgefill, so the module
// only has to exist for `import ridgefill_runtime._C` to load this library.
// Avoiding pybind11 (torch/extension.h) keeps the build noticeably faster.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",
      "Compiled ridgefill kernels; ops are exposed as torch.ops.ridgefill.*",
      -1,
      nullptr,
  };
  return PyModule_Create(&module_def);
}
