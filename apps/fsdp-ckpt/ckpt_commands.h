// The fsdp-ckpt subcommands. Each takes the arguments after its name, parses its own options
// (throwing UsageError for bad use), prints to stdout, and returns the process exit status.
// Problems with a checkpoint are thrown as fsdp::CheckpointError; main() reports them.
#pragma once

#include <string>
#include <vector>

namespace fsdp_ckpt {

using Args = std::vector<std::string>;

// info DIR: the tensors of every file set, totals, and the train state.
int run_info(const Args& args);
// verify DIR: every check there is; 0 and "ok: ..." or 1 and one line per problem.
int run_verify(const Args& args);
// diff [--ignore-world] [--ignore POINTER]... [--max-diffs N] A B: 0 when equal, 1 when not.
int run_diff(const Args& args);
// export [--dtype T] DIR OUT: a Hugging Face directory of the model's family, in dtype T.
int run_export(const Args& args);
// logits DIR TOKENS.npy OUT.npy: the unsharded model's logits for int64 tokens.
int run_logits(const Args& args);

}  // namespace fsdp_ckpt
