# The two helpers every install step goes through (sourced by scripts/install.sh; tested by
# tests/install/test_install_script.py). They need LOGS, the folder of the step logs.

fail() {  # fail STEP "what the user can do"
    echo "install: step '$1' failed: $2" >&2
    exit 1
}

# run STEP "remedy" CMD...: run CMD with its output in the step's log; one line either way.
run() {
    local step="$1" remedy="$2" start=$SECONDS
    shift 2
    mkdir -p "$LOGS"
    if "$@" >"$LOGS/$step.log" 2>&1; then
        echo "install: $step: done in $((SECONDS - start)) s"
    else
        fail "$step" "$remedy (log: $LOGS/$step.log, last line: $(tail -n 1 "$LOGS/$step.log"))"
    fi
}
