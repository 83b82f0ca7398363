// The Status -> exception translator of pdlink._core and the setter that gives it its classes
// (status_bridge.h).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <exception>

#include "bindings/bindings.h"
#include "bindings/status_bridge.h"

namespace py = pybind11;

namespace pdlink::bindings {
namespace {

// {code: (exception class, status_code value)} as _register_errors last received it: a new
// reference, never released (the translator may run until the interpreter is gone).
PyObject* g_errors = nullptr;

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
  const std::string& text = st.message();
  // Peers' messages are bytes off the wire: undecodable ones are replaced, never an error of their own.
  py::str message = py::reinterpret_steal<py::str>(
      PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace"));
  if (!message) throw py::error_already_set();
  PyObject* entry = errorEntry(st.code());
  if (entry == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    PyErr_SetString(PyExc_RuntimeError, st.toString().c_str());
    return;
  }
  py::tuple pair = py::reinterpret_borrow<py::tuple>(entry);
  py::object cls = pair[0];
  py::object error = cls(message, py::arg("status_code") = pair[1]);
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

}  // namespace

void bindStatus(py::module_& m) {
  py::register_exception_translator(&translate);
  // pdlink.native calls it once, with pdlink.status.native_errors(): the class each code raises.
  m.def("_register_errors", &registerErrors, py::arg("errors"));
}

}  // namespace pdlink::bindings
