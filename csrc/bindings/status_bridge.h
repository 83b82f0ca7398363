// The single place where a core Status becomes a Python exception.
//
// Bound functions call throwIfError(status, "pull_blocks"); the translator registered by
// registerStatusTranslator() turns the resulting StatusError into the pdlink.Engine exception for
// its code (pdlink.status.native_exception: an LLMException subclass such as InvalidArgument, or
// LLMException itself), with `status_code` set from the numeric code and the message formatted as
// llm_datadist does: "<op> failed, error code is <LLMStatusCode.X>, <detail>.". The llm_datadist
// layer turns these into plain LLMException (pdlink.status.as_llm_exception).
// Requires the GIL only inside the translator (pybind11 calls it with the GIL held).
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <string>

#include "core/status.h"

namespace pdlink::bindings {

class StatusError : public std::exception {
 public:
  StatusError(Status st, std::string op) : status_(std::move(st)), op_(std::move(op)) {}
  const char* what() const noexcept override { return status_.message().c_str(); }
  const Status& status() const { return status_; }
  const std::string& op() const { return op_; }

 private:
  Status status_;
  std::string op_;
};

inline void throwIfError(const Status& st, const char* op) {
  if (!st.ok()) throw StatusError(st, op);
}

template <class T>
T valueOrThrow(Result<T> r, const char* op) {
  if (!r.ok()) throw StatusError(r.status(), op);
  return std::move(r).value();
}

inline void registerStatusTranslator() {
  pybind11::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      namespace py = pybind11;
      py::module_ status = py::module_::import("pdlink.status");
      py::object exc =
          status.attr("native_exception")(static_cast<uint32_t>(e.status().code()), e.op(), e.status().message());
      PyErr_SetObject(status.attr("LLMException").ptr(), exc.ptr());
    }
  });
}

}  // namespace pdlink::bindings
