// The message of the fsdp::UsageError a call throws, for tests that assert on it.
#pragma once

#include <string>

#include <gtest/gtest.h>

#include "fsdp/errors.h"

namespace fsdp::testing {

// Runs `f`, which must throw fsdp::UsageError; returns its message (empty, and a test failure, when
// nothing was thrown).
template <typename F>
std::string usage_error_of(F&& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no UsageError";
  return "";
}

}  // namespace fsdp::testing
