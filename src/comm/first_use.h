// The math library's first use, made once per process before ranks compute (Note [The math
// library's first call] in rendezvous.cpp).
#pragma once

namespace fsdp {

// Runs a tanh and a matrix product on this thread, once per process (later calls wait for the
// first, then return). Dist creation calls it; a program that starts threads computing with ATen
// before any Dist exists (the test main) calls it first.
void settle_math_library();

}  // namespace fsdp
