# The two helpers every install step goes through (sourced by scripts/install.sh; tested by
# tests/install/test_install_script.py). They need LOGS, the folder of the step logs.

fail() {  # fail STEP "what the user can do"
    echo "install: step '$1' failed: $2" >&2
    exit 1
}

_PIP_SUMMARY="finished with status|subprocess-exited-with-error|Failed (building|to build)|Could not build wheels|This error originates|An error occurred when building"

# run STEP "remedy" CMD...: run CMD with its output in the step's log; one line either way.
run() {
    local step="$1" remedy="$2" start=$SECONDS
    shift 2
    mkdir -p "$LOGS"
    if "$@" >"$LOGS/$step.log" 2>&1; then
        echo "install: $step: done in $((SECONDS - start)) s"
    else
        # NOTE: the first line that says error or fatal, past pip's own summary lines, names
        # the cause; pip's last line does not.
        local cause
        cause="$(grep -iE 'fatal|error' "$LOGS/$step.log" | grep -vE "$_PIP_SUMMARY" | head -n 1)"
        [[ -n "$cause" ]] || cause="$(tail -n 1 "$LOGS/$step.log")"
        cause="${cause#"${cause%%[![:space:]]*}"}"
        fail "$step" "$remedy (log: $LOGS/$step.log; first error: ${cause:0:300})"
    fi
}
