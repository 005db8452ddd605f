#!/usr/bin/env bash
# Move a file larger than one device call may carry (64 MiB with the repository) in parts, over
# back-to-back calls to the same warm machine (docs/deploy.md, "Files larger than one carry").
#   carry_parts.sh split FILE [PARTS_DIR] [PART_MIB]   here: PARTS_DIR/1, PARTS_DIR/2, ... (default
#                                                      .carry/parts, 48 MiB each) and PARTS_DIR/manifest
#   carry_parts.sh gather PART_DIR [STORE]             there, once per call with one part carried:
#                                                      copy it into STORE (default /tmp/parts); when all
#                                                      parts are in, join them, check the sha256 and
#                                                      print the joined file's path (exit 0); else
#                                                      print what is still missing (exit 4)
set -euo pipefail
case "${1:?usage: carry_parts.sh split FILE [DIR] [MIB] | gather PART_DIR [STORE]}" in
split)
    FILE=${2:?file}; DIR=${3:-.carry/parts}; MIB=${4:-48}
    [ -f "$FILE" ] || { echo "carry_parts: $FILE: no such file" >&2; exit 2; }
    rm -rf "$DIR" && mkdir -p "$DIR/tmp"
    split -b "${MIB}M" -d -a 2 "$FILE" "$DIR/tmp/part."
    n=0
    for part in "$DIR"/tmp/part.*; do
        n=$((n + 1)); mkdir -p "$DIR/$n"; mv "$part" "$DIR/$n/data"
    done
    rmdir "$DIR/tmp"
    name=$(basename "$FILE"); sum=$(sha256sum "$FILE" | cut -d' ' -f1)
    for i in $(seq 1 $n); do printf '%s %s %s %s\n' "$name" "$sum" "$n" "$i" > "$DIR/$i/manifest"; done
    echo "carry_parts: $FILE -> $n parts under $DIR (carry $DIR/1 ... $DIR/$n, one per call)"
    ;;
gather)
    PART=${2:?part dir}; STORE=${3:-/tmp/parts}
    read -r name sum n i < "$PART/manifest"
    mkdir -p "$STORE/$sum"
    cp "$PART/data" "$STORE/$sum/$i.tmp" && mv "$STORE/$sum/$i.tmp" "$STORE/$sum/$i"
    missing=""
    for j in $(seq 1 "$n"); do [ -f "$STORE/$sum/$j" ] || missing="$missing $j"; done
    if [ -n "$missing" ]; then echo "carry_parts: $name: part $i of $n stored; missing:$missing"; exit 4; fi
    for j in $(seq 1 "$n"); do cat "$STORE/$sum/$j"; done > "$STORE/$name.tmp"
    got=$(sha256sum "$STORE/$name.tmp" | cut -d' ' -f1)
    [ "$got" = "$sum" ] || { echo "carry_parts: $name: joined sha256 $got != $sum" >&2; rm -f "$STORE/$name.tmp"; exit 5; }
    mv "$STORE/$name.tmp" "$STORE/$name"
    echo "$STORE/$name"
    ;;
*) echo "carry_parts: unknown verb $1" >&2; exit 2 ;;
esac
