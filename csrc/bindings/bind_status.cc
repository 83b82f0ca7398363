// The Status -> exception translator of pdlink._core and the setter that gives it its classes
// (status_bridge.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>

#include "bindings/bindings.h"
#include "bindings/status_bridge.h"

namespace py = pybind11;

namespace pdlink::bindings {
namespace {

// {code: (exception class, status_code value)} as _register_errors last received it: a new
// reference, never released (the translator may run until the interpreter is gone).
PyObject* g_errors = nullptr;

// The key under which _register_errors may give the class of a transfer stopped at a cancel point
// (Status::cancelled: pdlink.TransferCancelled), raised as cls(message).
constexpr int64_t kCancelledKey = -1;

// The registered (class, status_code) for a code, else the one for kFailed; null before any
// registration. A borrowed reference.
PyObject* errorEntry(Code code) {
  if (g_errors == nullptr) return nullptr;
  for (uint32_t key : {static_cast<uint32_t>(code), static_cast<uint32_t>(Code::kFailed)}) {
    py::int_ k(key);
    PyObject* entry = PyDict_GetItemWithError(g_errors, k.ptr());
    if (entry != nullptr || PyErr_Occurred()) return entry;
  }
  return nullptr;
}

// Sets the Python error for a failed Status. A Python error while building it (a class whose
// constructor raised) propagates as error_already_set, which pybind11 then restores.
void raiseStatus(const Status& st) {
  py::str message = messageText(st.message());
  if (st.cancelled() && g_errors != nullptr) {
    py::int_ k(kCancelledKey);
    PyObject* entry = PyDict_GetItemWithError(g_errors, k.ptr());
    if (entry == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (entry != nullptr) {
      py::object cls = py::reinterpret_borrow<py::tuple>(entry)[0];
      py::object error = cls(message);
      PyErr_SetObject(cls.ptr(), error.ptr());
      return;
    }
  }
  PyObject* entry = errorEntry(st.code());
  if (entry == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    PyErr_SetString(PyExc_RuntimeError, st.toString().c_str());
    return;
  }
  py::tuple pair = py::reinterpret_borrow<py::tuple>(entry);
  py::object cls = pair[0];
  py::object error = cls(message, py::arg("status_code") = pair[1]);
  error.attr("scope") = py::cast(st.scope());
  PyErr_SetObject(cls.ptr(), error.ptr());
}

void translate(std::exception_ptr p) {
  if (!p) return;
  try {
    std::rethrow_exception(p);
  } catch (const StatusError& e) {
    raiseStatus(e.status());
  }
}

void registerErrors(const py::object& errors) {
  py::dict table(errors);  // a copy when errors is another mapping; copied below when it is a dict
  for (auto [code, entry] : table) {
    if (!py::isinstance<py::int_>(code) || !py::isinstance<py::tuple>(entry) || py::len(entry) != 2 ||
        !PyExceptionClass_Check(entry[py::int_(0)].ptr())) {
      throw py::type_error("_register_errors takes {code: (exception class, status_code)}");
    }
  }
  PyObject* copy = PyDict_Copy(table.ptr());
  if (copy == nullptr) throw py::error_already_set();
  Py_XDECREF(g_errors);
  g_errors = copy;
}

std::string reprOf(const LinkResult& r) {
  std::string s = std::string("LinkResult(") + codeName(r.status.code()) + ", scope=" + scopeName(r.status.scope()) +
                  ", peer_cluster_id=" + std::to_string(r.peer_cluster_id);
  std::string message = py::repr(messageText(r.status.message()));
  return s + ", message=" + message + ")";
}

}  // namespace

py::object codeObject(Code code) {
  if (g_errors != nullptr) {
    py::int_ key(static_cast<uint32_t>(code));
    PyObject* entry = PyDict_GetItemWithError(g_errors, key.ptr());
    if (entry == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (entry != nullptr) return py::reinterpret_borrow<py::tuple>(entry)[1];
  }
  return py::int_(static_cast<uint32_t>(code));
}

py::str messageText(const std::string& text) {
  py::str message = py::reinterpret_steal<py::str>(
      PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace"));
  if (!message) throw py::error_already_set();
  return message;
}

void bindStatus(py::module_& m) {
  py::register_exception_translator(&translate);
  // pdlink.native calls it once, with pdlink.status.native_errors(): the class each code raises.
  m.def("_register_errors", &registerErrors, py::arg("errors"));
  m.attr("CANCELLED_ERROR_KEY") = kCancelledKey;  // the key of TransferCancelled's entry in that table
  // pdlink's own codes (core/status.h), which pdlink.LLMStatusCode names.
  m.attr("LLM_STALE_EPOCH") = static_cast<uint32_t>(Code::kStaleEpoch);
  m.attr("LLM_ROLE_SWITCHING") = static_cast<uint32_t>(Code::kRoleSwitching);
  m.attr("LLM_OFFER_RELEASED") = static_cast<uint32_t>(Code::kOfferReleased);
  py::enum_<Scope>(m, "Scope", "What a failure concerns (core/status.h): the call, one link, or the engine.")
      .value("CALL", Scope::kCall)
      .value("LINK", Scope::kLink)
      .value("ENGINE", Scope::kEngine);
  py::class_<LinkResult>(m, "LinkResult")
      // For layers that report a per-peer failure of their own beside the engine's (llm_datadist's
      // per-cluster checks): `scope` None is the code's default scope.
      .def(py::init(
               [](uint32_t status, const std::string& message, uint64_t peer_cluster_id, std::optional<Scope> scope) {
                 auto code = static_cast<Code>(status);
                 if (!isKnownCode(status)) throw py::value_error("unknown status code " + std::to_string(status));
                 return LinkResult{Status(code, scope.value_or(defaultScope(code)), message), peer_cluster_id};
               }),
           py::arg("status"), py::arg("message"), py::arg("peer_cluster_id"), py::arg("scope") = py::none())
      .def_property_readonly("status", [](const LinkResult& r) { return codeObject(r.status.code()); })
      .def_property_readonly("message", [](const LinkResult& r) { return messageText(r.status.message()); })
      .def_property_readonly("scope", [](const LinkResult& r) { return r.status.scope(); })
      .def_property_readonly("peer_cluster_id", [](const LinkResult& r) { return r.peer_cluster_id; })
      .def_property_readonly("ok", [](const LinkResult& r) { return r.status.ok(); })
      .def("check", [](const LinkResult& r) { throwIfError(r.status); })
      .def("__repr__", &reprOf);
}

}  // namespace pdlink::bindings
