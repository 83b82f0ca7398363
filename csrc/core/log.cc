#include "core/log.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

#include "core/environment.h"

namespace pdlink {
namespace {

LogLevel levelFromEnv() {
  std::string s = environment::read(environment::kLogLevel).value_or("");
  if (s == "error") return LogLevel::kError;
  if (s == "info") return LogLevel::kInfo;
  if (s == "debug") return LogLevel::kDebug;
  return LogLevel::kWarn;
}

const char* levelTag(LogLevel l) {
  switch (l) {
    case LogLevel::kError:
      return "E";
    case LogLevel::kWarn:
      return "W";
    case LogLevel::kInfo:
      return "I";
    case LogLevel::kDebug:
      return "D";
  }
  return "?";
}

}  // namespace

bool logEnabled(LogLevel level) {
  static const LogLevel threshold = levelFromEnv();
  return static_cast<int>(level) <= static_cast<int>(threshold);
}

void logLine(LogLevel level, const std::string& line) {
  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char ts[32];
  std::strftime(ts, sizeof(ts), "%H:%M:%S", &tm);
  std::string out =
      std::string("[pdlink ") + levelTag(level) + " " + ts + " pid " + std::to_string(getpid()) + "] " + line + "\n";
  ssize_t ignored = ::write(STDERR_FILENO, out.data(), out.size());
  (void)ignored;
}

}  // namespace pdlink
