// train_state.json's schema: every field save() writes, checked in one place for load() and for
// tools that verify a checkpoint (Note [train_state.json schema] in fsdp/checkpoint.h).
#include <string>
#include <vector>

#include "base/base64.h"
#include "fsdp/checkpoint.h"
#include "fsdp/options.h"

namespace fsdp::checkpoint {
namespace {

using nlohmann::json;

bool is_nonneg_int(const json& v) { return v.is_number_integer() && (v.is_number_unsigned() || v.get<int64_t>() >= 0); }

// Collects the problems of one document, each prefixed with `where`.
struct Checker {
  const json& doc;
  const std::string& where;
  std::vector<std::string> problems;

  const json* need(const char* key) {
    if (doc.contains(key)) return &doc[key];
    problems.push_back(where + "field '" + key + "' is missing");
    return nullptr;
  }
  void bad(const std::string& key, const json& v, const std::string& want) {
    problems.push_back(where + "field '" + key + "' is " +
                       v.dump(-1, ' ', false, json::error_handler_t::replace).substr(0, 200) + ", not " + want);
  }
};

void check_format_version(Checker& c) {
  const json* v = c.need("format_version");
  if (v == nullptr) return;
  if (!v->is_number_integer()) {
    c.bad("format_version", *v, "an integer");
  } else if (v->get<int64_t>() != kFormatVersion) {
    c.problems.push_back(c.where + "has format_version " + v->dump() + "; this build reads version " +
                         std::to_string(kFormatVersion));
  }
}

void check_rng_states(Checker& c, int64_t world_size) {
  const json* v = c.need("rng_states");
  if (v == nullptr) return;
  if (!v->is_array()) return c.bad("rng_states", *v, "an array of base64 RNG states, one per rank");
  if (world_size > 0 && static_cast<int64_t>(v->size()) != world_size) {
    c.problems.push_back(c.where + "field 'rng_states' holds " + std::to_string(v->size()) +
                         " RNG states for world_size " + std::to_string(world_size));
  }
  for (size_t r = 0; r < v->size(); ++r) {
    const json& x = (*v)[r];
    bool ok = x.is_string() && !x.get<std::string>().empty();
    if (ok) {
      try {
        base::base64_decode(x.get<std::string>());
      } catch (const std::exception&) {
        ok = false;
      }
    }
    if (!ok) c.bad("rng_states[" + std::to_string(r) + "]", x, "a base64 RNG state");
  }
}

void check_optimizer(Checker& c) {
  const json* o = c.need("optimizer");
  if (o == nullptr) return;
  if (!o->is_object()) return c.bad("optimizer", *o, "an object {type, state_names, steps}");
  const json missing;  // a missing member reads as null
  const json& type = o->contains("type") ? (*o)["type"] : missing;
  if (!type.is_string()) c.bad("optimizer.type", type, "a string");
  const json& names = o->contains("state_names") ? (*o)["state_names"] : missing;
  bool names_ok = names.is_array();
  for (size_t i = 0; names_ok && i < names.size(); ++i) {
    names_ok = names[i].is_string() && !names[i].get<std::string>().empty();
  }
  if (!names_ok) c.bad("optimizer.state_names", names, "an array of non-empty strings");
  const json& steps = o->contains("steps") ? (*o)["steps"] : missing;
  if (!steps.is_object()) return c.bad("optimizer.steps", steps, "an object {tensor: step}");
  for (const auto& [name, step] : steps.items()) {
    if (!is_nonneg_int(step)) c.bad("optimizer.steps['" + name + "']", step, "a non-negative integer");
  }
}

}  // namespace

std::vector<std::string> check_train_state(const json& doc, const std::string& where) {
  Checker c{doc, where, {}};
  if (!doc.is_object()) return {where + "is not a JSON object"};
  check_format_version(c);
  for (const char* key : {"step", "samples_seen"}) {
    if (const json* v = c.need(key); v && !is_nonneg_int(*v)) c.bad(key, *v, "a non-negative integer");
  }
  if (doc.contains("commit_index") && !is_nonneg_int(doc["commit_index"])) {
    c.bad("commit_index", doc["commit_index"], "a non-negative integer");
  }
  int64_t world_size = -1;
  if (const json* v = c.need("world_size")) {
    if (v->is_number_integer() && v->get<int64_t>() >= 1 && v->get<int64_t>() <= (1 << 30)) {
      world_size = v->get<int64_t>();
    } else {
      c.bad("world_size", *v, "a positive integer");
    }
  }
  if (const json* v = c.need("strategy")) {
    bool ok = v->is_string();
    if (ok) {
      try {
        parse_strategy(v->get<std::string>());
      } catch (const std::exception&) {
        ok = false;
      }
    }
    if (!ok) c.bad("strategy", *v, "a sharding strategy (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD)");
  }
  check_rng_states(c, world_size);
  if (const json* v = c.need("extra"); v && !v->is_object()) c.bad("extra", *v, "an object");
  check_optimizer(c);
  if (const json* v = c.need("files")) {
    bool ok = v->is_array();
    for (size_t i = 0; ok && i < v->size(); ++i) ok = (*v)[i].is_string();
    if (!ok) c.bad("files", *v, "an array of file names");
  }
  return c.problems;
}

}  // namespace fsdp::checkpoint
