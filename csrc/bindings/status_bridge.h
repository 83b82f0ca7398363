// The single place where a core Status becomes a Python exception.
//
// Bound functions call throwIfError(status) or valueOrThrow(result); the translator that
// bindStatus() registers (bind_status.cc) raises, for the resulting StatusError, an instance of the
// exception class registered for the Status's code, built from the Status alone:
// `cls(status.message(), status_code=<registered code object>)`. The classes come from Python, once:
// pdlink.native calls `_core._register_errors(pdlink.status.native_errors())` when it loads the
// module (C++ imports no module of the package). Before that registration (a `_core` imported by
// itself) a failed Status raises RuntimeError("LLM_NAME: message").
//
// The exception also carries the Status's scope as `.scope` (a _core.Scope, core/status.h), set on
// the instance after construction. A failure that is returned rather than raised (link, unlink:
// one per peer) is a LinkResult (bindings.h), whose check() raises exactly as the translator does.
//
// The message is the engine's own ("no link to cluster 5; connect first"); whatever an API on top
// adds (llm_datadist's "<op> failed, error code is <LLMStatusCode.X>, <detail>.") is that layer's
// (python/pdlink/compat/llm_datadist/_utils.py raising_as).
// Requires the GIL only inside the translator (pybind11 calls it with the GIL held).
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <string>
#include <utility>

#include "core/status.h"

namespace pdlink::bindings {

class StatusError : public std::exception {
 public:
  explicit StatusError(Status st) : status_(std::move(st)) {}
  const char* what() const noexcept override { return status_.message().c_str(); }
  const Status& status() const { return status_; }

 private:
  Status status_;
};

inline void throwIfError(const Status& st) {
  if (!st.ok()) throw StatusError(st);
}

template <class T>
T valueOrThrow(Result<T> r) {
  if (!r.ok()) throw StatusError(r.status());
  return std::move(r).value();
}

// The code object registered for `code` (its LLMStatusCode member, from _register_errors), else
// the plain int (before any registration, or for a code the table lacks). Requires the GIL.
pybind11::object codeObject(Code code);
// `text` as str, undecodable bytes replaced (peers' messages are bytes off the wire, never an
// error of their own). Requires the GIL.
pybind11::str messageText(const std::string& text);

}  // namespace pdlink::bindings
