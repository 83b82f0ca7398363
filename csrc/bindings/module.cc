// pdlink._core: registration of the native engine for the Python layer (python/pdlink).
// The module mirrors the C++ engine and makes no policy decisions; argument validation that
// llm_datadist performs in Python stays in Python. Every call that may block releases the GIL.
// Each group of types is bound in its own file (bindings.h); this one only calls them, in order.
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  m.doc() = "pdlink native engine (C++ core; CPU and Ascend backends; TCP, same-host and HCCL transports)";
  pdlink::bindings::bindStatus(m);
  pdlink::bindings::bindConstants(m);
  pdlink::bindings::bindTypes(m);
  pdlink::bindings::bindBackend(m);
  pdlink::bindings::bindTransfers(m);
  pdlink::bindings::bindEngine(m);
}
