// A small sharded training job built directly on fsdp's communicator: linear regression whose
// weight vector is sharded across ranks ZeRO-3 style. Each step every rank all-gathers the full
// weight, computes the gradient on its own slice of the global batch, reduce-scatters (averages)
// the gradient so each rank keeps only its shard's gradient, and updates only its shard.
// Run: build/bin/fsdp-run --nproc-per-node 2 -- build/bin/fsdp-demo [--steps N]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdio>
#include <string>

#include "fsdp/fsdp.h"

int main(int argc, char** argv) {
  int steps = 200;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) {
      steps = std::stoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: fsdp-demo [--steps N]\n");
      return 2;
    }
  }
  try {
    at::set_num_threads(1);
    auto dist = fsdp::init_from_env();
    fsdp::DeviceMesh mesh(dist);
    auto& group = mesh.shard_group();
    const int n = group.size(), rank = group.rank();
    const int64_t dim = 1021, global_batch = 256;  // odd dimension: the flat weight is padded
    const int64_t padded = (dim + n - 1) / n * n, shard = padded / n;

    auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
    auto true_w = at::randn({dim}, gen);
    auto w_shard = at::zeros({shard});  // this rank's 1/N of the model
    auto full_w = at::empty({padded});
    auto full_grad = at::empty({padded});
    auto grad_shard = at::empty({shard});
    const double lr = 0.1;
    for (int step = 0; step < steps; ++step) {
      // The same global batch whatever the world size; rank r takes rows [r*B/N, (r+1)*B/N).
      auto batch_gen = at::make_generator<at::CPUGeneratorImpl>(step + 1);
      auto x = at::randn({global_batch, dim}, batch_gen);
      auto y = at::mv(x, true_w) + 0.01 * at::randn({global_batch}, batch_gen);
      const int64_t rows = global_batch / n;
      auto xs = x.narrow(0, rank * rows, rows), ys = y.narrow(0, rank * rows, rows);

      group.all_gather(full_w, w_shard, "weight").wait();
      auto w = full_w.narrow(0, 0, dim);
      auto err = at::mv(xs, w) - ys;
      auto loss = (err * err).mean();
      full_grad.zero_();
      full_grad.narrow(0, 0, dim).copy_(at::mv(xs.t(), err) * (2.0 / rows));
      group.reduce_scatter(grad_shard, full_grad, fsdp::ReduceOp::kAvg, "grad").wait();
      w_shard.sub_(grad_shard, lr);

      group.all_reduce(loss, fsdp::ReduceOp::kAvg, "loss").wait();
      if (rank == 0 && (step % 20 == 0 || step == steps - 1)) {
        const auto s = group.stats();
        std::printf("step %4d  loss %.6f  sent %.1f KiB/rank\n", step, loss.item<double>(),
                    s.total_bytes_sent() / 1024.0);
        std::fflush(stdout);
      }
    }
    if (rank == 0) std::printf("demo done on %d ranks\n", n);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-demo: %s\n", e.what());
    fsdp::write_launcher_error(e);  // under torchrun, its summary shows the error
    return 1;
  }
}
