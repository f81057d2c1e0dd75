#include "decode_step.h"

#include <ATen/core/stack.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

namespace lowbit {
namespace {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("lowbit::rms_norm", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x, weight, eps);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            int64_t position, double scale, int64_t start, double softcap) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("lowbit::decode_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double, int64_t,
                            const std::optional<at::Tensor>&, double)>();
  return op.call(q, k, v, cos, sin, key_cache, value_cache, position, scale, start, std::nullopt, softcap);
}

// A layer's cache rows in its buffers [1, heads, capacity, dim]: the
// buffers and the row where the cache's `rows` rows start.
struct Buffers {
  at::Tensor keys, values;
  int64_t first;
};

// The layer's buffers for a cache holding `rows` rows: last step's where the
// cache's tensors are still rows first .. first + rows - 1 of them (a
// window's cache moves on a row a step) and a row is free after them, new
// ones (the rows copied in at row 0) otherwise.
Buffers buffers_for(const at::Tensor& keys, const at::Tensor& values, const std::optional<at::Tensor>& key_buffer,
                    const std::optional<at::Tensor>& value_buffer, int64_t rows) {
  // The row of `buffer` where view t starts; -1 where t is not such a view
  // or the buffer is not one of ours (contiguous, a row a step written in).
  const auto first_row = [](const at::Tensor& t, const std::optional<at::Tensor>& buffer) -> int64_t {
    if (!buffer.has_value() || buffer->dim() != 4 || !buffer->is_contiguous() || buffer->numel() == 0 ||
        t.strides() != buffer->strides() ||
        t.sizes().slice(0, 2) != buffer->sizes().slice(0, 2) || t.scalar_type() != buffer->scalar_type()) {
      return -1;
    }
    const auto offset = static_cast<const char*>(t.data_ptr()) - static_cast<const char*>(buffer->data_ptr());
    const int64_t row_bytes = buffer->stride(2) * buffer->element_size();
    return offset >= 0 && offset % row_bytes == 0 ? offset / row_bytes : -1;
  };
  const int64_t first = first_row(keys, key_buffer);
  if (first >= 0 && first == first_row(values, value_buffer) && first + rows < key_buffer->size(2)) {
    return {*key_buffer, *value_buffer, first};
  }
  const int64_t capacity = std::max(2 * rows, rows + 64);
  const auto fresh = [rows, capacity](const at::Tensor& t) {
    at::Tensor buffer = t.new_empty({1, t.size(1), capacity, t.size(3)});
    buffer.narrow(2, 0, rows).copy_(t);
    return buffer;
  };
  return {fresh(keys), fresh(values), 0};
}

}  // namespace

int64_t DecodeStep::checked_id(int64_t id, const char* what) const {
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(projections_.size()), "DecodeStep: ", what, " is projection ", id,
              ", not one of the ", projections_.size(), " registered");
  return id;
}

namespace {

// Operator `op` (overload `overload`) called with `args` and tensors
// inserted at the places `inserted` names (e.g. {"x_index", 1}): checked to
// take them, return one tensor and write none of its arguments.
c10::OperatorHandle checked_operator(const char* method, const std::string& op, const std::string& overload,
                                     const std::vector<c10::IValue>& args,
                                     const std::vector<std::pair<const char*, int64_t>>& inserted) {
  const auto handle = c10::Dispatcher::singleton().findSchema({op, overload});
  TORCH_CHECK(handle.has_value(), method, ": no operator ", op, " (overload '", overload, "')");
  const c10::FunctionSchema& schema = handle->schema();
  const auto& formals = schema.arguments();
  const auto count = static_cast<int64_t>(formals.size());
  TORCH_CHECK(formals.size() == args.size() + inserted.size(), method, ": ", op, " takes ", formals.size(),
              " arguments; got ", args.size(), " besides the activation", inserted.size() > 1 ? " and ids" : "");
  for (const auto& [name, index] : inserted) {
    TORCH_CHECK(index >= 0 && index < count, method, ": ", name, " ", index, " is out of range for ", op);
    TORCH_CHECK(formals[index].type()->kind() == c10::TypeKind::TensorType, method, ": ", op, "'s argument ",
                formals[index].name(), " (", name, ") is not a Tensor");
  }
  TORCH_CHECK(inserted.size() < 2 || inserted[0].second != inserted[1].second, method, ": x_index and ids_index are "
              "both ", inserted[0].second);
  TORCH_CHECK(!schema.is_mutable() && schema.returns().size() == 1 &&
                  schema.returns()[0].type()->kind() == c10::TypeKind::TensorType,
              method, ": ", op, " must return one tensor and write none of its arguments");
  const auto is_inserted = [&inserted](int64_t i) {
    return std::any_of(inserted.begin(), inserted.end(), [i](const auto& p) { return p.second == i; });
  };
  for (int64_t i = 0, j = 0; i < count; ++i) {
    if (is_inserted(i)) continue;
    const c10::TypePtr& type = formals[i].type();
    TORCH_CHECK(args[j].type()->isSubtypeOf(*type), method, ": ", op, "'s argument ", formals[i].name(), " takes ",
                type->str(), "; got ", args[j].type()->str());
    ++j;
  }
  return *handle;
}

}  // namespace

int64_t DecodeStep::projection(const std::string& op, const std::string& overload, std::vector<c10::IValue> args,
                               int64_t x_index, std::optional<at::Tensor> perm, std::optional<at::Tensor> bias) {
  const auto handle = checked_operator("DecodeStep.projection", op, overload, args, {{"x_index", x_index}});
  if (perm) {  // checked once here: run() gathers x by it every step
    TORCH_CHECK(perm->dim() == 1 && (perm->scalar_type() == at::kLong || perm->scalar_type() == at::kInt),
                "DecodeStep.projection: perm must be a 1-D int32 or int64 tensor, got ", perm->scalar_type(), " of shape ",
                perm->sizes());
    const at::Tensor sorted = std::get<0>(perm->to(at::kLong).sort());
    TORCH_CHECK_VALUE(at::equal(sorted, at::arange(perm->numel(), sorted.options())),
                      "DecodeStep.projection: perm must be a permutation of [0, ", perm->numel(), ")");
  }
  projections_.push_back(Projection{handle, std::move(args), x_index, std::move(perm), std::move(bias)});
  return static_cast<int64_t>(projections_.size()) - 1;
}

int64_t DecodeStep::expert_projection(const std::string& op, const std::string& overload,
                                      std::vector<c10::IValue> args, int64_t x_index, int64_t ids_index) {
  const auto handle = checked_operator("DecodeStep.expert_projection", op, overload, args,
                                       {{"x_index", x_index}, {"ids_index", ids_index}});
  projections_.push_back(Projection{handle, std::move(args), x_index, std::nullopt, std::nullopt, ids_index});
  return static_cast<int64_t>(projections_.size()) - 1;
}

int64_t DecodeStep::checked_kind(int64_t id, const char* what, bool experts) const {
  checked_id(id, what);
  TORCH_CHECK((projections_[id].ids_index >= 0) == experts, "DecodeStep: ", what, " is projection ", id, ", ",
              experts ? "not an experts projection" : "an experts projection");
  return id;
}

void DecodeStep::layer(at::Tensor input_norm, double input_eps, std::vector<int64_t> qkv,
                       std::vector<int64_t> qkv_sizes, std::optional<at::Tensor> q_norm,
                       std::optional<at::Tensor> k_norm, double qk_eps, int64_t o, at::Tensor post_norm,
                       double post_eps, std::vector<int64_t> gate_up, std::vector<int64_t> gate_up_sizes,
                       int64_t down, int64_t head_dim, double scale, bool rotary, double residual_scale) {
  const auto positive = [](const std::vector<int64_t>& sizes) {
    return std::all_of(sizes.begin(), sizes.end(), [](int64_t s) { return s > 0; });
  };
  TORCH_CHECK(!qkv.empty() && qkv.size() <= 3, "DecodeStep.layer: qkv holds 1 to 3 projections; got ", qkv.size());
  TORCH_CHECK(qkv_sizes.size() == 3 && positive(qkv_sizes),
              "DecodeStep.layer: qkv_sizes must be the 3 positive widths of q, k and v; got ", qkv_sizes);
  // No gate_up, no sizes and down -1: the MLP layer_experts gives.
  const bool experts_mlp = gate_up.empty() && gate_up_sizes.empty() && down == -1;
  TORCH_CHECK(experts_mlp || (!gate_up.empty() && gate_up.size() <= 2),
              "DecodeStep.layer: gate_up holds 1 or 2 projections; got ", gate_up.size());
  TORCH_CHECK(experts_mlp || (gate_up_sizes.size() == 2 && positive(gate_up_sizes) &&
                              gate_up_sizes[0] == gate_up_sizes[1]),
              "DecodeStep.layer: gate_up_sizes must be the equal widths of gate and up; got ", gate_up_sizes);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecodeStep.layer: q_norm and k_norm come together");
  TORCH_CHECK(head_dim > 0 && qkv_sizes[0] % head_dim == 0 && qkv_sizes[1] % head_dim == 0 &&
                  qkv_sizes[1] == qkv_sizes[2],
              "DecodeStep.layer: head_dim ", head_dim, " does not divide the q, k and v widths ", qkv_sizes);
  TORCH_CHECK(std::isfinite(residual_scale), "DecodeStep.layer: residual_scale must be finite; got ", residual_scale);
  for (int64_t id : qkv) checked_kind(id, "qkv", false);
  for (int64_t id : gate_up) checked_kind(id, "gate_up", false);
  layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), input_eps, post_eps, qk_eps, scale,
                          std::move(qkv), std::move(qkv_sizes), std::move(gate_up), std::move(gate_up_sizes),
                          std::move(q_norm), std::move(k_norm), checked_kind(o, "o", false),
                          experts_mlp ? -1 : checked_kind(down, "down", false), head_dim, rotary, residual_scale});
}

void DecodeStep::layer_extras(int64_t window, int64_t table, std::optional<at::Tensor> attn_out_norm,
                              std::optional<at::Tensor> mlp_out_norm, double out_eps, double attn_softcap) {
  TORCH_CHECK(!layers_.empty(), "DecodeStep.layer_extras: no layer to extend");
  TORCH_CHECK(window >= 0 && table >= 0, "DecodeStep.layer_extras: window and table must be >= 0; got ", window,
              " and ", table);
  TORCH_CHECK(std::isfinite(attn_softcap) && attn_softcap >= 0,
              "DecodeStep.layer_extras: attn_softcap must be finite and >= 0; got ", attn_softcap);
  TORCH_CHECK(attn_out_norm.has_value() == mlp_out_norm.has_value(),
              "DecodeStep.layer_extras: attn_out_norm and mlp_out_norm come together");
  Layer& l = layers_.back();
  l.window = window;
  l.table = table;
  l.attn_out_norm = std::move(attn_out_norm);
  l.mlp_out_norm = std::move(mlp_out_norm);
  l.out_eps = out_eps;
  l.attn_softcap = attn_softcap;
}

void DecodeStep::layer_experts(at::Tensor router, int64_t top_k, bool normalize, bool weights_in_dtype,
                               int64_t gate, int64_t up, int64_t down) {
  TORCH_CHECK(!layers_.empty() && layers_.back().gate_up.empty() && !layers_.back().experts,
              "DecodeStep.layer_experts: the last layer must be one without an MLP (gate_up empty, down -1)");
  TORCH_CHECK(router.dim() == 2 && top_k > 0 && top_k <= router.size(0), "DecodeStep.layer_experts: router must be "
              "[experts, hidden] and top_k in [1, experts]; got ", router.sizes(), " and ", top_k);
  layers_.back().experts = Experts{std::move(router), top_k, checked_kind(gate, "gate", true),
                                   checked_kind(up, "up", true), checked_kind(down, "down", true), normalize,
                                   weights_in_dtype};
}

void DecodeStep::style(double norm_offset, const std::string& activation, double softcap) {
  TORCH_CHECK(activation == "silu" || activation == "gelu_tanh",
              "DecodeStep.style: activation must be \"silu\" or \"gelu_tanh\"; got \"", activation, "\"");
  TORCH_CHECK(std::isfinite(norm_offset) && std::isfinite(softcap) && softcap >= 0,
              "DecodeStep.style: norm_offset must be finite and softcap finite and >= 0; got ", norm_offset, " and ",
              softcap);
  norm_offset_ = norm_offset;
  gelu_tanh_ = activation == "gelu_tanh";
  softcap_ = softcap;
}

at::Tensor DecodeStep::norm(const at::Tensor& x, const at::Tensor& weight, double eps) const {
  return rms_norm(x, norm_offset_ == 0.0 ? weight : weight + norm_offset_, eps);
}

void DecodeStep::head(at::Tensor norm, double eps, int64_t lm_head, double logits_divisor) {
  TORCH_CHECK(std::isfinite(logits_divisor) && logits_divisor != 0.0,
              "DecodeStep.head: logits_divisor must be finite and non-zero; got ", logits_divisor);
  lm_head_ = checked_kind(lm_head, "lm_head", false);
  norm_ = std::move(norm);
  norm_eps_ = eps;
  logits_divisor_ = logits_divisor;
}

at::Tensor DecodeStep::project_experts(int64_t id, const at::Tensor& x, const at::Tensor& ids) const {
  const Projection& p = projections_[id];
  torch::jit::Stack stack(p.args.begin(), p.args.end());
  // Inserted in the order of their places, so that each lands where the schema has it.
  const bool x_first = p.x_index < p.ids_index;
  stack.insert(stack.begin() + (x_first ? p.x_index : p.ids_index), x_first ? x : ids);
  stack.insert(stack.begin() + (x_first ? p.ids_index : p.x_index), x_first ? ids : x);
  p.op.callBoxed(stack);
  return std::move(stack.front()).toTensor();
}

// What the Qwen3-MoE / Mixtral sparse block computes for rows x [1, hidden],
// op for op: its router (TopKRouter) and its experts (GGUFExperts.forward).
at::Tensor DecodeStep::experts_mlp(const Experts& e, const at::Tensor& x) const {
  const at::Tensor logits = at::linear(x, e.router);
  const auto [top_values, top_ids] = at::softmax(logits, -1, at::kFloat).topk(e.top_k, -1);
  at::Tensor weights = e.normalize ? top_values / top_values.sum(-1, true) : top_values;
  if (e.weights_in_dtype) weights = weights.to(logits.scalar_type());
  const at::Tensor gate = project_experts(e.gate, x, top_ids), up = project_experts(e.up, x, top_ids);
  const at::Tensor act = gelu_tanh_ ? at::gelu(gate, "tanh") : at::silu(gate);
  const at::Tensor down = project_experts(e.down, act * up, top_ids);
  return (down * weights.unsqueeze(-1).to(down.scalar_type())).sum(1);
}

at::Tensor DecodeStep::project(int64_t id, const at::Tensor& x) const {
  const Projection& p = projections_[id];
  torch::jit::Stack stack;
  stack.reserve(p.args.size() + 1);
  stack.insert(stack.end(), p.args.begin(), p.args.end());
  TORCH_CHECK_VALUE(!p.perm || p.perm->size(0) == x.size(1), "DecodeStep: projection ", id, "'s perm orders ",
                    p.perm ? p.perm->size(0) : 0, " columns, its input has ", x.size(1));
  stack.insert(stack.begin() + p.x_index, p.perm ? x.index_select(1, *p.perm) : x);
  p.op.callBoxed(stack);
  at::Tensor y = std::move(stack.front()).toTensor();
  return p.bias ? y + p.bias->to(y.scalar_type()) : y;
}

std::vector<at::Tensor> DecodeStep::project_group(const std::vector<int64_t>& ids, const std::vector<int64_t>& sizes,
                                                  const at::Tensor& x) const {
  std::vector<at::Tensor> parts;
  parts.reserve(ids.size());
  for (int64_t id : ids) parts.push_back(project(id, x));
  if (parts.size() == sizes.size()) return parts;  // one projection each
  const at::Tensor joined = parts.size() == 1 ? parts.front() : at::cat(parts, -1);
  TORCH_CHECK(joined.size(-1) == std::accumulate(sizes.begin(), sizes.end(), int64_t{0}),
              "DecodeStep.run: projections give ", joined.size(-1), " outputs for widths ", sizes);
  return joined.split_with_sizes(sizes, -1);
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>> DecodeStep::run(
    at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
    std::vector<std::optional<at::Tensor>> buffers, int64_t n) {
  const size_t layers = layers_.size();
  TORCH_CHECK(norm_.has_value(), "DecodeStep.run: head() was not called");
  TORCH_CHECK(keys.size() == layers && values.size() == layers && buffers.size() == 2 * layers,
              "DecodeStep.run: ", layers, " layers take as many keys and values and twice as many buffers; got ",
              keys.size(), ", ", values.size(), " and ", buffers.size());
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && x.size(1) == 1, "DecodeStep.run: x must be one token's [1, 1, hidden]");
  TORCH_CHECK(n >= 0, "DecodeStep.run: n must be >= 0; got ", n);
  TORCH_CHECK((cos.dim() == 1 || cos.dim() == 2) && sin.sizes() == cos.sizes(),
              "DecodeStep.run: cos and sin must be one table [rotated] or several [tables, rotated] alike; got ",
              cos.sizes(), " and ", sin.sizes());
  const int64_t tables = cos.dim() == 2 ? cos.size(0) : 1;
  for (size_t i = 0; i < layers; ++i) {
    TORCH_CHECK(layers_[i].experts || !layers_[i].gate_up.empty(), "DecodeStep.run: layer ", i,
                " has no MLP (layer_experts was not called)");
  }
  std::vector<at::Tensor> key_views, value_views, new_buffers;
  key_views.reserve(layers);
  value_views.reserve(layers);
  new_buffers.reserve(2 * layers);
  at::Tensor h = x.view({1, -1});
  // A layer without rotation takes the identity's tables: q * 1 + rotate_half(q) * 0 is q exactly.
  at::Tensor identity_cos, identity_sin;
  // transformers' Granite layer adds residual + out * multiplier; a scale of 1 adds out itself.
  const auto scaled = [](const at::Tensor& out, double s) { return s == 1.0 ? out : out * s; };
  for (size_t i = 0; i < layers; ++i) {
    const Layer& l = layers_[i];
    // A window's cache may keep only its last window - 1 rows; any other holds all n.
    const int64_t rows = keys[i].dim() == 4 ? keys[i].size(2) : -1;
    TORCH_CHECK(keys[i].dim() == 4 && keys[i].size(0) == 1 && values[i].sizes() == keys[i].sizes() &&
                    (rows == n || (l.window > 0 && rows == std::min(n, l.window - 1))),
                "DecodeStep.run: layer ", i, "'s cache holds keys ", keys[i].sizes(), " and values ",
                values[i].sizes(), ", not [1, heads, ", n, ", dim] each",
                l.window > 0 ? " (or its window's last rows)" : "");
    TORCH_CHECK(l.table < tables, "DecodeStep.run: layer ", i, " takes rotary table ", l.table, " of ", tables);
    const at::Tensor normed = norm(h, l.input_norm, l.input_eps);
    const std::vector<at::Tensor> qkv = project_group(l.qkv, l.qkv_sizes, normed);
    at::Tensor q = qkv[0].view({-1, l.head_dim}), k = qkv[1].view({-1, l.head_dim}), v = qkv[2].view({-1, l.head_dim});
    if (l.q_norm) {
      q = norm(q, *l.q_norm, l.qk_eps);
      k = norm(k, *l.k_norm, l.qk_eps);
    }
    auto [key_buffer, value_buffer, first] = buffers_for(keys[i], values[i], buffers[2 * i], buffers[2 * i + 1], rows);
    at::Tensor layer_cos = cos.dim() == 2 ? cos[l.table] : cos, layer_sin = sin.dim() == 2 ? sin[l.table] : sin;
    if (!l.rotary) {
      if (!identity_cos.defined()) {
        identity_cos = at::ones_like(layer_cos);
        identity_sin = at::zeros_like(layer_sin);
      }
      layer_cos = identity_cos;
      layer_sin = identity_sin;
    }
    // The new token's row, and the first its window reaches.
    const int64_t row = first + rows, start = l.window > 0 ? std::max(first, row + 1 - l.window) : first;
    const at::Tensor o = decode_attention(q, k, v, layer_cos, layer_sin, key_buffer.select(0, 0),
                                          value_buffer.select(0, 0), row, l.scale, start, l.attn_softcap);
    at::Tensor out = project(l.o, o.view({1, -1}));
    if (l.attn_out_norm) out = norm(out, *l.attn_out_norm, l.out_eps);
    h = h + scaled(out, l.residual_scale);
    const at::Tensor post = norm(h, l.post_norm, l.post_eps);
    if (l.experts) {
      out = experts_mlp(*l.experts, post);
    } else {
      const std::vector<at::Tensor> gate_up = project_group(l.gate_up, l.gate_up_sizes, post);
      const at::Tensor gate = gelu_tanh_ ? at::gelu(gate_up[0], "tanh") : at::silu(gate_up[0]);
      out = project(l.down, gate * gate_up[1]);
    }
    if (l.mlp_out_norm) out = norm(out, *l.mlp_out_norm, l.out_eps);
    h = h + scaled(out, l.residual_scale);
    key_views.push_back(key_buffer.narrow(2, first, rows + 1));
    value_views.push_back(value_buffer.narrow(2, first, rows + 1));
    new_buffers.push_back(std::move(key_buffer));
    new_buffers.push_back(std::move(value_buffer));
  }
  at::Tensor logits = project(lm_head_, norm(h, *norm_, norm_eps_)).view({1, 1, -1});
  if (logits_divisor_ != 1.0) logits = logits / logits_divisor_;
  if (softcap_ != 0.0) logits = at::tanh(logits / softcap_) * softcap_;
  return {std::move(logits), std::move(key_views), std::move(value_views), std::move(new_buffers)};
}

}  // namespace lowbit
