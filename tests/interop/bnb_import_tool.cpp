// bnb_import_tool: fsdp's side of the bitsandbytes 4-bit checks (tests/interop/bnb_import_test.py,
// bench/nf4_check.py). It builds the Llama model of a Hugging Face directory on the meta device
// with LoRA on its seven projections and their weights kept in NF4 (the QLoRA setting of
// fsdp-train), shards it on one rank, imports the directory's weights (a transformers "bnb-4bit"
// save: the NF4 codes become the stored form as they are) and, when given, a PEFT adapter; then
// writes what the checks compare:
//   bnb_import_tool HF_DIR TOKENS.i64 OUT_PREFIX R ALPHA [ADAPTER_DIR]
//     TOKENS.i64  raw little-endian int64 tokens, one sequence
//     OUT_PREFIX.json  {"weights": {name: {"shape", "codes": [offset, bytes], "absmax": [offset,
//                       bytes], "decoded": [offset, bytes]}}, "logits": [offset, bytes, vocab]}
//     OUT_PREFIX.bin   the bytes those offsets point into: each NF4 weight's stored codes, its fp32
//                       absmax and its values decoded by fsdp's codec (fp32), then the model's fp32
//                       logits for the tokens (fp32 compute, the NF4 base decoded in each gather)
// Errors go to stderr with exit status 1 (2 for bad usage).
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "fsdp/lora.h"
#include "hf.h"
#include "llama.h"
#include "frozen/frozen_storage.h"
#include "shard/testing.h"

namespace {

using nlohmann::json;

struct Out {
  std::ofstream bin;
  int64_t at = 0;
  json put(const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    bin.write(static_cast<const char*>(c.const_data_ptr()), static_cast<std::streamsize>(c.nbytes()));
    const json where = {at, static_cast<int64_t>(c.nbytes())};
    at += static_cast<int64_t>(c.nbytes());
    return where;
  }
};

// Each NF4 weight's part of its flat param's stored form (one rank: the shard is the whole flat
// param; each parameter starts a block), and its values decoded by fsdp's codec.
json dump_weights(fsdp::FSDPModule& root, torch::nn::Module& model, Out& out) {
  std::map<const void*, std::string> names;
  for (const auto& p : model.named_parameters()) names[p.value().unsafeGetTensorImpl()] = p.key();
  json weights = json::object();
  for (fsdp::FlatParam* flat : fsdp::testing::flat_params(root)) {
    if (flat->config().storage != fsdp::FrozenStorage::kNF4) continue;
    const at::Tensor stored = flat->residency().master();
    const int64_t all_codes = flat->shard_numel() / 2;
    for (const auto& e : flat->entries()) {
      const int64_t blocks = (e.numel + 63) / 64;
      if (e.offset % 64 != 0) throw std::runtime_error(e.name + " does not start a block");
      const at::Tensor codes = stored.narrow(0, e.offset / 2, blocks * 32);
      const at::Tensor absmax = stored.narrow(0, all_codes + e.offset / 64 * 4, blocks * 4);
      at::Tensor decoded = at::empty({blocks * 64}, at::kFloat);
      fsdp::frozen::decode(fsdp::FrozenStorage::kNF4, at::cat({codes, absmax}), decoded);
      weights[names.at(e.param.unsafeGetTensorImpl())] = {{"shape", e.shape},
                                                          {"codes", out.put(codes.narrow(0, 0, (e.numel + 1) / 2))},
                                                          {"absmax", out.put(absmax)},
                                                          {"decoded", out.put(decoded.narrow(0, 0, e.numel))}};
    }
  }
  return weights;
}

void run(int argc, char** argv) {
  const std::string dir = argv[1], prefix = argv[3];
  std::ifstream tin(argv[2], std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(tin)), std::istreambuf_iterator<char>());
  const at::Tensor tokens =
      at::from_blob(const_cast<char*>(bytes.data()), {1, static_cast<int64_t>(bytes.size() / 8)}, at::kLong).clone();
  const std::string store_path = "/tmp/fsdp-bnb-store-" + std::to_string(::getpid());
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, 1);
  auto dist = fsdp::Dist::from_store(store, 0, 1, fsdp::InitOptions().timeout(std::chrono::seconds(120)));
  ::unlink(store_path.c_str());
  fsdp::DeviceMesh mesh(dist);

  const llama::LlamaConfig config = llama::hf::read_hf_config(dir);
  llama::LlamaForCausalLM model(config, at::kMeta);
  const auto lm = fsdp::lora(
      *model,
      fsdp::LoraOptions().r(std::stoi(argv[4])).alpha(std::stod(argv[5])).base_dtype(fsdp::FrozenStorage::kNF4));
  const auto opts = fsdp::FullyShardOptions()
                        .frozen_storage(lm.frozen_storage())
                        .init(lm.init(fsdp::init::constant(0.0), /*seed=*/0));
  for (auto& layer : model->model->layers) fsdp::fully_shard(layer, mesh, opts);
  auto root = fsdp::fully_shard(model, mesh, opts);
  namespace ck = fsdp::checkpoint;
  ck::import_weights(dir, *root,
                     ck::ImportOptions().select([](const std::string& n) { return !fsdp::is_lora_adapter(n); }));
  if (argc > 6) {
    ck::import_weights(argv[6], *root,
                       ck::ImportOptions()
                           .select(fsdp::is_lora_adapter)
                           .source_prefix("base_model.model.")
                           .file_name("adapter_model.safetensors"));
  }
  Out out{std::ofstream(prefix + ".bin", std::ios::binary | std::ios::trunc)};
  json doc = {{"weights", dump_weights(*root, *model, out)}};
  at::NoGradGuard no_grad;
  const at::Tensor logits = fsdp::call(model, tokens).to(at::kFloat);
  doc["logits"] = out.put(logits);
  doc["logits"].push_back(logits.size(-1));
  out.bin.close();
  if (!out.bin) throw std::runtime_error("cannot write " + prefix + ".bin");
  std::ofstream(prefix + ".json") << doc.dump(1) << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6 && argc != 7) {
    std::fprintf(stderr, "usage: bnb_import_tool HF_DIR TOKENS.i64 OUT_PREFIX R ALPHA [ADAPTER_DIR]\n");
    return 2;
  }
  try {
    run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bnb_import_tool: %s\n", e.what());
    return 1;
  }
  return 0;
}
