/*
 * node_features/k8s_resources: the GPU indices Kubernetes holds, carried in
 * the node's own `gpu` GRES record.
 *
 * An index the ledger holds is allocated there exactly as a job's would be
 * (gres_ctld/gres_stepmgr _job_alloc): its bit set in gres_bit_alloc,
 * gres_cnt_alloc, the topo_gres_cnt_alloc of every topo record whose
 * topo_gres_bitmap has it, and the type_cnt_alloc of that record's type.
 * cons_tres then never picks it for a job, and a job that needs it pends
 * (Resources).  A job's end clears only its own bits (_job_dealloc), never
 * ours; a rebuild of allocations from jobs (gres_node_state_dealloc_all)
 * clears ours with every other: gres_carry.c notices it and carries again.
 *
 * What is carried is remembered per node (struct gpu_carried): what jobs
 * hold is every bit set that is not ours.  One of our bits found clear
 * means the record was rebuilt since we set it, and a record Slurm made
 * anew holds none of ours: nothing is ours any more in either.
 * Bitmaps are only touched through Slurm's bit_* functions.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "slurm/slurm.h"
#include "slurm/slurm_errno.h"

#include "src/common/slurm_xlator.h"
#include "src/common/bitstring.h"
#include "src/common/list.h"
#include "src/common/log.h"
#include "src/common/node_conf.h"
#include "src/common/xmalloc.h"
#if PYK8SRES_INTERFACES_DIR /* detected by meson: src/interfaces/ (23.02+) */
#include "src/interfaces/gres.h"
#else
#include "src/common/gres.h"
#endif

#include "gpu_carry.h"
#include "slurm_layout.h"

#define GPU_BITS (PYK8SRES_GPU_WORDS * 64)

static bool _has(const uint64_t *mask, int i)
{
	return mask[i / 64] >> (i % 64) & 1;
}

static void _put(uint64_t *mask, int i, bool on)
{
	if (on)
		mask[i / 64] |= (uint64_t) 1 << (i % 64);
	else
		mask[i / 64] &= ~((uint64_t) 1 << (i % 64));
}

static bool _empty(const uint64_t *mask)
{
	for (int w = 0; w < PYK8SRES_GPU_WORDS; w++)
		if (mask[w])
			return false;
	return true;
}

/* The node's gpu GRES record, or NULL. */
static gres_node_state_t *_gpu_ns(node_record_t *node_ptr)
{
	static uint32_t id;
	gres_state_t *gres_state;

	if (!id)
		id = gres_build_id("gpu");
	if (!node_ptr || !node_ptr->gres_list ||
	    !(gres_state = list_find_first(node_ptr->gres_list, gres_find_id, &id)))
		return NULL;
	return gres_state->gres_data;
}

/* shard and MPS GRES split the node's GPUs: a job holding a share of one
 * sets bits in its own record only (alt_gres links the two), never in the
 * gpu record's gres_bit_alloc, so that bitmap alone cannot say which GPUs
 * jobs hold.  The field was alt_gres_ns before 23.11. */
#if SLURM_VERSION_NUMBER < SLURM_VERSION_NUM(23,11,0)
#define GPU_SHARED_BY(ns) ((ns)->alt_gres_ns != NULL)
#else
#define GPU_SHARED_BY(ns) ((ns)->alt_gres != NULL)
#endif

/* The bitmap's size, or -1 with `*problem` set: no bitmap (no File= in
 * gres.conf, or not registered yet), more indices than our masks, GPUs
 * also shared as shard/MPS, or a gpu GRES Slurm does not count (no_consume):
 * in each the node's GPUs are fenced, never guessed. */
static int _size(gres_node_state_t *ns, uint64_t *problem)
{
	int size;

	if (GPU_SHARED_BY(ns)) {
		*problem = PYK8SRES_GPU_SHARED;
		return -1;
	}
	if (ns->no_consume) {
		*problem = PYK8SRES_GPU_NO_CONSUME;
		return -1;
	}
	if (!ns->gres_bit_alloc) {
		*problem = PYK8SRES_GPU_NO_FILES;
		return -1;
	}
	size = bit_size(ns->gres_bit_alloc);
	if (size > GPU_BITS) {
		*problem = PYK8SRES_GPU_TOO_MANY;
		return -1;
	}
	return size;
}

/* Indices we carried beyond the bitmap (it shrank at a registration) are
 * gone, the others kept.  One found clear inside it means the record was
 * rebuilt from jobs (gres_node_state_dealloc_all clears all of ours at
 * once): nothing set in it is ours now, whatever a job took since. */
static void _forget_if_rebuilt(gres_node_state_t *ns, int size, uint64_t *carried)
{
	for (int i = size; i < GPU_BITS; i++)
		_put(carried, i, false);
	for (int i = 0; i < size; i++)
		if (_has(carried, i) && !bit_test(ns->gres_bit_alloc, i)) {
			memset(carried, 0, PYK8SRES_GPU_WORDS * sizeof(*carried));
			return;
		}
}

/* One index in or out of every count a job's allocation of it moves. */
static void _count(gres_node_state_t *ns, int i, bool on)
{
	int64_t d = on ? 1 : -1;

	if (on || ns->gres_cnt_alloc)
		ns->gres_cnt_alloc += d;
	for (int t = 0; ns->topo_gres_cnt_alloc && ns->topo_gres_bitmap && t < ns->topo_cnt; t++) {
		if (!ns->topo_gres_bitmap[t] || i >= bit_size(ns->topo_gres_bitmap[t]) ||
		    !bit_test(ns->topo_gres_bitmap[t], i))
			continue;
		if (on || ns->topo_gres_cnt_alloc[t])
			ns->topo_gres_cnt_alloc[t] += d;
		if (!ns->type_cnt || !ns->topo_type_name || !ns->topo_type_name[t] ||
		    !ns->topo_type_id || !ns->type_cnt_alloc || !ns->type_id)
			continue;
		for (int j = 0; j < ns->type_cnt; j++)
			if (ns->type_id[j] == ns->topo_type_id[t]) {
				if (on || ns->type_cnt_alloc[j])
					ns->type_cnt_alloc[j] += d;
				break;
			}
	}
}

struct gpu_carry {
	node_record_t *node_ptr;
	gres_node_state_t *ns;
	const uint64_t *want;
	uint64_t *carried;	/* the bits of a struct gpu_carried */
	bool clamped;
};

/* Under the gres list's lock (see _carry_locked in gres_carry.c). */
static int _carry_locked(void *x, void *arg)
{
	struct gpu_carry *c = arg;
	gres_node_state_t *ns = c->ns;
	uint64_t problem = 0;
	int size;
	bool changed = false;

	if (((gres_state_t *) x)->gres_data != ns)
		return 0;
	if ((size = _size(ns, &problem)) < 0) {
		c->clamped = !_empty(c->want);
		memset(c->carried, 0, PYK8SRES_GPU_WORDS * sizeof(*c->carried));
		return 0;
	}
	_forget_if_rebuilt(ns, size, c->carried);
	for (int i = 0; i < GPU_BITS; i++) {
		bool want = _has(c->want, i), ours = _has(c->carried, i);

		if (want == ours)
			continue;
		/* A job holds it, no such GPU, or the counts say every GPU is
		 * taken already (counted past avail, cons_tres's unsigned
		 * arithmetic would wrap). */
		if (want && (i >= size || bit_test(ns->gres_bit_alloc, i) ||
			     ns->gres_cnt_alloc >= ns->gres_cnt_avail)) {
			c->clamped = true;
			continue;
		}
		if (want)
			bit_set(ns->gres_bit_alloc, i);
		else
			bit_clear(ns->gres_bit_alloc, i);
		_count(ns, i, want);
		_put(c->carried, i, want);
		changed = true;
	}
	if (changed)
		xfree(ns->gres_used); /* cached GresUsed string, rebuilt on demand */
	return 0;
}

/* What we carried in a record Slurm has since replaced is not there. */
static void _same_record(gres_node_state_t *ns, struct gpu_carried *carried)
{
	if (carried->record == ns)
		return;
	memset(carried->bits, 0, sizeof(carried->bits));
	carried->record = ns;
}

extern bool gpu_carry(node_record_t *node_ptr, const uint64_t *want,
		      struct gpu_carried *carried)
{
	struct gpu_carry c = { .node_ptr = node_ptr, .ns = _gpu_ns(node_ptr),
			       .want = want, .carried = carried->bits };

	_same_record(c.ns, carried);
	if (!c.ns)
		return !_empty(want);
	(void) list_for_each(node_ptr->gres_list, _carry_locked, &c);
	return c.clamped;	/* logged by the caller when it changes */
}

extern void gpu_carry_facts(node_record_t *node_ptr, const struct gpu_carried *carried,
			    uint64_t *out)
{
	gres_node_state_t *ns = _gpu_ns(node_ptr);
	uint64_t ours[PYK8SRES_GPU_WORDS];
	uint64_t *jobs = out + 2;
	bool unknown;
	int size;

	memset(out, 0, (2 + PYK8SRES_GPU_WORDS) * sizeof(*out));
	if (!ns)
		return;
	out[0] = ns->gres_cnt_avail;
	if ((size = _size(ns, &out[1])) < 0)
		return;
	out[0] = size;
	if (carried->record == ns)
		memcpy(ours, carried->bits, sizeof(ours));
	else
		memset(ours, 0, sizeof(ours));
	_forget_if_rebuilt(ns, size, ours);
	/* A node whose slurmd has not registered with this slurmctld yet
	 * (recovered UNKNOWN, or NOT_RESPONDING) may run jobs slurmctld does
	 * not know: a job a slurmctld killed -9 had not saved runs on its
	 * GPUs until slurmd registers and is told to kill it.  Slurm starts no
	 * job on such a node; every GPU not ours counts as a job's until then.
	 * So while a job completes there: Slurm freed its GPUs when it began
	 * completing, and its processes may use them until KillWait. */
	unknown = (node_ptr->node_state & NODE_STATE_NO_RESPOND) ||
		  (node_ptr->node_state & NODE_STATE_COMPLETING) ||
		  (node_ptr->node_state & NODE_STATE_BASE) == NODE_STATE_UNKNOWN;
	for (int i = 0; i < size; i++)
		if ((unknown || bit_test(ns->gres_bit_alloc, i)) && !_has(ours, i))
			_put(jobs, i, true);
}
