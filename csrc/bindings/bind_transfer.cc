// pdlink._core's prepared transfers and descriptor lists (engine/engine.h PreparedTransfer, and
// TransferSpec kExplicit to one peer): their index and descriptor arrays are read without one
// Python object per element. Each post releases the GIL while the engine works.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "bindings/bindings.h"
#include "bindings/status_bridge.h"
#include "core/spans.h"
#include "transport/wire.h"

namespace py = pybind11;

namespace pdlink::bindings {
namespace {

size_t length1d(const py::array& a, const char* name) {
  if (a.ndim() != 1) throw py::value_error(std::string(name) + " must be one-dimensional");
  return static_cast<size_t>(a.shape(0));
}

// Integers as T (int64_t: block indices; uint64_t: addresses and lengths): a Python list is read
// directly (the common short list, without a numpy conversion) and must hold ints only (not bools:
// TypeError, as for an int outside T), anything else goes through a numpy array of T.
template <typename T>
class Ints {
 public:
  using Array = py::array_t<T, py::array::c_style | py::array::forcecast>;
  Ints(py::handle obj, const char* name) {
    if (PyList_CheckExact(obj.ptr())) {
      const size_t n = static_cast<size_t>(PyList_GET_SIZE(obj.ptr()));
      T* out = inline_;
      if (n > kInline) {
        list_.resize(n);
        out = list_.data();
      }
      for (size_t i = 0; i < n; ++i) {
        PyObject* item = PyList_GET_ITEM(obj.ptr(), static_cast<Py_ssize_t>(i));
        if (!PyLong_CheckExact(item) || !read(item, &out[i])) {
          throw py::type_error(std::string(name) + " must be a list of ints within " +
                               (std::is_signed_v<T> ? "int64" : "uint64"));
        }
      }
      data_ = out;
      size_ = n;
    } else {
      // Already T and C-contiguous: borrowed, no conversion call; anything else converted once.
      Array a = Array::check_(obj) ? py::reinterpret_borrow<Array>(obj) : Array::ensure(obj);
      if (!a) throw py::error_already_set();
      size_ = length1d(a, name);
      data_ = a.data();
      keep_ = std::move(a);
    }
  }
  const T* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  static bool read(PyObject* item, T* out) {
    if constexpr (std::is_signed_v<T>) {
      int overflow = 0;
      *out = PyLong_AsLongLongAndOverflow(item, &overflow);
      return overflow == 0;
    } else {
      *out = PyLong_AsUnsignedLongLong(item);
      if (*out == static_cast<T>(-1) && PyErr_Occurred()) {
        PyErr_Clear();  // negative, or past 2**64
        return false;
      }
      return true;
    }
  }
  // A short list is read into inline_ (no allocation), a longer one into list_.
  static constexpr size_t kInline = 8;
  T inline_[kInline];
  std::vector<T> list_;
  // The array data_ points into. Not an Array member: a default-constructed array_t allocates an
  // empty numpy array, which cost more than the rest of a small post.
  py::object keep_;
  const T* data_ = nullptr;
  size_t size_ = 0;
};
using Indices = Ints<int64_t>;

}  // namespace

void BoundPrepared::post(py::handle local, py::handle remote, bool is_push, const CancelToken* cancel) {
  const Indices l(local, "local blocks"), r(remote, "remote blocks");
  const uint32_t ratio = prepared->mapping.block_ratio;
  if (r.size() != l.size() * ratio) {
    throw py::value_error(ratio == 1 ? std::string("local and remote block arrays differ in length")
                                     : "block_ratio " + std::to_string(ratio) + ": " + std::to_string(l.size()) +
                                           " local blocks need " + std::to_string(l.size() * ratio) +
                                           " remote blocks, got " + std::to_string(r.size()));
  }
  Status st;
  {
    py::gil_scoped_release unlocked;
    st = engine->post(*prepared, l.data(), r.data(), l.size(), is_push, cancel);
  }
  throwIfError(st);
}

void BoundBatch::move(py::handle local, py::handle remote, py::handle lengths, bool is_push, int64_t timeout_ms,
                      const CancelToken* cancel) const {
  const Ints<uint64_t> lo(local, "local addresses"), ro(remote, "remote addresses"), len(lengths, "lengths");
  const size_t n = lo.size();
  if (ro.size() != n || len.size() != n) throw py::value_error("descriptor arrays differ in length");
  if (timeout_ms < 0 || timeout_ms >= (int64_t{1} << 31)) {
    throw py::value_error("timeout_ms must be 0 (the engine's timeout) or a positive int32");
  }
  // Reused per thread (its vectors keep their capacity): a short list allocates nothing.
  thread_local TransferSpec s;
  s = spec;
  if (timeout_ms > 0) s.timeout_ms = timeout_ms;
  s.cancel = cancel;
  s.local_runs.resize(n);
  s.remote_runs.resize(n);
  for (size_t i = 0; i < n; ++i) {
    s.local_runs[i] = {lo.data()[i], len.data()[i]};
    s.remote_runs[i] = {ro.data()[i], len.data()[i]};
  }
  Status st;
  {
    py::gil_scoped_release unlocked;
    st = is_push ? engine->push(s) : engine->pull(s);
  }
  throwIfError(st);
}

void bindTransfers(py::module_& m) {
  // MemoryMap.covers: core/spans.h's rule, each range on its own (no request bound on the steps).
  m.def(
      "covers",
      [](std::vector<std::pair<uint64_t, uint64_t>> ranges, const std::vector<uint64_t>& addresses,
         const std::vector<uint64_t>& lengths) {
        if (addresses.size() != lengths.size()) throw py::value_error("addresses and lengths differ in length");
        std::vector<wire::Run> sorted, runs;
        for (const auto& [offset, length] : ranges) sorted.push_back({offset, length});
        std::sort(sorted.begin(), sorted.end(),
                  [](const wire::Run& a, const wire::Run& b) { return a.offset < b.offset; });
        for (size_t i = 0; i < addresses.size(); ++i) runs.push_back({addresses[i], lengths[i]});
        return spans::covers(sorted, runs, UINT64_MAX);
      },
      py::arg("ranges"), py::arg("addresses"), py::arg("lengths"));

  // A transfer's cancel token (core/cancel.h), passed to a read or write as `cancel=`.
  py::class_<CancelToken, std::shared_ptr<CancelToken>>(m, "CancelToken")
      .def(py::init<>())
      .def("cancel", &CancelToken::cancel,
           "True: the transfer will end cancelled; False: it had already finished. Never blocks.")
      .def("finish", &CancelToken::finish,
           "The transfer is over: True when it finished before any cancel, False when it was cancelled.")
      .def_property_readonly("cancelled",
                             [](const CancelToken& t) { return t.state() == CancelToken::State::kCancelled; })
      .def_property_readonly("finished",
                             [](const CancelToken& t) { return t.state() == CancelToken::State::kFinished; });

  // A prepared transfer (engine/engine.h PreparedTransfer), posted with int64 block-index arrays.
  py::class_<BoundPrepared>(m, "PreparedTransfer")
      .def(
          "post",
          [](BoundPrepared& b, py::handle l, py::handle r, bool push, const CancelToken* cancel) {
            b.post(l, r, push, cancel);
          },
          py::arg("local"), py::arg("remote"), py::arg("push"), py::arg("cancel") = nullptr)
      .def(
          "read",
          [](BoundPrepared& b, py::handle l, py::handle r, const CancelToken* cancel) { b.post(l, r, false, cancel); },
          py::arg("local"), py::arg("remote"), py::arg("cancel") = nullptr)
      .def(
          "write",
          [](BoundPrepared& b, py::handle l, py::handle r, const CancelToken* cancel) { b.post(l, r, true, cancel); },
          py::arg("local"), py::arg("remote"), py::arg("cancel") = nullptr)
      .def_property_readonly("block_size", [](const BoundPrepared& b) { return b.prepared->block_size; })
      .def_property_readonly("mapping", [](const BoundPrepared& b) { return b.prepared->mapping; })
      .def_property_readonly("local_blocks", [](const BoundPrepared& b) { return b.prepared->local_blocks; })
      .def_property_readonly("remote_blocks", [](const BoundPrepared& b) { return b.prepared->remote_blocks; })
      .def_property_readonly("peer_cluster_id", [](const BoundPrepared& b) { return b.prepared->peer_cluster_id; });

  py::class_<BoundBatch>(m, "BatchTransfer")
      .def(
          "read",
          [](const BoundBatch& b, py::handle l, py::handle r, py::handle n, int64_t timeout_ms,
             const CancelToken* cancel) { b.move(l, r, n, false, timeout_ms, cancel); },
          py::arg("local_addresses"), py::arg("remote_addresses"), py::arg("lengths"), py::arg("timeout_ms") = 0,
          py::arg("cancel") = nullptr)
      .def(
          "write",
          [](const BoundBatch& b, py::handle l, py::handle r, py::handle n, int64_t timeout_ms,
             const CancelToken* cancel) { b.move(l, r, n, true, timeout_ms, cancel); },
          py::arg("local_addresses"), py::arg("remote_addresses"), py::arg("lengths"), py::arg("timeout_ms") = 0,
          py::arg("cancel") = nullptr)
      .def_property_readonly("peer_cluster_id", [](const BoundBatch& b) { return b.spec.peer_cluster_id; });
}

}  // namespace pdlink::bindings
