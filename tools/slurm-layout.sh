#!/bin/bash
# The offsets of the Slurm fields node_features/k8s_resources reads and
# writes, as a configured source tree's headers give them: the line to add
# to plugins/slurm_layout.h for that release.
#
# Usage: tools/slurm-layout.sh DIR [--check BINARY]
#   DIR     a configured Slurm tree (tools/slurm-source.sh or the src/ of a
#           tools/slurm-build.sh build)
#   --check compare them with the debug information (DWARF, read with gdb)
#           of the slurmctld or libslurmfull.so that will load the plugin:
#           Debian's need its -dbgsym packages; tools/slurm-build.sh builds
#           with -g.  Exit status 1 on any difference.
set -eu

die() { echo "slurm-layout: error: $*" >&2; exit 2; }

binary=
if [ $# -eq 3 ] && [ "$2" = --check ]; then
	binary=$3
	[ -f "$binary" ] || die "no such file: $binary"
	command -v gdb >/dev/null || die "--check reads debug information with gdb: apt-get install gdb"
elif [ $# -ne 1 ]; then
	die "usage: $0 DIR [--check BINARY]"
fi
src=$1
for f in config.h slurm/slurm_version.h src/common/node_conf.h; do
	[ -f "$src/$f" ] || die "$src/$f missing: not a configured Slurm tree"
done
gres_h=src/interfaces/gres.h
[ -f "$src/$gres_h" ] || gres_h=src/common/gres.h
[ -f "$src/$gres_h" ] || die "no gres.h under $src/src/interfaces or $src/src/common"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/probe.c" <<EOF
#include <stdio.h>
#include <stddef.h>
#include "slurm/slurm.h"
#include "src/common/node_conf.h"
#include "$gres_h"
#define P(t, s, f) printf("%s %s %s %zu\n", #t, #s, #f, offsetof(t, f))
int main(void)
{
	P(node_record_t, node_record, cpus); P(node_record_t, node_record, gres);
	P(node_record_t, node_record, gres_list); P(node_record_t, node_record, name);
	P(node_record_t, node_record, index); P(node_record_t, node_record, real_memory);
	P(node_record_t, node_record, cpus_efctv);
	P(node_record_t, node_record, mem_spec_limit);
	P(gres_state_t, gres_state, plugin_id); P(gres_state_t, gres_state, gres_data);
	P(gres_node_state_t, gres_node_state, node_feature);
	P(gres_node_state_t, gres_node_state, gres_cnt_avail);
	P(gres_node_state_t, gres_node_state, gres_cnt_alloc);
	P(gres_node_state_t, gres_node_state, topo_cnt);
	P(gres_node_state_t, gres_node_state, topo_gres_cnt_alloc);
	P(gres_node_state_t, gres_node_state, gres_used);
	P(gres_node_state_t, gres_node_state, gres_bit_alloc);
	P(gres_node_state_t, gres_node_state, topo_gres_bitmap);
	P(gres_node_state_t, gres_node_state, topo_type_id);
	P(gres_node_state_t, gres_node_state, topo_type_name);
	P(gres_node_state_t, gres_node_state, type_cnt);
	P(gres_node_state_t, gres_node_state, type_cnt_alloc);
	P(gres_node_state_t, gres_node_state, type_id);
	return 0;
}
EOF
${CC:-cc} -I"$src" -I"$src/src" -include "$src/config.h" "$tmp/probe.c" -o "$tmp/probe" ||
	die "cannot compile against $src"
"$tmp/probe" >"$tmp/offsets"

num=$(sed -n 's/^#define SLURM_VERSION_NUMBER \(0x[0-9a-fA-F]*\).*/\1/p' "$src/slurm/slurm_version.h")
off() { awk -v t="$1" -v f="$2" '$1 == t && $3 == f { print $4 }' "$tmp/offsets"; }
printf '#elif SLURM_VERSION_NUMBER == SLURM_VERSION_NUM(%d,%d,%d)\n' \
	$((num >> 16)) $(((num >> 8) & 255)) $((num & 255))
printf 'AT_NODE(%s, %s, %s, %s, %s, %s); AT_GRES(%s);\n' \
	"$(off node_record_t cpus)" "$(off node_record_t gres)" "$(off node_record_t gres_list)" \
	"$(off node_record_t name)" "$(off node_record_t index)" "$(off node_record_t real_memory)" \
	"$(off gres_node_state_t topo_gres_cnt_alloc)"
printf 'AT_GPU(%s, %s, %s, %s, %s, %s, %s, %s);\n' \
	"$(off gres_node_state_t gres_used)" "$(off gres_node_state_t gres_bit_alloc)" \
	"$(off gres_node_state_t topo_gres_bitmap)" "$(off gres_node_state_t topo_type_id)" \
	"$(off gres_node_state_t topo_type_name)" "$(off gres_node_state_t type_cnt)" \
	"$(off gres_node_state_t type_cnt_alloc)" "$(off gres_node_state_t type_id)"
# AT_NODE places cpus_efctv right after cpus and mem_spec_limit right
# before name: say so if this release does not.
[ "$(off node_record_t cpus_efctv)" = "$(($(off node_record_t cpus) + 2))" ] ||
	echo "slurm-layout: node_record_t.cpus_efctv is not right after cpus: AT_NODE does not fit this release" >&2
[ "$(off node_record_t mem_spec_limit)" = "$(($(off node_record_t name) - 8))" ] ||
	echo "slurm-layout: node_record_t.mem_spec_limit is not right before name: AT_NODE does not fit this release" >&2
# AT_GRES pins these for every release: say so if one moved.
for pin in "gres_state_t plugin_id 4" "gres_state_t gres_data 8" \
	"gres_node_state_t node_feature 25" "gres_node_state_t gres_cnt_avail 32" \
	"gres_node_state_t gres_cnt_alloc 48" "gres_node_state_t topo_cnt 64"; do
	set -- $pin
	[ "$(off "$1" "$2")" = "$3" ] || echo "slurm-layout: $1.$2 is at $(off "$1" "$2"), not $3: AT_GRES does not fit this release" >&2
done

[ -n "$binary" ] || exit 0
# The same fields in the binary's DWARF: gdb's `ptype /o struct X` lines
# look like "/*    144      |       2 */    uint16_t cpus;".
status=0
for struct in node_record gres_state gres_node_state; do
	gdb -batch -ex "ptype /o struct $struct" "$binary" 2>/dev/null |
		sed -n 's|^/\* *\([0-9][0-9]*\) *[|].*\*/.*[ *]\([a-z_][a-z_0-9]*\);$|\1 \2|p' >"$tmp/$struct"
	[ -s "$tmp/$struct" ] || { echo "slurm-layout: no debug information for struct $struct in $binary" >&2; exit 1; }
done
while read -r type struct field offset; do
	dwarf=$(awk -v f="$field" '$2 == f { print $1; exit }' "$tmp/$struct")
	if [ "$dwarf" != "$offset" ]; then
		echo "slurm-layout: $type.$field: $offset in the headers, ${dwarf:-absent} in $binary" >&2
		status=1
	fi
done <"$tmp/offsets"
[ $status -ne 0 ] || echo "slurm-layout: the headers of $src and $binary agree" >&2
exit $status
