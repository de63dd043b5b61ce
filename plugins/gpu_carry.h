/*
 * The GPU indices Kubernetes holds, carried in the node's `gpu` GRES record
 * (gpu_carry.c), for gres_carry.c.  Masks are PYK8SRES_GPU_WORDS words
 * (bit i of word i / 64 = gpu index i).  Include after Slurm's headers.
 */
#ifndef PYK8SRES_GPU_CARRY_H
#define PYK8SRES_GPU_CARRY_H
#include <stdbool.h>
#include <stdint.h>

#include "pyk8sres_core.h"

/* The indices we set in one node's gpu record, and which record that was:
 * a record Slurm made anew (reconfigure, a takeover, a dynamic node made
 * again) holds none of them. */
struct gpu_carried {
	const void *record;
	uint64_t bits[PYK8SRES_GPU_WORDS];
};

/* Make the node's gpu GRES carry `want`: what `carried` (ours, as last
 * set; updated) says we hold, the rest left to jobs.  An index a job holds
 * or the node has not is skipped: true then (clamped).  The node write
 * lock, or a read lock plus gres_carry's sync_lock. */
extern bool gpu_carry(node_record_t *node_ptr, const uint64_t *want,
		      struct gpu_carried *carried);

/* out[0] gpu count (0: no gpu GRES), out[1] PYK8SRES_GPU_* problem,
 * out[2..] the mask of indices jobs hold (set, and not in `carried`; on a
 * node not registered since slurmctld started, not responding or
 * completing a job, every index not in `carried`). */
extern void gpu_carry_facts(node_record_t *node_ptr, const struct gpu_carried *carried,
			    uint64_t *out);
#endif
