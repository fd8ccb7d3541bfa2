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
  DistTensor<T> y(out_, Layout::nchw, uninitialized, this->allocator());
  kernel_->sums(x.local, y.local.span_in(this->allocator().space()));
  // N x C values: reduced and scaled on the host (through a host copy on a device).
  HostValues<T> sums(y.local);
  allreduce_sum(*comm_, sums.span(), Group::spatial,
                "spatial sums of layer '" + this->name() + "'");
  const T area = static_cast<T>(in_.global.h * in_.global.w);
  for (T& v : sums.span())
    v /= area;
  sums.store();
  return y;
}

template <typename T>
DistTensor<T> GlobalAvgPool<T>::backward_one(const DistTensor<T>& dy, const RunState&) {
  const T area = static_cast<T>(in_.global.h * in_.global.w);
  Tensor<T> g = dy.local;
  HostValues<T> values(g);
  for (T& v : values.span())
    v /= area;
  values.store();
  DistTensor<T> dx(in_, Layout::nchw, uninitialized, this->allocator());  // spread overwrites it
  kernel_->spread(std::as_const(g).span_in(this->allocator().space()), dx.local);
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
  weight_ = this->make_param("weight", wshape);
  if (spec_.bias) {
    const Shape4 bshape{spec_.out_features, 1, 1, 1};
    bias_ = this->make_param("bias", bshape);
  }
  return out_;
}

template <typename T>
DistTensor<T> Linear<T>::forward(const DistTensor<T>& x, const RunState&) {
  TESSERA_CHECK(kernel_ != nullptr, "layer '" + this->name() + "' (linear): forward before bind");
  const MemorySpace space = this->allocator().space();
  x_ = x.local;
  DistTensor<T> y(out_, Layout::nchw, this->allocator());
  kernel_->forward(x.local.span_in(space), std::as_const(weight_.value).span_in(space),
                   std::as_const(bias_.value).span_in(space), y.local.span_in(space),
                   x.local.shape().n);
  return y;
}

template <typename T>
DistTensor<T> Linear<T>::backward_one(const DistTensor<T>& dy, const RunState&) {
  const MemorySpace space = this->allocator().space();
  DistTensor<T> dx(in_, Layout::nchw, this->allocator());
  const std::int64_t n = dy.local.shape().n;
  kernel_->backward_data(dy.local.span_in(space), std::as_const(weight_.value).span_in(space),
                         dx.local.span_in(space), n);
  // Every spatial rank holds the same samples: one of them counts them.
  if (in_.me.i == 0 && in_.me.j == 0)
    kernel_->backward_weights(std::as_const(x_).span_in(space), dy.local.span_in(space),
                              weight_.grad.span_in(space), bias_.grad.span_in(space), n);
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
