// Every eecore op schema, in one place. The CPU and CUDA kernels register implementations in
// csrc/<op>/<op>_{cpu,cuda}.cpp; fake (meta) implementations live in python/eecore/ops.py and the
// pure-PyTorch oracles in python/eecore/reference.py. Shapes use these letters:
//   T  tokens in a step          B  sequences (or rows)         L  decoder layers
//   Hq query heads               Hkv KV heads (Hq % Hkv == 0)    D  head dim
//   NB cache blocks              BS tokens per block             d  hidden size     V vocab
// Activations are fp32, bf16 or fp16; reductions and softmax accumulate in fp32.
#include <torch/library.h>

TORCH_LIBRARY(eecore, m) {
  // key, value [T, Hkv, D] -> k_cache, v_cache [NB, BS, Hkv, D] at slot_mapping[t] (int64 [T]);
  // slot = block * BS + offset, -1 skips the token. key/value have the caches' dtype and may be
  // strided in T and Hkv (slices of a fused QKV output); the caches are contiguous. A slot outside
  // [-1, NB * BS) is an error, raised before anything is written.
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()");

  // out, query [Tq, Hq, D]; k_cache, v_cache [NB, BS, Hkv, D]; block_table int32 [B, max_blocks];
  // seq_lens int32 [B]: cached tokens of each sequence, its new ones included;
  // query_start_loc int32 [B+1]: sequence b owns query rows qsl[b]:qsl[b+1] (qsl[0] = 0,
  // non-decreasing, qsl[B] = Tq), which are its last tokens: row i of a sequence with q_len rows
  // sits at position seq_len - q_len + i (causal mask aligned bottom-right; q_len <= seq_len).
  // causal=False: every row sees all seq_len keys, and q_len may exceed seq_len (cross-attention).
  // max_query_len >= every q_len (1 selects the decode kernel). position_bias fp32
  // [Hq, max_distance] is added to the score at distance q_pos - k_pos (clamped to
  // [0, max_distance - 1]). query/out may be strided in Tq and Hq; the caches are contiguous and
  // of query's dtype; block_table is -1 padded past each sequence's ceil(seq_len / BS) blocks.
  // tree_mask int64 [Tq] (token-tree verification; needs causal and max_query_len <= 64): row i of
  // a chunk sees every key before its chunk and chunk key j (position seq_len - q_len + j) iff bit
  // j of its mask is set; bit i must be set and no bit above i (a chain 0..i is plain causal).
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor seq_lens, Tensor query_start_loc, int max_query_len, float scale, bool causal, "
        "Tensor? position_bias, Tensor? tree_mask=None) -> ()");

  // out, input [..., d]; weight [d]: out = input * rsqrt(mean(input^2) + eps) * weight
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float eps) -> ()");

  // input, residual [..., d]: residual += input; input = rms_norm(residual) * weight
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()");

  // input [..., 2 d] = [gate | up] (a fused gate/up projection), out [..., d], contiguous, one float
  // dtype: out = silu(gate) * up = gate / (1 + exp(-gate)) * up, in fp32, rounded once (vLLM's op)
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");

  // positions int64 [T] in [0, max_pos); query [T, Hq, D]; key [T, Hkv, D]; cos_sin_cache
  // [max_pos, rot_dim] = cat(cos, sin) along the last dim, fp32 or the dtype of query. Rotates the
  // first rot_dim dims of every head in place (rot_dim even, <= D; the rest is untouched), in fp32.
  // is_neox: rotate the two halves (Llama/NeoX); else rotate interleaved pairs (GPT-J). query and
  // key need unit stride in D only: strided views (e.g. into a fused qkv buffer) are fine.
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache, "
        "bool is_neox) -> ()");

  // rotary_embedding(positions, query, key, cos_sin_cache, is_neox), then
  // reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) of the rotated key: the two ops a
  // layer runs between its QKV projection and attention, in one launch on a GPU.
  m.def("rotary_embedding_and_cache(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor value, "
        "Tensor cos_sin_cache, bool is_neox, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping) -> ()");

  // logits [B, V >= 2] (any row stride, unit stride along V) -> (gap fp32 [B] = p1 - p2 of
  // softmax(logits), top1 int64 [B] = argmax). On a tie for the max, top1 is the first index and
  // the gap is 0. -inf entries take no probability; a row of only -inf gives gap NaN (top1 0), as
  // does any +inf or NaN in the row (top1 then skips NaN entries).
  m.def("softmax_top2_gap(Tensor logits) -> (Tensor, Tensor)");

  // out int64 [B] (any stride) = argmax of each row of logits [B, V >= 1] (any row stride, unit
  // stride along V), as torch.argmax: the first NaN of a row if it has one, else the first index
  // of its maximum. Writes into out, so a decode loop allocates nothing.
  m.def("argmax(Tensor(a!) out, Tensor logits) -> ()");

  // weight: any contiguous tensor. On CUDA, asks the L2 cache to fetch the first
  // min(max_bytes, its size) bytes of it (a hint; nothing waits for the data; issued on a side
  // stream, it fills the memory bus while the main stream runs latency-bound kernels). On the CPU
  // it only checks its arguments.
  m.def("prefetch_l2(Tensor weight, int max_bytes) -> ()");

  // hidden [B, d >= 1], weight [V >= 2, d] of hidden's dtype (any row strides) -> the same for
  // logits = hidden @ weight.T in fp32, never materialized
  m.def("lm_head_top2_gap(Tensor hidden, Tensor weight) -> (Tensor, Tensor)");

  // prev, cur [B, d >= 1] -> fp32 [B] cosine similarity of each row, as
  // F.cosine_similarity(prev.float(), cur.float(), dim=-1, eps=1e-8): each norm clamped at eps
  m.def("hidden_cosine(Tensor prev, Tensor cur) -> Tensor");

  // hidden [B, d]; w1 [m, d]; b1 [m]; w2 [m]; b2 [1] -> fp32 [B] sigmoid(w2 . relu(w1 h + b1) + b2).
  // The four weights share one dtype: hidden's, or fp32 (an fp32 classifier serves a bf16 model).
  m.def("mlp_confidence(Tensor hidden, Tensor w1, Tensor b1, Tensor w2, Tensor b2) -> Tensor");

  // status bool [B] |= (confidence fp32 [B] > threshold fp32 [] or [B]) & active bool [B]
  // (sticky: a row never reverts; a NaN confidence never passes; any strides).
  // Returns int32 []: the active rows still not confident (0: the batch may exit).
  m.def("accept_update(Tensor(a!) status, Tensor confidence, Tensor threshold, Tensor active) -> Tensor");

  // out [M, N] = input [M, K] @ weight [N, K]^T (+ bias [N]); with accumulate, out += that instead
  // (a residual add fused into the projection). Rows may be strided, the last dim contiguous.
  // The model's projections: decode-sized M streams the weight once on the CPU. Weight-only int8:
  // weight int8 [N, K] with weight_scale fp32 [N] stands for weight_scale[:, None] * weight, and
  // each input row is rounded to int16 with a scale of its own first (eecore/int8_linear.h says
  // exactly how); weight_scale only then. A weight may also come pre-tiled for AMX (CPU): bf16
  // [N/16, K/32, 16, 32] for bf16 input, or int8 [N/16, K/64, 16, 64] (with its weight_scale [N],
  // fp32 or bf16 input, K < 65536), tile [b, s] holding output rows 16b.. x input features
  // depth*s..; eecore._C.amx_bf16_available() / amx_int8_available() say whether this machine runs it.
  m.def("linear(Tensor(a!) out, Tensor input, Tensor weight, Tensor? bias, bool accumulate, "
        "Tensor? weight_scale=None) -> ()");

  // A decoder layer's projections with the elementwise ops around them, for dense weights [N, d]
  // of input's dtype; each writes exactly what the ops it fuses write (on a GPU, for 1-8 rows, one
  // launch each: csrc/fused_projections/). input [T, d] is the residual stream.
  // qkv_projection: normed = rms_norm(input) * norm_weight; out [T, (Hq + 2 Hkv) D] =
  // linear(normed, weight, bias); then rotary_embedding_and_cache on out's query, key and value
  // views, Hkv and D read from k_cache [NB, BS, Hkv, D].
  m.def("qkv_projection(Tensor(a!) out, Tensor(b!) normed, Tensor input, Tensor norm_weight, float eps, "
        "Tensor weight, Tensor? bias, Tensor positions, Tensor cos_sin_cache, bool is_neox, Tensor(c!) k_cache, "
        "Tensor(d!) v_cache, Tensor slot_mapping) -> ()");
  // gate_up_projection: normed = rms_norm(input) * norm_weight; out [T, 2 I] = linear(normed,
  // weight) (the stacked gate and up projections); act [T, I] = silu_and_mul(out).
  m.def("gate_up_projection(Tensor(a!) act, Tensor(b!) out, Tensor(c!) normed, Tensor input, Tensor norm_weight, "
        "float eps, Tensor weight) -> ()");
  // linear_residual: out [T, N] = linear(input, weight, bias); residual [T, N] += out, rounded to
  // the dtype after the product is (attention's output projection and the residual add).
  m.def("linear_residual(Tensor(a!) out, Tensor(b!) residual, Tensor input, Tensor weight, Tensor? bias) -> ()");

  // linear with a weight in a GGUF block format, computed with its exact values: weight uint8
  // [N, K / W * block bytes], each row K / W blocks of quant_type (GGML's type ids: 2 Q4_0,
  // 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0 with W = 32; 12 Q4_K, 13 Q5_K, 14 Q6_K with W = 256; eecore's
  // csrc/linear/gguf_blocks.h says the layouts), K a multiple of W.
  // out [M, N] = input [M, K] @ dequantized(weight)^T (+ bias [N]), or out += that with accumulate;
  // fp32 accumulation. CPU.
  m.def("linear_gguf(Tensor(a!) out, Tensor input, Tensor weight, int quant_type, Tensor? bias, "
        "bool accumulate) -> ()");
  // The fp32 values [N, features] of such a weight (what linear_gguf multiplies by).
  m.def("dequantize_gguf(Tensor weight, int quant_type, int features) -> Tensor");
  // out [T, K] = the rows token_ids [T] (int64, each in [0, N)) of such a weight, dequantized
  // (a GGUF token embedding, or the rows of a GGUF LM head).
  m.def("embedding_gguf(Tensor(a!) out, Tensor token_ids, Tensor weight, int quant_type) -> ()");
  // 8-bit activations (csrc/linear/gguf_q8.h): a GGUF weight [N, row bytes] of any of the formats
  // above repacked once to [ceil(N / 16), units, unit bytes] (a unit: a block of 32 weights, a K
  // format's superblock of 256, of 16 rows), then out [M, N] (+)= input [M, K] . weight^T (+ bias)
  // with each input row rounded to int8 in blocks of 32 (llama.cpp's arithmetic, not exact).
  m.def("repack_gguf_q8(Tensor weight, int quant_type, int features) -> Tensor");
  m.def("linear_gguf_q8(Tensor(a!) out, Tensor input, Tensor packed, int quant_type, Tensor? bias, "
        "bool accumulate) -> ()");

  // kv_cache [L, 2, NB, BS, Hkv, D]; hidden [T, d] (exit residual stream); weight [L, 2*Hkv*D, d]
  // (each layer's K then V projection, its input-norm gain folded in); bias [L, 2*Hkv*D]?;
  // cos_sin_cache [max_pos, rot_dim]? (RoPE on K, as in rotary_embedding; fp32 or the dtype of
  // kv_cache); positions int64 [T] (read only with RoPE); slot_mapping int64 [T] (negative skips);
  // start_layer int32 [T] (>= 0; >= L writes nothing). kv_cache, hidden, weight and bias share one
  // dtype. For every t and l >= start_layer[t]: [K; V] = W_l rms(hidden[t]) + b_l, with
  // rms(x) = x * rsqrt(mean(x^2) + eps) (no gain), written at slot_mapping[t] of layer l.
  m.def("kv_fill(Tensor(a!) kv_cache, Tensor hidden, Tensor weight, Tensor? bias, Tensor? cos_sin_cache, "
        "Tensor positions, Tensor slot_mapping, Tensor start_layer, float eps, bool is_neox) -> ()");
}
