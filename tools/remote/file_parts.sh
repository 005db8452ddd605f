#!/usr/bin/env bash
# Move a file too large for one transfer in parts, and check it whole at the other end.
#   file_parts.sh split FILE [PARTS_DIR] [PART_MIB]
#       cut FILE into PARTS_DIR/1/data, PARTS_DIR/2/data, ... (default .parts, 48 MiB each), each
#       with a manifest: the file's name, its sha256, the number of parts and the part's number
#   file_parts.sh join PART_DIR [STORE]
#       add one transferred part to STORE (default /tmp/parts); once every part is there, join
#       them, check the sha256 and print the joined file's path (exit 0); else print the parts
#       still missing (exit 4). A joined file whose sha256 differs is removed (exit 5).
set -euo pipefail
case "${1:?usage: file_parts.sh split FILE [DIR] [MIB] | join PART_DIR [STORE]}" in
split)
    file=${2:?file}; dir=${3:-.parts}; mib=${4:-48}
    [ -f "$file" ] || { echo "file_parts: $file: no such file" >&2; exit 2; }
    [[ "$mib" =~ ^[1-9][0-9]*$ ]] || { echo "file_parts: PART_MIB=$mib: expected a whole number of MiB" >&2; exit 2; }
    rm -rf "$dir" && mkdir -p "$dir/tmp"
    split -b "${mib}M" -d -a 3 "$file" "$dir/tmp/part."
    n=0
    for part in "$dir"/tmp/part.*; do
        n=$((n + 1)); mkdir -p "$dir/$n"; mv "$part" "$dir/$n/data"
    done
    rmdir "$dir/tmp"
    name=$(basename "$file"); sum=$(sha256sum "$file" | cut -d' ' -f1)
    for i in $(seq 1 "$n"); do printf '%s %s %s %s\n' "$name" "$sum" "$n" "$i" > "$dir/$i/manifest"; done
    echo "file_parts: $file -> $n parts: $dir/1 ... $dir/$n" ;;
join)
    part=${2:?part dir}; store=${3:-/tmp/parts}
    read -r name sum n i < "$part/manifest"
    mkdir -p "$store/$sum"
    cp "$part/data" "$store/$sum/$i.tmp" && mv "$store/$sum/$i.tmp" "$store/$sum/$i"
    missing=""
    for j in $(seq 1 "$n"); do [ -f "$store/$sum/$j" ] || missing="$missing $j"; done
    if [ -n "$missing" ]; then echo "file_parts: $name: part $i of $n stored; missing:$missing"; exit 4; fi
    for j in $(seq 1 "$n"); do cat "$store/$sum/$j"; done > "$store/$name.tmp"
    got=$(sha256sum "$store/$name.tmp" | cut -d' ' -f1)
    [ "$got" = "$sum" ] || { echo "file_parts: $name: joined sha256 $got != $sum" >&2; rm -f "$store/$name.tmp"; exit 5; }
    mv "$store/$name.tmp" "$store/$name"
    echo "$store/$name" ;;
*) echo "file_parts: unknown verb $1 (split, join)" >&2; exit 2 ;;
esac
