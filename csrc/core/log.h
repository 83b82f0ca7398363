// Minimal leveled logging to stderr.
//
// The level comes from the environment variable PDLINK_LOG_LEVEL (error, warn, info, debug;
// default warn), read once. Logging is thread-safe: each line is formatted first, then written with
// one write(2), so lines from different threads never interleave.
#pragma once

#include <sstream>

namespace pdlink {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

bool logEnabled(LogLevel level);
void logLine(LogLevel level, const std::string& line);

}  // namespace pdlink

#define PDLINK_LOG(level, expr)                                \
  do {                                                         \
    if (::pdlink::logEnabled(::pdlink::LogLevel::level)) {     \
      std::ostringstream _os;                                  \
      _os << expr;                                             \
      ::pdlink::logLine(::pdlink::LogLevel::level, _os.str()); \
    }                                                          \
  } while (0)
