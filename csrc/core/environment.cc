// The one reader of the core's PDLINK_* variables (environment.h).
#include "core/environment.h"

#include <cstdlib>

namespace pdlink::environment {

const Variable kLogLevel{"PDLINK_LOG_LEVEL", "the C++ core's log level on stderr: error, warn, info or debug", "warn",
                         false};
const Variable kUcxLibDir{"PDLINK_UCX_LIB_DIR",
                          "a directory holding libucp.so.0; unset: the libucx wheel's, then the loader path", nullptr,
                          false};
// No fallback text: unset means UCX's RDMA families (ucx::autoFamilies), empty means none.
const Variable kUcxAutoTransports{
    "PDLINK_UCX_AUTO_TRANSPORTS",
    "UCX transport families (comma list) that make auto pick ucx between hosts; unset: rc,dc,ud,srd; empty: none",
    nullptr, true};
const Variable kLibcrypto{"PDLINK_LIBCRYPTO",
                          "the libcrypto to load for link secrets; unset: libcrypto.so.3, then libcrypto.so", nullptr,
                          false};
const Variable kAscendLibDir{
    "PDLINK_ASCEND_LIB_DIR",
    "CANN's lib64 directory; unset: $ASCEND_HOME_PATH, $ASCEND_TOOLKIT_HOME, then the loader path", nullptr, false};

const Variable* const kVariables[5] = {&kLogLevel, &kUcxLibDir, &kUcxAutoTransports, &kLibcrypto, &kAscendLibDir};

std::optional<std::string> read(const Variable& variable) {
  const char* value = std::getenv(variable.name);
  if (value != nullptr && (*value != '\0' || variable.empty_is_value)) return std::string(value);
  if (variable.fallback != nullptr) return std::string(variable.fallback);
  return std::nullopt;
}

}  // namespace pdlink::environment
