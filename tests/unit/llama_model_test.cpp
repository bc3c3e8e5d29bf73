// The Llama example model (models/llama): transformers-compatible names and config, shapes,
// causality, rotary and grouped-query attention against plain-loop references, logits against
// values computed by transformers itself, deferred (meta) construction, and that it trains.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/optim/sgd.h>

#include "fsdp/init.h"
#include "llama.h"

namespace {

using llama::LlamaConfig;
using llama::LlamaForCausalLM;

// Small enough to run in milliseconds; GQA on (4 query heads share 2 key/value heads).
LlamaConfig tiny_config(bool tied = false) {
  LlamaConfig c;
  c.vocab_size = 32;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  return c;
}

std::vector<std::string> names_of(const torch::nn::Module& m) {
  std::vector<std::string> names;
  for (const auto& p : m.named_parameters()) names.push_back(p.key());
  return names;
}

// transformers' LlamaForCausalLM state_dict keys, in its order.
// (LibTorch also lists a tied lm_head.weight, so the list is the same either way.)
std::vector<std::string> hf_names(int layers) {
  std::vector<std::string> n = {"model.embed_tokens.weight"};
  for (int i = 0; i < layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    for (const char* s :
         {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"}) {
      n.push_back(p + s + ".weight");
    }
  }
  n.push_back("model.norm.weight");
  n.push_back("lm_head.weight");  // present in transformers' state_dict even when tied
  return n;
}

// RoPE as in the paper, one pair at a time in double: element i pairs with i + D/2 (transformers'
// half-split layout) and turns by pos * theta^(-2i/D).
at::Tensor rope_reference(const at::Tensor& v, int64_t pos, double theta) {
  const int64_t D = v.size(0), half = D / 2;
  auto in = v.to(at::kDouble).contiguous();
  auto out = at::empty_like(in);
  auto a = in.accessor<double, 1>();
  auto o = out.accessor<double, 1>();
  for (int64_t i = 0; i < half; ++i) {
    const double angle = pos * std::pow(theta, -2.0 * i / D);
    o[i] = a[i] * std::cos(angle) - a[i + half] * std::sin(angle);
    o[i + half] = a[i + half] * std::cos(angle) + a[i] * std::sin(angle);
  }
  return out;
}

std::string message_of(const LlamaConfig& base, const nlohmann::json& patch) {
  nlohmann::json j = base.to_json();
  j.merge_patch(patch);
  try {
    LlamaConfig::from_json(j);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(accepted)";
}

// Values that both this test and the script that produced the transformers reference compute
// exactly, in integers: parameter k (in name order) element i gets
// ((i*i*7919 + i*104729 + (k+1)*15485863) mod 65536) / 65536 - 0.5, times 0.25 for weights and
// plus 1 after that for norm weights. Exact in fp32, so no libm or RNG differences.
void fill_reference_weights(LlamaForCausalLM& model) {
  at::NoGradGuard no_grad;
  int64_t k = 0;
  for (auto& p : llama::unique_parameters(*model)) {
    const auto i = at::arange(p.numel(), at::kLong);
    const auto h = (i * i * 7919 + i * 104729 + (k + 1) * 15485863) % 65536;
    auto v = (h.to(at::kDouble) / 65536.0 - 0.5) * 0.25;
    if (p.dim() == 1) v = v + 1.0;
    p.copy_(v.to(at::kFloat).view(p.sizes()));
    ++k;
  }
}

// logits[:, :, 0:4] and the loss against the tokens shifted by one, printed by transformers 5.23.0
// (LlamaForCausalLM, attn_implementation="eager", fp32) for MatchesTransformersLogits.
constexpr float kUntiedFirst4[56] = {
    -0.0095986668f, 0.62600058f,  0.13123202f,   -0.55875915f, -0.13406202f, 0.40733236f,  -0.019081498f, -0.65686852f,
    0.43120509f,    -0.22056289f, -0.024254203f, -0.21422182f, -0.38633758f, -0.19566023f, 0.52961069f,   -0.61935908f,
    1.1506571f,     -0.26109859f, -0.011720103f, -0.35770977f, 0.25271487f,  -0.12359248f, -0.66366595f,  -0.30992013f,
    0.14365707f,    0.67363667f,  0.4475399f,    -0.5179618f,  0.2438224f,   -0.44244373f, 0.058290374f,  0.14439766f,
    0.24382246f,    -0.44244403f, 0.058290377f,  0.14439762f,  0.24382246f,  -0.44244367f, 0.058290441f,  0.1443976f,
    0.037994873f,   -0.35880637f, -0.039460886f, -0.55104673f, 0.28174511f,  -0.45207393f, 0.10515647f,   -0.09095373f,
    0.20330858f,    -0.34773427f, 0.035081591f,  -0.13726442f, 0.50613528f,  -0.10810653f, -0.054202285f, 0.24264617f};
constexpr double kUntiedLoss = 3.300163507;
constexpr float kTiedFirst4[56] = {
    -0.075467467f, 0.43330735f,  0.14515567f,  -0.23075765f,  -0.029304245f, -0.3706938f,  0.034629613f, -0.031639598f,
    0.55373156f,   -0.24396612f, 0.13577132f,  0.14171784f,   -0.024711519f, -0.14776175f, 0.45802882f,  -0.05527468f,
    1.4442225f,    0.093303122f, -0.12613237f, -0.14759599f,  0.29113176f,   -0.18025483f, -0.72996008f, -0.043950118f,
    0.048827808f,  0.79240865f,  0.32067895f,  -0.13784726f,  0.055096716f,  -0.31314605f, 0.58576798f,  0.31846762f,
    0.055096883f,  -0.31314617f, 0.58576798f,  0.31846768f,   0.055096805f,  -0.31314608f, 0.58576804f,  0.31846768f,
    -0.22957243f,  -0.43926015f, 0.15179163f,  -0.56387508f,  0.21479094f,   -0.52308583f, 0.1954976f,   -0.1863399f,
    0.24802458f,   -0.31839597f, 0.096557781f, -0.072381869f, 0.58906645f,   -0.2154474f,  0.12571183f,  -0.41321453f};
constexpr double kTiedLoss = 3.490888596;

TEST(LlamaModel, ParameterNamesMatchTransformersUntied) {
  LlamaForCausalLM model(tiny_config(/*tied=*/false), at::kMeta);
  EXPECT_EQ(names_of(*model), hf_names(2));
  EXPECT_FALSE(model->lm_head->weight.is_same(model->model->embed_tokens->weight));
}

TEST(LlamaModel, TiedEmbeddingIsOneTensorUnderBothNames) {
  LlamaForCausalLM model(tiny_config(/*tied=*/true));
  EXPECT_EQ(names_of(*model), hf_names(2));
  auto params = model->named_parameters();
  EXPECT_TRUE(params["lm_head.weight"].is_same(params["model.embed_tokens.weight"]));
  EXPECT_EQ(llama::unique_parameters(*model).size(), params.size() - 1);

  // The tie holds through a dtype change and gradients from both uses land in the one tensor.
  model->to(at::kDouble);
  EXPECT_TRUE(model->lm_head->weight.is_same(model->model->embed_tokens->weight));
  auto tokens = at::tensor({3, 1, 4, 1, 5}, at::kLong).view({1, 5});
  llama::loss(model->forward(tokens), tokens).backward();
  EXPECT_TRUE(model->model->embed_tokens->weight.grad().defined());
  EXPECT_TRUE(model->lm_head->weight.grad().is_same(model->model->embed_tokens->weight.grad()));
}

TEST(LlamaModel, ParameterShapesAndCountFollowTheFormula) {
  for (bool tied : {false, true}) {
    const LlamaConfig c = tiny_config(tied);
    LlamaForCausalLM model(c, at::kMeta);
    const int64_t V = c.vocab_size, h = c.hidden_size, I = c.intermediate_size, D = c.head_dim();
    const int64_t kv = c.num_key_value_heads * D;
    const int64_t per_layer = h * h /*q*/ + 2 * h * kv /*k, v*/ + h * h /*o*/ + 3 * h * I /*mlp*/ + 2 * h /*norms*/;
    const int64_t expected = V * h + c.num_hidden_layers * per_layer + h + (tied ? 0 : V * h);
    int64_t count = 0;
    for (const auto& p : llama::unique_parameters(*model)) count += p.numel();
    EXPECT_EQ(count, expected) << "tied=" << tied;

    auto params = model->named_parameters();
    EXPECT_EQ(params["model.layers.1.self_attn.k_proj.weight"].sizes(), at::IntArrayRef({kv, h}));
    EXPECT_EQ(params["model.layers.1.self_attn.o_proj.weight"].sizes(), at::IntArrayRef({h, h}));
    EXPECT_EQ(params["model.layers.0.mlp.down_proj.weight"].sizes(), at::IntArrayRef({h, I}));
    EXPECT_EQ(params["lm_head.weight"].sizes(), at::IntArrayRef({V, h}));
  }
}

TEST(LlamaModel, MetaConstructionOfLlama2SevenBAllocatesNothing) {
  // The defaults are Llama-2-7B's shape; 26 GB of fp32 would not fit here, so this only passes if
  // nothing is allocated. 6,738,415,616 is the published parameter count.
  LlamaForCausalLM model(LlamaConfig{}, at::kMeta);
  int64_t count = 0;
  for (const auto& p : llama::unique_parameters(*model)) {
    ASSERT_TRUE(p.is_meta());
    count += p.numel();
  }
  EXPECT_EQ(count, 6738415616);
}

TEST(LlamaModel, ForwardShapesAndLossAtInit) {
  torch::manual_seed(0);
  const LlamaConfig c = tiny_config();
  LlamaForCausalLM model(c);
  auto tokens = at::randint(c.vocab_size, {3, 7}, at::kLong);
  auto logits = model->forward(tokens);
  EXPECT_EQ(logits.sizes(), at::IntArrayRef({3, 7, c.vocab_size}));
  EXPECT_EQ(logits.scalar_type(), at::kFloat);
  EXPECT_TRUE(logits.isfinite().all().item<bool>());
  // Weights of std 0.02 give near-uniform predictions: loss close to log(vocab).
  EXPECT_NEAR(llama::loss(logits, tokens).item<double>(), std::log(static_cast<double>(c.vocab_size)), 0.05);

  EXPECT_THROW(model->forward(tokens.to(at::kInt)), c10::Error);
  EXPECT_THROW(model->forward(at::zeros({1, c.max_position_embeddings + 1}, at::kLong)), c10::Error);
}

TEST(LlamaModel, MatchesTransformersLogits) {
  // Reference values from transformers' LlamaForCausalLM (eager attention, fp32) with the same
  // config and fill_reference_weights' values; see the note on that function.
  // Both attention kinds: eager is transformers' reference path, sdpa the default.
  for (int k = 0; k < 4; ++k) {
    const bool tied = k % 2 == 1;
    LlamaConfig config = tiny_config(tied);
    config.attn_implementation = k < 2 ? "eager" : "sdpa";
    LlamaForCausalLM model(config);
    fill_reference_weights(model);
    auto tokens = at::tensor({1, 5, 9, 31, 0, 17, 4, 3, 3, 3, 8, 30, 12, 21}, at::kLong).view({2, 7});
    auto logits = model->forward(tokens);
    const auto expected_first4 = tied ? kTiedFirst4 : kUntiedFirst4;
    auto expected = at::tensor(std::vector<float>(expected_first4, expected_first4 + 56)).view({2, 7, 4});
    EXPECT_TRUE(at::allclose(logits.slice(2, 0, 4), expected, 1e-5, 1e-5)) << "tied=" << tied << "\n"
                                                                           << logits.slice(2, 0, 4) << "\nexpected\n"
                                                                           << expected;
    EXPECT_NEAR(llama::loss(logits, tokens.roll(-1, 1)).item<double>(), tied ? kTiedLoss : kUntiedLoss, 1e-5)
        << "tied=" << tied;
  }
}

TEST(LlamaModel, GroupedQueryAttentionMatchesPerHeadReference) {
  torch::manual_seed(1);
  LlamaConfig c = tiny_config();
  c.hidden_size = 24;
  c.num_attention_heads = 6;
  c.num_key_value_heads = 2;  // query heads 0-2 read kv head 0, 3-5 read kv head 1
  const int64_t H = 6, D = c.head_dim(), n_rep = 3, B = 2, T = 5;
  llama::LlamaAttention attn(c, at::kCPU);
  {
    at::NoGradGuard no_grad;
    for (auto& p : attn->parameters()) p.normal_(0.0, 0.3);
  }
  auto x = at::randn({B, T, c.hidden_size});
  auto [cos, sin] = llama::rotary_cos_sin(D, c.rope_theta, at::arange(T, at::kLong), at::kFloat);
  auto got = attn->forward(x, cos, sin);

  auto X = x.to(at::kDouble);
  auto Wq = attn->q_proj->weight.to(at::kDouble), Wk = attn->k_proj->weight.to(at::kDouble);
  auto Wv = attn->v_proj->weight.to(at::kDouble), Wo = attn->o_proj->weight.to(at::kDouble);
  auto heads = at::zeros({B, T, H * D}, at::kDouble);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / n_rep;
      auto q = at::matmul(X[b], Wq.slice(0, h * D, (h + 1) * D).t());
      auto k = at::matmul(X[b], Wk.slice(0, g * D, (g + 1) * D).t());
      auto v = at::matmul(X[b], Wv.slice(0, g * D, (g + 1) * D).t());
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> s;
        for (int64_t u = 0; u <= t; ++u) {
          s.push_back(
              at::dot(rope_reference(q[t], t, c.rope_theta), rope_reference(k[u], u, c.rope_theta)).item<double>() /
              std::sqrt(static_cast<double>(D)));
        }
        double mx = s[0], z = 0;
        for (double e : s) mx = std::max(mx, e);
        for (double& e : s) z += (e = std::exp(e - mx));
        auto out = at::zeros({D}, at::kDouble);
        for (int64_t u = 0; u <= t; ++u) out += (s[u] / z) * v[u];
        heads[b][t].slice(0, h * D, (h + 1) * D).copy_(out);
      }
    }
  }
  auto expected = at::matmul(heads, Wo.t());
  EXPECT_TRUE(at::allclose(got.to(at::kDouble), expected, 1e-5, 1e-5)) << (got - expected).abs().max();
}

TEST(LlamaModel, FutureTokensDoNotChangeEarlierLogits) {
  torch::manual_seed(2);
  const LlamaConfig c = tiny_config();
  LlamaForCausalLM model(c);
  auto a = at::randint(c.vocab_size, {2, 9}, at::kLong);
  auto b = a.clone();
  b.select(1, 5).add_(1).remainder_(c.vocab_size);
  auto la = model->forward(a), lb = model->forward(b);
  EXPECT_TRUE(at::allclose(la.slice(1, 0, 5), lb.slice(1, 0, 5), 0.0, 1e-6));
  // ... while position 5 onwards must change, or the check above proves nothing.
  EXPECT_GT((la.slice(1, 5) - lb.slice(1, 5)).abs().amax({0, 2}).min().item<double>(), 1e-4);
}

TEST(LlamaModel, RotaryScoreDependsOnlyOnRelativeOffset) {
  torch::manual_seed(3);
  const int64_t D = 16, T = 40;
  const double theta = 10000.0;
  auto q = at::randn({D}), k = at::randn({D});
  auto [cos, sin] = llama::rotary_cos_sin(D, theta, at::arange(T, at::kLong), at::kFloat);
  // The same content at every position, rotated per position.
  auto qr = llama::apply_rotary(q.expand({T, D}), cos, sin);
  auto kr = llama::apply_rotary(k.expand({T, D}), cos, sin);
  auto score = at::matmul(qr, kr.t());  // score[t][s] = <rot(q, t), rot(k, s)>
  auto score_at = [&](int64_t t, int64_t s) { return score[t][s].item<double>(); };
  for (int64_t off : {0, 1, 3, 7}) {
    for (int64_t t : {10, 22, 39}) {
      EXPECT_NEAR(score_at(t, t - off), score_at(off, 0), 1e-4) << "offset " << off << " t " << t;
    }
  }
  EXPECT_GT(std::abs(score_at(10, 7) - score_at(10, 8)), 1e-3);  // different offsets do differ
  // Each rotated row equals the pair-by-pair rotation.
  for (int64_t t : {0, 1, 17, 39}) {
    EXPECT_TRUE(at::allclose(qr[t].to(at::kDouble), rope_reference(q, t, theta), 1e-5, 1e-5)) << "t " << t;
  }
}

TEST(LlamaModel, ConfigJsonRoundTrip) {
  LlamaConfig c = tiny_config(true);
  c.rope_theta = 500000.0;
  c.initializer_range = 0.01;
  const auto text = c.to_json().dump();
  const LlamaConfig back = LlamaConfig::from_json(nlohmann::json::parse(text));
  EXPECT_EQ(back.to_json(), c.to_json());
  EXPECT_EQ(nlohmann::json::parse(text).get<LlamaConfig>().to_json(), c.to_json());
  EXPECT_EQ(c.to_json().size(), 17u);
  EXPECT_EQ(c.identity_json().size(), 11u);  // the keys of a plain Llama, as before the families

  // transformers' rule: absent or null num_key_value_heads means one per attention head.
  EXPECT_EQ(LlamaConfig::from_json({{"num_attention_heads", 8}, {"hidden_size", 64}}).num_key_value_heads, 8);
  EXPECT_EQ(LlamaConfig::from_json({{"num_attention_heads", 8}, {"hidden_size", 64}, {"num_key_value_heads", nullptr}})
                .num_key_value_heads,
            8);
  EXPECT_EQ(LlamaConfig::from_json(nlohmann::json::object()).to_json(), LlamaConfig{}.to_json());
  // transformers 5 nests rope_theta.
  const auto nested = nlohmann::json::parse(R"({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})");
  EXPECT_EQ(LlamaConfig::from_json(nested).rope_theta, 500000.0);
}

TEST(LlamaModel, ConfigRejectsUnknownKeysAndBadValuesNamingThem) {
  const LlamaConfig c = tiny_config();
  struct Case {
    nlohmann::json patch;
    std::string must_contain;
  };
  const std::vector<Case> cases = {
      {{{"hidden_sizes", 64}}, "hidden_sizes=64"},
      {{{"hidden_size", 30}}, "hidden_size=30 is not divisible by num_attention_heads=4"},
      {{{"num_key_value_heads", 3}}, "num_attention_heads=4 is not divisible by num_key_value_heads=3"},
      {{{"hidden_size", 12}}, "head_dim=3"},
      {{{"vocab_size", 0}}, "vocab_size=0"},
      {{{"intermediate_size", -5}}, "intermediate_size=-5"},
      {{{"num_hidden_layers", 2.5}}, "num_hidden_layers=2.5"},
      {{{"vocab_size", "32000"}}, "vocab_size=\"32000\""},
      {{{"rms_norm_eps", 0}}, "rms_norm_eps=0"},
      {{{"rope_theta", -1.0}}, "rope_theta=-1.0"},
      {{{"tie_word_embeddings", "yes"}}, "tie_word_embeddings=\"yes\""},
      {{{"rope_parameters", {{"rope_type", "yarn"}, {"factor", 8.0}}}}, "rope_parameters.rope_type=\"yarn\""},
      {{{"rope_parameters", {{"rope_type", "llama3"}, {"factor", 8.0}}}}, "needs factor, low_freq_factor"},
      {{{"rope_parameters", {{"rope_theta", 1.0}}}, {"rope_theta", 2.0}}, "rope_parameters.rope_theta=1.0 disagrees"},
  };
  for (const auto& k : cases) {
    const auto msg = message_of(c, k.patch);
    EXPECT_NE(msg.find(k.must_contain), std::string::npos) << "patch " << k.patch << " gave: " << msg;
  }
  EXPECT_THROW(LlamaConfig::from_json(nlohmann::json::array()), std::invalid_argument);

  LlamaConfig bad = c;
  bad.num_key_value_heads = 3;  // the constructor validates too
  EXPECT_THROW(LlamaForCausalLM(bad, at::kMeta), std::invalid_argument);
}

TEST(LlamaModel, InitFnGivesUnitNormsAndInitializerRangeWeights) {
  LlamaConfig c = tiny_config(/*tied=*/true);
  c.hidden_size = 64;
  c.intermediate_size = 128;
  LlamaForCausalLM model(c, at::kMeta);
  fsdp::init::materialize(*model, llama::llama_init_fn(c, /*seed=*/7));
  EXPECT_TRUE(model->lm_head->weight.is_same(model->model->embed_tokens->weight));
  for (const auto& p : model->named_parameters()) {
    ASSERT_EQ(p.value().device(), at::Device(at::kCPU)) << p.key();
    if (p.value().dim() == 1) {
      EXPECT_TRUE(p.value().eq(1.0).all().item<bool>()) << p.key();
    } else {
      EXPECT_NEAR(p.value().mean().item<double>(), 0.0, 0.005) << p.key();
      EXPECT_NEAR(p.value().std().item<double>(), c.initializer_range, 0.004) << p.key();
    }
  }
}

TEST(LlamaModel, Bf16ForwardStaysBf16AndCloseToFp32) {
  torch::manual_seed(4);
  const LlamaConfig c = tiny_config();
  LlamaForCausalLM model(c);
  auto tokens = at::randint(c.vocab_size, {2, 6}, at::kLong);
  auto ref = model->forward(tokens);
  model->to(at::kBFloat16);
  auto got = model->forward(tokens);
  EXPECT_EQ(got.scalar_type(), at::kBFloat16);
  EXPECT_LT((got.to(at::kFloat) - ref).abs().max().item<double>(), 2e-2 * ref.abs().max().item<double>() + 1e-3);
}

TEST(LlamaModel, LossDecreasesUnderSgdOnARepeatedSequence) {
  torch::manual_seed(5);
  LlamaConfig c = tiny_config();
  c.vocab_size = 16;
  LlamaForCausalLM model(c);
  auto seq = at::arange(8, at::kLong).repeat({4}).view({1, 32});  // 0 1 ... 7 0 1 ... 7 ...
  auto inputs = seq.slice(1, 0, 31), targets = seq.slice(1, 1, 32);
  // unique_parameters is what an optimizer should get; see Note [Tied embeddings].
  torch::optim::SGD opt(llama::unique_parameters(*model), torch::optim::SGDOptions(/*lr=*/1.0));
  std::vector<double> losses;
  for (int step = 0; step < 30; ++step) {
    opt.zero_grad();
    auto l = llama::loss(model->forward(inputs), targets);
    l.backward();
    opt.step();
    losses.push_back(l.item<double>());
  }
  EXPECT_NEAR(losses.front(), std::log(static_cast<double>(c.vocab_size)), 0.1);
  // Every next token is determined by the current one, so the model can learn it almost exactly.
  EXPECT_LT(losses.back(), 0.1) << "first " << losses.front() << " last " << losses.back();
}

}  // namespace
