// Environment: every PDLINK_* variable the C++ core reads, in one table, and the one function that
// reads them.
//
// The Python layer reads its own variables (pdlink.environment: transport, backend, link secret,
// limits, ...) and passes them to the core as options; the core reads only the variables that
// decide what it loads and how loudly it logs, which must work before (and without) any Python
// option. The table is bound once as pdlink._core.NATIVE_VARIABLES, so pdlink.environment lists
// every variable of both layers without re-typing a name.
// Threading: the table is immutable; read() calls getenv, which is safe as long as nothing calls
// setenv concurrently (pdlink never does).
#pragma once

#include <optional>
#include <string>

namespace pdlink::environment {

struct Variable {
  const char* name;
  const char* meaning;
  const char* fallback;  // the value when unset (or empty, unless empty_is_value); nullptr: no value
  bool empty_is_value;   // an empty setting is a value of its own ("" lists nothing), not "unset"
};

// error, warn, info or debug: the level of what the core writes to stderr (core/log.h).
extern const Variable kLogLevel;
// A directory holding libucp.so.0 (docs/ucx.md); unset: the libucx wheel's, then the loader path.
extern const Variable kUcxLibDir;
// UCX transport families (comma-separated) that make `auto` pick ucx between hosts (docs/ucx.md);
// unset: UCX's RDMA families; empty: none.
extern const Variable kUcxAutoTransports;
// The libcrypto to load for link secrets (docs/security.md); unset: libcrypto.so.3, then libcrypto.so.
extern const Variable kLibcrypto;
// CANN's lib64 directory (docs/ascend.md); unset: $ASCEND_HOME_PATH, $ASCEND_TOOLKIT_HOME, loader path.
extern const Variable kAscendLibDir;

// Every variable above, in that order.
extern const Variable* const kVariables[5];

// The variable's text, or its fallback when it is unset or (unless empty_is_value) empty; nullopt
// when there is no fallback.
std::optional<std::string> read(const Variable& variable);

}  // namespace pdlink::environment
