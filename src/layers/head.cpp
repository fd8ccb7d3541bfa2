#include "tessera/layers/head.hpp"

#include <utility>

#include "tessera/collectives.hpp"
#include "tessera/error.hpp"
#include "tessera/layers/window.hpp"

namespace tessera {

void parse_global_avgpool(const LayerSpec& spec) {
  Fields(spec).finish();
}

template <typename T>
Distribution GlobalAvgPool<T>::setup(const Distribution& in) {
  require_spatial("layer '" + this->name() + "' (global_avgpool)", in);
  in_ = in;
  out_ = in.replicated_with_shape({in.global.n, in.global.c, 1, 1});
  return out_;
}

template <typename T>
DistTensor<T> GlobalAvgPool<T>::forward(const DistTensor<T>& x, const RunState&) {
  TESSERA_CHECK(comm_ != nullptr && kernel_ != nullptr,
                "layer '" + this->name() + "' (global_avgpool): forward before bind");
  DistTensor<T> y(out_);
  kernel_->sums(x.local, y.local.span());
  allreduce_sum(*comm_, y.local.span(), Group::spatial,
                "spatial sums of layer '" + this->name() + "'");
  const T area = static_cast<T>(in_.global.h * in_.global.w);
  for (T& v : y.local.span())
    v /= area;
  return y;
}

template <typename T>
DistTensor<T> GlobalAvgPool<T>::backward_one(const DistTensor<T>& dy, const RunState&) {
  DistTensor<T> dx(in_);
  const T area = static_cast<T>(in_.global.h * in_.global.w);
  std::vector<T> g(dy.local.span().begin(), dy.local.span().end());
  for (T& v : g)
    v /= area;
  kernel_->spread(g, dx.local);
  return dx;
}

LinearSpec parse_linear(const LayerSpec& spec) {
  Fields f(spec);
  LinearSpec s;
  s.out_features = f.integer("out_features", std::nullopt, 1);
  s.bias = f.boolean("bias", true);
  f.finish();
  return s;
}

template <typename T>
Distribution Linear<T>::setup(const Distribution& in) {
  TESSERA_CHECK(in.replicated,
                "layer '" + this->name() + "' (linear): its input is an image (" + in.global.str() +
                    "); a linear layer takes the N x C output of global_avgpool or of another "
                    "linear layer");
  in_ = in;
  out_ = in.replicated_with_shape({in.global.n, spec_.out_features, 1, 1});
  const Shape4 wshape{spec_.out_features, in.global.c, 1, 1};
  weight_ = {"weight", Tensor<T>(wshape), Tensor<T>(wshape)};
  if (spec_.bias) {
    const Shape4 bshape{spec_.out_features, 1, 1, 1};
    bias_ = {"bias", Tensor<T>(bshape), Tensor<T>(bshape)};
  }
  return out_;
}

template <typename T>
DistTensor<T> Linear<T>::forward(const DistTensor<T>& x, const RunState&) {
  TESSERA_CHECK(kernel_ != nullptr, "layer '" + this->name() + "' (linear): forward before bind");
  x_ = x.local;
  DistTensor<T> y(out_);
  kernel_->forward(x.local.span(), std::as_const(weight_.value).span(),
                   std::as_const(bias_.value).span(), y.local.span(), x.local.shape().n);
  return y;
}

template <typename T>
DistTensor<T> Linear<T>::backward_one(const DistTensor<T>& dy, const RunState&) {
  DistTensor<T> dx(in_);
  const std::int64_t n = dy.local.shape().n;
  kernel_->backward_data(dy.local.span(), std::as_const(weight_.value).span(), dx.local.span(), n);
  // Every spatial rank holds the same samples: one of them counts them.
  if (in_.me.i == 0 && in_.me.j == 0)
    kernel_->backward_weights(std::as_const(x_).span(), dy.local.span(), weight_.grad.span(),
                              bias_.grad.span(), n);
  return dx;
}

template <typename T>
std::vector<Param<T>*> Linear<T>::params() {
  if (spec_.bias) return {&weight_, &bias_};
  return {&weight_};
}

template class GlobalAvgPool<float>;
template class GlobalAvgPool<double>;
template class Linear<float>;
template class Linear<double>;

}  // namespace tessera
