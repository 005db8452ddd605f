#!/usr/bin/env bash
# Run Snakemake targets on a machine that is reached only through short commands: `start` launches
# the run detached (it outlives the command that started it), `poll` waits a while and reports,
# `archive` packs what the run has written so far.
#
#   run_target.sh start TARGET ... [SNAKEMAKE OPTION ...]
#       snakemake --workflow-profile $RUN_TARGET_PROFILE TARGET ..., detached (setsid, nohup);
#       refuses to start while a run of this state folder is alive.
#   run_target.sh poll [SECONDS]
#       wait up to SECONDS (default 0) for the run to end, then print the log's tail and Snakemake's
#       last progress line. Exit 0: finished well; 1: finished with an error; 3: still running;
#       4: no run was started here (e.g. a fresh machine).
#   run_target.sh archive FILE.tgz
#       pack the files under results/, figures/, logs/ and benchmarks/ written since `start`, and
#       the run's log, into FILE.tgz (partial results of a run cut short included).
#
# Environment:
#   RUN_TARGET_PROFILE  workflow profile (default workflow/profiles/gpu)
#   RUN_TARGET_DIR      run in a copy of this checkout made there by `start` (for transports that
#                       replace the checkout between commands); poll and archive read it there too
#   RUN_TARGET_STATE    state folder: pid, log, exit status (default <run dir>/.snakemake/run_target)
#   OCCULT_COMMIT       the commit results are attributed to where the checkout has no .git
set -uo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
run_dir=${RUN_TARGET_DIR:-$repo}
state=${RUN_TARGET_STATE:-$run_dir/.snakemake/run_target}
profile=${RUN_TARGET_PROFILE:-workflow/profiles/gpu}

alive() { [ -f "$state/pid" ] && kill -0 "$(cat "$state/pid")" 2>/dev/null && [ ! -f "$state/exit" ]; }

case "${1:-}" in
start)
    shift
    [ $# -gt 0 ] || { echo "run_target: start needs at least one target" >&2; exit 2; }
    if alive; then echo "run_target: a run is still going (pid $(cat "$state/pid")); poll it"; exit 0; fi
    if [ "$run_dir" != "$repo" ]; then
        rm -rf "$run_dir" && mkdir -p "$(dirname "$run_dir")" && cp -a "$repo" "$run_dir" \
            || { echo "run_target: cannot copy the checkout to $run_dir" >&2; exit 2; }
    fi
    rm -rf "$state" && mkdir -p "$state" && touch "$state/started"
    printf '%q ' snakemake --workflow-profile "$profile" "$@" > "$state/command"
    cd "$run_dir" || exit 2
    setsid nohup bash -c 'snakemake --workflow-profile "$1" "${@:3}" > "$2/log" 2>&1; echo $? > "$2/exit"' \
        run_target "$profile" "$state" "$@" < /dev/null > /dev/null 2>&1 &
    echo $! > "$state/pid"
    echo "run_target: started in $run_dir: $(cat "$state/command")" ;;
poll)
    [ -f "$state/started" ] || { echo "run_target: no run was started here ($state)"; exit 4; }
    end=$(( SECONDS + ${2:-0} ))
    while alive && [ "$SECONDS" -lt "$end" ]; do sleep 2; done
    tail -n "${POLL_LINES:-30}" "$state/log" 2>/dev/null
    grep -E "^[0-9]+ of [0-9]+ steps" "$state/log" 2>/dev/null | tail -1
    if [ -f "$state/exit" ]; then
        code=$(cat "$state/exit")
        echo "run_target: finished, exit $code: $(cat "$state/command")"
        [ "$code" = 0 ] && exit 0 || exit 1
    fi
    if alive; then echo "run_target: running (pid $(cat "$state/pid"))"; exit 3; fi
    echo "run_target: the run ended without an exit status (killed?)"; exit 1 ;;
archive)
    out=${2:?usage: run_target.sh archive FILE.tgz}
    [ -f "$state/started" ] || { echo "run_target: no run was started here ($state)"; exit 4; }
    case "$out" in /*) ;; *) out=$PWD/$out ;; esac
    cd "$run_dir" || exit 2
    { find results figures logs benchmarks -type f -newer "$state/started" -print0 2>/dev/null
      printf '%s\0' "${state#"$run_dir"/}/log" "${state#"$run_dir"/}/command"; } \
        | tar --null -czf "$out" -T - && echo "run_target: $out" ;;
*)
    echo "usage: run_target.sh start TARGET ... | poll [SECONDS] | archive FILE.tgz" >&2; exit 2 ;;
esac
