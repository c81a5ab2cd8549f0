// The one pybind11 module for the host-side engine: fastjudge._engine.
//
// Each engine component gets a bind_<component>(m) function below and one call in
// PYBIND11_MODULE; the shared numpy conversion helpers sit at the top. Arrays cross the
// boundary whole (numpy in, numpy out) so no per-element Python objects are ever created,
// and the GIL is released while C++ works.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "planner.hpp"

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

}  // namespace

PYBIND11_MODULE(_engine, m) {
  m.doc() = "fastjudge host-side engine (C++): batch planning.";
  bind_planner(m);
}
