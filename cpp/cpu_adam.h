// Fused CPU AdamW: one pass over a bucket's flat buffers.
//
// Reads the fp32 master, the grad (fp32, bf16 or fp16), Adam m and v; writes the master, m, v and,
// optionally, the low-precision copy (bf16 or fp16, round to nearest even) that the next
// host-to-device copy sends. Replaces six torch passes (offload/optim.py: adamw_) with one.
//
// [Note: AdamW op order] The arithmetic is torch.optim.AdamW(foreach=False, fused=False) operation for
// operation, in fp32, with every scalar computed in double and rounded to float once, as torch does,
// except one division (marked *):
//   p  = p * float(1 - lr*wd)                            (skipped when wd == 0, as torch skips it)
//   g  = float(grad) * float(grad_scale)
//   m  = lerp(m, g, w),  w = float(1 - beta1)            torch's CPU lerp: w < 0.5 ? fma(w, g-m, m)
//                                                                                : fma(w-1, g-m, g)
//   v  = fma(float(1-beta2) * g, g, v * float(beta2))    what torch's vectorised addcmul compiles to
//   d  = sqrt(v) * r + float(eps),  r = 1.0f / float(pow(1 - beta2^step, 0.5))   (float division, once)
//   p  = p + (float(-lr / (1 - beta1^step)) * m) / d
// (*) torch computes sqrt(v) / float(pow(...)). The product with the correctly rounded reciprocal equals
// that quotient or is 1 ulp from it; it saves one of the two vector divisions per element, which made the
// AVX-512 loop ~7-10 % faster on a 2-core Xeon (benchmarks/cpu_adam.py). The master then
// differs from torch's formula by at most ulp(master) + 2 ulp(update), which is 1 ulp of the master
// wherever |update| <= |master| / 4 (tests/test_cpu_adam.py: test_reciprocal_against_torch_formula);
// m and v are unaffected. offload.cpu_adam.adamw_step_reference does the same operations.
// The fused multiply-adds are fused exactly where torch's AVX2/AVX-512 kernels fuse them (checked
// against torch bit for bit, see tests/test_cpu_adam.py); on an x86-64 CPU without FMA they are
// unfused, as in torch's default-capability kernels. The file is built with -ffp-contract=off so the
// compiler adds no other contraction. sqrt is IEEE (correctly rounded); torch's own sqrt on large
// tensors goes through MKL VML and is 1 ulp low on about 0.6 % of elements, which adds to the difference
// above against plain torch ops (then <= ulp(master) + 3 ulp(update), where ulp(update) is taken at the
// update's own value; measured up to 4 where the update's significand is near the top of its binade, ~1 in
// 50,000 elements of the hf test models, so tests/compare.py bounds that term as 2^-21 |update|); m and v
// never differ.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace offload {

enum class ScalarType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct AdamWHyper {
  std::int64_t step = 1;  // step count after this update: 1 on the first update
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double grad_scale = 1.0;  // multiplies the grad before use (1/loss_scale times a clip coefficient)
};

// numel elements each. The buffers must not overlap; any 4-byte (fp32) or 2-byte alignment is fine.
struct AdamWBuffers {
  float* param = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  const void* grad = nullptr;
  ScalarType grad_type = ScalarType::kFloat32;
  void* lowp_out = nullptr;                     // nullptr: no low-precision copy
  ScalarType lowp_type = ScalarType::kBFloat16;  // kBFloat16 or kFloat16 when lowp_out is set
  std::size_t numel = 0;
};

// One AdamW update. With check_finite, first checks every grad * grad_scale: if any is inf or nan it
// writes nothing and returns true (found inf). Otherwise returns false. Runs on up to num_threads
// OpenMP threads (1 when built without OpenMP or when numel is small).
// Throws std::invalid_argument on null pointers with numel > 0, step < 1, num_threads < 1 or a lowp
// type that is not bf16/fp16.
bool adamw_step(const AdamWBuffers& buffers, const AdamWHyper& hyper, bool check_finite, int num_threads);

// The same with the instruction set forced (for tests): "auto", "avx512", "avx2" or "baseline".
// Throws std::invalid_argument for one this CPU or build lacks.
bool adamw_step(const AdamWBuffers& buffers, const AdamWHyper& hyper, bool check_finite, int num_threads,
                const std::string& isa);

// One range of adamw_step_segments: numel elements of its own buffers (as AdamWBuffers, the grad and copy types
// shared by the call), updated with hypers[hyper].
struct AdamWSegment {
  float* param = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  const void* grad = nullptr;
  void* lowp_out = nullptr;  // nullptr: no low-precision copy
  std::size_t numel = 0;
  std::size_t hyper = 0;  // index into the call's hypers
};

// [Note: segmented AdamW] (issue 17, the hot path) adamw_step on segments[0], ..., segments[count - 1], in that
// order, each with hypers[segment.hyper], in one call: what one adamw_step call per segment does, element for
// element. The update is element-wise (every element is computed by the same instructions wherever a call, a
// chunk or a segment begins: [Note: work split under contention]), so cutting a range into segments, or joining
// ranges into one call, cannot change a bit. It exists so that the engine can update many small ranges whose
// grads lie in separate tensors (a fast step's parameters' own grads, read where autograd left them) with one
// crossing from Python instead of a grad copy and a call per range (runtime/bucket_send.py, [Note: sent as one
// batch]). With check_finite, each segment is checked before it is written, as adamw_step checks its range:
// the first segment holding an inf or nan and every later one are left unwritten, and its index is returned;
// otherwise -1. Every argument is checked before anything is written; the exceptions are adamw_step's.
std::int64_t adamw_step_segments(const AdamWSegment* segments, std::size_t count, const AdamWHyper* hypers,
                                 std::size_t n_hypers, ScalarType grad_type, ScalarType lowp_type, bool check_finite,
                                 int num_threads, const std::string& isa = "auto");

// The memory traffic of adamw_step (the same loads and stores, loop and threads) without its arithmetic:
// it overwrites the buffers with meaningless values. Its speed is the bandwidth bound of the kernel on
// this machine (benchmarks/cpu_adam.py). Same argument checks as adamw_step.
void adamw_memory_traffic(const AdamWBuffers& buffers, int num_threads);

// The instruction set the runtime dispatcher picked on this CPU: "avx512", "avx2" or "baseline".
const char* adamw_isa();

// Whether this build runs the kernel on OpenMP threads.
bool adamw_has_openmp();

}  // namespace offload
