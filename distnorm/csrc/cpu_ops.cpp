// distnorm's operators on the CPU, registered under the CPU dispatch key: the C kernels of
// distnorm/csrc/kernels.c (compiled as C and linked into this library) called with no
// Python between the dispatcher and the loop. distnorm/_cpu_kernels.py builds and loads this file.
//
// Each function is the C++ twin of the Python wrapper it replaced (the same checks, outputs and
// arguments to the C kernels), so a step computes the same bits either way. The per-channel
// operators and BNP's transform take the cases their C kernels take, where the group agreed on
// them (kernel == "cpu"); every other call (the composite, Triton's interpreter, other dtypes)
// goes to the operator's Python implementation for the CPU, declared in distnorm/_ops.py as
// distnorm::_<name>_cpu, so no case is decided twice.

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/batch_norm_update_stats.h>
#include <ATen/ops/native_batch_norm_backward.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

extern "C" {
#define ELEMT_DECL(NAME, T, ACC)                                                                     \
  void NAME(const T* g, const T* x, T* out, const ACC* mean, const ACC* invstd, const ACC* weight,   \
            const ACC* sum_dy, const ACC* sum_dy_xmu, int64_t total, int64_t C, int64_t inner,       \
            int64_t numel, int threads, ACC* coef);
ELEMT_DECL(elemt_f32, float, float)
ELEMT_DECL(elemt_f64, double, double)
ELEMT_DECL(elemt_bf16, uint16_t, float)
ELEMT_DECL(elemt_f16, uint16_t, float)  // _Float16 in C: the same 16 bits
#define AFFINE_DECL(NAME, T, ACC)                                                                     \
  void NAME(const T* x, T* out, const ACC* mean, const ACC* invstd, const ACC* weight, const ACC* bias, int64_t C, \
            int64_t inner, int64_t numel, int threads, ACC* coef);
AFFINE_DECL(affine_f32, float, float)
AFFINE_DECL(affine_f64, double, double)
AFFINE_DECL(affine_bf16, uint16_t, float)
AFFINE_DECL(affine_f16, uint16_t, float)
#define REDUCE_DECL(NAME, T, ACC)                                                                     \
  void NAME(const T* g, const T* x, const ACC* mean, ACC* sum_dy, ACC* sum_dy_xmu, int64_t C, int64_t inner,   \
            int64_t numel, int threads);
REDUCE_DECL(reduce_f32, float, float)
REDUCE_DECL(reduce_f64, double, double)
REDUCE_DECL(reduce_bf16, uint16_t, float)
REDUCE_DECL(reduce_f16, uint16_t, float)
void stats_f32(const float* x, float* mean_out, float* var_out, int64_t C, int64_t inner, int64_t numel,
               int threads);
void stats_f32_cl(const float* x, float* mean_out, float* var_out, int64_t C, int64_t rows, int threads);
void cbn_plan_f32(const float* mean, const float* var, const float* count, const float* weight, const float* bias,
                  const float* eta_ptr, float* amat_mean, float* amat_var, uint8_t* amat_init, float* run_mean,
                  float* run_var, int64_t* nbt, float* center_out, float* var_u_out, float* invstd_out, float* a_out,
                  float* coef, float* beta_coef, int64_t C, float host_n, float bessel, float eps, int cumulative,
                  float momentum, float inv_rho, int scale_a, float r_min, float r_max);
void backward_sums_f32(const float* s1, const float* t, const float* beta_coef, const float* a, const float* coef,
                       float* sums, float* grad_weight, float* grad_bias, float* w, int32_t* count, int64_t C,
                       float inv_rho);
void bnp_precondition_f32(const float* gw, const float* gb, const float* mu, const float* vt, float q2, float* out_w,
                          float* out_b, float* table, int64_t out_ch, int64_t in_ch, int64_t per_group,
                          int64_t kernel, int64_t groups, int threads);
void bnp_precondition_f64(const double* gw, const double* gb, const double* mu, const double* vt, double q2,
                          double* out_w, double* out_b, double* table, int64_t out_ch, int64_t in_ch,
                          int64_t per_group, int64_t kernel, int64_t groups, int threads);
}

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

template <typename T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

template <typename T>
const T* ptr_or_null(const OptTensor& t) {
  return t.has_value() && t->defined() ? static_cast<const T*>(t->data_ptr()) : nullptr;
}

// A new CPU tensor for an operator's output, allocated without a trip through the dispatcher
// (at::empty's, a cost paid per output at every call of these small operators).
Tensor vec(c10::IntArrayRef size, at::ScalarType dtype) {
  return Tensor(at::detail::empty_cpu(size, dtype));
}

// Scratch memory for a C loop's per-channel coefficients: n values of float or double (read by
// nothing else, so not a tensor).
struct Scratch {
  explicit Scratch(int64_t n) : values(static_cast<size_t>(n)) {}
  template <typename T>
  T* as() {
    static_assert(sizeof(T) <= sizeof(double));
    return reinterpret_cast<T*>(values.data());
  }
  std::vector<double> values;
};

// t itself when it is of `dtype` and contiguous, else a contiguous copy in `dtype`.
Tensor dense(const Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype && t.is_contiguous() ? t : t.to(dtype).contiguous();
}

// The memory format of _cpu_kernels.memory_format: channels_last(_3d) for a tensor laid out so
// and not also contiguous.
at::MemoryFormat layout_of(const Tensor& t) {
  if (t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast) && !t.is_contiguous())
    return at::MemoryFormat::ChannelsLast;
  if (t.dim() == 5 && t.is_contiguous(at::MemoryFormat::ChannelsLast3d) && !t.is_contiguous())
    return at::MemoryFormat::ChannelsLast3d;
  return at::MemoryFormat::Contiguous;
}

// The channel stride of a tensor dense with channels innermost (1) or outermost after the
// batch (prod(shape[2:])), else -1.
int64_t dense_inner(const Tensor& x) {
  if (x.is_contiguous()) {
    int64_t inner = 1;
    for (int64_t d = 2; d < x.dim(); ++d) inner *= x.size(d);
    return inner;
  }
  if ((x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
      (x.dim() == 5 && x.is_contiguous(at::MemoryFormat::ChannelsLast3d)))
    return 1;
  return -1;
}

// ATen's grain, at::internal::GRAIN_SIZE (ATen/TensorIterator.h): the values its own CPU
// kernels give each thread at least.
constexpr int64_t kGrain = 32768;

// The OpenMP threads of a kernel's parallel loop over `numel` values: one below ATen's grain,
// where waking a team costs more than the loop. Every loop splits independent rows or
// channels, so the bits do not depend on the count.
int threads_for(int64_t numel) {
  return numel < kGrain ? 1 : at::get_num_threads();
}

bool on_device_of(const Tensor& first, const OptTensor& t) {
  return !t.has_value() || !t->defined() || t->device() == first.device();
}

// The accumulation dtype of an input: float64 for float64, else float32.
at::ScalarType acc_of(const Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// distnorm::batch_norm_backward_elemt: the formula of ATen's CUDA kernel in one pass
// (_cpu_kernels.py's module docstring). Inputs of other layouts are made dense first, in the
// gradient's memory format.
Tensor batch_norm_backward_elemt(const Tensor& grad_out_in, const Tensor& x_in, const Tensor& mean,
                                 const Tensor& invstd, const OptTensor& weight_in, const Tensor& sum_dy,
                                 const Tensor& sum_dy_xmu, const Tensor& count) {
  Tensor x = x_in, grad_out = grad_out_in;
  if (dense_inner(x) < 0 || x.strides() != grad_out.strides()) {
    const auto layout = layout_of(grad_out);
    x = x.contiguous(layout);
    grad_out = grad_out.contiguous(layout);
  }
  const int64_t inner = dense_inner(x);
  TORCH_INTERNAL_ASSERT(inner >= 0 && x.strides() == grad_out.strides());
  const int64_t channels = x.size(1);
  const auto acc = acc_of(x);
  const Tensor weight = weight_in.has_value() && weight_in->defined()
                            ? dense(*weight_in, acc)
                            : at::ones({channels}, at::TensorOptions().dtype(acc));
  const Tensor mean_ = dense(mean, acc), invstd_ = dense(invstd, acc), sum_dy_ = dense(sum_dy, acc),
               sum_dy_xmu_ = dense(sum_dy_xmu, acc);
  Tensor out = at::empty_like(x);
  Scratch coef(3 * channels);
  const int64_t total = count.numel() > 1 ? count.sum().item<int64_t>() : count.item<int64_t>();
  const int64_t numel = x.numel();
  const int threads = threads_for(numel);
  switch (x.scalar_type()) {
    case at::kFloat:
      elemt_f32(ptr<float>(grad_out), ptr<float>(x), ptr<float>(out), ptr<float>(mean_), ptr<float>(invstd_),
                ptr<float>(weight), ptr<float>(sum_dy_), ptr<float>(sum_dy_xmu_), total, channels, inner, numel,
                threads, coef.as<float>());
      break;
    case at::kDouble:
      elemt_f64(ptr<double>(grad_out), ptr<double>(x), ptr<double>(out), ptr<double>(mean_), ptr<double>(invstd_),
                ptr<double>(weight), ptr<double>(sum_dy_), ptr<double>(sum_dy_xmu_), total, channels, inner, numel,
                threads, coef.as<double>());
      break;
    case at::kBFloat16:
    case at::kHalf: {
      auto kernel = x.scalar_type() == at::kBFloat16 ? elemt_bf16 : elemt_f16;
      kernel(ptr<uint16_t>(grad_out), ptr<uint16_t>(x), ptr<uint16_t>(out), ptr<float>(mean_), ptr<float>(invstd_),
             ptr<float>(weight), ptr<float>(sum_dy_), ptr<float>(sum_dy_xmu_), total, channels, inner, numel,
             threads, coef.as<float>());
      break;
    }
    default:
      TORCH_CHECK_TYPE(false, "distnorm::batch_norm_backward_elemt: a float32, float64, bfloat16 or float16 input, "
                       "not ", x.scalar_type());
  }
  return out;
}

template <typename T>
void scale(const T* v, const T* factor, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = v[i] * factor[i];
}

void check_floating(const Tensor& x, const char* op) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
                   "distnorm::", op, ": a float32, float64, bfloat16 or float16 input, not ", dtype);
}

// distnorm::batch_norm_elemt: the forward's output, y = (x - mean) * invstd * weight + bias per
// channel, with the schema and formula of ATen's CUDA batch_norm_elemt (kernels.c: AFFINE),
// in one pass. A strided input is made contiguous first; the output has the input's layout.
Tensor batch_norm_elemt(const Tensor& x_in, const OptTensor& weight, const OptTensor& bias, const Tensor& mean,
                        const Tensor& invstd, double /*eps: unused, as by CUDA's kernel*/) {
  check_floating(x_in, "batch_norm_elemt");
  const Tensor x = dense_inner(x_in) < 0 ? x_in.contiguous() : x_in;
  const int64_t channels = x.size(1), inner = dense_inner(x), numel = x.numel();
  const auto acc = acc_of(x);
  Tensor out = at::empty_like(x);
  if (numel == 0) return out;
  const Tensor mean_ = dense(mean, acc), invstd_ = dense(invstd, acc);
  const bool has_weight = weight.has_value() && weight->defined(), has_bias = bias.has_value() && bias->defined();
  const Tensor weight_ = has_weight ? dense(*weight, acc) : Tensor(), bias_ = has_bias ? dense(*bias, acc) : Tensor();
  Scratch coef(2 * channels);
  const int threads = threads_for(numel);
  if (acc == at::kDouble) {
    affine_f64(ptr<double>(x), ptr<double>(out), ptr<double>(mean_), ptr<double>(invstd_),
               has_weight ? ptr<double>(weight_) : nullptr, has_bias ? ptr<double>(bias_) : nullptr, channels, inner,
               numel, threads, coef.as<double>());
    return out;
  }
  const float *m = ptr<float>(mean_), *is = ptr<float>(invstd_);
  const float *w = has_weight ? ptr<float>(weight_) : nullptr, *b = has_bias ? ptr<float>(bias_) : nullptr;
  if (x.scalar_type() == at::kFloat)
    affine_f32(ptr<float>(x), ptr<float>(out), m, is, w, b, channels, inner, numel, threads, coef.as<float>());
  else
    (x.scalar_type() == at::kBFloat16 ? affine_bf16 : affine_f16)(ptr<uint16_t>(x), ptr<uint16_t>(out), m, is, w, b,
                                                                   channels, inner, numel, threads, coef.as<float>());
  return out;
}

// distnorm::batch_norm_backward_reduce: the backward's local sums with the schema and results of
// ATen's CUDA batch_norm_backward_reduce: (sum_dy, sum_dy_xmu) where input_g, grad_weight =
// sum_dy_xmu * invstd where weight_g (the weight's dtype, as CUDA's), grad_bias = sum_dy where
// bias_g; the others undefined. The sums are the C loops' (kernels.c: REDUCE), except for a
// channels-last input from ATen's grain up, where ATen's parallel reduction is the faster: there
// they come from ATen's CPU batch-norm backward, given invstd = 1 so that its weight gradient is
// sum_dy_xmu itself.
std::tuple<Tensor, Tensor, Tensor, Tensor> batch_norm_backward_reduce(const Tensor& grad_out_in, const Tensor& x_in,
                                                                      const Tensor& mean, const Tensor& invstd,
                                                                      const OptTensor& weight, bool input_g,
                                                                      bool weight_g, bool bias_g) {
  check_floating(x_in, "batch_norm_backward_reduce");
  Tensor x = x_in, grad_out = grad_out_in;
  if (dense_inner(x) < 0 || x.strides() != grad_out.strides()) {
    const auto layout = layout_of(grad_out);
    x = x.contiguous(layout);
    grad_out = grad_out.contiguous(layout);
  }
  const int64_t channels = x.size(1), inner = dense_inner(x), numel = x.numel();
  const auto acc = acc_of(x);
  const auto options = at::TensorOptions().dtype(acc);
  const Tensor mean_ = dense(mean, acc), invstd_ = dense(invstd, acc);
  Tensor sum_dy, sum_dy_xmu;
  if (numel == 0) {
    sum_dy = at::zeros({channels}, options);
    sum_dy_xmu = at::zeros({channels}, options);
  } else if (inner == 1 && x.dim() > 2 && numel >= kGrain) {
    const Tensor one = at::ones({channels}, options);
    auto sums = at::native_batch_norm_backward(grad_out, x, one, {}, {}, mean_, one, true, 0.0, {false, true, true});
    sum_dy_xmu = std::get<1>(sums);
    sum_dy = std::get<2>(sums);
  } else {
    sum_dy = vec({channels}, acc);
    sum_dy_xmu = vec({channels}, acc);
    const int threads = threads_for(numel);
    switch (x.scalar_type()) {
      case at::kFloat:
        reduce_f32(ptr<float>(grad_out), ptr<float>(x), ptr<float>(mean_), ptr<float>(sum_dy), ptr<float>(sum_dy_xmu),
                   channels, inner, numel, threads);
        break;
      case at::kDouble:
        reduce_f64(ptr<double>(grad_out), ptr<double>(x), ptr<double>(mean_), ptr<double>(sum_dy),
                   ptr<double>(sum_dy_xmu), channels, inner, numel, threads);
        break;
      default:
        (x.scalar_type() == at::kBFloat16 ? reduce_bf16 : reduce_f16)(
            ptr<uint16_t>(grad_out), ptr<uint16_t>(x), ptr<float>(mean_), ptr<float>(sum_dy), ptr<float>(sum_dy_xmu),
            channels, inner, numel, threads);
    }
  }
  const auto dtype = weight.has_value() && weight->defined() ? weight->scalar_type() : acc;
  Tensor grad_weight, grad_bias;
  if (weight_g) {
    grad_weight = vec({channels}, acc);
    if (acc == at::kDouble)
      scale(ptr<double>(sum_dy_xmu), ptr<double>(invstd_), ptr<double>(grad_weight), channels);
    else
      scale(ptr<float>(sum_dy_xmu), ptr<float>(invstd_), ptr<float>(grad_weight), channels);
    grad_weight = grad_weight.to(dtype);
  }
  if (bias_g) grad_bias = input_g ? sum_dy.to(dtype, false, /*copy=*/true) : sum_dy.to(dtype);  // never sum_dy's alias
  if (!input_g) {
    sum_dy = Tensor();
    sum_dy_xmu = Tensor();
  }
  return {sum_dy, sum_dy_xmu, grad_weight, grad_bias};
}

// distnorm::batch_norm_update_stats: a float32 input without running buffers takes the C
// kernels, contiguous (stats_f32: ATen's arithmetic, partial sums in a fixed order; more than one
// value per sample and channel) or channels-last below ATen's grain (stats_f32_cl: the same
// arithmetic on one thread, where ATen's channels-last reduction costs a small layer more than its
// loop; above the grain ATen's parallel reduction is the faster); every other call is ATen's own
// batch_norm_update_stats.
std::tuple<Tensor, Tensor> batch_norm_update_stats(const Tensor& x, const OptTensor& running_mean,
                                                   const OptTensor& running_var, double momentum) {
  const int64_t channels = x.dim() > 1 ? x.size(1) : 0;
  int64_t inner = 1;
  for (int64_t d = 2; d < x.dim(); ++d) inner *= x.size(d);
  const bool has_running = (running_mean.has_value() && running_mean->defined()) ||
                           (running_var.has_value() && running_var->defined());
  const bool contiguous = x.is_contiguous() && inner > 1;
  const bool channels_last =
      x.numel() < kGrain && !x.is_contiguous() && layout_of(x) != at::MemoryFormat::Contiguous;
  if (x.scalar_type() != at::kFloat || has_running || x.numel() == 0 || !(contiguous || channels_last))
    return at::batch_norm_update_stats(x, running_mean, running_var, momentum);
  Tensor mean = vec({channels}, at::kFloat), var = vec({channels}, at::kFloat);
  if (contiguous)
    stats_f32(ptr<float>(x), ptr<float>(mean), ptr<float>(var), channels, inner, x.numel(), threads_for(x.numel()));
  else
    stats_f32_cl(ptr<float>(x), ptr<float>(mean), ptr<float>(var), channels, x.numel() / channels,
                 threads_for(x.numel()));
  return {mean, var};
}

// The operator's Python implementation for the CPU (distnorm/_ops.py: distnorm::_<name>_cpu),
// called straight at its CPU kernel.
template <typename Signature>
c10::TypedOperatorHandle<Signature> python_cpu(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

const c10::DispatchKeySet kCpu(c10::DispatchKey::CPU);

using PlanResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using PlanSignature = PlanResult(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&, const Tensor&,
                                 const Tensor&, const OptTensor&, at::TensorList, c10::SymInt, c10::ArrayRef<double>,
                                 std::optional<double>, bool, c10::string_view);

// The C kernel's cases (_kernels._triton_takes_plan, with the buffers' own dtypes): float32
// statistics and buffers, contiguous vectors, every tensor on one device, a host count only
// when the batch is valid.
bool plan_taken(const Tensor& mean, const Tensor& var, const OptTensor& count, const Tensor& weight,
                const Tensor& bias, const OptTensor& eta, at::TensorList buffers, int64_t host_count) {
  if (mean.scalar_type() != at::kFloat || buffers.size() != 6 || !mean.is_contiguous()) return false;
  for (int i : {0, 1, 3, 4})
    if (buffers[i].scalar_type() != at::kFloat || !buffers[i].is_contiguous()) return false;
  if (buffers[2].scalar_type() != at::kBool || buffers[5].scalar_type() != at::kLong) return false;
  if (count.has_value() && count->defined() ? !count->is_contiguous() : host_count <= 1) return false;
  for (const Tensor& t : {var, weight, bias})
    if (t.device() != mean.device()) return false;
  for (const Tensor& t : buffers)
    if (t.device() != mean.device()) return false;
  return on_device_of(mean, count) && on_device_of(mean, eta);
}

// distnorm::cbn_plan (the arguments and the maths of _composite.cbn_plan_composite): the C
// kernel cbn_plan_f32, one loop over the channels.
PlanResult cbn_plan(const Tensor& mean, const Tensor& var, const OptTensor& count, const OptTensor& valid,
                    const Tensor& weight, const Tensor& bias, const OptTensor& eta, at::TensorList buffers,
                    c10::SymInt host_count_sym, c10::ArrayRef<double> hyper, std::optional<double> momentum,
                    bool amat_ready, c10::string_view kernel) {
  const int64_t host_count = host_count_sym.expect_int();
  if (kernel != "cpu" || hyper.size() != 3 ||
      !plan_taken(mean, var, count, weight, bias, eta, buffers, host_count)) {
    static const auto fallback = python_cpu<PlanSignature>("distnorm::_cbn_plan_cpu");
    return fallback.redispatch(kCpu, mean, var, count, valid, weight, bias, eta, buffers, std::move(host_count_sym),
                               hyper, momentum, amat_ready, kernel);
  }
  const Tensor count_ = count.has_value() && count->defined() ? count->contiguous() : Tensor();
  const Tensor weight_ = dense(weight, at::kFloat), bias_ = dense(bias, at::kFloat);
  const Tensor eta_ = eta.has_value() && eta->defined() ? dense(*eta, at::kFloat) : Tensor();
  const Tensor mean_ = mean.contiguous(), var_ = var.contiguous();
  const double eps = hyper[0], rho = hyper[1], r_max = hyper[2];
  const int64_t channels = mean.size(0);
  Tensor center = vec({channels}, at::kFloat), var_u = vec({channels}, at::kFloat),
         invstd = vec({channels}, at::kFloat), a = vec({channels}, at::kFloat), beta_coef = vec({channels}, at::kFloat);
  Tensor grad_coef = vec({2, 2, channels}, at::kFloat);
  const int64_t n = std::max<int64_t>(host_count, 1);
  cbn_plan_f32(ptr<float>(mean_), ptr<float>(var_), count_.defined() ? ptr<float>(count_) : nullptr,
               ptr<float>(weight_), ptr<float>(bias_), eta_.defined() ? ptr<float>(eta_) : nullptr,
               ptr<float>(buffers[0]), ptr<float>(buffers[1]), ptr<uint8_t>(buffers[2]), ptr<float>(buffers[3]),
               ptr<float>(buffers[4]), ptr<int64_t>(buffers[5]), ptr<float>(center), ptr<float>(var_u),
               ptr<float>(invstd), ptr<float>(a), ptr<float>(grad_coef), ptr<float>(beta_coef), channels,
               static_cast<float>(n),
               static_cast<float>(static_cast<double>(host_count) / static_cast<double>(std::max<int64_t>(host_count - 1, 1))),
               static_cast<float>(eps), !momentum.has_value(), static_cast<float>(momentum.value_or(0.0)),
               static_cast<float>(1.0 / rho), rho != 1.0, static_cast<float>(1.0 / r_max), static_cast<float>(r_max));
  return {center, var_u, invstd, a, grad_coef, beta_coef};
}

using SumsResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
using SumsSignature = SumsResult(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                                 c10::string_view);

// distnorm::backward_sums (_composite.backward_sums_composite) in float32: the C kernel
// backward_sums_f32.
SumsResult backward_sums(const Tensor& s1, const Tensor& t, const Tensor& beta_coef, const Tensor& grad_scale,
                         const Tensor& grad_coef, double inv_rho, c10::string_view kernel) {
  bool taken = kernel == "cpu";
  for (const Tensor& v : {s1, t, beta_coef, grad_scale, grad_coef})
    taken = taken && v.scalar_type() == at::kFloat && v.device() == s1.device();
  if (!taken) {
    static const auto fallback = python_cpu<SumsSignature>("distnorm::_backward_sums_cpu");
    return fallback.redispatch(kCpu, s1, t, beta_coef, grad_scale, grad_coef, inv_rho, kernel);
  }
  const int64_t channels = s1.size(0);
  Tensor sums = vec({2, channels}, at::kFloat);
  Tensor grad_weight = vec({channels}, at::kFloat), grad_bias = vec({channels}, at::kFloat),
         w = vec({channels}, at::kFloat);
  Tensor count = vec({1}, at::kInt);
  const Tensor s1_ = s1.contiguous(), t_ = t.contiguous(), beta_ = beta_coef.contiguous(),
               a_ = grad_scale.contiguous(), coef_ = grad_coef.contiguous();
  backward_sums_f32(ptr<float>(s1_), ptr<float>(t_), ptr<float>(beta_), ptr<float>(a_), ptr<float>(coef_),
                    ptr<float>(sums), ptr<float>(grad_weight), ptr<float>(grad_bias), ptr<float>(w),
                    ptr<int32_t>(count), channels, static_cast<float>(inv_rho));
  return {sums, grad_weight, grad_bias, w, count};
}

using TransformResult = std::tuple<Tensor, Tensor>;
using TransformSignature = TransformResult(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                                           const Tensor&, c10::SymInt, c10::string_view);

// distnorm::bnp_precondition (_composite.bnp_precondition): the C kernel for a float32 or
// float64 gradient, in one pass. It reads raw pointers, so arguments that do not fit raise
// first, with the message of _cpu_kernels.check_precondition_arguments.
TransformResult bnp_precondition(const Tensor& grad_weight, const OptTensor& grad_bias, const Tensor& mean,
                                 const Tensor& var_t, const Tensor& q2, c10::SymInt groups_sym,
                                 c10::string_view kernel) {
  const auto dtype = grad_weight.scalar_type();
  if (kernel != "cpu" || (dtype != at::kFloat && dtype != at::kDouble) || !q2.device().is_cpu()) {
    static const auto fallback = python_cpu<TransformSignature>("distnorm::_bnp_precondition_cpu");
    return fallback.redispatch(kCpu, grad_weight, grad_bias, mean, var_t, q2, std::move(groups_sym), kernel);
  }
  const int64_t groups = groups_sym.expect_int();
  const bool has_bias = grad_bias.has_value() && grad_bias->defined();
  const int64_t in_channels = mean.numel();
  TORCH_CHECK_VALUE(
      grad_weight.dim() >= 2 && groups >= 1 && grad_weight.size(0) % groups == 0 &&
          in_channels == groups * grad_weight.size(1) && var_t.numel() == in_channels &&
          (!has_bias || grad_bias->numel() == grad_weight.size(0)),
      "bnp_precondition: weight gradient of shape ", grad_weight.sizes(), ", bias gradient of ",
      has_bias ? std::to_string(grad_bias->numel()) : std::string("None"), " values and ", in_channels, " / ",
      var_t.numel(), " input-channel moments do not match in ", groups, " group(s)");
  const int64_t out_channels = grad_weight.size(0);
  int64_t kernel_size = 1;
  for (int64_t d = 2; d < grad_weight.dim(); ++d) kernel_size *= grad_weight.size(d);
  const auto options = at::TensorOptions().dtype(dtype);
  const Tensor gw = grad_weight.contiguous();
  const Tensor gb = has_bias ? dense(*grad_bias, dtype) : Tensor();
  const Tensor mu = dense(mean, dtype), vt = dense(var_t, dtype);
  Tensor out_w = at::empty_like(gw);
  Tensor out_b = at::empty({has_bias ? out_channels : 0}, options);
  Tensor table = at::empty({2 * in_channels * kernel_size}, options);
  const int threads = threads_for(gw.numel());
  const double q2_value = q2.item<double>();
  if (dtype == at::kFloat) {
    bnp_precondition_f32(ptr<float>(gw), has_bias ? ptr<float>(gb) : nullptr, ptr<float>(mu), ptr<float>(vt),
                         static_cast<float>(q2_value), ptr<float>(out_w), ptr<float>(out_b), ptr<float>(table),
                         out_channels, in_channels, gw.size(1), kernel_size, groups, threads);
  } else {
    bnp_precondition_f64(ptr<double>(gw), has_bias ? ptr<double>(gb) : nullptr, ptr<double>(mu), ptr<double>(vt),
                         q2_value, ptr<double>(out_w), ptr<double>(out_b), ptr<double>(table), out_channels,
                         in_channels, gw.size(1), kernel_size, groups, threads);
  }
  return {out_w, out_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(distnorm, CPU, m) {
  m.impl("batch_norm_backward_elemt", &batch_norm_backward_elemt);
  m.impl("batch_norm_elemt", &batch_norm_elemt);
  m.impl("batch_norm_backward_reduce", &batch_norm_backward_reduce);
  m.impl("batch_norm_update_stats", &batch_norm_update_stats);
  m.impl("cbn_plan", &cbn_plan);
  m.impl("backward_sums", &backward_sums);
  m.impl("bnp_precondition", &bnp_precondition);
}
