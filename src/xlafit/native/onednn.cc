// oneDNN's convolutions and max-pooling as XLA FFI calls, for XLA:CPU (see onednn.py).
//
// float32 or bfloat16 (every operand of a call the same), channels-last, the shapes in the
// handlers' comments below. Activations stay NHWC (oneDNN's "nhwc" tag, what PyTorch's
// channels-last layers use); a kernel is reordered to and from the layout oneDNN picks for
// its shape. Each shape's primitives are created once and kept; reordered kernels and
// oneDNN's scratchpads live in per-thread buffers, so XLA may run two of these calls at once.

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dnnl::memory;
using tag = dnnl::memory::format_tag;
using Any = ffi::AnyBuffer;
using AnyResult = ffi::Result<ffi::AnyBuffer>;
using U8 = ffi::Buffer<ffi::U8>;
using Type = memory::data_type;
using Dims = ffi::Span<const int64_t>;

namespace {

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::stream& Stream() {
  thread_local dnnl::stream stream(Engine());
  return stream;
}

// A per-thread buffer of at least `bytes`, reused across calls.
void* ThreadBuffer(int slot, size_t bytes) {
  thread_local std::vector<char> buffers[2];
  if (buffers[slot].size() < bytes) buffers[slot].resize(bytes);
  return buffers[slot].data();
}

memory::desc Md(const memory::dims& dims, Type type, tag t) { return memory::desc(dims, type, t); }

// oneDNN's type for the buffers of one call, which must all have the same float32 or bfloat16 type.
ffi::ErrorOr<Type> CommonType(std::initializer_list<ffi::DataType> types) {
  ffi::DataType first = *types.begin();
  for (auto t : types)
    if (t != first) return ffi::Unexpected(ffi::Error::InvalidArgument("oneDNN call: operands of different types"));
  if (first == ffi::DataType::F32) return Type::f32;
  if (first == ffi::DataType::BF16) return Type::bf16;
  return ffi::Unexpected(ffi::Error::InvalidArgument("oneDNN call: float32 or bfloat16 operands expected"));
}

// [N, H, W, C] as oneDNN's logical {N, C, H, W}.
memory::dims Nchw(Dims d) { return {d[0], d[3], d[1], d[2]}; }

// An NHWC activation buffer of XLA's, with oneDNN's logical {N, C, H, W} dimensions.
memory Activations(const memory::dims& nchw, Type type, void* data) {
  return memory(Md(nchw, type, tag::nhwc), Engine(), data);
}

// The primitives of one shape, created on first use and kept for the process's lifetime.
template <typename Entry, typename Shape>
const Entry& Cached(const std::string& key, Entry (*create)(const Shape&), const Shape& shape) {
  static std::mutex mutex;
  static std::unordered_map<std::string, std::unique_ptr<Entry>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = cache[key];
  if (!slot) slot = std::make_unique<Entry>(create(shape));
  return *slot;
}

std::string Key(const char* kind, Type type, std::initializer_list<const memory::dims*> parts) {
  std::string key = std::string(kind) + (type == Type::bf16 ? ",bf16" : ",f32");
  for (const auto* dims : parts)
    for (auto d : *dims) key += "," + std::to_string(d);
  return key;
}

ffi::Error Failed(const char* what, const dnnl::error& e) {
  return ffi::Error::Internal(std::string("oneDNN ") + what + " failed: " + e.what() +
                              "; model.conv=xla (or XLAFIT_ONEDNN=0) runs XLA's operations instead");
}

// --------------------------------------------------------------------------- convolution

enum class Pass { kForward, kBackwardData, kBackwardWeights };

struct ConvShape {
  Pass pass;
  Type type;
  memory::dims src, weights, dst, strides, pad_l, pad_r;
};

struct Conv {
  dnnl::primitive primitive;
  memory::desc user_weights, weights, scratchpad;
  bool reorder = false;
  dnnl::reorder weights_reorder;  // HWIO -> oneDNN's layout, or back for the weight gradient
};

Conv CreateConv(const ConvShape& s) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  auto src = Md(s.src, s.type, tag::nhwc), dst = Md(s.dst, s.type, tag::nhwc), any = Md(s.weights, s.type, tag::any);
  auto algorithm = dnnl::algorithm::convolution_direct;
  dnnl::convolution_forward::primitive_desc forward(Engine(), dnnl::prop_kind::forward_training, algorithm, src, any,
                                                    dst, s.strides, s.pad_l, s.pad_r, attr);
  Conv c;
  c.user_weights = Md(s.weights, s.type, tag::hwio);
  if (s.pass == Pass::kForward) {
    c.primitive = dnnl::convolution_forward(forward);
    c.weights = forward.weights_desc();
    c.scratchpad = forward.scratchpad_desc();
  } else if (s.pass == Pass::kBackwardData) {
    dnnl::convolution_backward_data::primitive_desc pd(Engine(), algorithm, src, any, dst, s.strides, s.pad_l,
                                                       s.pad_r, forward, attr);
    c.primitive = dnnl::convolution_backward_data(pd);
    c.weights = pd.weights_desc();
    c.scratchpad = pd.scratchpad_desc();
  } else {
    dnnl::convolution_backward_weights::primitive_desc pd(Engine(), algorithm, src, any, dst, s.strides, s.pad_l,
                                                          s.pad_r, forward, attr);
    c.primitive = dnnl::convolution_backward_weights(pd);
    c.weights = pd.diff_weights_desc();
    c.scratchpad = pd.scratchpad_desc();
  }
  c.reorder = c.weights != c.user_weights;
  if (c.reorder) {
    bool to_user = s.pass == Pass::kBackwardWeights;
    auto pd = to_user ? dnnl::reorder::primitive_desc(Engine(), c.weights, Engine(), c.user_weights)
                      : dnnl::reorder::primitive_desc(Engine(), c.user_weights, Engine(), c.weights);
    c.weights_reorder = dnnl::reorder(pd);
  }
  return c;
}

// x: the input (the input's gradient for kBackwardData), w: the kernel (its gradient for
// kBackwardWeights), y: the output (the output's gradient for both backward passes).
ffi::Error RunConv(Pass pass, ffi::ErrorOr<Type> type, Dims x_dims, Dims w_dims, Dims y_dims, void* x, void* w, void* y,
                   int64_t stride_h, int64_t stride_w, int64_t pad_top, int64_t pad_bottom, int64_t pad_left,
                   int64_t pad_right) {
  if (type.has_error()) return type.error();
  if (x_dims.size() != 4 || w_dims.size() != 4 || y_dims.size() != 4)
    return ffi::Error::InvalidArgument("oneDNN convolution: expected rank-4 NHWC and HWIO buffers");
  ConvShape s{pass,
              type.value(),
              Nchw(x_dims),
              {w_dims[3], w_dims[2], w_dims[0], w_dims[1]},
              Nchw(y_dims),
              {stride_h, stride_w},
              {pad_top, pad_left},
              {pad_bottom, pad_right}};
  const char* kinds[] = {"fwd", "bwd_data", "bwd_weights"};
  try {
    const Conv& c = Cached<Conv>(Key(kinds[static_cast<int>(pass)], s.type,
                                     {&s.src, &s.weights, &s.dst, &s.strides, &s.pad_l, &s.pad_r}),
                                 CreateConv, s);
    auto& stream = Stream();
    memory src = Activations(s.src, s.type, x), dst = Activations(s.dst, s.type, y);
    memory user_weights(c.user_weights, Engine(), w), weights = user_weights;
    if (c.reorder) weights = memory(c.weights, Engine(), ThreadBuffer(0, c.weights.get_size()));
    memory scratchpad(c.scratchpad, Engine(), ThreadBuffer(1, c.scratchpad.get_size()));
    if (pass == Pass::kForward) {
      if (c.reorder) c.weights_reorder.execute(stream, user_weights, weights);
      c.primitive.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, dst},
                                   {DNNL_ARG_SCRATCHPAD, scratchpad}});
    } else if (pass == Pass::kBackwardData) {
      if (c.reorder) c.weights_reorder.execute(stream, user_weights, weights);
      c.primitive.execute(stream, {{DNNL_ARG_DIFF_SRC, src}, {DNNL_ARG_WEIGHTS, weights},
                                   {DNNL_ARG_DIFF_DST, dst}, {DNNL_ARG_SCRATCHPAD, scratchpad}});
    } else {
      c.primitive.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_WEIGHTS, weights},
                                   {DNNL_ARG_DIFF_DST, dst}, {DNNL_ARG_SCRATCHPAD, scratchpad}});
      if (c.reorder) c.weights_reorder.execute(stream, weights, user_weights);
    }
    stream.wait();
  } catch (const dnnl::error& e) {
    return Failed("convolution", e);
  }
  return ffi::Error::Success();
}

// x [N,H,W,C], w [KH,KW,C,O] -> y [N,OH,OW,O]
ffi::Error ConvForward(Any x, Any w, AnyResult y, int64_t sh, int64_t sw, int64_t pt, int64_t pb, int64_t pl,
                       int64_t pr) {
  return RunConv(Pass::kForward, CommonType({x.element_type(), w.element_type(), y->element_type()}), x.dimensions(),
                 w.dimensions(), y->dimensions(), x.untyped_data(), w.untyped_data(), y->untyped_data(), sh, sw, pt,
                 pb, pl, pr);
}

// x [N,H,W,C], dy [N,OH,OW,O] -> dw [KH,KW,C,O]
ffi::Error ConvBackwardWeights(Any x, Any dy, AnyResult dw, int64_t sh, int64_t sw, int64_t pt, int64_t pb, int64_t pl,
                               int64_t pr) {
  return RunConv(Pass::kBackwardWeights, CommonType({x.element_type(), dy.element_type(), dw->element_type()}),
                 x.dimensions(), dw->dimensions(), dy.dimensions(), x.untyped_data(), dw->untyped_data(),
                 dy.untyped_data(), sh, sw, pt, pb, pl, pr);
}

// dy [N,OH,OW,O], w [KH,KW,C,O], after (the weight gradient, unread) -> dx [N,H,W,C].
// `after` makes XLA run this call after the weight gradient's instead of beside it: two at
// once would share the cores between two OpenMP teams. XLA still drops this call where the
// input's gradient is unused (the stem).
ffi::Error ConvBackwardData(Any dy, Any w, Any after, AnyResult dx, int64_t sh, int64_t sw, int64_t pt, int64_t pb,
                            int64_t pl, int64_t pr) {
  return RunConv(Pass::kBackwardData, CommonType({dy.element_type(), w.element_type(), dx->element_type()}),
                 dx->dimensions(), w.dimensions(), dy.dimensions(), dx->untyped_data(), w.untyped_data(),
                 dy.untyped_data(), sh, sw, pt, pb, pl, pr);
}

// --------------------------------------------------------------------------- max-pooling

struct PoolShape {
  Type type;
  memory::dims src, dst, kernel, strides, pad_l, pad_r;
};

struct Pool {
  dnnl::pooling_forward forward;
  dnnl::pooling_backward backward;
  memory::desc workspace;
};

Pool CreatePool(const PoolShape& s) {
  auto src = Md(s.src, s.type, tag::nhwc), dst = Md(s.dst, s.type, tag::nhwc);
  memory::dims dilation(s.kernel.size(), 0);
  auto max = dnnl::algorithm::pooling_max;
  dnnl::pooling_forward::primitive_desc forward(Engine(), dnnl::prop_kind::forward_training, max, src, dst, s.strides,
                                                s.kernel, dilation, s.pad_l, s.pad_r);
  dnnl::pooling_backward::primitive_desc backward(Engine(), max, src, dst, s.strides, s.kernel, dilation, s.pad_l,
                                                  s.pad_r, forward);
  return Pool{dnnl::pooling_forward(forward), dnnl::pooling_backward(backward), forward.workspace_desc()};
}

const Pool& LookupPool(Type type, Dims x, Dims y, int64_t window, int64_t stride, int64_t pad) {
  PoolShape s{type, Nchw(x), Nchw(y), {window, window}, {stride, stride}, {pad, pad}, {pad, pad}};
  return Cached<Pool>(Key("pool", type, {&s.src, &s.dst, &s.kernel, &s.strides, &s.pad_l}), CreatePool, s);
}

// x [N,H,W,C] -> y [N,OH,OW,C], workspace [N,OH,OW,C] (u8: which window position won)
ffi::Error PoolForward(Any x, AnyResult y, ffi::ResultBuffer<ffi::U8> workspace, int64_t window, int64_t stride,
                       int64_t pad) {
  auto type = CommonType({x.element_type(), y->element_type()});
  if (type.has_error()) return type.error();
  try {
    const Pool& p = LookupPool(type.value(), x.dimensions(), y->dimensions(), window, stride, pad);
    if (p.workspace.get_size() != workspace->size_bytes())
      return ffi::Error::Internal("oneDNN max-pool: its workspace is not one byte per output");
    auto& stream = Stream();
    p.forward.execute(stream, {{DNNL_ARG_SRC, Activations(Nchw(x.dimensions()), type.value(), x.untyped_data())},
                               {DNNL_ARG_DST, Activations(Nchw(y->dimensions()), type.value(), y->untyped_data())},
                               {DNNL_ARG_WORKSPACE, memory(p.workspace, Engine(), workspace->untyped_data())}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return Failed("max-pool", e);
  }
  return ffi::Error::Success();
}

// dy [N,OH,OW,C], workspace (the forward's) -> dx [N,H,W,C]: each output's gradient goes to
// the first maximum of its window, as PyTorch's and XLA's select-and-scatter send it.
ffi::Error PoolBackward(Any dy, U8 workspace, AnyResult dx, int64_t window, int64_t stride, int64_t pad) {
  auto type = CommonType({dy.element_type(), dx->element_type()});
  if (type.has_error()) return type.error();
  try {
    const Pool& p = LookupPool(type.value(), dx->dimensions(), dy.dimensions(), window, stride, pad);
    auto& stream = Stream();
    p.backward.execute(stream,
                       {{DNNL_ARG_DIFF_DST, Activations(Nchw(dy.dimensions()), type.value(), dy.untyped_data())},
                        {DNNL_ARG_DIFF_SRC, Activations(Nchw(dx->dimensions()), type.value(), dx->untyped_data())},
                        {DNNL_ARG_WORKSPACE, memory(p.workspace, Engine(), workspace.untyped_data())}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return Failed("max-pool gradient", e);
  }
  return ffi::Error::Success();
}

template <typename Binding>
auto ConvAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("stride_h")
      .template Attr<int64_t>("stride_w")
      .template Attr<int64_t>("pad_top")
      .template Attr<int64_t>("pad_bottom")
      .template Attr<int64_t>("pad_left")
      .template Attr<int64_t>("pad_right");
}

template <typename Binding>
auto PoolAttrs(Binding binding) {
  return std::move(binding).template Attr<int64_t>("window").template Attr<int64_t>("stride").template Attr<int64_t>(
      "pad");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlafit_onednn_conv_fwd, ConvForward,
                              ConvAttrs(ffi::Ffi::Bind().Arg<Any>().Arg<Any>().Ret<Any>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(xlafit_onednn_conv_bwd_weights, ConvBackwardWeights,
                              ConvAttrs(ffi::Ffi::Bind().Arg<Any>().Arg<Any>().Ret<Any>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(xlafit_onednn_conv_bwd_data, ConvBackwardData,
                              ConvAttrs(ffi::Ffi::Bind().Arg<Any>().Arg<Any>().Arg<Any>().Ret<Any>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(xlafit_onednn_max_pool_fwd, PoolForward,
                              PoolAttrs(ffi::Ffi::Bind().Arg<Any>().Ret<Any>().Ret<U8>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(xlafit_onednn_max_pool_bwd, PoolBackward,
                              PoolAttrs(ffi::Ffi::Bind().Arg<Any>().Arg<U8>().Ret<Any>()));

// 1 where oneDNN runs bfloat16 on this CPU's own instructions (AVX512-BF16, or AMX), 0 where
// it would emulate them: xlafit then keeps XLA's operations for bfloat16.
extern "C" int xlafit_onednn_native_bf16() {
  auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
  return (isa & bf16) == bf16;
}
