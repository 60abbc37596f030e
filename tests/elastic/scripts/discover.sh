#!/bin/sh
# A host discovery script the elastic tests steer through files in the folder given as $1:
#   $1/mode   ok (the default), fail (exit 3), garbage (a line that is no host), or hang (sleep
#             with a child process; both pids go to $1/hang.pids, one a line)
#   $1/hosts  what "ok" prints (the test replaces it atomically)
dir=$1
mode=$(cat "$dir/mode" 2>/dev/null || echo ok)
case "$mode" in
  fail)
    echo "discovery backend unavailable" >&2
    exit 3 ;;
  garbage)
    echo "localhost:2"
    echo "this is not a host line" ;;
  hang)
    sleep 300 &
    printf '%s\n%s\n' "$$" "$!" > "$dir/hang.pids.tmp" && mv "$dir/hang.pids.tmp" "$dir/hang.pids"
    wait ;;
  *)
    cat "$dir/hosts" ;;
esac
