// DecodeStep: a llama-family model's decode step (one token, batch 1) as one
// C++ loop over its layers, for lowbit.decoding. From Python every op of a
// step costs a few microseconds of host time whatever it computes, and a
// small model's step makes some 25 per layer; here each is a dispatcher call.
//
// Python describes the model once (per generation): each projection as an
// operator and its arguments with the activation's place left out (a
// lowbit layer's op_template, aten::linear for nn.Linear), then each layer's
// norms, projections and attention shape, then the final norm and the head.
// run() computes what lowbit.decoding's Python step computes, op for op.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace lowbit {

class DecodeStep : public torch::CustomClassHolder {
 public:
  // Registers op(args with x inserted at x_index) [+ bias] as a projection
  // of rows x [1, in]; x is first gathered by `perm` where one is given
  // (an act-order GPTQ layer's column order). Returns its id.
  int64_t projection(const std::string& op, const std::string& overload, std::vector<c10::IValue> args,
                     int64_t x_index, std::optional<at::Tensor> perm, std::optional<at::Tensor> bias);

  // Registers op(args with x inserted at x_index and the experts' ids at
  // ids_index) as an experts projection: rows x [tokens, in] or [tokens,
  // slots, in] times each (token, slot)'s expert (ggml_mul_mat_id). Returns its id.
  int64_t expert_projection(const std::string& op, const std::string& overload, std::vector<c10::IValue> args,
                            int64_t x_index, int64_t ids_index);

  // Appends a decoder layer: pre-norm attention over q, k and v, optional
  // per-head q and k norms, then o; pre-norm SiLU-gated MLP, then down
  // (gate_up and gate_up_sizes empty and down -1: layer_experts gives it).
  // qkv: the projections whose outputs side by side are [q | k | v] (one
  // fused layer, three, or a fused pair and one), split by qkv_sizes; the
  // same for gate_up, [gate | up] and gate_up_sizes. rotary: whether q and
  // k are rotated (SmolLM3's NoPE layers are not); residual_scale
  // multiplies o's and down's outputs before each is added (Granite's
  // residual_multiplier; 1 elsewhere).
  void layer(at::Tensor input_norm, double input_eps, std::vector<int64_t> qkv, std::vector<int64_t> qkv_sizes,
             std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm, double qk_eps, int64_t o,
             at::Tensor post_norm, double post_eps, std::vector<int64_t> gate_up, std::vector<int64_t> gate_up_sizes,
             int64_t down, int64_t head_dim, double scale, bool rotary, double residual_scale);

  // What the last layer appended has beyond a llama layer: a sliding
  // window (each token attends to itself and the window - 1 rows before
  // it; 0: none), the rotary tables it takes (a row of run's cos and sin
  // where they are 2-D: Gemma 3's per layer type), norms of o's and down's
  // outputs before each is added (Gemma's post_attention and
  // post_feedforward norms, its post_norm then being the pre-MLP one) and
  // the attention scores' soft cap (Gemma 2's; 0: none).
  void layer_extras(int64_t window, int64_t table, std::optional<at::Tensor> attn_out_norm,
                    std::optional<at::Tensor> mlp_out_norm, double out_eps, double attn_softcap);

  // The last layer's MLP as a mixture of experts (Qwen3-MoE's and
  // Mixtral's blocks): router logits x router^T, their softmax in fp32, the
  // top_k largest (renormalized to sum 1 where `normalize`; rounded to the
  // logits' dtype where `weights_in_dtype`), then each chosen expert's
  // down(act(gate) * up) (expert projections) weighted and summed over the slots.
  void layer_experts(at::Tensor router, int64_t top_k, bool normalize, bool weights_in_dtype, int64_t gate,
                     int64_t up, int64_t down);

  // The whole step's: every norm scales by weight + norm_offset (Gemma's 1;
  // 0 elsewhere), the MLPs gate with `activation` ("silu" or "gelu_tanh"),
  // and logits are soft-capped as softcap * tanh(logits / softcap) (0: not).
  void style(double norm_offset, const std::string& activation, double softcap);

  // The final norm and the LM head's projection, whose logits are divided
  // by logits_divisor (Granite's logits_scaling; 1 elsewhere).
  void head(at::Tensor norm, double eps, int64_t lm_head, double logits_divisor);

  // One step from the token's embedding x [1, 1, hidden] at position n, with
  // the rotary tables cos, sin [the rotated values of a head: head_dim, or
  // fewer under a partial rotary factor], or [tables, rotated values] for
  // layers taking tables of their own. keys / values: each layer's cache
  // tensors [1, kv_heads, rows, head_dim], rows = n, or fewer for a window's
  // cache that keeps only its last rows; buffers: per layer its key and
  // value buffers from the last step (2 per layer, None where there are
  // none). Buffers whose rows the cache's tensors are, with a row free after
  // them, are written in place; others are made anew (the cache's rows
  // copied in at row 0, twice the room). Returns (logits [1, 1, vocab], each
  // layer's keys and values: its cache's rows and the new one, in its
  // buffers, the buffers: 2 per layer).
  std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>> run(
      at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
      std::vector<std::optional<at::Tensor>> buffers, int64_t n);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  struct Projection {
    c10::OperatorHandle op;
    std::vector<c10::IValue> args;  // without the activation (and an experts projection's ids)
    int64_t x_index;
    std::optional<at::Tensor> perm, bias;
    int64_t ids_index = -1;  // an experts projection's ids; -1 for a plain one
  };
  struct Experts {
    at::Tensor router;
    int64_t top_k, gate, up, down;
    bool normalize, weights_in_dtype;
  };
  struct Layer {
    at::Tensor input_norm, post_norm;
    double input_eps, post_eps, qk_eps, scale;
    std::vector<int64_t> qkv, qkv_sizes, gate_up, gate_up_sizes;
    std::optional<at::Tensor> q_norm, k_norm;
    int64_t o, down, head_dim;
    bool rotary;
    double residual_scale;
    int64_t window = 0, table = 0;
    std::optional<at::Tensor> attn_out_norm, mlp_out_norm;
    double out_eps = 0.0, attn_softcap = 0.0;
    std::optional<Experts> experts;
  };

  at::Tensor project(int64_t id, const at::Tensor& x) const;
  at::Tensor project_experts(int64_t id, const at::Tensor& x, const at::Tensor& ids) const;
  at::Tensor experts_mlp(const Experts& e, const at::Tensor& x) const;
  int64_t checked_kind(int64_t id, const char* what, bool experts) const;
  at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps) const;
  std::vector<at::Tensor> project_group(const std::vector<int64_t>& ids, const std::vector<int64_t>& sizes,
                                        const at::Tensor& x) const;
  int64_t checked_id(int64_t id, const char* what) const;

  std::vector<Projection> projections_;
  std::vector<Layer> layers_;
  std::optional<at::Tensor> norm_;
  double norm_eps_ = 0.0, logits_divisor_ = 1.0, norm_offset_ = 0.0, softcap_ = 0.0;
  bool gelu_tanh_ = false;
  int64_t lm_head_ = -1;
};

}  // namespace lowbit
