// The autograd of the sharded cross-entropy's statistics ops, ce_shard_stats and
// ce_shard_stats_keep: one C++ autograd node each, registered for the Autograd key, so that
// no Python runs between a training step's forward kernels and its backward kernels (the
// per-step host time a Python formula costs is the whole time of the op at small shapes and
// delays the first kernel of every step on a GPU). The forwards run below autograd on
// whatever backend holds the tensors (cpu/ and cuda/ kernels, the fake kernels of
// python/shardkit/ops/_sharded_ce.py under tracing); each backward calls its backward op.
//
// The backward refuses a second derivative (create_graph=True): the backward ops are fused
// kernels with no derivative of their own, so a double backward would be silently zero.

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kDoubleBackward =
    "shardkit.ce_shard_stats does not support double backward (create_graph=True): its "
    "backward is a fused kernel with no derivative of its own, so a second-order gradient "
    "(e.g. a gradient penalty) through ShardedSoftmaxLoss / sharded_cross_entropy would be "
    "wrong. Differentiate twice only through parts of the model without the sharded loss, "
    "or use torch.nn.functional.cross_entropy for the term that needs it";

// The scalar arguments both ops share, kept in the node between forward and backward.
struct Params {
  int64_t class_offset;
  double scale, m1, m2, m3;
  bool normalize;
  int64_t chunk_classes;
};

void save_params(AutogradContext* ctx, const Params& p) {
  ctx->saved_data["f"] = std::vector<double>{p.scale, p.m1, p.m2, p.m3};
  ctx->saved_data["i"] = std::vector<int64_t>{p.class_offset, p.normalize ? 1 : 0, p.chunk_classes};
}

Params load_params(AutogradContext* ctx) {
  const auto f = ctx->saved_data["f"].toDoubleVector();
  const auto i = ctx->saved_data["i"].toIntVector();
  return {i[0], f[0], f[1], f[2], f[3], i[1] != 0, i[2]};
}

// The three statistics' gradients as the backward ops take them (zeros for an unused
// statistic), after refusing a second derivative: grad mode is on inside a backward only
// for create_graph=True, and the kernels' outputs would carry no graph.
std::vector<Tensor> stat_grads(const variable_list& grads, const Tensor& x, const Tensor& w,
                               const Tensor& lse) {
  if (at::GradMode::is_enabled()) {
    bool graph = x.requires_grad() || w.requires_grad();
    for (int k = 0; k < 3; ++k) graph = graph || (grads[k].defined() && grads[k].requires_grad());
    TORCH_CHECK(!graph, kDoubleBackward);
  }
  std::vector<Tensor> out(3);
  for (int k = 0; k < 3; ++k) out[k] = grads[k].defined() ? grads[k] : at::zeros_like(lse);
  return out;
}

using StatsTuple = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using KeepTuple = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using GradTuple = std::tuple<Tensor, Tensor>;

class CeShardStatsFn : public torch::autograd::Function<CeShardStatsFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, const Tensor& labels,
                               const std::optional<Tensor>& target_ref, int64_t class_offset, double scale,
                               double m1, double m2, double m3, bool normalize, int64_t chunk_classes) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("shardkit::ce_shard_stats", "")
            .typed<StatsTuple(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&,
                              int64_t, double, double, double, double, bool, int64_t)>();
    StatsTuple out;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      out = op.call(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes);
    }
    auto& [lse, target, logit_sum, count] = out;
    ctx->save_for_backward({x, w, labels, lse});
    save_params(ctx, {class_offset, scale, m1, m2, m3, normalize, chunk_classes});
    ctx->mark_non_differentiable({count});
    ctx->set_materialize_grads(false);  // zeros only for the statistics the backward op takes
    return {lse, target, logit_sum, count};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("shardkit::ce_shard_stats_backward", "")
                               .typed<GradTuple(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                const Tensor&, const Tensor&, const Tensor&, int64_t, double,
                                                double, double, double, bool, int64_t, bool)>();
    variable_list out(11);  // x, w, then nine arguments without a gradient
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    if (!(need_x || need_w)) return out;
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1], &labels = saved[2], &lse = saved[3];
    const auto g = stat_grads(grads, x, w, lse);
    const Params p = load_params(ctx);
    // A frozen w: the op makes no [C, D] gradient (nor its GEMMs).
    auto [gx, gw] = op.call(g[0], g[1], g[2], x, w, labels, lse, p.class_offset, p.scale, p.m1, p.m2, p.m3,
                            p.normalize, p.chunk_classes, need_w);
    if (need_x) out[0] = gx;
    if (need_w) out[1] = gw;
    return out;
  }
};

class CeShardStatsKeepFn : public torch::autograd::Function<CeShardStatsKeepFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, const Tensor& labels,
                               const std::optional<Tensor>& target_ref, int64_t class_offset, double scale,
                               double m1, double m2, double m3, bool normalize, int64_t chunk_classes,
                               int64_t keep_chunks) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("shardkit::ce_shard_stats_keep", "")
            .typed<KeepTuple(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&,
                             int64_t, double, double, double, double, bool, int64_t, int64_t)>();
    KeepTuple out;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      out = op.call(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes,
                    keep_chunks);
    }
    auto& [lse, target, logit_sum, count, kept_logits, kept_target] = out;
    ctx->save_for_backward({x, w, labels, lse, kept_logits, kept_target});
    save_params(ctx, {class_offset, scale, m1, m2, m3, normalize, chunk_classes});
    ctx->saved_data["keep"] = keep_chunks;
    ctx->mark_non_differentiable({count, kept_logits, kept_target});
    // The kept logits must never get a materialized zero gradient of their size.
    ctx->set_materialize_grads(false);
    return {lse, target, logit_sum, count, kept_logits, kept_target};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("shardkit::ce_shard_stats_backward_kept", "")
            .typed<GradTuple(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                             const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, double,
                             double, double, double, bool, int64_t, int64_t, bool)>();
    variable_list out(12);  // x, w, then ten arguments without a gradient
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    if (!(need_x || need_w)) return out;
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1], &labels = saved[2], &lse = saved[3];
    const auto g = stat_grads(grads, x, w, lse);
    const Params p = load_params(ctx);
    auto [gx, gw] =
        op.call(g[0], g[1], g[2], x, w, labels, lse, saved[4], saved[5], p.class_offset, p.scale, p.m1, p.m2,
                p.m3, p.normalize, p.chunk_classes, ctx->saved_data["keep"].toInt(), need_w);
    if (need_x) out[0] = gx;
    if (need_w) out[1] = gw;
    return out;
  }
};

StatsTuple ce_shard_stats_autograd(const Tensor& x, const Tensor& w, const Tensor& labels,
                                   const std::optional<Tensor>& target_ref, int64_t class_offset,
                                   double scale, double m1, double m2, double m3, bool normalize,
                                   int64_t chunk_classes) {
  auto o = CeShardStatsFn::apply(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize,
                                 chunk_classes);
  return {o[0], o[1], o[2], o[3]};
}

KeepTuple ce_shard_stats_keep_autograd(const Tensor& x, const Tensor& w, const Tensor& labels,
                                       const std::optional<Tensor>& target_ref, int64_t class_offset,
                                       double scale, double m1, double m2, double m3, bool normalize,
                                       int64_t chunk_classes, int64_t keep_chunks) {
  auto o = CeShardStatsKeepFn::apply(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize,
                                     chunk_classes, keep_chunks);
  return {o[0], o[1], o[2], o[3], o[4], o[5]};
}

}  // namespace

TORCH_LIBRARY_IMPL(shardkit, Autograd, m) {
  m.impl("ce_shard_stats", &ce_shard_stats_autograd);
  m.impl("ce_shard_stats_keep", &ce_shard_stats_keep_autograd);
}
