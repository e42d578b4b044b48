// bench_ep (k3/harness/ep_bench.hpp).
#include <algorithm>
#include <chrono>
#include <numeric>
#include <random>
#include <vector>

#include "k3/harness/ep_bench.hpp"
#include "k3/formats.hpp"

namespace k3::comm {
namespace {

using Clock = std::chrono::steady_clock;

double median_us(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return t.empty() ? 0.0 : t[t.size() / 2] * 1e6;
}

// max over ranks of each value (every rank gets the same numbers).
Status max_over_ranks(Communicator& comm, std::vector<double>& v) {
  std::vector<double> all(v.size() * static_cast<size_t>(comm.size()));
  K3_RETURN_IF_ERROR(comm.allgather(v.data(), static_cast<int64_t>(v.size() * sizeof(double)), all.data()));
  for (size_t i = 0; i < v.size(); ++i) {
    for (int q = 0; q < comm.size(); ++q) v[i] = std::max(v[i], all[static_cast<size_t>(q) * v.size() + i]);
  }
  return Status::ok();
}

}  // namespace

Result<std::vector<EpBenchRecord>> bench_ep(Communicator& comm, const MoeProblem& problem, std::span<const int64_t> ms,
                                            int iters, bool mxfp8_wire, int threads) {
  Status local = Status::ok();
  if (iters < 1 || iters > 100000) local = invalid_argument("iters = " + std::to_string(iters) + " must be in [1, 100000]");
  for (const int64_t m : ms) {
    if (m < 0 || m > (int64_t{1} << 20)) local = invalid_argument("m = " + std::to_string(m) + " must be in [0, 2^20]");
  }
  K3_RETURN_IF_ERROR(agree_on_status(comm, local));
  const MoeShape& s = problem.shape;
  const EpOptions opt{.mxfp8_wire = mxfp8_wire, .threads = threads};
  const int64_t k = s.hidden, topk = s.top_k;
  std::vector<EpBenchRecord> out;
  EpBuffers buffers;  // kept across calls, as a serving loop would
  std::vector<float> ybuf;
  for (const int64_t m : ms) {
    std::mt19937_64 rng(1234 + static_cast<uint64_t>(comm.rank()) * 7919 + static_cast<uint64_t>(m));
    std::vector<uint16_t> x(static_cast<size_t>(m * k));
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& v : x) v = bf16_from_f32(nd(rng));
    std::vector<int32_t> ids(static_cast<size_t>(m * topk));
    std::vector<float> w(static_cast<size_t>(m * topk), 1.0f / static_cast<float>(topk));
    std::vector<int32_t> perm(static_cast<size_t>(s.num_experts));
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t t = 0; t < m; ++t) {  // partial Fisher-Yates: top_k distinct experts
      for (int64_t j = 0; j < topk; ++j) {
        std::uniform_int_distribution<int64_t> pick(j, s.num_experts - 1);
        std::swap(perm[static_cast<size_t>(j)], perm[static_cast<size_t>(pick(rng))]);
        ids[static_cast<size_t>(t * topk + j)] = perm[static_cast<size_t>(j)];
      }
    }
    const MoeInputsView in{m, x, ids, w};
    std::vector<uint8_t> result(static_cast<size_t>(m * k * out_dtype_size(problem.out_dtype)));
    std::vector<double> td, tc, tnd, tnc;
    EpBenchRecord r;
    r.m = m;
    r.mxfp8_wire = mxfp8_wire && problem.recipe == Recipe::kW4A8;
    for (int it = 0; it < iters + 1; ++it) {  // iteration 0 warms up
      K3_RETURN_IF_ERROR(comm.barrier());
      auto t0 = Clock::now();
      K3_ASSIGN_OR_RETURN(EpDispatch d, ep_dispatch(comm, problem, in, opt, &buffers));
      const double dispatch_s = std::chrono::duration<double>(Clock::now() - t0).count();
      int64_t slots = 0;
      for (const int64_t v : d.slots_from) slots += v;
      std::vector<float>& y = ybuf;
      if (y.size() < static_cast<size_t>(slots * k)) y.resize(static_cast<size_t>(slots * k), 0.f);
      const std::span<const float> ys(y.data(), static_cast<size_t>(slots * k));
      K3_RETURN_IF_ERROR(comm.barrier());
      t0 = Clock::now();
      K3_RETURN_IF_ERROR(ep_combine(comm, d, problem, ys, w, result, &buffers, opt));
      const double combine_s = std::chrono::duration<double>(Clock::now() - t0).count();

      // The transport alone with the same byte counts (buffers prepared outside the timing).
      const size_t W = static_cast<size_t>(comm.size());
      const int64_t record = d.rows > 0 ? d.bytes_received / d.rows : 0;
      std::vector<int64_t> sb(W), rb(W), csb(W), crb(W);
      const int64_t send_record = d.route.sent_tokens.empty() ? 0 : d.bytes_sent / static_cast<int64_t>(d.route.sent_tokens.size());
      for (size_t q = 0; q < W; ++q) {
        sb[q] = (d.route.sent_offsets[q + 1] - d.route.sent_offsets[q]) * send_record;
        rb[q] = d.rows_from[q] * record;
        csb[q] = d.slots_from[q] * k * 4;
      }
      K3_RETURN_IF_ERROR(comm.alltoall_counts(sb, rb));  // exact counts (send_record is 0 on ranks without tokens)
      K3_RETURN_IF_ERROR(comm.alltoall_counts(csb, crb));
      std::vector<uint8_t> sbuf(static_cast<size_t>(std::accumulate(sb.begin(), sb.end(), int64_t{0})));
      std::vector<uint8_t> rbuf(static_cast<size_t>(std::accumulate(rb.begin(), rb.end(), int64_t{0})));
      std::vector<uint8_t> csbuf(static_cast<size_t>(std::accumulate(csb.begin(), csb.end(), int64_t{0})));
      std::vector<uint8_t> crbuf(static_cast<size_t>(std::accumulate(crb.begin(), crb.end(), int64_t{0})));
      K3_RETURN_IF_ERROR(comm.barrier());
      t0 = Clock::now();
      K3_RETURN_IF_ERROR(comm.alltoallv(sbuf.data(), sb, rbuf.data(), rb));
      const double nd_s = std::chrono::duration<double>(Clock::now() - t0).count();
      K3_RETURN_IF_ERROR(comm.barrier());
      t0 = Clock::now();
      K3_RETURN_IF_ERROR(comm.alltoallv(csbuf.data(), csb, crbuf.data(), crb));
      const double nc_s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (it == 0) continue;
      td.push_back(dispatch_s);
      tc.push_back(combine_s);
      tnd.push_back(nd_s);
      tnc.push_back(nc_s);
      r.dispatch_bytes = d.bytes_sent;
      r.combine_bytes = slots * k * 4;
    }
    std::vector<double> v = {median_us(td), median_us(tc), median_us(tnd), median_us(tnc),
                             static_cast<double>(r.dispatch_bytes), static_cast<double>(r.combine_bytes)};
    K3_RETURN_IF_ERROR(max_over_ranks(comm, v));
    r.dispatch_us = v[0];
    r.combine_us = v[1];
    r.native_dispatch_us = v[2];
    r.native_combine_us = v[3];
    r.dispatch_bytes = static_cast<int64_t>(v[4]);
    r.combine_bytes = static_cast<int64_t>(v[5]);
    out.push_back(r);
  }
  return out;
}

}  // namespace k3::comm
