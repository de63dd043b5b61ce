/*
 * Kubernetes' share carried in Slurm's GRES records (gres_carry.c), for
 * node_features/k8s_resources.  The plugin's hooks say when a node gets its
 * capacity and when a rebuild may have happened; the ledger server calls the
 * rest through struct ledger_plugin_ops (ledger_server.h).
 *
 * Include after Slurm's headers: node_record_t comes from node_conf.h.
 */
#ifndef PYK8SRES_GRES_CARRY_H
#define PYK8SRES_GRES_CARRY_H
#include <stdbool.h>
#include <stdint.h>

#define GRES_CARRY_CPU "k8scpu"
#define GRES_CARRY_MEM "k8smemory"

/* Give the node its capacity, cnt[0] k8scpu and cnt[1] k8smemory (never
 * below what its jobs hold), then its share, clamped to what fits.
 * SLURM_ERROR if Slurm made no record for a GRES. */
extern int gres_carry_set_capacity(node_record_t *node_ptr, const uint64_t *cnt);

/* Before every scheduling attempt (node_features_p_user_update): the share
 * back after a rebuild, timed for gres_carry_stats.  O(1) unless one
 * happened. */
extern void gres_carry_check(void);

/* The share back on every node if Slurm rebuilt allocations from jobs, and
 * on nodes whose pods wait for what jobs free; resync_due says whether
 * either is needed (O(1), no lock of ours).  The node lock held. */
extern void gres_carry_resync(void);
extern bool gres_carry_resync_due(void);
/* Carry every node's share from scratch (a journal was loaded):
 * slurmctld's job+node write locks held. */
extern void gres_carry_all(void);

/* Ledger callbacks: the contracts of struct ledger_plugin_ops. */
extern int gres_carry_facts(const char *name, uint64_t *out);
extern void gres_carry_share(const char *name, uint64_t cpu, uint64_t mem,
			     const uint64_t *gpus);
extern void gres_carry_remember(const char *name, uint64_t cpu, uint64_t mem,
				const uint64_t *gpus);
/* True once after gres_carry_share lowered a node's share (CPUs, memory or
 * any GPU index freed), under the same locks. */
extern bool gres_carry_take_freed(void);
extern void gres_carry_stats(uint64_t *out);
extern void gres_carry_copy_facts(void);
extern int gres_carry_copied_facts(const char *name, uint64_t *out);
extern const char *gres_carry_copied_node_name(int index);
extern int gres_carry_copied_changes(uint64_t layout, uint64_t since, uint64_t *now,
				     int *indices, int max);
#endif
