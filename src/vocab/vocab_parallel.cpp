// See fsdp/vocab_parallel.h.
//
// Note [Vocab-parallel tables]
// The table is one parameter of V rows of D values, flattened into its flat param and split into
// shards of S elements: rank r holds elements [r*S, (r+1)*S) of the flat buffer, which need not
// fall on row boundaries. So each rank holds a run of whole rows, [full_begin, full_end), and at
// each end perhaps part of a row whose other part is on the neighbouring rank: a "split row".
// Which rows are split follows from S, D and the group's size alone, so every rank knows them
// all. A split row belongs, for the softmax, to the rank holding its first element; its logits
// are the sums of the partial dot products of the ranks holding its parts (one small all-reduce
// of [tokens, split rows] fp32). The lookup needs no owner: each rank writes the columns it holds.
//
// Every rank computes for every rank's tokens (the group's hidden states are gathered, a few
// hundred rows of D values each), so the softmax's sums are per rank partial sums over its rows:
// a running maximum m and sum s = sum(exp(z - m)) per token over its chunks, and the target's
// logit where the rank holds the target's row; an all-gather of the three then gives every token's
// log-sum-exp. When the loss will be differentiated, the same pass over the chunks also forms the
// hidden states' gradient, so that backward computes no logits again (a product of the head's size
// fewer per step): beside the sums, an fp32 [tokens, D] accumulator A = sum(exp(z - a) W) over the
// chunks, rescaled as its own running maximum a grows (as an online softmax rescales its sum), and
// O, the table's row of each token's target where this rank holds it. Once the log-sum-exp is
// known, softmax(z) W = A exp(a - lse), so D = A exp(a - lse) - O (plus the split rows' parts) is
// this rank's share of every token's gradient for a loss gradient of 1 per target. Backward scales
// each token's row by its rank's gradient over its rank's count of targets, and a reduce-scatter
// sums each rank's tokens back to it: no table values are read in backward.
#include "fsdp/vocab_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/errors.h"
#include "shard/table_shard.h"

namespace fsdp {
namespace {

// This rank's part of the table (Note [Vocab-parallel tables]), in the table's elements.
struct TablePart {
  std::optional<TableShard> fp;
  int64_t vocab = 0, dim = 0;
  int64_t begin = 0, end = 0;            // elements [begin, end) of the V*D table are here
  int64_t full_begin = 0, full_end = 0;  // whole rows held here
  int64_t local_at = 0;                  // the table's element `begin` is shard element local_at
  std::vector<int64_t> split_rows;       // every rank's (same list)
  std::vector<int> split_owner;          // the rank holding each split row's first element
  Communicator& group() const { return fp->group(); }
  std::string tag(const char* what) const { return fp->tag() + "/vocab/" + what; }
  at::ScalarType dtype() const { return fp->compute_dtype(); }

  // Columns [c0, c1) of split row q held here, at shard element `at`; false when none are.
  bool piece(int64_t q, int64_t& c0, int64_t& c1, int64_t& at) const {
    const int64_t a = std::max(begin, q * dim), b = std::min(end, (q + 1) * dim);
    if (a >= b) return false;
    c0 = a - q * dim;
    c1 = b - q * dim;
    at = local_at + (a - begin);
    return true;
  }
};

TablePart table_part(const TableShard& fp) {
  TablePart t;
  t.fp = fp;
  t.vocab = fp.shape()[0];
  t.dim = fp.shape()[1];
  const int64_t numel = t.vocab * t.dim, S = fp.shard_numel(), N = fp.group().size();
  t.begin = std::clamp<int64_t>(fp.shard_offset() - fp.offset(), 0, numel);
  t.end = std::clamp<int64_t>(fp.shard_offset() + S - fp.offset(), 0, numel);
  t.local_at = fp.offset() + t.begin - fp.shard_offset();
  t.full_begin = (t.begin + t.dim - 1) / t.dim;
  t.full_end = std::max(t.full_begin, t.end / t.dim);
  for (int64_t k = 1; k < N; ++k) {
    const int64_t x = k * S - fp.offset();
    if (x <= 0 || x >= numel || x % t.dim == 0) continue;
    const int64_t q = x / t.dim;
    if (!t.split_rows.empty() && t.split_rows.back() == q) continue;
    t.split_rows.push_back(q);
    t.split_owner.push_back(static_cast<int>((fp.offset() + q * t.dim) / S));
  }
  return t;
}

// The one parameter of an unsharded table module.
at::Tensor plain_table(const torch::nn::Module& module, const char* fn) {
  const auto params = module.parameters(/*recurse=*/true);
  if (params.size() != 1 || params[0].dim() != 2) {
    throw UsageError(std::string("fsdp::") + fn + ": module " + module.name() +
                     " must hold exactly one [vocab, dim] parameter");
  }
  return params[0];
}

// Every rank's count of rows (int64 [N], on the host).
at::Tensor gather_counts(Communicator& g, int64_t n, const c10::Device& device, const std::string& tag) {
  at::Tensor mine = at::full({1}, n, at::TensorOptions().dtype(at::kLong).device(device));
  at::Tensor all = at::empty({g.size()}, mine.options());
  g.all_gather(all, mine, tag).wait();
  return all.cpu();
}

// `x` ([n, ...]) padded to m rows with `fill`, gathered from every rank: [N * m, ...].
at::Tensor gather_padded(Communicator& g, const at::Tensor& x, int64_t m, double fill, const std::string& tag) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = m;
  at::Tensor padded = at::full(shape, fill, x.options());
  padded.narrow(0, 0, x.size(0)).copy_(x);
  shape[0] = m * g.size();
  at::Tensor all = at::empty(shape, x.options());
  g.all_gather(all, padded, tag).wait();
  return all;
}

// Throws UsageError (on every rank alike: `ids` are every rank's) for an id outside [0, vocab)
// that is not `ignore`.
void check_ids(const at::Tensor& ids, const at::Tensor& counts, int64_t m, int64_t vocab, int64_t ignore,
               const char* what) {
  const auto c = counts.accessor<int64_t, 1>();
  for (int64_t r = 0; r < counts.size(0); ++r) {
    const at::Tensor mine = ids.narrow(0, r * m, c[r]).cpu();
    const at::Tensor bad = (mine.lt(0) | mine.ge(vocab)) & mine.ne(ignore);
    if (!bad.any().item<bool>()) continue;
    const int64_t v = mine.masked_select(bad)[0].item<int64_t>();
    throw UsageError(std::string("fsdp::sharded_") + what + ": rank " + std::to_string(r) + " gave " + what + " id " +
                     std::to_string(v) + ", outside the table's " + std::to_string(vocab) + " rows");
  }
}

}  // namespace

at::Tensor sharded_embedding(const torch::nn::Module& module, const at::Tensor& tokens) {
  if (tokens.scalar_type() != at::kLong) {
    throw UsageError("fsdp::sharded_embedding: tokens must be int64, got " +
                     std::string(c10::toString(tokens.scalar_type())));
  }
  const std::optional<TableShard> fp = TableShard::of(module, "sharded_embedding");
  if (!fp) return at::embedding(plain_table(module, "sharded_embedding"), tokens);
  c10::NoGradGuard no_grad;
  const TablePart t = table_part(*fp);
  Communicator& g = t.group();
  const c10::Device dev = fp->device();
  const at::Tensor ids_here = tokens.reshape({-1}).to(dev);
  const int64_t n = ids_here.numel();
  const at::Tensor counts = gather_counts(g, n, dev, t.tag("counts"));
  const int64_t m = std::max<int64_t>(1, counts.max().item<int64_t>());
  const at::Tensor ids = gather_padded(g, ids_here, m, -1, t.tag("ids"));
  check_ids(ids, counts, m, t.vocab, /*ignore=*/-1, "embedding");
  at::Tensor rows = at::zeros({ids.size(0), t.dim}, ids.options().dtype(at::kFloat));
  fp->with_values([&](const at::Tensor& shard) {
    if (t.full_end > t.full_begin) {
      const at::Tensor table =
          shard.narrow(0, t.local_at + t.full_begin * t.dim - t.begin, (t.full_end - t.full_begin) * t.dim)
              .view({t.full_end - t.full_begin, t.dim});
      const at::Tensor pos = (ids.ge(t.full_begin) & ids.lt(t.full_end)).nonzero().squeeze(1);
      rows.index_copy_(0, pos,
                       table.index_select(0, ids.index_select(0, pos) - t.full_begin).to(t.dtype()).to(at::kFloat));
    }
    for (int64_t q : t.split_rows) {
      int64_t c0 = 0, c1 = 0, at = 0;
      if (!t.piece(q, c0, c1, at)) continue;
      const at::Tensor pos = ids.eq(q).nonzero().squeeze(1);
      const at::Tensor part = shard.narrow(0, at, c1 - c0).to(t.dtype()).to(at::kFloat);
      rows.narrow(1, c0, c1 - c0).index_copy_(0, pos, part.unsqueeze(0).expand({pos.numel(), c1 - c0}).contiguous());
    }
  });
  at::Tensor mine = at::empty({m, t.dim}, rows.options());
  g.reduce_scatter(mine, rows, ReduceOp::kSum, t.tag("rows")).wait();
  std::vector<int64_t> shape = tokens.sizes().vec();
  shape.push_back(t.dim);
  return mine.narrow(0, 0, n).to(tokens.device(), t.dtype()).view(shape);
}

namespace {

// The cross-entropy's state: every rank's tokens (hidden states X in the compute dtype, targets T,
// each row's log-sum-exp), the split rows' logits, and for backward this rank's share D of every
// token's gradient (Note [Vocab-parallel tables]); backward keeps T and D only.
struct Saved {
  Saved() = default;
  explicit Saved(TablePart part) : t(std::move(part)) {}
  TablePart t;
  at::Tensor X, T, lse, split_z, D;
  int64_t m = 0, n = 0, chunk = 0, ignore = -100, count = 0;
  std::vector<int64_t> hidden_shape;
  at::ScalarType hidden_dtype = at::kFloat;
  c10::Device hidden_device = c10::Device(c10::kCPU);
};

// Calls fn(a, c, W, z) for each chunk of this rank's whole rows [a, a + c): W [c, D] in the
// compute dtype and z = linear(X, W) taken to fp32 ([M, c]).
template <typename F>
void for_each_chunk(const Saved& s, const at::Tensor& shard, F&& fn) {
  const TablePart& t = s.t;
  for (int64_t a = t.full_begin; a < t.full_end; a += s.chunk) {
    const int64_t c = std::min(s.chunk, t.full_end - a);
    // A chunk's rows in the compute dtype (a stored form in another dtype is cast a chunk at a time).
    const at::Tensor W = shard.narrow(0, t.local_at + a * t.dim - t.begin, c * t.dim).view({c, t.dim}).to(t.dtype());
    fn(a, c, W, at::linear(s.X, W).to(at::kFloat));
  }
}

// Where T falls in rows [a, a + c): the mask and the column (0 where it does not).
std::pair<at::Tensor, at::Tensor> targets_in(const at::Tensor& T, int64_t a, int64_t c) {
  return {T.ge(a) & T.lt(a + c), (T - a).clamp(0, c - 1).unsqueeze(1)};
}

// Folds logits z ([M, c], rows [a, a + c)) into the running maximum, sum and target logit.
// Returns exp(z - cm) and cm, each token's maximum over the chunk, for the gradient's sums.
std::pair<at::Tensor, at::Tensor> fold(const at::Tensor& z, int64_t a, const at::Tensor& T, at::Tensor& mx,
                                       at::Tensor& sum, at::Tensor& tl) {
  const at::Tensor cm = z.amax(1);
  at::Tensor e = (z - cm.unsqueeze(1)).exp_();
  const at::Tensor cs = e.sum(1);
  const at::Tensor nm = at::maximum(mx, cm);
  sum = sum * (mx - nm).exp_() + cs * (cm - nm).exp_();
  mx = nm;
  const auto [in, col] = targets_in(T, a, z.size(1));
  tl.add_(at::where(in, z.gather(1, col).squeeze(1), at::zeros_like(tl)));
  return {e, cm};
}

// The split rows' logits for every token ([M, split rows], fp32, rounded to the compute dtype as
// at::linear's output is): each rank's partial dot products, summed.
at::Tensor split_logits(const Saved& s, const at::Tensor& shard) {
  const TablePart& t = s.t;
  const int64_t M = s.X.size(0), ns = static_cast<int64_t>(t.split_rows.size());
  at::Tensor P = at::zeros({M, ns}, s.X.options().dtype(at::kFloat));
  if (ns == 0) return P;
  for (int64_t j = 0; j < ns; ++j) {
    int64_t c0 = 0, c1 = 0, at = 0;
    if (!t.piece(t.split_rows[j], c0, c1, at)) continue;
    P.select(1, j).copy_(
        at::mv(s.X.narrow(1, c0, c1 - c0).to(at::kFloat), shard.narrow(0, at, c1 - c0).to(t.dtype()).to(at::kFloat)));
  }
  t.group().all_reduce(P, ReduceOp::kSum, t.tag("split_rows")).wait();
  return P.to(t.dtype()).to(at::kFloat);
}

// The gradient's accumulators over the chunks (Note [Vocab-parallel tables]): A relative to its
// running maximum am, and O, the target rows.
struct GradSums {
  at::Tensor A, O, am;
  // The chunk of rows [a, a + c) whose rows in the compute dtype are W ([c, D]), as fold() left
  // it: e = exp(z - cm) ([M, c] fp32), cm each token's maximum over the chunk.
  void add(at::Tensor& e, const at::Tensor& cm, int64_t a, const at::Tensor& W, const at::Tensor& T) {
    const at::Tensor nm = at::maximum(am, cm);
    A.mul_((am - nm).exp_().unsqueeze(1));  // the first chunk: exp(-inf) = 0 on zeros
    am = nm;
    const at::Tensor p = e.mul_((cm - am).exp_().unsqueeze(1));  // exp(z - am)
    if (W.scalar_type() == at::kFloat) {
      A.addmm_(p, W);
    } else {
      A.add_(at::mm(p.to(W.scalar_type()), W));
    }
    const auto [in, col] = targets_in(T, a, e.size(1));
    const at::Tensor rows = in.nonzero().squeeze(1);
    if (rows.numel() > 0) O.index_add_(0, rows, W.index_select(0, col.squeeze(1).index_select(0, rows)).to(at::kFloat));
  }
};

// D: this rank's share of every token's gradient for a loss gradient of 1 per target.
at::Tensor gradient_share(const Saved& s, const GradSums& g, const at::Tensor& shard) {
  const TablePart& t = s.t;
  at::Tensor D = g.A.mul_((g.am - s.lse).exp_().unsqueeze(1)).sub_(g.O);
  for (size_t j = 0; j < t.split_rows.size(); ++j) {
    int64_t c0 = 0, c1 = 0, at = 0;
    const int64_t q = t.split_rows[j];
    if (!t.piece(q, c0, c1, at)) continue;
    at::Tensor dz = (s.split_z.select(1, static_cast<int64_t>(j)) - s.lse).exp_();
    dz.sub_(s.T.eq(q).to(at::kFloat));
    D.narrow(1, c0, c1 - c0)
        .add_(dz.unsqueeze(1) * shard.narrow(0, at, c1 - c0).to(t.dtype()).to(at::kFloat).unsqueeze(0));
  }
  return D;
}

// Forward: fills s.lse and s.split_z, and with `grad` s.D; returns this rank's mean loss.
at::Tensor forward_loss(Saved& s, bool grad) {
  const TablePart& t = s.t;
  Communicator& g = t.group();
  const int64_t M = s.X.size(0);
  const auto f32 = s.X.options().dtype(at::kFloat);
  at::Tensor mx = at::full({M}, -std::numeric_limits<float>::infinity(), f32);
  at::Tensor sum = at::zeros({M}, f32), tl = at::zeros({M}, f32);
  GradSums sums;
  if (grad) sums = {at::zeros({M, t.dim}, f32), at::zeros({M, t.dim}, f32), mx.clone()};
  t.fp->with_values([&](const at::Tensor& shard) {
    for_each_chunk(s, shard, [&](int64_t a, int64_t, const at::Tensor& W, const at::Tensor& z) {
      auto [e, cm] = fold(z, a, s.T, mx, sum, tl);
      if (grad) sums.add(e, cm, a, W, s.T);
    });
    s.split_z = split_logits(s, shard);
    for (size_t j = 0; j < t.split_rows.size(); ++j) {
      if (t.split_owner[j] != g.rank()) continue;
      fold(s.split_z.narrow(1, static_cast<int64_t>(j), 1), t.split_rows[j], s.T, mx, sum, tl);
    }
    at::Tensor all = at::empty({g.size() * 3 * M}, f32);
    g.all_gather(all, at::stack({mx, sum, tl}).reshape({-1}), t.tag("sums")).wait();
    all = all.view({g.size(), 3, M});
    const at::Tensor gm = all.select(1, 0).amax(0);
    s.lse = gm + (all.select(1, 1) * (all.select(1, 0) - gm).exp()).sum(0).log();
    tl = all.select(1, 2).sum(0);
    if (grad) s.D = gradient_share(s, sums, shard);
  });
  const at::Tensor target_logit = tl;
  const int64_t own = g.rank() * s.m;
  const at::Tensor T = s.T.narrow(0, own, s.n);
  const at::Tensor valid = T.ne(s.ignore);
  s.count = valid.sum().item<int64_t>();
  const at::Tensor per = (s.lse.narrow(0, own, s.n) - target_logit.narrow(0, own, s.n));
  return at::where(valid, per, at::zeros_like(per)).sum() / static_cast<double>(s.count);
}

// Backward: the gradient of this rank's hidden states for the loss's gradient `grad`: each token's
// row of s.D scaled by its rank's gradient over its rank's count of targets, summed over the ranks.
at::Tensor backward_hidden(const Saved& s, const at::Tensor& grad) {
  const TablePart& t = s.t;
  Communicator& g = t.group();
  const auto f32 = s.D.options();
  at::Tensor scale = (grad.to(f32).reshape({1}) / static_cast<double>(s.count)).contiguous();
  at::Tensor scales = at::empty({g.size()}, f32);
  g.all_gather(scales, scale, t.tag("scales")).wait();
  const at::Tensor tok = scales.repeat_interleave(s.m) * s.T.ne(s.ignore).to(at::kFloat);
  const at::Tensor dX = s.D * tok.unsqueeze(1);
  at::Tensor mine = at::empty({s.m, t.dim}, f32);
  g.reduce_scatter(mine, dX, ReduceOp::kSum, t.tag("grads")).wait();
  return mine.narrow(0, 0, s.n).to(s.hidden_device, s.hidden_dtype).view(s.hidden_shape);
}

struct VocabCrossEntropyBackward : torch::autograd::Node {
  Saved saved;  // its table part keeps the table's flat param alive
  std::string name() const override { return "fsdp::VocabCrossEntropyBackward"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    c10::NoGradGuard no_grad;
    return {backward_hidden(saved, grads[0])};
  }
  void release_variables() override { saved = Saved(saved.t); }
};

at::Tensor plain_cross_entropy(const at::Tensor& table, const at::Tensor& hidden, const at::Tensor& targets,
                               int64_t ignore_index) {
  const at::Tensor z = at::linear(hidden.reshape({-1, hidden.size(-1)}).to(table.scalar_type()), table);
  return at::cross_entropy_loss(z.to(at::kFloat), targets.reshape({-1}), {}, at::Reduction::Mean, ignore_index);
}

}  // namespace

int64_t sharded_cross_entropy_chunk_rows(int64_t tokens, int64_t dim) {
  return std::max<int64_t>(64, (int64_t{16} << 20) / (4 * std::max<int64_t>({tokens, dim, 1})));
}

at::Tensor sharded_cross_entropy(const torch::nn::Module& module, const at::Tensor& hidden, const at::Tensor& targets,
                                 int64_t ignore_index, int64_t chunk_rows) {
  if (targets.scalar_type() != at::kLong || hidden.dim() < 1 ||
      targets.sizes() != hidden.sizes().slice(0, hidden.dim() - 1)) {
    throw UsageError("fsdp::sharded_cross_entropy: targets must be int64 of hidden's leading shape; got hidden " +
                     c10::str(hidden.sizes()) + ", targets " + c10::str(targets.sizes()) + " " +
                     c10::toString(targets.scalar_type()));
  }
  const std::optional<TableShard> fp = TableShard::of(module, "sharded_cross_entropy");
  if (!fp) return plain_cross_entropy(plain_table(module, "sharded_cross_entropy"), hidden, targets, ignore_index);
  Saved s(table_part(*fp));
  if (hidden.size(-1) != s.t.dim) {
    throw UsageError("fsdp::sharded_cross_entropy: hidden's last dimension is " + std::to_string(hidden.size(-1)) +
                     ", the table's rows have " + std::to_string(s.t.dim));
  }
  const bool grad = hidden.requires_grad() && c10::GradMode::is_enabled();
  at::Tensor loss;
  {
    c10::NoGradGuard no_grad;
    Communicator& g = s.t.group();
    const c10::Device dev = fp->device();
    const at::Tensor h = hidden.reshape({-1, s.t.dim}).to(dev, s.t.dtype());
    const at::Tensor tg = targets.reshape({-1}).to(dev);
    s.n = h.size(0);
    const at::Tensor counts = gather_counts(g, s.n, dev, s.t.tag("counts"));
    s.m = std::max<int64_t>(1, counts.max().item<int64_t>());
    s.X = gather_padded(g, h, s.m, 0.0, s.t.tag("hidden"));
    s.T = gather_padded(g, tg, s.m, static_cast<double>(ignore_index), s.t.tag("targets"));
    check_ids(s.T, counts, s.m, s.t.vocab, ignore_index, "target");
    s.ignore = ignore_index;
    s.chunk = chunk_rows > 0 ? chunk_rows : sharded_cross_entropy_chunk_rows(s.X.size(0), s.t.dim);
    s.hidden_shape = hidden.sizes().vec();
    s.hidden_dtype = hidden.scalar_type();
    s.hidden_device = hidden.device();
    loss = forward_loss(s, grad);
    s.X = s.lse = s.split_z = at::Tensor();  // backward reads T and D only
  }
  if (grad) {
    auto node =
        std::shared_ptr<VocabCrossEntropyBackward>(new VocabCrossEntropyBackward(), torch::autograd::deleteNode);
    node->saved = std::move(s);
    node->set_next_edges(torch::autograd::collect_next_edges(hidden));
    torch::autograd::set_history(loss, node);
  }
  return loss;
}

}  // namespace fsdp
