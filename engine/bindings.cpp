// The one pybind11 module for the host-side engine: fastjudge._engine.
//
// Each engine component gets a bind_<component>(m) function below and one call in
// PYBIND11_MODULE; the shared numpy conversion helpers sit at the top. Arrays cross the
// boundary whole (numpy in, numpy out) so no per-element Python objects are ever created,
// and the GIL is released while C++ works.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_product.hpp"
#include "attention_inputs.hpp"
#include "causal_attention.hpp"
#include "cpu_parallel.hpp"
#include "delta_rule.hpp"
#include "dense.hpp"
#include "encoder_attention.hpp"
#include "planner.hpp"
#include "prefix_index.hpp"
#include "qwen_step.hpp"
#include "rms_norm.hpp"
#include "rotary.hpp"
#include "t5_step.hpp"
#include "triangular.hpp"

namespace py = pybind11;

namespace {

// ---------------------------------------------------------------------------------------
// numpy helpers
// ---------------------------------------------------------------------------------------

using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// Any integer array-like becomes a contiguous int64 array. Floats and bools are refused
// because forcecast would silently truncate them into plausible-looking integers. An empty
// input is accepted whatever its dtype, since np.asarray([]) is float64.
Int64Array as_int64_vector(const py::handle& obj, const std::string& name) {
  py::array arr = py::array::ensure(obj);
  if (!arr) throw py::value_error(name + " must be a 1-D integer array");
  if (arr.ndim() != 1) {
    throw py::value_error(name + " must be a 1-D array, got " + std::to_string(arr.ndim()) +
                          "-D");
  }
  const char kind = arr.dtype().kind();
  if (arr.size() > 0 && kind != 'i' && kind != 'u') {
    throw py::value_error(name + " must hold integers, got dtype " +
                          py::str(arr.dtype()).cast<std::string>());
  }
  Int64Array out = Int64Array::ensure(arr);
  if (!out) throw py::value_error(name + " could not be converted to int64");
  return out;
}

// Hands a vector to numpy without copying: the capsule owns it and frees it with the array.
py::array_t<int64_t> to_numpy(std::vector<int64_t>&& values) {
  auto* owned = new std::vector<int64_t>(std::move(values));
  py::capsule owner(owned, [](void* p) { delete static_cast<std::vector<int64_t>*>(p); });
  return py::array_t<int64_t>(static_cast<py::ssize_t>(owned->size()), owned->data(), owner);
}

// ---------------------------------------------------------------------------------------
// planner
// ---------------------------------------------------------------------------------------

py::tuple plan_batches(const py::handle& lengths, int64_t max_batch_tokens,
                       int64_t max_batch_size, const py::handle& group_ids) {
  const Int64Array lens = as_int64_vector(lengths, "lengths");
  std::optional<Int64Array> groups;
  const int64_t* group_ptr = nullptr;
  if (!group_ids.is_none()) {
    groups = as_int64_vector(group_ids, "group_ids");
    if (groups->size() != lens.size()) {
      throw py::value_error("group_ids has " + std::to_string(groups->size()) +
                            " entries but lengths has " + std::to_string(lens.size()));
    }
    group_ptr = groups->data();
  }

  fastjudge::BatchPlan plan;
  {
    // lens and groups keep the buffers alive; std::invalid_argument from the planner
    // propagates after the GIL is re-acquired and reaches Python as ValueError.
    py::gil_scoped_release release;
    plan = fastjudge::plan_batches(lens.data(), static_cast<std::size_t>(lens.size()),
                                   max_batch_tokens, max_batch_size, group_ptr);
  }
  return py::make_tuple(to_numpy(std::move(plan.order)), to_numpy(std::move(plan.offsets)));
}

void bind_planner(py::module_& m) {
  m.def("plan_batches", &plan_batches, py::arg("lengths"), py::arg("max_batch_tokens"),
        py::arg("max_batch_size"), py::arg("group_ids") = py::none(),
        R"doc(Plan padded batches by sort-and-pack.

lengths: 1-D integer array of token lengths (>= 0, each <= max_batch_tokens).
group_ids: optional 1-D integer array, same length; batches never mix groups.
Returns (order, offsets), both int64: batch b is order[offsets[b]:offsets[b+1]].
Within a group, batches hold longest requests first; groups follow first appearance.
Each batch satisfies rows * longest <= max_batch_tokens and rows <= max_batch_size.
Raises ValueError on invalid arguments.)doc");
}

// ---------------------------------------------------------------------------------------
// prefix index
// ---------------------------------------------------------------------------------------

// fastjudge::PrefixIndex behind a mutex. match_many works without the GIL, so another
// Python thread could otherwise reach the tree meanwhile. No thread ever waits for the
// mutex while holding the GIL, so the two locks cannot deadlock.
class PyPrefixIndex {
 public:
  explicit PyPrefixIndex(int64_t capacity_bytes) : index_(capacity_bytes) {}

  // Runs f(index) under the mutex, keeping the GIL: short calls cost one try_lock. Only a
  // contended mutex is waited for, with the GIL released.
  template <class F>
  auto with_gil(F&& f) {
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock()) {
      py::gil_scoped_release release;
      lock.lock();
    }
    return f(index_);
  }

  // Runs f(index) under the mutex with the GIL released; f must not touch Python objects.
  // The mutex is unlocked before the GIL is taken back.
  template <class F>
  auto without_gil(F&& f) {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mutex_);
    return f(index_);
  }

 private:
  std::mutex mutex_;
  fastjudge::PrefixIndex index_;
};

using Index = fastjudge::PrefixIndex;

int64_t prefix_insert(PyPrefixIndex& self, const py::handle& tokens, int64_t nbytes) {
  const Int64Array toks = as_int64_vector(tokens, "tokens");
  return self.with_gil([&](Index& index) {
    return index.insert(toks.data(), static_cast<std::size_t>(toks.size()), nbytes);
  });
}

py::tuple prefix_match(PyPrefixIndex& self, const py::handle& tokens) {
  const Int64Array toks = as_int64_vector(tokens, "tokens");
  const fastjudge::PrefixMatch found = self.with_gil([&](Index& index) {
    return index.match(toks.data(), static_cast<std::size_t>(toks.size()));
  });
  return py::make_tuple(found.slot, found.length);
}

py::tuple prefix_match_many(PyPrefixIndex& self, const py::handle& tokens,
                            const py::handle& offsets) {
  std::vector<Int64Array> buffers;  // keep every query's tokens alive while matching
  std::vector<std::pair<const int64_t*, std::size_t>> queries;
  if (!offsets.is_none()) {
    buffers.push_back(as_int64_vector(tokens, "tokens"));
    const Int64Array offs = as_int64_vector(offsets, "offsets");
    const int64_t* flat = buffers.back().data();
    const int64_t total = static_cast<int64_t>(buffers.back().size());
    const int64_t* o = offs.data();
    const py::ssize_t count = offs.size();
    if (count == 0) throw py::value_error("offsets must have at least one entry");
    if (o[0] != 0) throw py::value_error("offsets must start at 0, got " + std::to_string(o[0]));
    for (py::ssize_t i = 0; i + 1 < count; ++i) {
      if (o[i] > o[i + 1]) {
        throw py::value_error("offsets must be non-decreasing, but offsets[" +
                              std::to_string(i) + "]=" + std::to_string(o[i]) + " > offsets[" +
                              std::to_string(i + 1) + "]=" + std::to_string(o[i + 1]));
      }
    }
    if (o[count - 1] != total) {
      throw py::value_error("offsets must end at len(tokens)=" + std::to_string(total) +
                            ", got " + std::to_string(o[count - 1]));
    }
    queries.reserve(static_cast<std::size_t>(count - 1));
    for (py::ssize_t i = 0; i + 1 < count; ++i) {
      queries.emplace_back(flat + o[i], static_cast<std::size_t>(o[i + 1] - o[i]));
    }
  } else {
    if (py::isinstance<py::array>(tokens) &&
        py::reinterpret_borrow<py::array>(tokens).ndim() == 1) {
      throw py::value_error(
          "a flat tokens array needs offsets; pass offsets or a sequence of 1-D arrays");
    }
    for (const py::handle item : tokens) {
      buffers.push_back(as_int64_vector(item, "tokens[" + std::to_string(buffers.size()) + "]"));
      queries.emplace_back(buffers.back().data(), static_cast<std::size_t>(buffers.back().size()));
    }
  }

  std::vector<int64_t> slots(queries.size());
  std::vector<int64_t> lengths(queries.size());
  self.without_gil([&](Index& index) {
    for (std::size_t i = 0; i < queries.size(); ++i) {
      const fastjudge::PrefixMatch found = index.match(queries[i].first, queries[i].second);
      slots[i] = found.slot;
      lengths[i] = found.length;
    }
  });
  return py::make_tuple(to_numpy(std::move(slots)), to_numpy(std::move(lengths)));
}

void bind_prefix_index(py::module_& m) {
  py::register_exception<fastjudge::CacheFull>(m, "CacheFullError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const fastjudge::UnknownSlot& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });

  py::class_<PyPrefixIndex>(m, "PrefixIndex",
                            R"doc(Radix-tree index from cached token prefixes to cache slots.

See fastjudge.runtime.prefix_index for the full contract. Slot ids are issued 0, 1, 2, ...
and never reused. Entries with refcount 0 are evicted least recently used first.)doc")
      .def(py::init<int64_t>(), py::arg("capacity_bytes"),
           "Empty index with a byte budget (>= 0); ValueError if negative.")
      .def("insert", &prefix_insert, py::arg("tokens"), py::arg("nbytes"),
           R"doc(Register a cached prefix whose state costs nbytes; returns its slot.

tokens: non-empty 1-D integer array. If exactly these tokens are cached, returns that slot
(size unchanged, nbytes ignored). Otherwise evicts least-recently-used entries with refcount
0 until the budget fits (drain them with take_evicted()). Raises CacheFullError, evicting
nothing, if the entry cannot fit; ValueError on empty tokens or negative nbytes.)doc")
      .def("match", &prefix_match, py::arg("tokens"),
           R"doc((slot, length) of the longest cached entry that is a prefix of tokens, or (-1, 0).

Marks the matched entry most recently used and counts a hit or a miss.)doc")
      .def("match_many", &prefix_match_many, py::arg("tokens"), py::arg("offsets") = py::none(),
           R"doc(match() for many queries in order, without the GIL; returns int64 (slots, lengths).

Either a sequence of 1-D integer arrays, or one flat array with offsets (offsets[0] == 0,
non-decreasing, offsets[-1] == len(tokens)): query i is tokens[offsets[i]:offsets[i+1]].)doc")
      .def("acquire",
           [](PyPrefixIndex& self, int64_t slot) {
             self.with_gil([&](Index& index) { index.acquire(slot); });
           },
           py::arg("slot"), "Pin an entry (refcount += 1); KeyError for an unknown slot.")
      .def("release",
           [](PyPrefixIndex& self, int64_t slot) {
             self.with_gil([&](Index& index) { index.release(slot); });
           },
           py::arg("slot"),
           "Unpin (refcount -= 1); ValueError at refcount 0, KeyError for an unknown slot.")
      .def("remove",
           [](PyPrefixIndex& self, int64_t slot) {
             self.with_gil([&](Index& index) { index.remove(slot); });
           },
           py::arg("slot"),
           "Drop an entry with refcount 0 (not reported by take_evicted); ValueError if "
           "acquired, KeyError for an unknown slot.")
      .def("refcount",
           [](PyPrefixIndex& self, int64_t slot) {
             return self.with_gil([&](Index& index) { return index.refcount(slot); });
           },
           py::arg("slot"), "Current reference count; KeyError for an unknown slot.")
      .def("take_evicted",
           [](PyPrefixIndex& self) {
             return to_numpy(self.with_gil([](Index& index) { return index.take_evicted(); }));
           },
           "int64 array of slots evicted by insert since the last call, oldest first.")
      .def("__contains__",
           [](PyPrefixIndex& self, int64_t slot) {
             return self.with_gil([&](Index& index) { return index.contains(slot); });
           })
      .def("__len__",
           [](PyPrefixIndex& self) {
             return self.with_gil([](Index& index) { return index.num_entries(); });
           })
      .def_property_readonly(
          "capacity_bytes",
          [](PyPrefixIndex& self) {
            return self.with_gil([](Index& index) { return index.capacity_bytes(); });
          })
      .def_property_readonly(
          "bytes_used",
          [](PyPrefixIndex& self) {
            return self.with_gil([](Index& index) { return index.bytes_used(); });
          })
      .def_property_readonly(
          "num_entries",
          [](PyPrefixIndex& self) {
            return self.with_gil([](Index& index) { return index.num_entries(); });
          })
      .def_property_readonly(
          "hits",
          [](PyPrefixIndex& self) {
            return self.with_gil([](Index& index) { return index.hits(); });
          })
      .def_property_readonly(
          "misses",
          [](PyPrefixIndex& self) {
            return self.with_gil([](Index& index) { return index.misses(); });
          })
      .def_property_readonly(
          "hit_rate",
          [](PyPrefixIndex& self) {
            return self.with_gil([](Index& index) {
              const int64_t total = index.hits() + index.misses();
              return total == 0 ? 0.0 : static_cast<double>(index.hits()) / total;
            });
          },
          "hits / (hits + misses), 0.0 before the first match.")
      .def("__repr__", [](PyPrefixIndex& self) {
        return self.with_gil([](Index& index) {
          return "PrefixIndex(capacity_bytes=" + std::to_string(index.capacity_bytes()) +
                 ", bytes_used=" + std::to_string(index.bytes_used()) +
                 ", num_entries=" + std::to_string(index.num_entries()) + ")";
        });
      });
}

// ---------------------------------------------------------------------------------------
// triangular inverse (the chunked delta rule's per-chunk system)
// ---------------------------------------------------------------------------------------

// A float32 array as it is, C-contiguous, or nothing: no silent conversion copy, which would
// leave an output or the state unwritten and hide a caller's layout mistake.
py::array float32_array(const py::handle& obj) {
  py::array arr = py::array::ensure(obj);
  const bool ok = arr && arr.dtype().kind() == 'f' && arr.itemsize() == 4 && (arr.flags() & py::array::c_style);
  return ok ? arr : py::array();
}

py::array_t<float> float32_matrices(const py::handle& obj, const std::string& name) {
  py::array arr = float32_array(obj);
  if (!arr || arr.ndim() < 2 || arr.shape(arr.ndim() - 1) != arr.shape(arr.ndim() - 2)) {
    throw py::value_error(name + " must be a C-contiguous float32 array of square matrices [..., C, C]");
  }
  return py::reinterpret_borrow<py::array_t<float>>(arr);
}

void unit_lower_inverse(const py::handle& system, const py::handle& out, int threads) {
  py::array_t<float> in = float32_matrices(system, "system");
  py::array_t<float> res = float32_matrices(out, "out");
  if (!res.writeable()) throw py::value_error("out must be writable");
  if (in.ndim() != res.ndim() ||
      !std::equal(in.shape(), in.shape() + in.ndim(), res.shape())) {
    throw py::value_error("out must have the shape of system");
  }
  const int64_t C = in.shape(in.ndim() - 1);
  const int64_t n = C == 0 ? 0 : in.size() / (C * C);
  const float* src = in.data();
  float* dst = res.mutable_data();
  if (src == dst) throw py::value_error("out must not be system itself");
  py::gil_scoped_release release;
  fastjudge::unit_lower_inverse(src, dst, n, C, threads);
}

void bind_triangular(py::module_& m) {
  m.def("unit_lower_inverse", &unit_lower_inverse, py::arg("system"), py::arg("out"),
        py::arg("threads") = 1,
        R"doc(Write (I + L)^-1 into out for L the strictly lower triangle of each C x C matrix of
system (float32, C-contiguous, [..., C, C]; the diagonal and upper triangle are not read).
out: a float32 array of the same shape, written whole (ones on the diagonal, zeros above).
threads: at most this many threads, used only where there are enough matrices.
Raises ValueError on arrays of another dtype, layout or shape, and for C over
unit_lower_inverse_max_size.)doc");
  m.attr("unit_lower_inverse_max_size") = fastjudge::kMaxUnitLowerSize;
}

// ---------------------------------------------------------------------------------------
// the gated delta rule's one-token steps
// ---------------------------------------------------------------------------------------

// obj as a numpy array of T's elements (float32; bfloat16 as 16-bit integers), else an empty handle
template <typename T>
py::array element_array(const py::handle& obj) {
  py::array arr = py::isinstance<py::array>(obj) ? py::reinterpret_borrow<py::array>(obj) : py::array();
  const char kind = arr ? arr.dtype().kind() : '\0';
  const bool ok = arr && (std::is_floating_point_v<T> ? kind == 'f' : kind == 'i' || kind == 'u') &&
                  arr.itemsize() == static_cast<py::ssize_t>(sizeof(T));
  return ok ? arr : py::array();
}

template <typename T>
std::string element_name() {
  return std::is_floating_point_v<T> ? "float32" : "16-bit integer (bfloat16 bits)";
}

// An array of T of the given shape, C-contiguous, or ValueError; writable when asked
template <typename T>
T* typed_array(const py::handle& obj, const std::string& name, const std::vector<int64_t>& shape,
               bool writable = false) {
  py::array arr = element_array<T>(obj);
  bool ok = arr && (arr.flags() & py::array::c_style) && arr.ndim() == static_cast<py::ssize_t>(shape.size());
  for (std::size_t i = 0; ok && i < shape.size(); ++i) ok = arr.shape(i) == shape[i];
  if (!ok) {
    std::string want;
    for (int64_t n : shape) want += (want.empty() ? "" : ", ") + std::to_string(n);
    throw py::value_error(name + " must be a C-contiguous " + element_name<T>() + " array of shape [" + want + "]");
  }
  if (writable && !arr.writeable()) throw py::value_error(name + " must be writable");
  return static_cast<T*>(arr.mutable_data());
}

// Each of B rows' real token count, in [0, S], as int64, or ValueError
Int64Array row_counts(const py::handle& counts, int64_t B, int64_t S) {
  Int64Array rows = as_int64_vector(counts, "counts");
  if (rows.shape(0) != B) throw py::value_error("counts must have one entry per row");
  for (int64_t b = 0; b < B; ++b) {
    if (rows.at(b) < 0 || rows.at(b) > S) throw py::value_error("counts must lie in [0, S]");
  }
  return rows;
}

// A [B, S, heads, dim] numpy array of T (float32; bfloat16 as 16-bit integers) read in place:
// any strides over its first three dimensions (a layer's views), contiguous rows; ValueError
// otherwise. Only an array itself is taken (the caller's argument keeps its memory alive for the
// call), never a converted copy.
template <typename T>
fastjudge::StridedRows<T> strided_rows(const py::handle& obj, const std::string& name,
                                       const std::vector<int64_t>& shape) {
  constexpr int64_t size = sizeof(T);
  py::array arr = element_array<T>(obj);
  bool ok = arr && arr.ndim() == 4 && (arr.shape(3) <= 1 || arr.strides(3) == size);
  for (int i = 0; ok && i < 4; ++i) ok = arr.shape(i) == shape[i] && arr.strides(i) % size == 0;
  if (!ok) {
    throw py::value_error(name + " must be a " + element_name<T>() +
                          " array of shape [" + std::to_string(shape[0]) + ", " + std::to_string(shape[1]) +
                          ", " + std::to_string(shape[2]) + ", " + std::to_string(shape[3]) +
                          "] with contiguous rows");
  }
  return {static_cast<const T*>(arr.data()), arr.strides(0) / size, arr.strides(1) / size, arr.strides(2) / size};
}

// The arrays of a gated delta rule over B rows of S tokens, checked: memory [B, Hv, dk, dv]
// (writable), query and key [B, S, Hk, dk] and value [B, S, Hv, dv] (strided rows), gates (g or
// decay) and beta [B, S, Hv], out [B, S, Hv, dv] (writable); all float32
struct RuleArrays {
  float* memory;
  fastjudge::StridedRows<float> query, key, value;
  const float *gates, *beta;
  float* out;
  int64_t B, S, Hk, Hv, dk, dv;
};

RuleArrays rule_arrays(const py::handle& memory, const py::handle& query, const py::handle& key,
                       const py::handle& value, const py::handle& gates, const std::string& gates_name,
                       const py::handle& beta, const py::handle& out) {
  py::array keys = py::array::ensure(key), values = py::array::ensure(value);
  if (!keys || keys.ndim() != 4 || !values || values.ndim() != 4) {
    throw py::value_error("key and value must be 4-D arrays [B, S, heads, dim]");
  }
  const int64_t B = keys.shape(0), S = keys.shape(1), Hk = keys.shape(2), dk = keys.shape(3);
  const int64_t Hv = values.shape(2), dv = values.shape(3);
  if (Hk == 0 || Hv % Hk != 0) throw py::value_error("value heads must be a multiple of key heads");
  return {typed_array<float>(memory, "memory", {B, Hv, dk, dv}, true),
          strided_rows<float>(query, "query", {B, S, Hk, dk}),
          strided_rows<float>(key, "key", {B, S, Hk, dk}),
          strided_rows<float>(value, "value", {B, S, Hv, dv}),
          typed_array<float>(gates, gates_name, {B, S, Hv}),
          typed_array<float>(beta, "beta", {B, S, Hv}),
          typed_array<float>(out, "out", {B, S, Hv, dv}, true),
          B, S, Hk, Hv, dk, dv};
}

void recurrent_delta_rule(const py::handle& memory, const py::handle& query, const py::handle& key,
                          const py::handle& value, const py::handle& decay, const py::handle& beta,
                          const py::handle& out, int threads) {
  const RuleArrays a = rule_arrays(memory, query, key, value, decay, "decay", beta, out);
  py::gil_scoped_release release;
  fastjudge::recurrent_delta_rule(a.memory, a.query, a.key, a.value, a.gates, a.beta, a.out, a.B, a.S, a.Hk, a.Hv,
                                  a.dk, a.dv, threads);
}

void chunked_delta_rule(const py::handle& memory, const py::handle& query, const py::handle& key,
                        const py::handle& value, const py::handle& g, const py::handle& beta, const py::handle& out,
                        int64_t chunk, bool fresh, bool normalise, float l2_eps, float exp_floor, int threads) {
  const RuleArrays a = rule_arrays(memory, query, key, value, g, "g", beta, out);
  if (a.dv % 16 != 0) throw py::value_error("the value head size must be a multiple of 16");
  if (chunk < 1 || chunk > fastjudge::kMaxChunk) {
    throw py::value_error("chunk must lie in [1, " + std::to_string(fastjudge::kMaxChunk) + "]");
  }
  py::gil_scoped_release release;
  fastjudge::chunked_delta_rule(a.memory, a.query, a.key, a.value, a.gates, a.beta, a.out, a.B, a.S, a.Hk, a.Hv,
                                a.dk, a.dv, chunk, fresh, normalise, l2_eps, exp_floor, threads);
}

template <typename T>
void deltanet_step_typed(const py::array& projected, const py::handle& conv_state, const py::handle& taps,
                         const py::handle& memory, const py::handle& counts, const py::handle& dt_bias,
                         const py::handle& neg_A, const py::handle& gated_norm, const py::handle& out,
                         int64_t key_heads, int64_t key_dim, float eps, float l2_eps, bool fresh, int64_t chunk,
                         float exp_floor, int threads) {
  py::array kernel = py::array::ensure(taps), bias = py::array::ensure(dt_bias), norm = py::array::ensure(gated_norm);
  if (!kernel || kernel.ndim() != 2 || !bias || bias.ndim() != 1 || !norm || norm.ndim() != 1) {
    throw py::value_error("taps must be [K, C], dt_bias [value heads] and gated_norm [value dim]");
  }
  const int64_t B = projected.shape(0), S = projected.shape(1), width = projected.shape(2);
  const int64_t K = kernel.shape(0), C = kernel.shape(1), Hv = bias.shape(0), dv = norm.shape(0);
  const int64_t Hk = key_heads, dk = key_dim;
  if (K < 1 || Hk < 1 || dk < 1 || Hv % Hk != 0 || C != 2 * Hk * dk + Hv * dv || width != C + Hv * dv + 2 * Hv) {
    throw py::value_error("projected [B, S, C + Hv dv + 2 Hv] and taps [K, C] must fit C = 2 Hk dk + Hv dv, "
                          "with value heads a multiple of key heads");
  }
  if (chunk < 0 || chunk > fastjudge::kMaxChunk) {
    throw py::value_error("chunk must lie in [0, " + std::to_string(fastjudge::kMaxChunk) + "]");
  }
  if (chunk > 0 && (dv % 16 != 0 || K > 16)) {
    throw py::value_error("the chunked form needs a value head size that is a multiple of 16 and at most 16 taps");
  }
  const Int64Array rows = row_counts(counts, B, S);
  const fastjudge::DeltaNetStep step{B, S, K, Hk, Hv, dk, dv, eps, l2_eps, fresh, rows.data(),
                                     typed_array<float>(dt_bias, "dt_bias", {Hv}),
                                     typed_array<float>(neg_A, "neg_A", {Hv}),
                                     typed_array<float>(gated_norm, "gated_norm", {dv})};
  const T* in = typed_array<T>(projected, "projected", {B, S, width});
  T* conv = typed_array<T>(conv_state, "conv_state", {B, K - 1, C}, true);
  const T* w = typed_array<T>(taps, "taps", {K, C});
  float* state = typed_array<float>(memory, "memory", {B, Hv, dk, dv}, true);
  T* dst = typed_array<T>(out, "out", {B, S, Hv * dv}, true);
  py::gil_scoped_release release;
  if (chunk > 0) {
    fastjudge::deltanet_prompt(step, in, conv, w, state, dst, chunk, exp_floor, threads);
  } else {
    fastjudge::deltanet_step(step, in, conv, w, state, dst, threads);
  }
}

void deltanet_step(const py::handle& projected, const py::handle& conv_state, const py::handle& taps,
                   const py::handle& memory, const py::handle& counts, const py::handle& dt_bias,
                   const py::handle& neg_A, const py::handle& gated_norm, const py::handle& out, int64_t key_heads,
                   int64_t key_dim, float eps, float l2_eps, bool fresh, int64_t chunk, float exp_floor,
                   int threads) {
  py::array p = py::isinstance<py::array>(projected) ? py::reinterpret_borrow<py::array>(projected) : py::array();
  if (!p || p.ndim() != 3) throw py::value_error("projected must be a 3-D array [B, S, width]");
  if (p.dtype().kind() == 'f' && p.itemsize() == 4) {
    deltanet_step_typed<float>(p, conv_state, taps, memory, counts, dt_bias, neg_A, gated_norm, out, key_heads,
                               key_dim, eps, l2_eps, fresh, chunk, exp_floor, threads);
  } else if ((p.dtype().kind() == 'i' || p.dtype().kind() == 'u') && p.itemsize() == 2) {
    deltanet_step_typed<uint16_t>(p, conv_state, taps, memory, counts, dt_bias, neg_A, gated_norm, out, key_heads,
                                  key_dim, eps, l2_eps, fresh, chunk, exp_floor, threads);
  } else {
    throw py::value_error("projected must be float32, or bfloat16 as 16-bit integers");
  }
}


void bind_delta_rule(py::module_& m) {
  m.def("recurrent_delta_rule", &recurrent_delta_rule, py::arg("memory"), py::arg("query"), py::arg("key"),
        py::arg("value"), py::arg("decay"), py::arg("beta"), py::arg("out"), py::arg("threads") = 1,
        R"doc(The gated delta rule one token at a time, in place on memory.

memory [B, Hv, dk, dv] (the state, updated), query and key [B, S, Hk, dk] (normalised; queries
scaled), value [B, S, Hv, dv], decay (exp of the log-decays) and beta [B, S, Hv], out
[B, S, Hv, dv] (written): float32; query, key and value read in place with any strides but
contiguous rows, the rest C-contiguous. Value head h reads key head h // (Hv // Hk).
threads: at most this many threads, used only for large states. Raises ValueError on arrays of
another dtype, layout or shape.)doc");
  m.def("chunked_delta_rule", &chunked_delta_rule, py::arg("memory"), py::arg("query"), py::arg("key"),
        py::arg("value"), py::arg("g"), py::arg("beta"), py::arg("out"), py::arg("chunk"), py::arg("fresh"),
        py::arg("normalise"), py::arg("l2_eps"), py::arg("exp_floor"), py::arg("threads") = 1,
        R"doc(The gated delta rule over many tokens, chunk tokens at a time, in place on memory.

memory [B, Hv, dk, dv] (the start state, updated to the final one; not read and zeroed when
fresh), query and key [B, S, Hk, dk] (L2-normalised here when normalise, with l2_eps under the
root; queries scaled by 1 / sqrt(dk)), value [B, S, Hv, dv], g (log-decays) and beta [B, S, Hv],
out [B, S, Hv, dv] (written): float32; query, key and value read in place with any strides but
contiguous rows, the rest C-contiguous. Value head h reads key head h // (Hv // Hk); dv a
multiple of 16; chunk in [1, chunked_delta_rule_max_chunk]. Decay exponents are clamped below at
exp_floor. threads: at most this many threads. Raises ValueError on arrays of another dtype,
layout or shape.)doc");
  m.attr("chunked_delta_rule_max_chunk") = fastjudge::kMaxChunk;
  m.def("deltanet_step", &deltanet_step, py::arg("projected"), py::arg("conv_state"), py::arg("taps"),
        py::arg("memory"), py::arg("counts"), py::arg("dt_bias"), py::arg("neg_A"), py::arg("gated_norm"),
        py::arg("out"), py::arg("key_heads"), py::arg("key_dim"), py::arg("eps"), py::arg("l2_eps"),
        py::arg("fresh") = false, py::arg("chunk") = 0, py::arg("exp_floor") = -87.33f, py::arg("threads") = 1,
        R"doc(A Gated DeltaNet layer's step between its input and output projections.

projected [B, S, C + Hv dv + 2 Hv] (the input projection: conv inputs, z, b, a; C = 2 Hk dk +
Hv dv), conv_state [B, K - 1, C] (updated: each row's last K - 1 real inputs), taps [K, C] (the
depthwise conv), out [B, S, Hv dv] (written: the gated RMSNorm of the rule's output, what the
output projection reads): all float32, or all bfloat16 as 16-bit integer arrays of their bits.
memory [B, Hv, dk, dv] (float32, the recurrent state, updated; zeroed first when fresh),
counts (int64 [B], each row's real tokens: later ones are padding and leave the state as it
is), dt_bias and neg_A [Hv], gated_norm [dv]: float32. key_heads (Hk) and key_dim (dk) give
the split of C; eps: the gated norm's; l2_eps: the query/key L2 norm's (inside the root, before
dividing by dk). fresh: every row starts empty. chunk: 0 (the default) runs the rule one token
at a time (decoding, a few tokens); 1 .. chunked_delta_rule_max_chunk runs a prompt: every
token's conv and gates at once (the conv's products summed unrounded in float32), the rule chunk
tokens at a time (chunked_delta_rule, queries and keys normalised there with l2_eps, decay
exponents clamped at exp_floor; the value head size a multiple of 16). All arrays C-contiguous.
Raises ValueError on arrays of another dtype, layout or shape.)doc");
}

// ---------------------------------------------------------------------------------------
// causal attention over prompts
// ---------------------------------------------------------------------------------------

template <typename T>
void causal_attention_typed(const py::array& query, const py::handle& key, const py::handle& value,
                            const py::handle& out, float scale, const py::handle& offsets, const py::handle& counts,
                            const py::handle& bias, int64_t shared_columns, const py::handle& shared_from,
                            int threads) {
  const int64_t B = query.shape(0), S = query.shape(1), H = query.shape(2), dim = query.shape(3);
  py::array keys = py::array::ensure(key);
  if (!keys || keys.ndim() != 4) throw py::value_error("key must be a 4-D array [B, W, kv_heads, dim]");
  const int64_t W = keys.shape(1), Hkv = keys.shape(2);
  if (Hkv == 0 || H % Hkv != 0) throw py::value_error("query heads must be a multiple of key heads");
  Int64Array starts;  // (a default array_t is an empty array, not a null one)
  const bool cached = !offsets.is_none();
  if (!cached) {
    if (W != S) throw py::value_error("without offsets, key must have the query's tokens");
  } else {
    starts = as_int64_vector(offsets, "offsets");
    if (starts.shape(0) != B) throw py::value_error("offsets must have one entry per row");
    if (W < S) throw py::value_error("key must have at least the query's tokens");
    for (int64_t b = 0; b < B; ++b) {
      if (starts.at(b) < 0) throw py::value_error("offsets must not be negative");
    }
  }
  const bool padded = !counts.is_none();
  const Int64Array real = padded ? row_counts(counts, B, S) : Int64Array();
  const auto q = strided_rows<T>(query, "query", {B, S, H, dim});
  const auto k = strided_rows<T>(key, "key", {B, W, Hkv, dim});
  const auto v = strided_rows<T>(value, "value", {B, W, Hkv, dim});
  T* dst = typed_array<T>(out, "out", {B, S, H, dim}, true);
  fastjudge::CausalProblem problem{B, S, W, H, Hkv, dim, scale, cached ? starts.data() : nullptr,
                                   padded ? real.data() : nullptr};
  if (!bias.is_none()) {
    const py::array table = py::array::ensure(bias);
    if (!cached) throw py::value_error("a bias needs offsets");
    int64_t distances = 0;  // the largest distance a query reads is its position: offset + t
    for (int64_t b = 0; b < B; ++b) distances = std::max(distances, starts.at(b) + S);
    if (!table || table.ndim() != 2 || table.shape(0) != H || table.shape(1) < distances) {
      throw py::value_error("bias must be [heads, distances] with a distance for each query position (offset + S)");
    }
    problem.bias = typed_array<float>(bias, "bias", {H, table.shape(1)});
    problem.bias_stride = table.shape(1);
  }
  Int64Array sources;
  if (!shared_from.is_none()) {
    sources = as_int64_vector(shared_from, "shared_from");
    if (!cached || sources.shape(0) != B) throw py::value_error("shared_from needs offsets and one entry per row");
    for (int64_t b = 0; b < B; ++b) {
      if (sources.at(b) < 0 || sources.at(b) >= B) throw py::value_error("shared_from must name rows of the batch");
    }
    problem.shared_columns = shared_columns, problem.shared_from = sources.data();
  }
  py::gil_scoped_release release;
  fastjudge::causal_attention(problem, q, k, v, dst, threads);
}

void causal_attention(const py::handle& query, const py::handle& key, const py::handle& value,
                      const py::handle& out, float scale, const py::handle& offsets, const py::handle& counts,
                      const py::handle& bias, int64_t shared_columns, const py::handle& shared_from, int threads) {
  py::array q = py::isinstance<py::array>(query) ? py::reinterpret_borrow<py::array>(query) : py::array();
  if (!q || q.ndim() != 4) throw py::value_error("query must be a 4-D array [B, S, heads, dim]");
  if (!(scale > 0.0f)) throw py::value_error("scale must be positive");
  if (q.dtype().kind() == 'f' && q.itemsize() == 4) {
    causal_attention_typed<float>(q, key, value, out, scale, offsets, counts, bias, shared_columns, shared_from,
                                  threads);
  } else if ((q.dtype().kind() == 'i' || q.dtype().kind() == 'u') && q.itemsize() == 2) {
    causal_attention_typed<uint16_t>(q, key, value, out, scale, offsets, counts, bias, shared_columns, shared_from,
                                     threads);
  } else {
    throw py::value_error("query must be float32, or bfloat16 as 16-bit integers");
  }
}

// attention over encoder states that are both keys and values
template <typename T>
void encoder_attention_typed(const py::array& query, const py::handle& states, const py::handle& lengths,
                             const py::handle& out, float scale, bool reverse, int threads) {
  const int64_t B = query.shape(0), R = query.shape(1), dim = query.shape(3);
  py::array held = py::array::ensure(states);
  if (!held || held.ndim() != 4) throw py::value_error("states must be a 4-D array [B, L, 1, dim]");
  const int64_t L = held.shape(1);
  if (dim % 16 != 0) throw py::value_error("dim must be a multiple of 16");
  const Int64Array keys = as_int64_vector(lengths, "lengths");
  if (keys.shape(0) != B) throw py::value_error("lengths must have one entry per row");
  for (int64_t b = 0; b < B; ++b) {
    if (keys.at(b) < 0 || keys.at(b) > L) throw py::value_error("lengths must lie in [0, L]");
  }
  const auto q = strided_rows<T>(query, "query", {B, R, 1, dim});
  const auto s = strided_rows<T>(states, "states", {B, L, 1, dim});
  T* dst = typed_array<T>(out, "out", {B, R, dim}, true);
  py::gil_scoped_release release;
  fastjudge::encoder_attention<T>(q, s, keys.data(), dst, B, R, dim, scale, reverse, threads);
}

void encoder_attention(const py::handle& query, const py::handle& states, const py::handle& lengths,
                       const py::handle& out, float scale, bool reverse, int threads) {
  py::array q = py::isinstance<py::array>(query) ? py::reinterpret_borrow<py::array>(query) : py::array();
  if (!q || q.ndim() != 4 || q.shape(2) != 1) throw py::value_error("query must be a 4-D array [B, R, 1, dim]");
  if (!(scale > 0.0f)) throw py::value_error("scale must be positive");
  if (q.dtype().kind() == 'f' && q.itemsize() == 4) {
    encoder_attention_typed<float>(q, states, lengths, out, scale, reverse, threads);
  } else if ((q.dtype().kind() == 'i' || q.dtype().kind() == 'u') && q.itemsize() == 2) {
    encoder_attention_typed<uint16_t>(q, states, lengths, out, scale, reverse, threads);
  } else {
    throw py::value_error("query must be float32, or bfloat16 as 16-bit integers");
  }
}

// T5's reassociated cross-attention with its per-head maps
template <typename T>
void reassociated_attention_typed(const py::array& xq, const py::handle& w_k, const py::handle& w_v,
                                  const py::handle& states, const py::handle& lengths, const py::handle& out,
                                  float scale, bool reverse, int threads, const py::handle& w_k_pairs) {
  const int64_t B = xq.shape(0), P = xq.shape(1), H = xq.shape(2), dk = xq.shape(3);
  py::array held = py::array::ensure(states);
  if (!held || held.ndim() != 4) throw py::value_error("states must be a 4-D array [B, L, 1, dim]");
  const int64_t L = held.shape(1), dim = held.shape(3);
  if (dim % 16 != 0) throw py::value_error("dim must be a multiple of 16");
  const Int64Array keys = as_int64_vector(lengths, "lengths");
  if (keys.shape(0) != B) throw py::value_error("lengths must have one entry per row");
  for (int64_t b = 0; b < B; ++b) {
    if (keys.at(b) < 0 || keys.at(b) > L) throw py::value_error("lengths must lie in [0, L]");
  }
  const T* x = typed_array<T>(xq, "xq", {B, P, H, dk});
  const T* wk = typed_array<T>(w_k, "w_k", {H, dk, dim});
  const T* wv = typed_array<T>(w_v, "w_v", {H, dk, dim});
  const auto s = strided_rows<T>(states, "states", {B, L, 1, dim});
  T* dst = typed_array<T>(out, "out", {B, P, H, dk}, true);
  const uint32_t* pairs = nullptr;
  if (!w_k_pairs.is_none()) {
    if (!std::is_same_v<T, uint16_t>) throw py::value_error("w_k_pairs are for bfloat16 weights");
    pairs = typed_array<uint32_t>(w_k_pairs, "w_k_pairs", {H, dk / 2, dim});
  }
  py::gil_scoped_release release;
  fastjudge::reassociated_attention<T>(x, wk, wv, s, keys.data(), dst, B, P, H, dk, dim, scale, reverse, threads,
                                       pairs);
}

void reassociated_attention(const py::handle& xq, const py::handle& w_k, const py::handle& w_v,
                            const py::handle& states, const py::handle& lengths, const py::handle& out, float scale,
                            bool reverse, int threads, const py::handle& w_k_pairs) {
  py::array x = py::isinstance<py::array>(xq) ? py::reinterpret_borrow<py::array>(xq) : py::array();
  if (!x || x.ndim() != 4) throw py::value_error("xq must be a 4-D array [B, P, heads, d_kv]");
  if (!(scale > 0.0f)) throw py::value_error("scale must be positive");
  if (x.dtype().kind() == 'f' && x.itemsize() == 4) {
    reassociated_attention_typed<float>(x, w_k, w_v, states, lengths, out, scale, reverse, threads, w_k_pairs);
  } else if ((x.dtype().kind() == 'i' || x.dtype().kind() == 'u') && x.itemsize() == 2) {
    reassociated_attention_typed<uint16_t>(x, w_k, w_v, states, lengths, out, scale, reverse, threads, w_k_pairs);
  } else {
    throw py::value_error("xq must be float32, or bfloat16 as 16-bit integers");
  }
}

void bind_cpu_threads(py::module_& m) {
  m.def(
      "cpu_thread_pool", [] { return fastjudge::process_openmp().parallel ? "openmp" : "threads"; },
      R"doc(Where the CPU kernels' threads come from: "openmp" (the OpenMP runtime already loaded in
this process, torch's, shared with its ops) or "threads" (threads of the engine's own, where no
OpenMP runtime is loaded).)doc");
}

void bind_causal_attention(py::module_& m) {
  m.def(
      "bf16_dot_products",
      [](const py::object& wanted) {
        return wanted.is_none() ? fastjudge::bf16_dot_products() : fastjudge::bf16_dot_products(wanted.cast<bool>());
      },
      py::arg("wanted") = py::none(),
      R"doc(Whether bfloat16 causal attention runs on bfloat16 dot products (AVX512-BF16, where the
CPU has it: the softmax weights rounded to bfloat16 before the weighted sum, as transformers'
eager path and SDPA round them) rather than the portable float32 path (float32 weights).
wanted: True (the default) or False sets the choice for the process; returns what is in use.)doc");
  m.def("encoder_attention", &encoder_attention, py::arg("query"), py::arg("states"), py::arg("lengths"),
        py::arg("out"), py::arg("scale"), py::arg("reverse") = false, py::arg("threads") = 1,
        R"doc(Attention of query rows [B, R, 1, dim] over states [B, L, 1, dim] that are both the keys
and the values (T5's reassociated cross-attention), written into out [B, R, dim]:
out[b, r] = sum over j < lengths[b] of softmax_j(scale * q[b, r] . s[b, j]) s[b, j], each row's
states read once (an online softmax over blocks of keys). lengths: int64 [B], each in [0, L]; a
row with none gets zeros. Arrays all float32, or all bfloat16 as 16-bit integer arrays of their
bits; query and states read in place with any strides but contiguous rows, out C-contiguous;
dim a multiple of 16. reverse: the rows in reverse order, with the same results (calls over the
same states that alternate it start where the last one ended, on states still in cache).
threads: at most this many, used only where the work pays for them. Raises ValueError on arrays
of another dtype, layout or shape.)doc");
  m.def(
      "pair_key_weights",
      [](const py::handle& w_k) {
        py::array w = py::isinstance<py::array>(w_k) ? py::reinterpret_borrow<py::array>(w_k) : py::array();
        if (!w || w.ndim() != 3) throw py::value_error("w_k must be a 3-D array [heads, d_kv, dim]");
        const int64_t H = w.shape(0), dk = w.shape(1), dim = w.shape(2);
        const uint16_t* src = typed_array<uint16_t>(w, "w_k", {H, dk, dim});
        py::array_t<uint32_t> pairs({H, dk / 2, dim});  // refused below (a ValueError) where unusable
        fastjudge::pair_key_weights(src, H, dk, dim, pairs.mutable_data());
        return pairs;
      },
      py::arg("w_k"),
      R"doc(A bfloat16 model's cross-attention key weights w_k [heads, d_kv, dim] (16-bit integer array of
their bits) as pairs of consecutive d_kv rows, uint32 [heads, d_kv / 2, dim] (row 2i's element in
the low half): what reassociated_attention's bfloat16 dot products map the queries through,
made once where a model decodes many steps. Raises ValueError where the CPU has no AVX512-BF16,
d_kv is odd or dim is not a multiple of 32.)doc");
  m.def("reassociated_attention", &reassociated_attention, py::arg("xq"), py::arg("w_k"), py::arg("w_v"),
        py::arg("states"), py::arg("lengths"), py::arg("out"), py::arg("scale"), py::arg("reverse") = false,
        py::arg("threads") = 1, py::arg("w_k_pairs") = py::none(),
        R"doc(T5's reassociated cross-attention in one call: for each row b, position p and head h,
q = w_k[h]^T xq[b, p, h] (the query in model space), ctx = encoder_attention of q over the row's
states, out[b, p, h] = w_v[h] ctx. xq, out [B, P, heads, d_kv] and w_k, w_v [heads, d_kv, dim]
C-contiguous; states [B, L, 1, dim] with contiguous rows; lengths int64 [B] in [0, L]; all
float32, or all bfloat16 as 16-bit integer arrays of their bits (out rounded once); dim a
multiple of 16. q and ctx are held in float32, or for bfloat16 on bfloat16 dot products
(bf16_dot_products(); d_kv even, dim a multiple of 32) as bfloat16, each rounded once, the
queries mapped through w_k_pairs (pair_key_weights of w_k; None: made from w_k in this call).
reverse and threads as for encoder_attention. Raises ValueError on arrays of another dtype,
layout or shape.)doc");
  m.def("causal_attention", &causal_attention, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("out"),
        py::arg("scale"), py::arg("offsets") = py::none(), py::arg("counts") = py::none(), py::arg("bias") = py::none(),
        py::arg("shared_columns") = 0, py::arg("shared_from") = py::none(), py::arg("threads") = 1,
        R"doc(Causal softmax attention of query [B, S, H, dim] over key and value [B, W, kv_heads, dim]
(query head h reads key head h // (H // kv_heads)), written into out [B, S, H, dim]:
out[b, t, h] = sum over visible j of softmax_j(scale * q[b, t, h] . k[b, j]) v[b, j], where
query token t of row b sees the keys j <= min(offsets[b] + t, W - 1). offsets (int64 [B], each
row's cached keys before its new tokens) may be None: then W must be S (a prompt's own keys).
counts (int64 [B], each row's real tokens; None: all S): later tokens are padding, their
outputs written as zeros and nothing computed for them.
bias (float32 [H, n], n >= max(offsets) + S; None: no bias): an additive bias by distance, T5's
relative position bias: the score of query token t of head h on key j is scale * q . k +
bias[h, offsets[b] + t - j]. It needs offsets. (Attention where each of n queries sees all n keys,
T5's encoder: one row with offsets [n - 1], the bias of relative position j - t at n - 1 + t - j.)
shared_from (int64 [B]; None: each row reads its own keys), with shared_columns: rows whose
first shared_columns keys and values are the same (one prefix snapshot's) may read them from row
shared_from[b]; where the few-token path takes it (no bias, at most 4 queries of a key head a
row, every row's offset at least shared_columns), each block of them is read once for all the
rows that share it, with the same output bits.
Arrays are all float32, or all bfloat16 passed as 16-bit integer arrays of their bits (torch's
tensor.view(torch.int16)); arithmetic runs in float32 and a bfloat16 output is rounded to nearest
even. query, key and value are read in place with any strides but contiguous rows; out is
C-contiguous, of the query's dtype. threads: at most this many threads, used only where the work
pays for them. Raises ValueError on arrays of another dtype, layout or shape.)doc");
}


// ---------------------------------------------------------------------------------------
// linear projections on panel-packed weights
// ---------------------------------------------------------------------------------------

// x as a [M, K] matrix of T with contiguous rows (any row stride), or ValueError
template <typename T>
std::pair<const T*, int64_t> input_rows(const py::handle& obj, int64_t K) {
  constexpr int64_t size = sizeof(T);
  py::array arr = element_array<T>(obj);
  const bool ok = arr && arr.ndim() == 2 && arr.shape(1) == K &&
                  (arr.shape(0) == 0 ||
                   ((K <= 1 || arr.strides(1) == size) && arr.strides(0) % size == 0 && arr.strides(0) >= 0));
  if (!ok) {
    throw py::value_error("x must be a " + element_name<T>() + " array [rows, " + std::to_string(K) +
                          "] with contiguous rows");
  }
  return {static_cast<const T*>(arr.data()), arr.shape(0) <= 1 ? K : arr.strides(0) / size};
}

// out [M, N] (C-contiguous, writable) and the panels' [P, depth, 64] shape checked against it
// and x's rows; returns (M, N, depth)
template <typename W>
std::tuple<int64_t, int64_t, int64_t> projection_shape(const py::handle& x, const py::handle& panels,
                                                        const py::handle& out) {
  py::array o = py::array::ensure(out), w = element_array<W>(panels), in = py::array::ensure(x);
  if (!o || o.ndim() != 2) throw py::value_error("out must be a 2-D array [rows, N]");
  if (!w || w.ndim() != 3 || w.shape(2) != fastjudge::kPanelColumns) {
    throw py::value_error("panels must be an array [panels, depth, 64] of " +
                          std::string(sizeof(W) == 4 && !std::is_floating_point_v<W> ? "32-bit bfloat16 pairs"
                                                                                      : "float32"));
  }
  if (!in || in.ndim() != 2 || in.shape(0) != o.shape(0)) throw py::value_error("x and out must have the same rows");
  return {o.shape(0), o.shape(1), w.shape(1)};
}

fastjudge::GateActivation gate_activation(const std::string& name) {
  static const std::pair<const char*, fastjudge::GateActivation> kNames[] = {
      {"silu", fastjudge::GateActivation::kSilu},
      {"gelu_tanh", fastjudge::GateActivation::kGeluTanh},
      {"relu", fastjudge::GateActivation::kRelu}};
  for (const auto& [known, activation] : kNames) {
    if (name == known) return activation;
  }
  throw py::value_error("activation must be silu, gelu_tanh or relu");
}

// out = x W^T (gated: act(x Wg^T) * (x Wu^T)): X float32 on float32 panels, or bfloat16 bits on
// panels of input pairs (W 32-bit words); ungated float32 also takes a bias (None or [N]) and an
// output activation, both applied in the engine's call
template <typename X, typename W>
void project(const py::handle& x, const py::handle& panels, const py::handle& up_panels, const py::handle& out,
             std::optional<fastjudge::GateActivation> activation, int threads, const py::handle& bias,
             std::optional<fastjudge::GateActivation> output_activation) {
  const int64_t columns = fastjudge::kPanelColumns, per_entry = sizeof(W) / sizeof(X);
  const auto [M, N, depth] = projection_shape<W>(x, panels, out);
  const int64_t K = py::array::ensure(x).shape(1), P = (N + columns - 1) / columns;
  if ((K + per_entry - 1) / per_entry != depth) {
    throw py::value_error("x must be [rows, K] for panels of ceil(K / " + std::to_string(per_entry) +
                          ") entries an output");
  }
  const auto [rows, stride] = input_rows<X>(x, K);
  const W* w = typed_array<W>(panels, "panels", {P, depth, columns});
  const W* up = activation ? typed_array<W>(up_panels, "up_panels", {P, depth, columns}) : nullptr;
  X* dst = typed_array<X>(out, "out", {M, N}, true);
  if constexpr (std::is_same_v<X, float>) {
    const float* b = bias.is_none() ? nullptr : typed_array<float>(bias, "bias", {N});
    if (b || output_activation) {
      py::gil_scoped_release release;
      fastjudge::dense_product(rows, stride, w, dst, M, K, N, b, output_activation, threads);
      return;
    }
  }
  py::gil_scoped_release release;
  if (activation) {
    fastjudge::gated_dense_product(rows, stride, w, up, dst, M, K, N, *activation, threads);
  } else {
    fastjudge::dense_product(rows, stride, w, dst, M, K, N, threads);
  }
}

void projection(const py::handle& x, const py::handle& panels, const py::handle& up_panels, const py::handle& out,
                std::optional<fastjudge::GateActivation> activation, int threads, const py::handle& bias = py::none(),
                std::optional<fastjudge::GateActivation> output_activation = std::nullopt) {
  const py::array in = py::array::ensure(x);
  if (!in || in.ndim() != 2) throw py::value_error("x must be a 2-D array [rows, K]");
  if (!((in.dtype().kind() == 'i' || in.dtype().kind() == 'u') && in.itemsize() == 2)) {
    project<float, float>(x, panels, up_panels, out, activation, threads, bias, output_activation);
  } else if (!bias.is_none() || output_activation) {
    throw py::value_error("bias and activation need a float32 x [rows, K]");  // the epilogue is float32's only
  } else if (fastjudge::bf16_dense_available()) {
    project<uint16_t, uint32_t>(x, panels, up_panels, out, activation, threads, bias, std::nullopt);
  } else {
    throw py::value_error("bfloat16 projections need AVX512-BF16");
  }
}

void dense_product(const py::handle& x, const py::handle& panels, const py::handle& out, int threads,
                   const py::handle& bias, const py::handle& activation) {
  std::optional<fastjudge::GateActivation> act;
  if (!activation.is_none()) act = gate_activation(py::cast<std::string>(activation));
  projection(x, panels, py::none(), out, std::nullopt, threads, bias, act);
}

void gated_dense_product(const py::handle& x, const py::handle& gate_panels, const py::handle& up_panels,
                         const py::handle& out, const std::string& activation, int threads) {
  projection(x, gate_panels, up_panels, out, gate_activation(activation), threads);
}

void bind_dense(py::module_& m) {
  m.def("dense_product", &dense_product, py::arg("x"), py::arg("panels"), py::arg("out"), py::arg("threads") = 1,
        py::arg("bias") = py::none(), py::arg("activation") = py::none(),
        R"doc(out = act(x W^T + bias) on a weight packed into panels of 64 output columns.

float32: x [M, K] (contiguous rows, any row stride), panels [ceil(N / 64), K, 64] (panels[p, k,
c] = W[64 p + c, k], zero past the last output), out [M, N] (C-contiguous, written); each
output sums over k in increasing order. bfloat16 (x and out as 16-bit integer arrays of the
bits; needs AVX512-BF16, bf16_dense_available()): panels [ceil(N / 64), ceil(K / 2), 64] of
32-bit words, each two bfloat16 weights of consecutive inputs (low half first); products
summed in float32, the output rounded once. threads: at most this many, used only where the
work pays for them. bias ([N] float32) and activation ("silu", "gelu_tanh" as g * sigmoid(2 y),
or "relu"): float32 only, added then applied to each panel's outputs while in cache. Raises
ValueError on arrays of another dtype, layout or shape.)doc");
  m.def("gated_dense_product", &gated_dense_product, py::arg("x"), py::arg("gate_panels"), py::arg("up_panels"),
        py::arg("out"), py::arg("activation"), py::arg("threads") = 1,
        R"doc(out = act(x Wg^T) * (x Wu^T) on two weights packed as dense_product packs one.

activation: "silu", "gelu_tanh" (the tanh approximation, as g * sigmoid(2 y)) or "relu".
Otherwise as dense_product.)doc");
  m.attr("dense_panel_columns") = fastjudge::kPanelColumns;
  m.def(
      "amx_products",
      [](const py::object& wanted) {
        return wanted.is_none() ? fastjudge::amx_products() : fastjudge::amx_products(wanted.cast<bool>());
      },
      py::arg("wanted") = py::none(),
      R"doc(Whether bfloat16 projections on the engine's panels run on AMX tiles (AMX-BF16, where the
CPU has it and the OS grants this process its tile data; inputs of four rows or more, an even
number of inputs that is a multiple of 32) rather than on AVX512-BF16 dot products. Each output
is a float32 sum over the inputs in increasing order either way (the tiles add each pair's two
products in a fused step, as oneDNN's tile GEMM does). wanted: True (the default) or False sets
the choice for the process; returns what is in use.)doc");
  m.def("bf16_dense_available", &fastjudge::bf16_dense_available,
        "Whether this CPU runs the bfloat16 projections (AVX512-BF16).");
}

// ---------------------------------------------------------------------------------------
// Rows of float32 or bfloat16 values, read in place (RMSNorm, rotary embedding)
// ---------------------------------------------------------------------------------------

// A [N, H, D] array's shape and element strides over N and H (its rows contiguous)
struct RowsLayout {
  int64_t N, H, D, row_stride, head_stride;
};

// run(data, layout) on x, a 3-D array of float32 (data: const float*) or of bfloat16 bits as
// 16-bit integers (const uint16_t*) with contiguous rows; ValueError otherwise
template <typename Run>
void with_rows(const py::handle& x, Run run) {
  const py::array rows = py::array::ensure(x);
  if (!rows || rows.ndim() != 3) throw py::value_error("x must be a 3-D array [rows, heads, dim]");
  const auto typed = [&](auto element) {
    using T = decltype(element);
    constexpr int64_t size = sizeof(T);
    const int64_t D = rows.shape(2);
    if (!((D <= 1 || rows.strides(2) == size) && rows.strides(0) % size == 0 && rows.strides(1) % size == 0))
      throw py::value_error("x must have contiguous rows");
    run(static_cast<const T*>(rows.data()),
        RowsLayout{rows.shape(0), rows.shape(1), D, rows.strides(0) / size, rows.strides(1) / size});
  };
  const char kind = rows.dtype().kind();
  if (kind == 'f' && rows.itemsize() == 4) {
    typed(float{});
  } else if ((kind == 'i' || kind == 'u') && rows.itemsize() == 2) {
    typed(uint16_t{});
  } else {
    throw py::value_error("x must be float32, or bfloat16 as 16-bit integers");
  }
}

// ---------------------------------------------------------------------------------------
// Rotary embedding of rows (rotate-half pairing)
// ---------------------------------------------------------------------------------------

void rotate_halves(const py::handle& x, const py::handle& cos, const py::handle& sin, const py::handle& out,
                   int threads) {
  with_rows(x, [&](const auto* src, const RowsLayout& rows) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(src)>>;
    if (rows.D % 2) throw py::value_error("x's rows must have an even length");
    const py::array table = py::array::ensure(cos);
    if (!table || table.ndim() != 2 || table.shape(0) < 1)
      throw py::value_error("cos must be a 2-D array [positions, dim]");
    const int64_t P = table.shape(0);
    if (rows.N % P) throw py::value_error("x's rows must be whole runs of the tables' positions");
    const float* c = typed_array<float>(cos, "cos", {P, rows.D});
    const float* s = typed_array<float>(sin, "sin", {P, rows.D});
    T* dst = typed_array<T>(out, "out", {rows.N, rows.H, rows.D}, true);
    py::gil_scoped_release release;
    fastjudge::rotate_halves(src, rows.row_stride, rows.head_stride, c, s, dst, rows.N, rows.H, rows.D, P, threads);
  });
}

void bind_rotate_halves(py::module_& m) {
  m.def("rotate_halves", &rotate_halves, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("out"),
        py::arg("threads") = 1,
        R"doc(Rotary embedding of each row in the rotate-half pairing, in one pass.

x [N, H, D] (float32, or bfloat16 as 16-bit integers; any strides over N and H, contiguous rows;
D even), cos and sin [P, D] float32 (row n takes position n % P; N a multiple of P), out [N, H, D]
C-contiguous of x's dtype: out[:D/2] = x1 cos - x2 sin, out[D/2:] = x2 cos + x1 sin (x1, x2 the
row's halves, cos and sin at each element's own index), each product and sum rounded apart in
float32, then once to x's dtype: transformers' x cos + rotate_half(x) sin. Raises ValueError on
arrays of another dtype, layout or shape.)doc");
}

// ---------------------------------------------------------------------------------------
// RMSNorm of rows
// ---------------------------------------------------------------------------------------

void rms_norm(const py::handle& x, const py::handle& weight, const py::handle& out, float eps, int threads,
              bool round_first) {
  with_rows(x, [&](const auto* src, const RowsLayout& rows) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(src)>>;
    const float* w = typed_array<float>(weight, "weight", {rows.H, rows.D});
    T* dst = typed_array<T>(out, "out", {rows.N, rows.H, rows.D}, true);
    py::gil_scoped_release release;
    fastjudge::rms_norm(src, rows.row_stride, rows.head_stride, w, dst, rows.N, rows.H, rows.D, eps, threads,
                        round_first);
  });
}

void bind_rms_norm(py::module_& m) {
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("eps"),
        py::arg("threads") = 1, py::arg("round_first") = false,
        R"doc(out = (x / sqrt(mean(x^2) + eps)) * weight for each row, in one pass.

x [N, H, D] (float32, or bfloat16 as 16-bit integers; any strides over N and H, contiguous rows),
weight [H, D] float32 (row (n, h) takes weight[h]), out [N, H, D] C-contiguous of x's dtype.
Arithmetic in float32; a bfloat16 output rounded once, or with round_first twice: the normalised
x rounded to bfloat16 before the weight multiplies it (T5's layer norm). Raises ValueError on
arrays of another dtype, layout or shape.)doc");
}


// ---------------------------------------------------------------------------------------
// A Qwen attention layer's inputs and output gate over a prompt
// ---------------------------------------------------------------------------------------

template <typename T>
void attention_inputs_typed(const py::array& qkv, const py::handle& qk_norm, const py::handle& cos,
                            const py::handle& sin, const py::handle& rotated, const py::handle& keys,
                            const py::handle& values, const py::handle& where, int64_t H, int64_t Hkv,
                            int64_t values_at, int64_t half, float eps, int threads) {
  const py::array pool = py::array::ensure(keys);
  if (!pool || pool.ndim() != 4) throw py::value_error("keys must be a 4-D array [B, kv_heads, columns, dim]");
  const int64_t B = qkv.shape(0), S = qkv.shape(1), width = qkv.shape(2), columns = pool.shape(2);
  const int64_t hd = pool.shape(3), heads = H + Hkv;
  if (H < 1 || Hkv < 1 || hd < 1 || hd % 16 != 0 || half < 0 || 2 * half > hd || heads * hd > width ||
      values_at < heads * hd || values_at + Hkv * hd > width || pool.shape(1) != Hkv) {
    throw py::value_error("qkv's rows must hold H + Hkv heads of queries and keys from column 0 and Hkv heads of "
                          "values from values_at, the head size a multiple of 16 with the rotary dims within it");
  }
  const Int64Array columns_of = as_int64_vector(where, "where");
  if (columns_of.shape(0) != B * S) throw py::value_error("where must hold one column per token");
  for (int64_t n = 0; n < B * S; ++n) {
    if (columns_of.at(n) < 0 || columns_of.at(n) >= columns) throw py::value_error("where must lie in [0, columns)");
  }
  const fastjudge::AttentionInputs<T> in{typed_array<T>(qkv, "qkv", {B, S, width}), width, values_at,
                                         typed_array<float>(qk_norm, "qk_norm", {heads, hd}), eps,
                                         typed_array<T>(cos, "cos", {B, S, hd}), typed_array<T>(sin, "sin", {B, S, hd}),
                                         half, typed_array<T>(rotated, "rotated", {B, S, heads, hd}, true),
                                         typed_array<T>(keys, "keys", {B, Hkv, columns, hd}, true),
                                         typed_array<T>(values, "values", {B, Hkv, columns, hd}, true),
                                         columns_of.data(), B, S, H, Hkv, hd, columns};
  py::gil_scoped_release release;
  fastjudge::attention_inputs(in, threads);
}

void attention_inputs(const py::handle& qkv, const py::handle& qk_norm, const py::handle& cos, const py::handle& sin,
                      const py::handle& rotated, const py::handle& keys, const py::handle& values,
                      const py::handle& where, int64_t heads, int64_t kv_heads, int64_t values_at, int64_t half,
                      float eps, int threads) {
  py::array rows = py::isinstance<py::array>(qkv) ? py::reinterpret_borrow<py::array>(qkv) : py::array();
  if (!rows || rows.ndim() != 3) throw py::value_error("qkv must be a 3-D array [B, S, width]");
  const char kind = rows.dtype().kind();
  if (kind == 'f' && rows.itemsize() == 4) {
    attention_inputs_typed<float>(rows, qk_norm, cos, sin, rotated, keys, values, where, heads, kv_heads, values_at,
                                  half, eps, threads);
  } else if ((kind == 'i' || kind == 'u') && rows.itemsize() == 2) {
    attention_inputs_typed<uint16_t>(rows, qk_norm, cos, sin, rotated, keys, values, where, heads, kv_heads,
                                     values_at, half, eps, threads);
  } else {
    throw py::value_error("qkv must be float32, or bfloat16 as 16-bit integers");
  }
}

void output_gate(const py::handle& o, const py::handle& gate, int threads) {
  with_rows(gate, [&](const auto* g, const RowsLayout& rows) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
    if (rows.H != 1 || rows.D % 16 != 0) throw py::value_error("gate must be [N, 1, n], n a multiple of 16");
    T* dst = typed_array<T>(o, "o", {rows.N, rows.D}, true);
    py::gil_scoped_release release;
    fastjudge::output_gate(dst, g, rows.row_stride, rows.N, rows.D, threads);
  });
}

void bind_attention_inputs(py::module_& m) {
  m.def("attention_inputs", &attention_inputs, py::arg("qkv"), py::arg("qk_norm"), py::arg("cos"), py::arg("sin"),
        py::arg("rotated"), py::arg("keys"), py::arg("values"), py::arg("where"), py::arg("heads"),
        py::arg("kv_heads"), py::arg("values_at"), py::arg("half"), py::arg("eps"), py::arg("threads") = 1,
        R"doc(A Qwen attention layer's inputs over B rows of S tokens, in one pass.

qkv [B, S, width] (the fused projection's rows: queries of `heads` heads and keys of `kv_heads`
heads side by side from column 0, values of kv_heads heads from column values_at): queries and
keys RMS-normalised per head (qk_norm [heads + kv_heads, dim] float32, eps), then rotated (cos
and sin [B, S, dim], each token's rows, sin carrying rotate-half's sign; half: half the rotary
dims) into rotated [B, S, heads + kv_heads, dim]; each token's rotated key and its value written
into keys and values [B, kv_heads, columns, dim] (the pool's rows) at column where[b S + s] (int64
[B S]; the last column, the pool's scratch for padding, is not written). Every value rounded where the layer's tensor ops round it. float32, or bfloat16 as
16-bit integers (qk_norm float32); all C-contiguous; dim a multiple of 16. Raises ValueError on
arrays of another dtype, layout or shape.)doc");
  m.def("output_gate", &output_gate, py::arg("o"), py::arg("gate"), py::arg("threads") = 1,
        R"doc(o <- o * sigmoid(gate), the sigmoid rounded to o's type first.

o [N, n] C-contiguous, gate [N, 1, n] (contiguous rows, any row stride: a slice of the fused
projection's rows); float32, or bfloat16 as 16-bit integers; n a multiple of 16. Raises
ValueError on arrays of another dtype, layout or shape.)doc");
}


// ---------------------------------------------------------------------------------------
// Qwen decoding step
// ---------------------------------------------------------------------------------------

// A run of picking steps' arguments, checked: tokens [B, S] int64 with their counts, picks
// [B, steps] int64 (written), room [B] (the tokens each row may still pick, each at least 1), the
// stop ids, as RunLimits reads them, and the tracked ids (K int64) with their logits [B, steps, K]
// float32 (written), as TrackedLogits reads them (the arrays kept here)
struct RunArgs {
  int64_t B = 0, S = 0;
  const int64_t* tokens = nullptr;
  int64_t* picks = nullptr;
  Int64Array counts, room, stops, ids;
  fastjudge::RunLimits limits;
  fastjudge::TrackedLogits tracked;

  RunArgs(const py::handle& token_array, const py::handle& count_array, const py::handle& pick_array,
          const py::handle& room_array, const py::handle& stop_array, const py::handle& id_array,
          const py::handle& tracked_array) {
    const py::array t = py::array::ensure(token_array), p = py::array::ensure(pick_array);
    if (!t || t.ndim() != 2) throw py::value_error("tokens must be [B, S]");
    B = t.shape(0), S = t.shape(1);
    if (!p || p.ndim() != 2 || p.shape(0) != B || p.shape(1) < 1) throw py::value_error("picks must be [B, steps]");
    tokens = typed_array<int64_t>(token_array, "tokens", {B, S});
    picks = typed_array<int64_t>(pick_array, "picks", {B, p.shape(1)}, true);
    counts = row_counts(count_array, B, S);
    room = as_int64_vector(room_array, "room"), stops = as_int64_vector(stop_array, "stops");
    if (room.shape(0) != B) throw py::value_error("room must have one entry per row");
    for (int64_t b = 0; b < B; ++b) {
      if (room.at(b) < 1) throw py::value_error("every row's room must be at least one token");
    }
    limits = {p.shape(1), room.data(), stops.data(), stops.shape(0)};
    ids = as_int64_vector(id_array, "tracked_ids");
    tracked = {ids.data(), ids.shape(0), typed_array<float>(tracked_array, "tracked", {B, limits.steps, ids.shape(0)},
                                                            true)};
  }
};

// Arrays a decoder binds once and keeps alive (a model's weights, its pool's buffers): each
// checked as it is taken
class BoundArrays {
 protected:
  const py::handle& keep(const py::handle& obj) {
    kept_.push_back(py::reinterpret_borrow<py::object>(obj));
    return obj;
  }

  // a projection's panels (W: float32, or bfloat16 input pairs) for `in` inputs and `out` outputs
  template <typename W>
  fastjudge::PackedWeight packed(const py::dict& layer, const char* key, int64_t in, int64_t out) {
    if (!layer.contains(key)) throw py::value_error(std::string("layer lacks ") + key);
    const py::handle panels = keep(layer[key]);
    const int64_t per_word = std::is_floating_point_v<W> ? 1 : 2, columns = fastjudge::kPanelColumns;
    return {typed_array<W>(panels, key, {(out + columns - 1) / columns, (in + per_word - 1) / per_word, columns}), in,
            out};
  }

  // a greedy pick's head: the final norm [d] float32 and the output projection's panels (as
  // dense_product takes them, bfloat16 input pairs where bf16) of `outputs` outputs, kept alive
  std::pair<const float*, fastjudge::PackedWeight> head(const py::handle& final_norm, const py::handle& panels,
                                                        int64_t d, int64_t outputs, bool bf16) {
    if (outputs < 1) throw py::value_error("the head needs at least one output");
    py::dict head;
    head["final_norm"] = final_norm, head["panels"] = panels;
    return {array<float>(head, "final_norm", {d}),
            bf16 ? packed<uint32_t>(head, "panels", d, outputs) : packed<float>(head, "panels", d, outputs)};
  }

  template <typename T>
  T* array(const py::dict& layer, const char* key, const std::vector<int64_t>& shape, bool writable = false) {
    if (!layer.contains(key)) throw py::value_error(std::string("layer lacks ") + key);
    return typed_array<T>(keep(layer[key]), key, shape, writable);
  }

  // step(dst) on out (`shape`, the model's type: bfloat16 bits or float32), alone()
  template <typename Step>
  void run_step(bool bf16, const py::handle& out, const std::vector<int64_t>& shape, Step step) {
    if (bf16) {
      uint16_t* dst = typed_array<uint16_t>(out, "out", shape, true);
      alone([&] { step(dst); });
    } else {
      float* dst = typed_array<float>(out, "out", shape, true);
      alone([&] { step(dst); });
    }
  }

  // run() without the GIL and one at a time (steps share the decoder's buffers); invalid_argument
  // becomes ValueError
  template <typename Run>
  void alone(Run run) {
    try {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(stepping_);
      run();
    } catch (const std::invalid_argument& e) {
      throw py::value_error(e.what());
    }
  }

 private:
  std::mutex stepping_;
  std::vector<py::object> kept_;
};

// A Qwen model's decoding step bound to its weights' panels and its state pool's buffers, which
// it keeps alive: a step then hands over its tokens alone (engine/qwen_step.hpp).
class QwenDecoder : BoundArrays {
 public:
  QwenDecoder(const py::dict& shape, const py::list& layers, const py::handle& embed, const py::handle& lengths,
              const py::handle& positions) {
    auto& m = model_;
    auto get = [&](const char* key) {
      if (!shape.contains(key)) throw py::value_error(std::string("shape lacks ") + key);
      return shape[key];
    };
    m.d = get("d").cast<int64_t>(), m.inner = get("inner").cast<int64_t>(), m.vocab = get("vocab").cast<int64_t>();
    m.H = get("heads").cast<int64_t>(), m.Hkv = get("kv_heads").cast<int64_t>(), m.hd = get("head_dim").cast<int64_t>();
    m.rotary_half = get("rotary_half").cast<int64_t>(), m.output_gate = get("output_gate").cast<bool>();
    m.lin_k_heads = get("lin_k_heads").cast<int64_t>(), m.lin_k_dim = get("lin_k_dim").cast<int64_t>();
    m.lin_v_heads = get("lin_v_heads").cast<int64_t>(), m.lin_v_dim = get("lin_v_dim").cast<int64_t>();
    m.conv_kernel = get("conv_kernel").cast<int64_t>(), m.eps = get("eps").cast<float>();
    m.l2_eps = get("l2_eps").cast<float>(), m.slots = get("slots").cast<int64_t>();
    m.capacity = get("capacity").cast<int64_t>();
    if (m.d < 1 || m.inner < 1 || m.vocab < 1 || m.slots < 1 || m.capacity < 1) {
      throw py::value_error("d, inner, vocab, slots and capacity must be positive");
    }
    const py::array table = py::array::ensure(embed);
    if (!table) throw py::value_error("embed must be an array [vocab, d]");
    bf16_ = (table.dtype().kind() == 'i' || table.dtype().kind() == 'u') && table.itemsize() == 2;
    if (bf16_) {
      if (!fastjudge::bf16_dense_available()) throw py::value_error("bfloat16 steps need AVX512-BF16");
      bind_layers<uint16_t, uint32_t>(layers, embed);
    } else {
      bind_layers<float, float>(layers, embed);
    }
    m.lengths = typed_array<int64_t>(keep(lengths), "lengths", {m.slots}, true);
    m.positions = typed_array<int64_t>(keep(positions), "positions", {m.slots}, true);
  }

  void set_rotary(const py::handle& cos, const py::handle& sin) {
    const py::array c = py::array::ensure(cos);
    if (!c || c.ndim() != 2) throw py::value_error("cos must be [positions, head_dim]");
    const int64_t P = c.shape(0);
    const void* cos_data = bf16_ ? static_cast<const void*>(typed_array<uint16_t>(cos, "cos", {P, model_.hd}))
                                 : typed_array<float>(cos, "cos", {P, model_.hd});
    const void* sin_data = bf16_ ? static_cast<const void*>(typed_array<uint16_t>(sin, "sin", {P, model_.hd}))
                                 : typed_array<float>(sin, "sin", {P, model_.hd});
    cos_ = py::reinterpret_borrow<py::object>(cos), sin_ = py::reinterpret_borrow<py::object>(sin);
    cos_data_ = cos_data, sin_data_ = sin_data, table_positions_ = P;
  }

  void step(const py::handle& tokens, const py::handle& counts, int64_t start, const py::handle& out, int threads,
            int64_t shared_columns, const py::handle& shared_from) {
    const py::array t = py::array::ensure(tokens);
    if (!t || t.ndim() != 2) throw py::value_error("tokens must be [B, S]");
    const int64_t B = t.shape(0), S = t.shape(1);
    const Int64Array rows = row_counts(counts, B, S);
    const Int64Array sources = shared_rows(shared_from, B);
    const fastjudge::QwenStepInput input{typed_array<int64_t>(tokens, "tokens", {B, S}), rows.data(), B, S, start,
                                         cos_data_, sin_data_, table_positions_, shared_columns,
                                         shared_from.is_none() ? nullptr : sources.data()};
    run_step(bf16_, out, {B, S, model_.d},
             [&](auto* dst) { fastjudge::qwen_decode_step(model_, input, dst, scratch_, threads); });
  }

  void set_head(const py::handle& final_norm, const py::handle& panels, int64_t outputs) {
    std::tie(model_.final_norm, model_.head) = head(final_norm, panels, model_.d, outputs, bf16_);
  }

  int64_t run_picks(const py::handle& tokens, const py::handle& counts, int64_t start, const py::handle& hidden,
                    const py::handle& picks, const py::handle& room, const py::handle& stops,
                    const py::handle& tracked_ids, const py::handle& tracked, int threads, int64_t shared_columns,
                    const py::handle& shared_from) {
    const RunArgs run(tokens, counts, picks, room, stops, tracked_ids, tracked);
    if (!model_.head.panels) throw py::value_error("the decoder has no head: set_head first");
    const Int64Array sources = shared_rows(shared_from, run.B);
    const fastjudge::QwenStepInput input{run.tokens, run.counts.data(), run.B, run.S, start, cos_data_, sin_data_,
                                         table_positions_, shared_columns,
                                         shared_from.is_none() ? nullptr : sources.data()};
    int64_t ran = 0;
    run_step(bf16_, hidden, {run.B, model_.d}, [&](auto* dst) {
      ran = fastjudge::qwen_decode_run(model_, input, run.limits, run.tracked, dst, run.picks, scratch_, threads);
    });
    return ran;
  }

 private:
  // a step's shared_from (int64 [B], each a row of the step), or an empty array for None
  static Int64Array shared_rows(const py::handle& shared_from, int64_t B) {
    if (shared_from.is_none()) return Int64Array();
    Int64Array sources = as_int64_vector(shared_from, "shared_from");
    if (sources.shape(0) != B) throw py::value_error("shared_from must have one entry per row");
    for (int64_t b = 0; b < B; ++b) {
      if (sources.at(b) < 0 || sources.at(b) >= B) throw py::value_error("shared_from must name rows of the step");
    }
    return sources;
  }

  template <typename T, typename W>
  void bind_layers(const py::list& layers, const py::handle& embed) {
    auto& m = model_;
    m.embed = typed_array<T>(keep(embed), "embed", {m.vocab, m.d});
    const int64_t H = m.H, Hkv = m.Hkv, hd = m.hd, Hv = m.lin_v_heads, dk = m.lin_k_dim, dv = m.lin_v_dim;
    const int64_t C = 2 * m.lin_k_heads * dk + Hv * dv, K = m.conv_kernel;
    for (const py::handle& item : layers) {
      const py::dict layer = py::reinterpret_borrow<py::dict>(item);
      fastjudge::QwenStepLayer l;
      l.attention = layer["attention"].cast<bool>();
      l.in_norm = array<float>(layer, "in_norm", {m.d});
      l.post_norm = array<float>(layer, "post_norm", {m.d});
      l.gate = packed<W>(layer, "gate", m.d, m.inner);
      l.up = packed<W>(layer, "up", m.d, m.inner);
      l.down = packed<W>(layer, "down", m.inner, m.d);
      if (l.attention) {
        if (H < 1 || Hkv < 1 || H % Hkv != 0 || hd % 16 != 0 || m.rotary_half < 0 ||
            2 * m.rotary_half > hd) {
          throw py::value_error("attention needs heads a multiple of kv_heads, head_dim a multiple of 16 and "
                                "rotary dims within it");
        }
        l.qkv = packed<W>(layer, "qkv", m.d, H * hd * (m.output_gate ? 2 : 1) + 2 * Hkv * hd);
        l.o = packed<W>(layer, "o", H * hd, m.d);
        l.qk_norm = array<float>(layer, "qk_norm", {H + Hkv, hd});
        l.keys = array<T>(layer, "keys", {m.slots, Hkv, m.capacity + 1, hd}, true);
        l.values = array<T>(layer, "values", {m.slots, Hkv, m.capacity + 1, hd}, true);
      } else {
        if (m.lin_k_heads < 1 || Hv % m.lin_k_heads != 0 || K < 1) {
          throw py::value_error("DeltaNet needs value heads a multiple of key heads and a conv kernel");
        }
        l.in_proj = packed<W>(layer, "in_proj", m.d, C + Hv * dv + 2 * Hv);
        l.out = packed<W>(layer, "out", Hv * dv, m.d);
        l.taps = array<T>(layer, "taps", {K, C});
        l.dt_bias = array<float>(layer, "dt_bias", {Hv});
        l.neg_A = array<float>(layer, "neg_A", {Hv});
        l.gated_norm = array<float>(layer, "gated_norm", {dv});
        l.conv_state = array<T>(layer, "conv_state", {m.slots, K - 1, C}, true);
        l.memory = array<float>(layer, "memory", {m.slots, Hv, dk, dv}, true);
      }
      m.layers.push_back(l);
    }
  }

  fastjudge::QwenStepModel model_;
  fastjudge::QwenStepScratch scratch_;
  py::object cos_, sin_;
  const void *cos_data_ = nullptr, *sin_data_ = nullptr;
  int64_t table_positions_ = 0;
  bool bf16_ = false;
};

// A T5 decoder's step bound to its weights' panels and its state pool's buffers, which it keeps
// alive: a step then hands over its tokens alone (engine/t5_step.hpp).
class T5Decoder : BoundArrays {
 public:
  T5Decoder(const py::dict& shape, const py::list& layers, const py::handle& embed, const py::handle& bias,
            const py::dict& pool) {
    auto& m = model_;
    auto get = [&](const py::dict& from, const char* key) {
      if (!from.contains(key)) throw py::value_error(std::string("missing ") + key);
      return from[key];
    };
    m.d = get(shape, "d").cast<int64_t>(), m.H = get(shape, "heads").cast<int64_t>();
    m.dk = get(shape, "d_kv").cast<int64_t>(), m.d_ff = get(shape, "d_ff").cast<int64_t>();
    m.vocab = get(shape, "vocab").cast<int64_t>(), m.eps = get(shape, "eps").cast<float>();
    m.activation = gate_activation(get(shape, "activation").cast<std::string>());
    m.slots = get(pool, "slots").cast<int64_t>(), m.capacity = get(pool, "capacity").cast<int64_t>();
    m.enc_capacity = get(pool, "enc_capacity").cast<int64_t>();
    m.cross_slots = get(pool, "cross_slots").cast<int64_t>();
    if (m.d < 1 || m.d % 16 || m.H < 1 || m.dk < 1 || m.dk % 16 || m.d_ff < 1 || m.vocab < 1 || m.slots < 1 ||
        m.capacity < 1 || m.enc_capacity < 1 || m.cross_slots < 0) {
      throw py::value_error("d and d_kv must be positive multiples of 16; heads, d_ff, vocab, slots and the "
                            "capacities positive");
    }
    const py::array table = py::array::ensure(embed);
    if (!table) throw py::value_error("embed must be an array [vocab, d]");
    bf16_ = (table.dtype().kind() == 'i' || table.dtype().kind() == 'u') && table.itemsize() == 2;
    if (bf16_) {
      if (!fastjudge::bf16_dense_available()) throw py::value_error("bfloat16 steps need AVX512-BF16");
      bind<uint16_t, uint32_t>(layers, embed, pool);
    } else {
      bind<float, float>(layers, embed, pool);
    }
    m.bias = typed_array<float>(keep(bias), "bias", {m.H, m.capacity + 1});
  }

  void step(const py::handle& tokens, const py::handle& counts, int64_t start, bool projected, const py::handle& out,
            int threads) {
    const py::array t = py::array::ensure(tokens);
    if (!t || t.ndim() != 2) throw py::value_error("tokens must be [B, S]");
    const int64_t B = t.shape(0), S = t.shape(1);
    const Int64Array rows = row_counts(counts, B, S);
    const fastjudge::T5StepInput input{typed_array<int64_t>(tokens, "tokens", {B, S}), rows.data(), B, S, start,
                                       projected};
    run_step(bf16_, out, {B, S, model_.d},
             [&](auto* dst) { fastjudge::t5_decode_step(model_, input, dst, scratch_, threads); });
  }

  void set_head(const py::handle& final_norm, const py::handle& panels, int64_t outputs, float scale) {
    std::tie(model_.final_norm, model_.head) = head(final_norm, panels, model_.d, outputs, bf16_);
    model_.head_scale = scale;
  }

  int64_t run_picks(const py::handle& tokens, const py::handle& counts, int64_t start, bool projected,
                    const py::handle& picks, const py::handle& room, const py::handle& stops,
                    const py::handle& tracked_ids, const py::handle& tracked, int threads) {
    const RunArgs run(tokens, counts, picks, room, stops, tracked_ids, tracked);
    if (!model_.head.panels) throw py::value_error("the decoder has no head: set_head first");
    const fastjudge::T5StepInput input{run.tokens, run.counts.data(), run.B, run.S, start, projected};
    int64_t ran = 0;
    alone([&] {
      ran = fastjudge::t5_decode_run(model_, input, run.limits, run.tracked, run.picks, bf16_, scratch_, threads);
    });
    return ran;
  }

 private:
  template <typename T, typename W>
  void bind(const py::list& layers, const py::handle& embed, const py::dict& pool) {
    auto& m = model_;
    const int64_t L = static_cast<int64_t>(py::len(layers)), H = m.H, dk = m.dk, inner = H * dk;
    m.embed = typed_array<T>(keep(embed), "embed", {m.vocab, m.d});
    m.mem = array<T>(pool, "mem", {m.slots, m.enc_capacity, m.d});
    m.kv = array<float>(pool, "kv", {m.slots, L, 2, H, m.capacity + 1, dk}, true);
    m.xkv = array<float>(pool, "xkv", {m.cross_slots, L, 2, H, m.enc_capacity, dk});
    m.enc_lengths = array<int64_t>(pool, "enc_lengths", {m.slots});
    m.dec_lengths = array<int64_t>(pool, "dec_lengths", {m.slots}, true);
    for (const py::handle& item : layers) {
      const py::dict layer = py::reinterpret_borrow<py::dict>(item);
      fastjudge::T5StepLayer l;
      l.norm = array<float>(layer, "norm", {m.d});
      l.x_norm = array<float>(layer, "x_norm", {m.d});
      l.ff_norm = array<float>(layer, "ff_norm", {m.d});
      l.qkv = packed<W>(layer, "qkv", m.d, 3 * inner);
      l.o = packed<W>(layer, "o", inner, m.d);
      l.x_q = packed<W>(layer, "x_q", m.d, inner);
      l.x_o = packed<W>(layer, "x_o", inner, m.d);
      l.gate = packed<W>(layer, "gate", m.d, m.d_ff);
      l.up = packed<W>(layer, "up", m.d, m.d_ff);
      l.down = packed<W>(layer, "down", m.d_ff, m.d);
      l.x_k = array<T>(layer, "x_k", {H, dk, m.d});
      l.x_v = array<T>(layer, "x_v", {H, dk, m.d});
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (fastjudge::reassociated_pairs_usable(dk, m.d)) {  // made once here, not at every step
          key_pairs_.emplace_back(static_cast<std::size_t>(H * dk / 2 * m.d));
          fastjudge::pair_key_weights(static_cast<const uint16_t*>(l.x_k), H, dk, m.d, key_pairs_.back().data());
          l.x_k_pairs = key_pairs_.back().data();
        }
      }
      m.layers.push_back(l);
    }
  }

  fastjudge::T5StepModel model_;
  std::deque<std::vector<uint32_t>> key_pairs_;  // the layers' x_k_pairs (a deque: they never move)
  fastjudge::T5StepScratch scratch_;
  bool bf16_ = false;
};

void bind_t5_step(py::module_& m) {
  py::class_<T5Decoder>(m, "T5Decoder", R"doc(A T5 decoder's step as one engine call on the CPU, bound to its
weights (the engine's panels, as dense_product takes them) and its state pool's buffers (read
and written in place; the decoder keeps every array it was given alive).

shape: dict of d, heads, d_kv, d_ff, vocab, eps, activation (the gate's: silu, gelu_tanh or
relu). layers: one dict a layer: norm, x_norm, ff_norm ([d] float32), qkv, o, x_q, x_o, gate, up,
down (panels), x_k, x_v [heads, d_kv, d] (the cross-attention's key and value weights).
embed [vocab, d]: float32, or bfloat16 as 16-bit integers (the model's type, which every panel,
x_k, x_v and mem share). bias [heads, capacity + 1] float32: the self-attention's bias of a key
n positions before its query. pool: dict of slots, capacity, enc_capacity, cross_slots, mem
[slots, enc_capacity, d], kv [slots, layers, 2, heads, capacity + 1, d_kv] float32, xkv
[cross_slots, layers, 2, heads, enc_capacity, d_kv] float32, enc_lengths and dec_lengths int64
[slots].)doc")
      .def(py::init<const py::dict&, const py::list&, const py::handle&, const py::handle&, const py::dict&>(),
           py::arg("shape"), py::arg("layers"), py::arg("embed"), py::arg("bias"), py::arg("pool"))
      .def("step", &T5Decoder::step, py::arg("tokens"), py::arg("counts"), py::arg("start"), py::arg("projected"),
           py::arg("out"), py::arg("threads") = 1,
           R"doc(One step of tokens [B, S] int64 (at most 4 a row; row b: counts[b] real tokens, then padding)
on slots start .. start + B - 1, the cross-attention per head over xkv when projected, else
reassociated over mem: writes out [B, S, d] (the last layer's output, before the final norm),
each layer's K/V for the real tokens, and advances dec_lengths by counts. Raises ValueError,
before writing anything, on tokens outside the vocabulary, rows past the slots, positions past
the capacity or encoder lengths outside [1, enc_capacity].)doc")
      .def("set_head", &T5Decoder::set_head, py::arg("final_norm"), py::arg("panels"), py::arg("outputs"),
           py::arg("scale"),
           R"doc(The head run_picks runs: the final norm [d] float32, the factor its output takes before the
head, and the output projection's panels (as dense_product takes them) of `outputs` outputs
(kept alive).)doc")
      .def("run_picks", &T5Decoder::run_picks, py::arg("tokens"), py::arg("counts"), py::arg("start"),
           py::arg("projected"), py::arg("picks"), py::arg("room"), py::arg("stops"), py::arg("tracked_ids"),
           py::arg("tracked"), py::arg("threads") = 1,
           R"doc(greedy decoding's steps back to back in one call, and how many ran. Each is step, then each
row's pick from its last real token's output: column s of picks [B, steps] int64 the index of the
largest of its logits at step s (final norm, scale and head in the model's type; the first of
equal ones, the first NaN, as torch's argmax), and tracked [B, steps, K] float32 the logits of
tracked_ids (K int64). The first step feeds tokens, each later one the picks of the step before,
until steps have run or a row ends: it picked one of stops (int64) or room[b] (each at least 1)
tokens. Raises ValueError as step does (the steps before have run), on a tracked id past the
head, or where no head was set.)doc");
}

void bind_qwen_step(py::module_& m) {
  py::class_<QwenDecoder>(m, "QwenDecoder", R"doc(A Qwen model's decoding step as one engine call on the CPU,
bound to its weights (the engine's panels, as dense_product takes them) and its state pool's
buffers (read and written in place; the decoder keeps every array it was given alive).

shape: dict of d, inner, vocab, heads, kv_heads, head_dim, rotary_half, output_gate,
lin_k_heads, lin_k_dim, lin_v_heads, lin_v_dim, conv_kernel, eps, l2_eps, slots, capacity.
layers: one dict a layer: attention (bool), in_norm, post_norm ([d] float32), gate, up, down
(panels); attention: qkv, o (panels), qk_norm [heads + kv_heads, head_dim] float32, keys,
values [slots, kv_heads, capacity + 1, head_dim]; DeltaNet: in_proj, out (panels), taps
[kernel, C], dt_bias, neg_A [value heads] and gated_norm [value dim] float32, conv_state
[slots, kernel - 1, C], memory [slots, value heads, key dim, value dim] float32.
embed [vocab, d]: float32, or bfloat16 as 16-bit integers (the model's type, which every
panel, taps, K/V and conv state share). lengths, positions: the pool's int64 [slots].)doc")
      .def(py::init<const py::dict&, const py::list&, const py::handle&, const py::handle&, const py::handle&>(),
           py::arg("shape"), py::arg("layers"), py::arg("embed"), py::arg("lengths"), py::arg("positions"))
      .def("set_rotary", &QwenDecoder::set_rotary, py::arg("cos"), py::arg("sin"),
           R"doc(The rotary tables cos, sin [positions, head_dim] in the model's type (kept alive).)doc")
      .def("step", &QwenDecoder::step, py::arg("tokens"), py::arg("counts"), py::arg("start"), py::arg("out"),
           py::arg("threads") = 1, py::arg("shared_columns") = 0, py::arg("shared_from") = py::none(),
           R"doc(One step of tokens [B, S] int64 (row b: counts[b] real tokens, then padding) on slots
start .. start + B - 1: writes out [B, S, d] (the last layer's output, before the final norm),
each layer's state for the real tokens, and advances lengths and positions by counts.
shared_from (int64 [B], rows of the step; None: each row reads its own keys), with
shared_columns: rows whose first shared_columns keys and values are the same in every attention
layer (loaded from one prefix snapshot) read them from row shared_from[b], each block once for
all the rows that share it (causal_attention's shared_from: the same bits). Raises ValueError,
before writing anything, on tokens outside the vocabulary, rows past the slots, keys past the
capacity or positions past the rotary tables.)doc")
      .def("set_head", &QwenDecoder::set_head, py::arg("final_norm"), py::arg("panels"), py::arg("outputs"),
           R"doc(The head run_picks runs: the final norm [d] float32 and the output projection's panels
(as dense_product takes them) of `outputs` outputs (kept alive).)doc")
      .def("run_picks", &QwenDecoder::run_picks, py::arg("tokens"), py::arg("counts"), py::arg("start"),
           py::arg("hidden"), py::arg("picks"), py::arg("room"), py::arg("stops"), py::arg("tracked_ids"),
           py::arg("tracked"), py::arg("threads") = 1, py::arg("shared_columns") = 0,
           py::arg("shared_from") = py::none(),
           R"doc(greedy decoding's steps back to back in one call, and how many ran. Each is step, then
greedy decoding's pick: hidden [B, d] gets each row's last real token's output (before the final
norm; the last column where counts[b] is 0), column s of picks [B, steps] int64 the index of the
largest of that row's logits at step s (final norm and head in the model's type; the first of
equal ones, the first NaN, as torch's argmax), and tracked [B, steps, K] float32 the logits of
tracked_ids (K int64). The first step feeds tokens, each later one the picks of the step before,
until steps have run or a row ends: it picked one of stops (int64) or room[b] (each at least 1)
tokens. Raises ValueError as step does (the steps before have run), on a tracked id past the
head, or where no head was set.)doc");
}
}  // namespace

PYBIND11_MODULE(_engine, m) {
  m.doc() = "fastjudge host-side engine (C++): batch planning, prefix index, delta-rule, attention and projection kernels.";
  bind_planner(m);
  bind_prefix_index(m);
  bind_triangular(m);
  bind_delta_rule(m);
  bind_causal_attention(m);
  bind_dense(m);
  bind_rms_norm(m);
  bind_attention_inputs(m);
  bind_rotate_halves(m);
  bind_qwen_step(m);
  bind_t5_step(m);
  bind_cpu_threads(m);
}
