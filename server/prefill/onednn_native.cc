// The onednn-bf16 prefill's host work as named XLA FFI targets calling torch's C++ ops directly (onednn_native.py):
// no Python, so no GIL, on the call path. The weights live here, prepacked in oneDNN's blocked layout, by id.
//
//   pdserve_onednn_linear     x bf16 [T, K], index s32 [] -> y bf16 [T, N]
//   pdserve_onednn_mlp        x bf16 [T, H], ids s32 [3] (gate, up, down) -> y bf16 [T, H]; attrs act ("silu",
//                             "gelu_tanh")
//   pdserve_host_attention    q bf16 [B, S, Hq, D], k, v bf16 [B, K, Hkv, D], q_pos, q_seg s32 [B, S], k_pos, k_seg
//                             s32 [B, K], window s32 [] -> out bf16 [B, S, Hq, D]; attrs scale (f32), mask_queries
//                             (i64)
//
// The attention follows host_attention.py's rule and cuts: query i reads key j iff seg[i] == seg[j] and
// 0 <= pos[i] - pos[j] < window; a segment whose keys are its queries' own at the same increasing positions with no
// window that cuts is plain causal attention, any other passes the rule as a mask, `mask_queries` queries at a time;
// padding queries (segment < 0) and queries that read nothing get zeros.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::shared_mutex weights_mutex;  // held to change the store (at load, at a bank's release); shared to read it
std::vector<at::Tensor> weights;

at::ScalarType TorchType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return at::kBFloat16;
    case ffi::DataType::F32: return at::kFloat;
    case ffi::DataType::S32: return at::kInt;
    default: throw std::invalid_argument("unexpected buffer dtype");
  }
}

at::Tensor Wrap(const ffi::AnyBuffer& b) {
  auto dims = b.dimensions();
  std::vector<int64_t> shape(dims.begin(), dims.end());
  return at::from_blob(b.untyped_data(), shape, at::TensorOptions().dtype(TorchType(b.element_type())));
}

c10::OperatorHandle Op(const char* name, const char* overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

at::Tensor Weight(int64_t id) {
  std::shared_lock<std::shared_mutex> lock(weights_mutex);
  if (id < 0 || id >= static_cast<int64_t>(weights.size()) || !weights[id].defined()) {
    throw std::out_of_range("weight " + std::to_string(id) + " is not held here (released, or never held)");
  }
  return weights[id];
}

at::Tensor Linear(const at::Tensor& x, int64_t id, const std::string& attr, const std::string& algorithm) {
  static const c10::OperatorHandle op = Op("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, Weight(id), c10::IValue(), attr, c10::List<std::optional<at::Scalar>>(),
                                 algorithm.empty() ? c10::IValue() : c10::IValue(algorithm)};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor LinearMul(const at::Tensor& x, const at::Tensor& other, int64_t id) {
  static const c10::OperatorHandle op = Op("mkldnn::_linear_pointwise", "binary");
  std::vector<c10::IValue> stack{x, other, Weight(id), c10::IValue(), std::string("mul")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

template <typename F>
ffi::Error Guarded(const char* what, F&& f) {
  try {
    f();
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string(what) + ": " + e.what());
  }
}

ffi::Error LinearCall(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> index, ffi::Result<ffi::AnyBuffer> y) {
  return Guarded("pdserve_onednn_linear", [&] {
    Wrap(*y).copy_(Linear(Wrap(x), index.typed_data()[0], "none", ""));
  });
}

ffi::Error MlpCall(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> y, std::string_view act) {
  return Guarded("pdserve_onednn_mlp", [&] {
    const int32_t* id = ids.typed_data();
    std::string attr = act == "silu" ? "swish" : "gelu", algorithm = act == "silu" ? "" : "tanh";
    if (act != "silu" && act != "gelu_tanh") throw std::invalid_argument("no fused activation " + std::string(act));
    at::Tensor xt = Wrap(x);
    at::Tensor gate = Linear(xt, id[0], attr, algorithm);  // [T, I]
    at::Tensor hidden = LinearMul(xt, gate, id[1]);  // [T, I]
    Wrap(*y).copy_(Linear(hidden, id[2], "none", ""));
  });
}

// The rows of `seg` [n] equal to `s`: a slice where they are one run, else their indexes.
struct Rows {
  int64_t begin = 0, end = 0;
  std::vector<int64_t> index;  // empty: the run [begin, end)
  int64_t size() const { return index.empty() ? end - begin : static_cast<int64_t>(index.size()); }
  int64_t at(int64_t i) const { return index.empty() ? begin + i : index[i]; }
  at::Tensor Take(const at::Tensor& t) const {  // t [n, ...] -> its rows
    if (index.empty()) return t.slice(0, begin, end);
    return t.index_select(0, at::tensor(index, at::kLong));
  }
  void Put(at::Tensor& t, const at::Tensor& rows) const {
    if (index.empty()) t.slice(0, begin, end).copy_(rows);
    else t.index_copy_(0, at::tensor(index, at::kLong), rows);
  }
};

Rows Where(const int32_t* seg, int64_t n, int32_t s) {
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < n; ++i)
    if (seg[i] == s) idx.push_back(i);
  Rows rows;
  if (!idx.empty() && idx.back() - idx.front() + 1 == static_cast<int64_t>(idx.size())) {
    rows.begin = idx.front();
    rows.end = idx.back() + 1;
  } else {
    rows.index = std::move(idx);
  }
  return rows;
}

ffi::Error AttentionCall(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> q_pos,
                         ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> k_pos, ffi::Buffer<ffi::S32> k_seg,
                         ffi::Buffer<ffi::S32> window_buf, ffi::Result<ffi::AnyBuffer> out_buf, float scale,
                         int64_t mask_queries) {
  return Guarded("pdserve_host_attention", [&] {
    at::Tensor qt = Wrap(q), kt = Wrap(k), vt = Wrap(v), out = Wrap(*out_buf);
    const int64_t B = qt.size(0), S = qt.size(1), K = kt.size(1);
    const int64_t window = window_buf.typed_data()[0];
    out.zero_();
    for (int64_t b = 0; b < B; ++b) {
      const int32_t *qs_ = q_seg.typed_data() + b * S, *ks_ = k_seg.typed_data() + b * K;
      const int32_t *qp_ = q_pos.typed_data() + b * S, *kp_ = k_pos.typed_data() + b * K;
      std::vector<int32_t> segments(qs_, qs_ + S);
      std::sort(segments.begin(), segments.end());
      segments.erase(std::unique(segments.begin(), segments.end()), segments.end());
      at::Tensor qb = qt[b], kb = kt[b], vb = vt[b], ob = out[b];
      for (int32_t s : segments) {
        if (s < 0) continue;
        Rows qi = Where(qs_, S, s), ki = Where(ks_, K, s);
        const int64_t n = qi.size(), m = ki.size();
        at::Tensor qs = qi.Take(qb).transpose(0, 1).unsqueeze(0);  // [1, Hq, n, D]
        at::Tensor ks = ki.Take(kb).transpose(0, 1).unsqueeze(0), vs = ki.Take(vb).transpose(0, 1).unsqueeze(0);
        bool causal = n == m && m > 0 && qp_[qi.at(n - 1)] - kp_[ki.at(0)] < window;
        for (int64_t i = 0; causal && i < n; ++i) {
          causal = qp_[qi.at(i)] == kp_[ki.at(i)] && (i == 0 || qp_[qi.at(i)] > qp_[qi.at(i - 1)]);
        }
        at::Tensor o;  // [1, Hq, n, D]
        if (causal) {
          o = at::scaled_dot_product_attention(qs, ks, vs, {}, 0.0, true, static_cast<double>(scale), true);
        } else {
          std::vector<at::Tensor> parts;
          for (int64_t i0 = 0; i0 < n; i0 += mask_queries) {
            const int64_t c = std::min(mask_queries, n - i0);
            at::Tensor mask = at::empty({c, m}, at::kBool);
            bool* mk = mask.data_ptr<bool>();
            std::vector<bool> seen(c, false);
            for (int64_t i = 0; i < c; ++i) {
              const int64_t p = qp_[qi.at(i0 + i)];
              for (int64_t j = 0; j < m; ++j) {
                const int64_t behind = p - kp_[ki.at(j)];
                mk[i * m + j] = behind >= 0 && behind < window;
                seen[i] = seen[i] || mk[i * m + j];
              }
              if (!seen[i]) std::fill(mk + i * m, mk + (i + 1) * m, true);  // computed, then zeroed
            }
            at::Tensor oc = at::scaled_dot_product_attention(qs.slice(2, i0, i0 + c), ks, vs, mask, 0.0, false,
                                                             static_cast<double>(scale), true);
            for (int64_t i = 0; i < c; ++i)
              if (!seen[i]) oc.select(2, i).zero_();
            parts.push_back(oc);
          }
          o = at::cat(parts, 2);
        }
        qi.Put(ob, o[0].transpose(0, 1));
      }
    }
  });
}

}  // namespace

extern "C" {

// Holds a dense bf16 weight [n, k] (out, in) prepacked for oneDNN's linear; its id, or -1 with `error` set.
int64_t pdserve_hold_weight(const void* data, int64_t n, int64_t k, char* error, int64_t error_len) {
  try {
    at::Tensor dense = at::from_blob(const_cast<void*>(data), {n, k}, at::kBFloat16).clone();
    static const c10::OperatorHandle op = Op("mkldnn::_reorder_linear_weight", "");
    std::vector<c10::IValue> stack{dense, c10::IValue()};
    op.callBoxed(&stack);
    std::unique_lock<std::shared_mutex> lock(weights_mutex);
    weights.push_back(stack[0].toTensor());
    return static_cast<int64_t>(weights.size()) - 1;
  } catch (const std::exception& e) {
    std::strncpy(error, e.what(), error_len - 1);
    return -1;
  }
}

void pdserve_release_weight(int64_t id) {
  std::unique_lock<std::shared_mutex> lock(weights_mutex);
  if (id >= 0 && id < static_cast<int64_t>(weights.size())) weights[id] = at::Tensor();
}

}  // extern "C"

XLA_FFI_DEFINE_HANDLER_SYMBOL(pdserve_onednn_linear, LinearCall,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(pdserve_onednn_mlp, MlpCall,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>()
                                  .Attr<std::string_view>("act"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(pdserve_host_attention, AttentionCall,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>().Attr<float>("scale")
                                  .Attr<int64_t>("mask_queries"));
