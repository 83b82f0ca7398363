# Helpers for .ci/sanitizers.sh and .ci/fuzz.sh (sourced from the repository root, not run).
# Build outputs go under build/ci/ (ignored by git).

CI_OUT=${CI_OUT:-build/ci}
mkdir -p "$CI_OUT"

step() { printf '\n=== [%d s] %s\n' "$SECONDS" "$*"; }  # SECONDS: since this script began

# apt_install PKG...: installs those of the packages that are missing, quietly (as root, or with
# sudo). Does nothing when all are present.
apt_install() {
  local missing=() p sudo=""
  for p in "$@"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  echo "apt-get install ${missing[*]}"
  { $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
    >"$CI_OUT/apt.log" 2>&1 || { cat "$CI_OUT/apt.log"; return 1; }
}

# tools_venv: a virtualenv with pybind11 (and cmake and ninja when the machine has none), put first
# on PATH. Configuring the project needs pybind11 even for targets that do not use it.
tools_venv() {
  local v="$CI_OUT/tools-venv" pkgs=(pybind11)
  command -v cmake >/dev/null || pkgs+=(cmake)
  command -v ninja >/dev/null || pkgs+=(ninja)
  [ -x "$v/bin/python" ] || python3 -m venv "$v"
  "$v/bin/python" -m pip install -q --disable-pip-version-check "${pkgs[@]}" >"$v.log" 2>&1 ||
    { cat "$v.log"; return 1; }
  PATH="$(cd "$v/bin" && pwd):$PATH"
  export PATH
}

# configure DIR [CMAKE ARGS...]: configures this project in DIR (Ninja, RelWithDebInfo).
configure() {
  local dir=$1
  shift
  cmake -S . -B "$dir" -G Ninja -DSKBUILD_PROJECT_NAME=pdlink -DSKBUILD_PROJECT_VERSION=0.1.0 \
    -Dpybind11_DIR="$(python -m pybind11 --cmakedir)" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
}
