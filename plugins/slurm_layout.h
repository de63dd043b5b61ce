/*
 * The layout of Slurm's structures node_features/k8s_resources reads and
 * writes (node_record_t, gres_state_t, gres_node_state_t; AT_GPU: the
 * fields gpu_carry.c sets in a gpu GRES record, as a job's allocation does).
 *
 * The structures come from the configured source tree the plugin is built
 * against.  When that tree is the one the running slurmctld was compiled
 * from (tools/slurm-build.sh; meson: PYK8SRES_SLURM_BUILT_HERE), the
 * compiler's offsets are slurmctld's own.  Otherwise (the installed Debian
 * packages, whose configure run tools/slurm-source.sh only imitates) the
 * offsets must equal those verified for that exact release, listed below,
 * and a release not listed fails the build rather than risk writing into
 * the wrong field of slurmctld's memory.  tools/slurm-layout.sh DIR prints
 * a tree's lines for this table.
 */
#ifndef PYK8SRES_SLURM_LAYOUT_H
#define PYK8SRES_SLURM_LAYOUT_H

#include <stddef.h>

#define FIELD_SIZE(t, f) sizeof(((t *) 0)->f)
_Static_assert(FIELD_SIZE(node_record_t, cpus) == sizeof(uint16_t), "cpus");
_Static_assert(FIELD_SIZE(node_record_t, cpus_efctv) == sizeof(uint16_t), "cpus_efctv");
_Static_assert(FIELD_SIZE(node_record_t, real_memory) == sizeof(uint64_t), "real_memory");
_Static_assert(FIELD_SIZE(node_record_t, mem_spec_limit) == sizeof(uint64_t), "mem_spec_limit");
_Static_assert(FIELD_SIZE(node_record_t, gres) == sizeof(char *), "gres");
_Static_assert(FIELD_SIZE(gres_state_t, plugin_id) == sizeof(uint32_t), "plugin_id");
_Static_assert(FIELD_SIZE(gres_node_state_t, gres_cnt_avail) == sizeof(uint64_t), "avail");
_Static_assert(FIELD_SIZE(gres_node_state_t, gres_cnt_alloc) == sizeof(uint64_t), "alloc");
_Static_assert(FIELD_SIZE(gres_node_state_t, node_feature) == sizeof(bool), "node_feature");
_Static_assert(FIELD_SIZE(gres_node_state_t, topo_cnt) == sizeof(uint16_t), "topo_cnt");
_Static_assert(FIELD_SIZE(gres_node_state_t, topo_gres_cnt_alloc) == sizeof(uint64_t *),
	       "topo_gres_cnt_alloc");
_Static_assert(FIELD_SIZE(gres_node_state_t, gres_bit_alloc) == sizeof(bitstr_t *),
	       "gres_bit_alloc");
_Static_assert(FIELD_SIZE(gres_node_state_t, topo_gres_bitmap) == sizeof(bitstr_t **),
	       "topo_gres_bitmap");
_Static_assert(FIELD_SIZE(gres_node_state_t, topo_type_id) == sizeof(uint32_t *), "topo_type_id");
_Static_assert(FIELD_SIZE(gres_node_state_t, topo_type_name) == sizeof(char **),
	       "topo_type_name");
_Static_assert(FIELD_SIZE(gres_node_state_t, type_cnt) == sizeof(uint16_t), "type_cnt");
_Static_assert(FIELD_SIZE(gres_node_state_t, type_cnt_alloc) == sizeof(uint64_t *),
	       "type_cnt_alloc");
_Static_assert(FIELD_SIZE(gres_node_state_t, type_id) == sizeof(uint32_t *), "type_id");

#define AT(t, f, off) _Static_assert(offsetof(t, f) == (off), #t "." #f)
/* Shared by every release verified: gres_state_t and gres_node_state_t. */
#define AT_GRES(alloc_array)						\
	AT(gres_state_t, plugin_id, 4);					\
	AT(gres_state_t, gres_data, 8);					\
	AT(gres_node_state_t, node_feature, 25);			\
	AT(gres_node_state_t, gres_cnt_avail, 32);			\
	AT(gres_node_state_t, gres_cnt_alloc, 48);			\
	AT(gres_node_state_t, topo_cnt, 64);				\
	AT(gres_node_state_t, topo_gres_cnt_alloc, alloc_array)
#define AT_GPU(used, bits, tbits, tid, tname, tcnt, talloc, typeid)	\
	AT(gres_node_state_t, gres_used, used);				\
	AT(gres_node_state_t, gres_bit_alloc, bits);			\
	AT(gres_node_state_t, topo_gres_bitmap, tbits);			\
	AT(gres_node_state_t, topo_type_id, tid);			\
	AT(gres_node_state_t, topo_type_name, tname);			\
	AT(gres_node_state_t, type_cnt, tcnt);				\
	AT(gres_node_state_t, type_cnt_alloc, talloc);			\
	AT(gres_node_state_t, type_id, typeid)
/*
 * cpus_efctv (CPUs less the specialized ones: CoreSpecCount x threads used
 * per core, or CpuSpecList) follows cpus, and mem_spec_limit (MemSpecLimit)
 * precedes name, in node_record of every release listed (read in each
 * tag's src/common/node_conf.h): a uint16_t after a uint16_t, a uint64_t
 * right before a pointer, so neither has padding between.
 */
#define AT_NODE(c, g, gl, n, i, m)					\
	AT(node_record_t, cpus, c);					\
	AT(node_record_t, cpus_efctv, (c) + 2);				\
	AT(node_record_t, mem_spec_limit, (n) - 8);			\
	AT(node_record_t, gres, g);					\
	AT(node_record_t, gres_list, gl);				\
	AT(node_record_t, name, n);					\
	AT(node_record_t, index, i);					\
	AT(node_record_t, real_memory, m)

/* Verified (x86-64): Debian's 22.05.8 and 24.11.5, SchedMD's release tags.
 * AT_GPU of 23.02.8 and 25.05.8: their gres_node_state_t is field for field
 * that of 22.05.8 and 24.11.5 (git show of the tags' gres.h). */
#if SLURM_VERSION_NUMBER == SLURM_VERSION_NUM(22,5,8)
AT_NODE(104, 168, 176, 232, 184, 344); AT_GRES(96);
AT_GPU(40, 56, 88, 112, 120, 128, 136, 152);
#elif SLURM_VERSION_NUMBER == SLURM_VERSION_NUM(23,2,8)
AT_NODE(104, 168, 176, 232, 184, 344); AT_GRES(96);
AT_GPU(40, 56, 88, 112, 120, 128, 136, 152);
#elif SLURM_VERSION_NUMBER == SLURM_VERSION_NUM(24,11,5)
AT_NODE(112, 192, 200, 272, 208, 376); AT_GRES(104);
AT_GPU(40, 56, 96, 120, 128, 136, 144, 160);
#elif SLURM_VERSION_NUMBER == SLURM_VERSION_NUM(25,5,8)
AT_NODE(144, 224, 232, 304, 240, 408); AT_GRES(104);
AT_GPU(40, 56, 96, 120, 128, 136, 144, 160);
#elif SLURM_VERSION_NUMBER == SLURM_VERSION_NUM(25,11,7)
AT_NODE(144, 224, 232, 304, 240, 424); AT_GRES(104);
AT_GPU(40, 56, 96, 120, 128, 136, 144, 160);
#elif SLURM_VERSION_NUMBER == SLURM_VERSION_NUM(26,5,3)
AT_NODE(120, 200, 208, 280, 216, 408); AT_GRES(104);
AT_GPU(40, 56, 96, 120, 128, 136, 144, 160);
#elif !PYK8SRES_SLURM_BUILT_HERE
#error "node_features/k8s_resources: the layout of node_record_t and gres_node_state_t is verified for Slurm 22.05.8, 23.02.8, 24.11.5, 25.05.8, 25.11.7 and 26.05.3 only. Build against the tree the running slurmctld was compiled from (tools/slurm-build.sh --source DIR VERSION), or add this release's line to plugins/slurm_layout.h from tools/slurm-layout.sh DIR once you have checked it against that slurmctld."
#endif

#endif
