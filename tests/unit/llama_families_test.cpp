// The decoder families of models/llama (llama with llama3 rope scaling, qwen2, qwen3, mistral):
// parameter names and counts, the attention kinds (sdpa against eager), sliding-window locality,
// llama3 frequencies against the formula, and Hugging Face config.json parsing (models/llama/hf.h):
// each family read, written back and read again, and every unsupported option refused by name.
// Logits against transformers itself are checked by tests/interop/hf_families_test.py (interop tier).
#include <cmath>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/utils.h>

#include "fsdp/init.h"
#include "hf.h"
#include "llama.h"

namespace {

using llama::LlamaConfig;
using llama::LlamaForCausalLM;
using nlohmann::json;

LlamaConfig family(const std::string& type) {
  LlamaConfig c;
  c.model_type = type;
  c.vocab_size = 40, c.hidden_size = 32, c.intermediate_size = 48, c.num_hidden_layers = 2;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.max_position_embeddings = 64;
  if (type == "llama") {
    c.rope_theta = 500000.0;
    c.rope_scaling.rope_type = "llama3";
    c.rope_scaling.original_max_position_embeddings = 16;
  }
  if (type == "qwen3") c.head_dim_override = 16;  // q, o are [64, 32]: head_dim independent of hidden
  if (type == "mistral") c.sliding_window = 3;
  return c;
}

int64_t count_params(const LlamaForCausalLM& m) {
  int64_t n = 0;
  for (const auto& p : llama::unique_parameters(*m)) n += p.numel();
  return n;
}

TEST(LlamaFamilies, ParameterNamesShapesAndCountsPerFamily) {
  for (const std::string type : {"llama", "qwen2", "qwen3", "mistral"}) {
    const LlamaConfig c = family(type);
    LlamaForCausalLM model(c, at::kMeta);
    auto p = model->named_parameters();
    EXPECT_EQ(count_params(model), llama::param_counts(c).total(c)) << type;
    EXPECT_EQ(p.contains("model.layers.1.self_attn.q_proj.bias"), type == "qwen2") << type;
    EXPECT_EQ(p.contains("model.layers.1.self_attn.v_proj.bias"), type == "qwen2") << type;
    EXPECT_FALSE(p.contains("model.layers.1.self_attn.o_proj.bias")) << type;
    EXPECT_EQ(p.contains("model.layers.0.self_attn.q_norm.weight"), type == "qwen3") << type;
    EXPECT_EQ(p.contains("model.layers.0.self_attn.k_norm.weight"), type == "qwen3") << type;
    if (type == "qwen3") {
      EXPECT_EQ(p["model.layers.0.self_attn.q_proj.weight"].sizes(), at::IntArrayRef({64, 32}));
      EXPECT_EQ(p["model.layers.0.self_attn.o_proj.weight"].sizes(), at::IntArrayRef({32, 64}));
      EXPECT_EQ(p["model.layers.0.self_attn.k_norm.weight"].sizes(), at::IntArrayRef({16}));
    }
  }
  LlamaConfig biased = family("llama");
  biased.attention_bias = true;  // llama's option: all four projections
  LlamaForCausalLM model(biased, at::kMeta);
  EXPECT_TRUE(model->named_parameters().contains("model.layers.0.self_attn.o_proj.bias"));
  EXPECT_EQ(count_params(model), llama::param_counts(biased).total(biased));
}

TEST(LlamaFamilies, SdpaMatchesEagerForEveryFamily) {
  for (const std::string type : {"llama", "qwen2", "qwen3", "mistral"}) {
    torch::manual_seed(3);
    LlamaConfig c = family(type);
    c.attn_implementation = "eager";
    LlamaForCausalLM eager(c);
    c.attn_implementation = "sdpa";
    LlamaForCausalLM sdpa(c);
    {
      at::NoGradGuard ng;
      auto src = llama::unique_parameters(*eager), dst = llama::unique_parameters(*sdpa);
      for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i] + 0.05 * at::randn_like(src[i]));
      for (size_t i = 0; i < src.size(); ++i) src[i].copy_(dst[i]);
    }
    auto tokens = at::randint(c.vocab_size, {2, 9}, at::kLong);
    const auto a = eager->forward(tokens), b = sdpa->forward(tokens);
    EXPECT_LT((a - b).abs().max().item<double>(), 1e-5) << type;
    EXPECT_GT(a.std().item<double>(), 1e-3) << type;  // not trivially equal
  }
}

TEST(LlamaFamilies, SlidingWindowSeesOnlyTheLastTokens) {
  // Through two layers a token's receptive field reaches back 2 * (window - 1) positions; a change
  // further back must leave its logits unchanged, and one inside must change them.
  for (const std::string attn : {"sdpa", "eager"}) {
    torch::manual_seed(5);
    LlamaConfig c = family("mistral");
    c.attn_implementation = attn;
    LlamaForCausalLM model(c);
    auto tokens = at::randint(c.vocab_size, {1, 12}, at::kLong);
    auto changed = tokens.clone();
    changed[0][2] = (tokens[0][2].item<int64_t>() + 1) % c.vocab_size;
    const auto a = model->forward(tokens), b = model->forward(changed);
    const int64_t reach = 2 * (c.sliding_window - 1);  // position 2 reaches up to 2 + reach
    EXPECT_TRUE(at::equal(a.narrow(1, 3 + reach, 12 - 3 - reach), b.narrow(1, 3 + reach, 12 - 3 - reach))) << attn;
    EXPECT_FALSE(at::allclose(a.narrow(1, 2, 1), b.narrow(1, 2, 1))) << attn;
  }
}

TEST(LlamaFamilies, Llama3FrequenciesFollowTheFormula) {
  llama::RopeScaling s;
  s.rope_type = "llama3";
  s.factor = 8, s.low_freq_factor = 1, s.high_freq_factor = 4, s.original_max_position_embeddings = 64;
  const int64_t d = 32;
  const double theta = 10000.0;
  const auto got = llama::rotary_inv_freq(d, theta, s, at::kCPU);
  for (int64_t i = 0; i < d / 2; ++i) {
    const double f = std::pow(theta, -2.0 * i / d), wavelen = 2 * M_PI / f;
    double want = f;
    if (wavelen > 64.0 / 1) {
      want = f / 8;
    } else if (wavelen >= 64.0 / 4) {
      const double smooth = (64.0 / wavelen - 1) / (4 - 1);
      want = (1 - smooth) * f / 8 + smooth * f;
    }
    EXPECT_NEAR(got[i].item<double>(), want, 1e-6 * want) << "i=" << i;
  }
  // The default type is the unscaled table.
  const auto plain = llama::rotary_inv_freq(d, theta, {}, at::kCPU);
  EXPECT_NEAR(plain[d / 2 - 1].item<double>(), std::pow(theta, -2.0 * (d / 2 - 1) / d), 1e-9);
}

TEST(LlamaFamilies, InitFnZeroesBiases) {
  const LlamaConfig c = family("qwen2");
  LlamaForCausalLM model(c, at::kMeta);
  fsdp::init::materialize(*model, llama::llama_init_fn(c, 1));
  auto p = model->named_parameters();
  EXPECT_TRUE(p["model.layers.0.self_attn.q_proj.bias"].eq(0).all().item<bool>());
  EXPECT_GT(p["model.layers.0.self_attn.q_proj.weight"].std().item<double>(), 0.01);
}

TEST(LlamaFamilies, HfConfigRoundTripsForEveryFamily) {
  for (const std::string type : {"llama", "qwen2", "qwen3", "mistral"}) {
    LlamaConfig c = family(type);
    c.dtype = "bfloat16";
    c.tie_word_embeddings = type == "qwen2";
    const json hf = llama::hf::hf_config_json(c, "bfloat16");
    EXPECT_EQ(hf["architectures"][0], llama::hf::architecture(type));
    EXPECT_EQ(hf["dtype"], "bfloat16");
    const LlamaConfig back = llama::hf::config_from_hf_json(hf.dump(), "config.json");
    EXPECT_EQ(back.to_json(), c.to_json()) << type << "\n" << hf.dump(2);
  }
}

TEST(LlamaFamilies, HfConfigReadsTransformers4Forms) {
  // rope_scaling with "type" (transformers 4), torch_dtype, top-level rope_theta; Qwen's ignored
  // sliding_window when use_sliding_window is false, and Qwen2.5's use_mrope false.
  const auto c = llama::hf::config_from_hf_json(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 100,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 1,
    "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}})",
                                                "c.json");
  EXPECT_EQ(c.rope_scaling.rope_type, "llama3");
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c.dtype, "bfloat16");
  const auto q = llama::hf::config_from_hf_json(
      R"({"model_type": "qwen2", "use_sliding_window": false, "sliding_window": 4096, "max_window_layers": 28,
          "use_mrope": false, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
          "num_hidden_layers": 2, "vocab_size": 100})",
      "q.json");
  EXPECT_EQ(q.sliding_window, 0);
  EXPECT_TRUE(q.qkv_bias());
}

std::string hf_error(const std::string& text) {
  try {
    llama::hf::config_from_hf_json(text, "DIR/config.json");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(LlamaFamilies, HfConfigTakesABitsandbytes4BitNf4Save) {
  const auto c = llama::hf::config_from_hf_json(R"({"model_type": "llama", "hidden_size": 64,
      "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 100,
      "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": true, "load_in_8bit": false,
        "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": true, "bnb_4bit_compute_dtype": "bfloat16"}})",
                                                "config.json");
  EXPECT_EQ(c.hidden_size, 64);
}

TEST(LlamaFamilies, HfConfigRefusesWhatIsNotImplementedByName) {
  const std::string base =
      R"("hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96, )"
      R"("vocab_size": 100)";
  const std::string sizes = R"("num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 100)";
  struct Case {
    std::string text, must_contain;
  };
  const std::vector<Case> cases = {
      {"{" + base + "}", "DIR/config.json: has no model_type"},
      {R"({"model_type": "gpt2", )" + base + "}", "model_type=\"gpt2\" is not supported"},
      {R"({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, )" + base + "}",
       "rope_parameters.rope_type=\"yarn\" is not supported"},
      {R"({"model_type": "llama", "rope_parameters": {"rope_type": "linear", "factor": 2.0}, )" + base + "}",
       "rope_parameters.rope_type=\"linear\""},
      {R"({"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "factor": 2.0}, )" + base + "}",
       "needs factor, low_freq_factor"},
      {R"({"model_type": "llama", "hidden_act": "gelu", )" + base + "}", "hidden_act=\"gelu\" is not supported"},
      {R"({"model_type": "llama", "mlp_bias": true, )" + base + "}", "mlp_bias=true"},
      {R"({"model_type": "llama", "attention_dropout": 0.1, )" + base + "}", "attention_dropout=0.1"},
      {R"({"model_type": "llama", "pretraining_tp": 2, )" + base + "}", "pretraining_tp=2"},
      {R"({"model_type": "llama", "sliding_window": 8, )" + base + "}", "sliding_window=8"},
      {R"({"model_type": "qwen2", "use_sliding_window": true, )" + base + "}", "use_sliding_window=true"},
      {R"({"model_type": "qwen2", "use_mrope": true, )" + base + "}", "use_mrope=true is not supported"},
      {R"({"model_type": "qwen3", "layer_types": ["sliding_attention", "full_attention"], )" + base + "}",
       "layer_types="},
      {R"({"model_type": "mistral", "attention_bias": true, )" + base + "}", "attention_bias=true"},
      {R"({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"], )" + base + "}",
       "architectures="},
      {R"({"model_type": "llama", "rope_interleaved": true, )" + base + "}", "rope_interleaved=true is not supported"},
      {R"({"model_type": "llama", "use_qk_layernorm": true, )" + base + "}", "use_qk_layernorm=true is not an option"},
      {R"({"model_type": "llama", "dtype": "int8", )" + base + "}", "dtype=\"int8\""},
      {R"({"model_type": "llama", "hidden_size": 30, "num_attention_heads": 4, )" + sizes + "}", "hidden_size=30"},
      // Each size a model needs is required: transformers' defaults would describe another model.
      {R"({"model_type": "llama", "num_attention_heads": 4, )" + sizes + "}", "has no hidden_size"},
      {R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
          "intermediate_size": 96, "vocab_size": null})",
       "has no vocab_size"},
      // Sizes beyond any model are refused, not planned in overflowing arithmetic.
      {R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
          "intermediate_size": 96, "vocab_size": 100000000000000000})",
       "vocab_size=100000000000000000 is out of range"},
      {R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1099511627776,
          "intermediate_size": 96, "vocab_size": 100})",
       "num_hidden_layers=1099511627776 is out of range"},
      {R"({"model_type": "llama", "hidden_size": 1048576, "num_attention_heads": 8, "num_hidden_layers": 65536,
          "intermediate_size": 4194304, "vocab_size": 100})",
       "more than the 1e15 this model supports"},
      // quantization_config: bitsandbytes 4-bit NF4 only (its weights import as they are).
      {R"({"model_type": "llama", "quantization_config": {"quant_method": "gptq", "bits": 4}, )" + base + "}",
       "quantization_config.quant_method=\"gptq\" is not supported"},
      {R"({"model_type": "llama", "quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": true}, )" +
           base + "}",
       "quantization_config.load_in_8bit=true is not supported"},
      {R"({"model_type": "llama", "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": true, )"
       R"("bnb_4bit_quant_type": "fp4"}, )" +
           base + "}",
       "quantization_config.bnb_4bit_quant_type=\"fp4\" is not supported"},
      {R"({"model_type": "llama", )", "not valid JSON"},
      {"[1, 2]", "expected a JSON object"},
  };
  for (const auto& k : cases) {
    const auto msg = hf_error(k.text);
    EXPECT_NE(msg.find(k.must_contain), std::string::npos) << k.text << "\ngave: " << msg;
    EXPECT_NE(msg.find("DIR/config.json"), std::string::npos) << msg;
  }
  try {
    llama::hf::read_hf_config("/nonexistent-dir");
    FAIL() << "accepted a directory without config.json";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir is not a Hugging Face model directory: it has no "
                                         "config.json"),
              std::string::npos)
        << e.what();
  }
}

TEST(LlamaFamilies, NativeConfigRefusesFamilyMismatches) {
  auto err = [](json j) {
    try {
      LlamaConfig::from_json(j);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(err({{"model_type", "qwen2"}, {"sliding_window", 4}}).find("sliding_window=4 is not supported"),
            std::string::npos);
  EXPECT_NE(err({{"attn_implementation", "flash"}}).find("attn_implementation=\"flash\""), std::string::npos);
  EXPECT_NE(err({{"model_type", "falcon"}}).find("model_type=\"falcon\""), std::string::npos);
  EXPECT_NE(err({{"head_dim", 7}, {"hidden_size", 28}, {"num_attention_heads", 4}}).find("head_dim=7"),
            std::string::npos);
}

}  // namespace
