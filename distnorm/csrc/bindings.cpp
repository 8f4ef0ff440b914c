// Python's calls into distnorm's operators, one function per operator, linked into the library of
// distnorm/csrc/cpu_ops.cpp and imported from it (distnorm/_cpu_kernels.py: library()).
//
// Each function calls the operator through the dispatcher, with the typed handle of
// distnorm::<name>: the call torch.ops.distnorm.<name>.default(...) makes, so every dispatch key
// is visited as before (autograd's fallback, a TorchDispatchMode, the profiler, each device's
// kernel). What it skips is torch.ops's generic path from Python: the schema-driven conversion of
// every argument into an IValue, the search of every argument for __torch_function__, and the
// boxing of the results, host time a layer step pays at each of its operators. distnorm/_ops.py
// calls these in eager steps once the library is loaded; compiled code never calls them.
//
// The GIL is released for the call, as torch's own bindings do (a kernel implemented in Python,
// such as Triton's on CUDA, takes it back).

#include <torch/csrc/utils/pybind.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using StatsSignature = std::tuple<Tensor, Tensor>(const Tensor&, const OptTensor&, const OptTensor&, double);
using ElemtSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                              const Tensor&, const Tensor&, const Tensor&);
using PlanSignature = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const OptTensor&, const OptTensor&, const Tensor&, const Tensor&, const OptTensor&,
    at::TensorList, c10::SymInt, c10::ArrayRef<double>, std::optional<double>, bool, c10::string_view);
using SumsSignature = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                         const Tensor&, const Tensor&, double,
                                                                         c10::string_view);
using AffineSignature = Tensor(const Tensor&, const OptTensor&, const OptTensor&, const Tensor&, const Tensor&, double);
using ReduceSignature = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                   const Tensor&, const OptTensor&, bool, bool, bool);
using TransformSignature = std::tuple<Tensor, Tensor>(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                                                      const Tensor&, c10::SymInt, c10::string_view);

std::tuple<Tensor, Tensor> batch_norm_update_stats(const Tensor& x, const OptTensor& running_mean,
                                                   const OptTensor& running_var, double momentum) {
  static const auto op = handle<StatsSignature>("distnorm::batch_norm_update_stats");
  return op.call(x, running_mean, running_var, momentum);
}

Tensor batch_norm_backward_elemt(const Tensor& grad_out, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                                 const OptTensor& weight, const Tensor& sum_dy, const Tensor& sum_dy_xmu,
                                 const Tensor& count) {
  static const auto op = handle<ElemtSignature>("distnorm::batch_norm_backward_elemt");
  return op.call(grad_out, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count);
}

Tensor batch_norm_elemt(const Tensor& x, const OptTensor& weight, const OptTensor& bias, const Tensor& mean,
                        const Tensor& invstd, double eps) {
  static const auto op = handle<AffineSignature>("distnorm::batch_norm_elemt");
  return op.call(x, weight, bias, mean, invstd, eps);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> batch_norm_backward_reduce(const Tensor& grad_out, const Tensor& x,
                                                                      const Tensor& mean, const Tensor& invstd,
                                                                      const OptTensor& weight, bool input_g,
                                                                      bool weight_g, bool bias_g) {
  static const auto op = handle<ReduceSignature>("distnorm::batch_norm_backward_reduce");
  return op.call(grad_out, x, mean, invstd, weight, input_g, weight_g, bias_g);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> cbn_plan(
    const Tensor& mean, const Tensor& var, const OptTensor& count, const OptTensor& valid, const Tensor& weight,
    const Tensor& bias, const OptTensor& eta, const std::vector<Tensor>& buffers, int64_t host_count,
    const std::vector<double>& hyper, std::optional<double> momentum, bool amat_ready, const std::string& kernel) {
  static const auto op = handle<PlanSignature>("distnorm::cbn_plan");
  return op.call(mean, var, count, valid, weight, bias, eta, buffers, c10::SymInt(host_count), hyper, momentum,
                 amat_ready, kernel);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> backward_sums(const Tensor& s1, const Tensor& t,
                                                                 const Tensor& beta_coef, const Tensor& grad_scale,
                                                                 const Tensor& grad_coef, double inv_rho,
                                                                 const std::string& kernel) {
  static const auto op = handle<SumsSignature>("distnorm::backward_sums");
  return op.call(s1, t, beta_coef, grad_scale, grad_coef, inv_rho, kernel);
}

std::tuple<Tensor, Tensor> bnp_precondition(const Tensor& grad_weight, const OptTensor& grad_bias, const Tensor& mean,
                                            const Tensor& var_t, const Tensor& q2, int64_t groups,
                                            const std::string& kernel) {
  static const auto op = handle<TransformSignature>("distnorm::bnp_precondition");
  return op.call(grad_weight, grad_bias, mean, var_t, q2, c10::SymInt(groups), kernel);
}

}  // namespace

PYBIND11_MODULE(_cpu_ops, m) {
  m.doc() = "distnorm's operators called through the dispatcher's typed handles (distnorm/csrc/bindings.cpp)";
  const auto released = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("batch_norm_update_stats", &batch_norm_update_stats, released);
  m.def("batch_norm_backward_elemt", &batch_norm_backward_elemt, released);
  m.def("cbn_plan", &cbn_plan, released);
  m.def("backward_sums", &backward_sums, released);
  m.def("bnp_precondition", &bnp_precondition, released);
  m.def("batch_norm_elemt", &batch_norm_elemt, released);
  m.def("batch_norm_backward_reduce", &batch_norm_backward_reduce, released);
}
