// fsdp-train's options that take one of a few names, as enums with one table each (value, name)
// that parsing, the dump and messages all read: the library's facility, base/named.h. Plain C++:
// token_file.cpp (and its fuzzer) use it without LibTorch.
#pragma once

#include <cstddef>

#include "base/named.h"

namespace train {

// An option that takes one of a few names: its values and their names, in one table that parsing,
// the dump and the messages all read. value_of(table, name) is the value named `name`, or nullopt
// when the table has none (base/named.h).
using fsdp::base::Named;
using fsdp::base::value_of;
// The name of `value` (the first row's for a value the table lacks).
template <class E, size_t N>
const char* name_of(const Named<E> (&table)[N], E value) {
  return fsdp::base::name_of(table, value, table[0].name);
}

// data.source: the built-in synthetic task, or a file (see data.h).
enum class DataSource { kSynthetic, kFile };
inline constexpr Named<DataSource> kDataSources[] = {{DataSource::kSynthetic, "synthetic"},
                                                     {DataSource::kFile, "file"}};
// data.token_dtype: the tokens of a .bin file (uint32 for vocabularies above 65,536); token_file.h.
enum class TokenDtype { kUint16, kUint32 };
inline constexpr Named<TokenDtype> kTokenDtypes[] = {{TokenDtype::kUint16, "uint16"}, {TokenDtype::kUint32, "uint32"}};
// optim.schedule: cosine decay to min_lr at train.steps, or constant (both after the warmup).
enum class Schedule { kCosine, kConstant };
inline constexpr Named<Schedule> kSchedules[] = {{Schedule::kCosine, "cosine"}, {Schedule::kConstant, "constant"}};
// fsdp.split_root, fsdp.vocab_parallel, train.save_in_step: "auto", "on" or "off", resolved once per
// run into what the run does (run_plan.h: Resolved).
enum class Switch { kAuto, kOn, kOff };
inline constexpr Named<Switch> kSwitches[] = {{Switch::kAuto, "auto"}, {Switch::kOn, "on"}, {Switch::kOff, "off"}};

}  // namespace train
