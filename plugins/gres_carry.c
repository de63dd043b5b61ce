/*
 * node_features/k8s_resources: Kubernetes' share carried in Slurm's own GRES
 * records.
 *
 * What Kubernetes holds on a node is *allocated* in Slurm's GRES accounting
 * next to what jobs hold (gres_cnt_alloc = jobs + share), so a job that fits
 * the node queues with reason Resources until pods leave, and nothing is
 * granted twice.  The share each record carries is kept inside that record,
 * in topo_gres_cnt_alloc[0]: for a count-only GRES (topo_cnt == 0) Slurm
 * reads that array nowhere, and gres_node_state_dealloc_all() -- the start
 * of every rebuild of allocations from jobs (startup, reconfigure, partition
 * changes, setdebugflags, dynamic nodes) -- frees it.  So "no array" means
 * exactly "alloc holds jobs only", checked in O(1) before every scheduling
 * attempt (user_update, called at the top of select_nodes) and every ledger
 * request; the share is then added back before any job can be allocated
 * onto it.
 *
 * This file owns that bookkeeping: each node's capacity (avail), the share
 * wanted per node, carrying it, noticing a rebuild, and the per-node facts
 * the ledger decides on.  The plugin hooks (node_features_k8s_resources.c)
 * say when; ledger_server.c serves the requests that change the shares.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "slurm/slurm.h"
#include "slurm/slurm_errno.h"

#include "src/common/slurm_xlator.h"
#include "src/common/list.h"
#include "src/common/log.h"
#include "src/common/macros.h"
#include "src/common/node_conf.h"
#include "src/common/xmalloc.h"
#include "src/common/xstring.h"
#if PYK8SRES_INTERFACES_DIR /* detected by meson: src/interfaces/ (23.02+) */
#include "src/interfaces/gres.h"
#else
#include "src/common/gres.h"
#endif

#include "gpu_carry.h"
#include "gres_carry.h"
#include "ledger_server.h"

/* The layout we rely on: pinned per verified release, or the tree the running
 * slurmctld was compiled from; any other release fails the build. */
#include "slurm_layout.h"

#define LOG_PREFIX "node_features/k8s_resources gres_carry"

/* --- Shares wanted per node --------------------------------------------
 * Python decides and persists (pyk8sres/slurmctld/ledger.py); C keeps the
 * wanted share of every node to re-apply it after a rebuild without
 * entering Python on the scheduling path. */
struct want {
	char *name;
	uint64_t cnt[2];	/* k8scpu CPUs, k8smemory MB */
	uint64_t gpus[PYK8SRES_GPU_WORDS];	/* gpu indices held (gpu_carry.c) */
	struct gpu_carried gpus_carried;	/* of them, set in the record */
	bool clamped;		/* carries less: jobs leave less than pods hold */
};
static const struct gpu_carried no_gpus;
static const uint64_t no_indices[PYK8SRES_GPU_WORDS];
static struct want *wants;
static int want_count, want_size;
/* Name -> index into wants (open addressing, at most half full): a rebuild
 * re-carries N nodes in O(N), not O(N^2). */
static int *want_slots;
static uint32_t want_slots_size;
static pthread_mutex_t sync_lock = PTHREAD_MUTEX_INITIALIZER;
/* A node whose record proves no rebuild happened since we last looked.
 * Read without sync_lock on the fast path: a torn read only sends the
 * caller down the locked slow path. */
static volatile int witness_inx = -1;
static char witness_name[256];
static uint64_t resyncs;	/* rebuilds seen */
/* Nodes whose pods hold more than jobs leave: re-carried before every
 * allocation, so capacity a job frees goes back to the pods first. */
static int clamped_nodes;
static uint64_t checks, check_ns; /* user_update calls and their cost */

static const char *gres_names[2] = { GRES_CARRY_CPU, GRES_CARRY_MEM };

/* Name -> index tables (open addressing, power-of-two size, at most half
 * full) over arrays of structs whose first member is the name: the slot
 * that holds `name`'s index, or the free slot where it belongs. */
static int *_slot(int *slots, uint32_t size, const void *array, size_t stride,
		  const char *name)
{
	uint32_t h = 2166136261u, mask = size - 1; /* FNV-1a */

	for (const char *p = name; *p; p++)
		h = (h ^ (unsigned char) *p) * 16777619u;
	for (h &= mask; slots[h] >= 0; h = (h + 1) & mask)
		if (!xstrcmp(*(char **) ((char *) array + slots[h] * stride), name))
			break;
	return &slots[h];
}

/* (Re)index the first `count` entries of `array` into *slots, with room
 * for `room` of them. */
static void _index(int **slots, uint32_t *size, const void *array, size_t stride,
		   int count, int room)
{
	if (2 * (uint32_t) room > *size || !*slots) {
		while (2 * (uint32_t) room > *size || *size < 128)
			*size = *size ? *size * 2 : 128;
		xfree(*slots);
		*slots = xcalloc(*size, sizeof(**slots));
	}
	memset(*slots, 0xff, *size * sizeof(**slots));
	for (int i = 0; i < count; i++)
		*_slot(*slots, *size, array, stride,
		       *(char **) ((char *) array + i * stride)) = i;
}

static int *_want_slot(const char *name)
{
	return _slot(want_slots, want_slots_size, wants, sizeof(*wants), name);
}

static struct want *_want_find(const char *name)
{
	int *slot;

	if (!want_slots_size)
		return NULL;
	slot = _want_slot(name);
	return *slot < 0 ? NULL : &wants[*slot];
}

static void _want_set(const char *name, uint64_t cpu, uint64_t mem, const uint64_t *gpus)
{
	struct want *w = _want_find(name);

	if (!w) {
		if (want_count == want_size) {
			want_size = want_size ? want_size * 2 : 64;
			xrecalloc(wants, want_size, sizeof(*wants));
		}
		if (2 * (uint32_t) (want_count + 1) > want_slots_size)
			_index(&want_slots, &want_slots_size, wants, sizeof(*wants),
			       want_count, want_count + 1);
		w = &wants[want_count];
		w->name = xstrdup(name);
		*_want_slot(name) = want_count++;
	}
	w->cnt[0] = cpu;
	w->cnt[1] = mem;
	memcpy(w->gpus, gpus ? gpus : no_indices, sizeof(w->gpus));
}

/* The node's record of GRES g (0 k8scpu, 1 k8smemory), or NULL. */
static gres_node_state_t *_gres_ns(node_record_t *node_ptr, int g)
{
	static uint32_t ids[2];
	gres_state_t *gres_state;

	if (!ids[g])
		ids[g] = gres_build_id((char *) gres_names[g]);
	if (!node_ptr || !node_ptr->gres_list ||
	    !(gres_state = list_find_first(node_ptr->gres_list, gres_find_id,
					   &ids[g])))
		return NULL;
	return gres_state->gres_data;
}

/* The share this record carries (0 after a rebuild: alloc = jobs only). */
static uint64_t _carried(gres_node_state_t *ns)
{
	return (ns->topo_cnt == 0 && ns->topo_gres_cnt_alloc) ?
		ns->topo_gres_cnt_alloc[0] : 0;
}

/* What jobs hold on this record. */
static uint64_t _jobs(gres_node_state_t *ns)
{
	uint64_t carried = _carried(ns);

	return ns->gres_cnt_alloc >= carried ? ns->gres_cnt_alloc - carried : 0;
}

/* One record's new share (_carry), applied under its list's lock. */
struct carry {
	gres_node_state_t *ns;
	uint64_t want;
	bool clamped;
};

static int _carry_locked(void *x, void *arg)
{
	struct carry *c = arg;
	gres_node_state_t *ns = c->ns;
	uint64_t jobs, room, carry;

	if (((gres_state_t *) x)->gres_data != ns)
		return 0;
	jobs = _jobs(ns);
	room = ns->gres_cnt_avail > jobs ? ns->gres_cnt_avail - jobs : 0;
	carry = MIN(c->want, room);
	c->clamped = carry < c->want;
	if (!ns->topo_gres_cnt_alloc)
		ns->topo_gres_cnt_alloc = xcalloc(1, sizeof(uint64_t));
	if (ns->topo_gres_cnt_alloc[0] != carry || ns->gres_cnt_alloc != jobs + carry) {
		ns->topo_gres_cnt_alloc[0] = carry;
		ns->gres_cnt_alloc = jobs + carry;
		xfree(ns->gres_used); /* cached GresUsed string, rebuilt on demand */
	}
	return 0;
}

/*
 * Make one record carry `want` next to its jobs, clamped so that allocated
 * never exceeds the total (Slurm subtracts unsigned: alloc > avail would
 * look like a huge free count).  Needs the node write lock, or a read lock
 * plus sync_lock (see user_update): other readers then may be packing the
 * node's GresUsed, so the record changes under its list's own lock, which
 * Slurm's readers of that cached string take too (list_for_each).
 */
static bool _carry(node_record_t *node_ptr, int g, uint64_t want)
{
	struct carry c = { .ns = _gres_ns(node_ptr, g), .want = want };

	if (!c.ns)
		return false; /* not registered yet: node_xlate will call us */
	if (c.ns->topo_cnt) {
		error("%s: %s: node %s: %s has File= topology; it must be CountOnly (gres.conf)",
		      LOG_PREFIX, __func__, node_ptr->name, gres_names[g]);
		return false;
	}
	(void) list_for_each(node_ptr->gres_list, _carry_locked, &c);
	return c.clamped;
}

static void _carry_node(node_record_t *node_ptr)
{
	struct want *w = _want_find(node_ptr->name);
	bool clamped = false;

	for (int g = 0; g < 2; g++)
		clamped |= _carry(node_ptr, g, w ? w->cnt[g] : 0);
	if (w)
		clamped |= gpu_carry(node_ptr, w->gpus, &w->gpus_carried);
	if (!w || clamped == w->clamped)
		return;
	w->clamped = clamped;
	clamped_nodes += clamped ? 1 : -1;
	if (clamped)
		error("%s: %s: node %s: pods hold %" PRIu64 " k8scpu/%" PRIu64 " k8smemory (or "
		      "GPU indices), more than Slurm jobs leave or the node has; carrying what "
		      "fits, and what jobs free goes to the pods first: no new job starts there "
		      "until they leave", LOG_PREFIX,
		      __func__, node_ptr->name, w->cnt[0], w->cnt[1]);
	else
		info("%s: %s: node %s: its pods fit next to Slurm's jobs again", LOG_PREFIX,
		     __func__, node_ptr->name);
}

/* O(1): does the witness record still carry its array (no rebuild)? */
static bool _intact(void)
{
	node_record_t *node_ptr;
	gres_node_state_t *ns;

	int inx = witness_inx;

	if (inx < 0 || inx >= node_record_count ||
	    !(node_ptr = node_record_table_ptr[inx]) || !node_ptr->name ||
	    strncmp(node_ptr->name, witness_name, sizeof(witness_name)) ||
	    !(ns = _gres_ns(node_ptr, 0)))
		return false;
	return ns->topo_gres_cnt_alloc != NULL;
}

/* Carry every node's share from scratch and pick a new witness (sync_lock
 * held).  False: no node has its k8s GRES yet. */
static bool _carry_every_node(void)
{
	node_record_t *node_ptr;

	witness_inx = -1;
	for (int i = 0; (node_ptr = next_node(&i)); i++) {
		_carry_node(node_ptr);
		if (witness_inx < 0 && _gres_ns(node_ptr, 0) &&
		    strlen(node_ptr->name) < sizeof(witness_name)) {
			strcpy(witness_name, node_ptr->name);
			witness_inx = node_ptr->index;
		}
	}
	if (witness_inx < 0)
		return false;
	last_node_update = time(NULL);
	return true;
}

/* Has Slurm rebuilt allocations from jobs, or do pods wait for what jobs
 * free?  O(1), no lock of ours; the node lock held (reads the node table). */
extern bool gres_carry_resync_due(void)
{
	return !_intact() || clamped_nodes;
}

/* Put every node's share back if Slurm rebuilt allocations from jobs, and
 * top up nodes whose pods hold more than jobs left them. */
extern void gres_carry_resync(void)
{
	node_record_t *node_ptr;

	if (!gres_carry_resync_due())
		return; /* the common case */
	slurm_mutex_lock(&sync_lock);
	if (_intact()) {
		/* Jobs may have ended on a clamped node: its freed capacity
		 * is the pods', not the next job's. */
		for (int i = 0; clamped_nodes && i < want_count; i++)
			if (wants[i].clamped && (node_ptr = find_node_record(wants[i].name)))
				_carry_node(node_ptr);
	} else {
		/* Startup and a backup's takeover rebuild too: if this process
		 * is in control now but another owned the journal until a
		 * moment ago, load it before any job is placed. */
		(void) ledger_server_claim();
		if (_carry_every_node())
			verbose("%s: %s: allocations were rebuilt (%" PRIu64
			      "); Kubernetes' share is back on every node",
			      LOG_PREFIX, __func__, ++resyncs);
	}
	slurm_mutex_unlock(&sync_lock);
}

/* After the journal was (re)loaded: slurmctld's job+node write locks held. */
extern void gres_carry_all(void)
{
	slurm_mutex_lock(&sync_lock);
	(void) _carry_every_node();
	slurm_mutex_unlock(&sync_lock);
}

/* --- Facts the ledger decides on, and shares it sets -------------------
 * Ledger callbacks (pyk8sres_core.h), called from Python under slurmctld's
 * job+node write locks. */
static int _node_facts(node_record_t *node_ptr, uint64_t *out)
{
	gres_node_state_t *cpu, *mem;

	if (!(cpu = _gres_ns(node_ptr, 0)) ||
	    !(mem = _gres_ns(node_ptr, 1)))
		return -1;
	memset(out, 0, PYK8SRES_FACTS_WORDS * sizeof(*out));
	out[0] = cpu->gres_cnt_avail;
	out[1] = mem->gres_cnt_avail;
	out[2] = _jobs(cpu);
	out[3] = _jobs(mem);
	{
		struct want *w = _want_find(node_ptr->name);

		gpu_carry_facts(node_ptr, w ? &w->gpus_carried : &no_gpus, out + 4);
	}
	return 0;
}

extern int gres_carry_facts(const char *name, uint64_t *out)
{
	return _node_facts(find_node_record((char *) name), out);
}

/* A `show` runs without slurmctld's locks on a copy of every node's facts,
 * taken under the node lock (server thread only): the lock is held for a C
 * loop, not for building the reply in Python. */
struct fact_copy {
	char *name;		/* first: _slot() reads it */
	bool ok;		/* has k8s GRES */
	uint64_t facts[PYK8SRES_FACTS_WORDS];
	uint64_t gen;		/* copy_gen when these facts last changed */
};
static struct fact_copy *copies;
static int copy_count, copy_size;
static int *copy_slots;
static uint32_t copy_slots_size;
static bool copy_indexed;
/* A `show` since a token lists only the nodes whose facts changed: each
 * copy compares with the one before.  copy_layout moves when the node table
 * itself changed (a node added or gone): then nothing can be listed as
 * "changed since", and the caller gets every node. */
static uint64_t copy_gen, copy_layout = 1;

extern void gres_carry_copy_facts(void)
{
	node_record_t *node_ptr;
	uint64_t layout = copy_layout;
	int count = 0;

	/* Only the node read lock is held here, as on the submit path, where
	 * a resync may load the journal and grow the wants table that
	 * _node_facts reads: sync_lock keeps the two apart. */
	slurm_mutex_lock(&sync_lock);
	for (int i = 0; (node_ptr = next_node(&i)); i++) {
		struct fact_copy *c;
		uint64_t facts[PYK8SRES_FACTS_WORDS] = { 0 };
		bool ok;

		if (count == copy_size) {
			copy_size = copy_size ? copy_size * 2 : 64;
			xrecalloc(copies, copy_size, sizeof(*copies));
		}
		c = &copies[count++];
		if (count > copy_count || xstrcmp(c->name, node_ptr->name)) {
			xfree(c->name);
			c->name = xstrdup(node_ptr->name);
			c->ok = false;
			copy_layout++;
		}
		ok = !_node_facts(node_ptr, facts);
		if (ok != c->ok || memcmp(facts, c->facts, sizeof(facts))) {
			memcpy(c->facts, facts, sizeof(facts));
			c->ok = ok;
			c->gen = ++copy_gen;
		}
	}
	slurm_mutex_unlock(&sync_lock);
	if (count != copy_count)
		copy_layout++;
	copy_count = count;
	if (copy_layout != layout)	/* the same names keep their index */
		copy_indexed = false;
}

/* Indices of the copied nodes whose facts changed after generation `since`
 * of layout `layout` (at most `max`); -1 when that cannot be said (another
 * layout, or more than `max`).  now[0..1] get the current layout and
 * generation, the caller's next token. */
extern int gres_carry_copied_changes(uint64_t layout, uint64_t since, uint64_t *now,
			   int *indices, int max)
{
	int n = 0;

	now[0] = copy_layout;
	now[1] = copy_gen;
	if (layout != copy_layout || since > copy_gen)
		return -1;
	for (int i = 0; i < copy_count && since < copy_gen; i++)
		if (copies[i].gen > since) {
			if (n == max)
				return -1;
			indices[n++] = i;
		}
	return n;
}

extern int gres_carry_copied_facts(const char *name, uint64_t *out)
{
	int inx;

	if (!copy_indexed) {	/* outside slurmctld's locks, once per layout */
		_index(&copy_slots, &copy_slots_size, copies, sizeof(*copies),
		       copy_count, copy_count);
		copy_indexed = true;
	}
	inx = *_slot(copy_slots, copy_slots_size, copies, sizeof(*copies), name);
	if (inx < 0 || !copies[inx].ok)
		return -1;
	memcpy(out, copies[inx].facts, sizeof(copies[inx].facts));
	return 0;
}

extern const char *gres_carry_copied_node_name(int index)
{
	return index >= 0 && index < copy_count ? copies[index].name : NULL;
}

static bool freed;	/* a share was lowered since gres_carry_take_freed */

/* Does the new share leave anything the old one held? */
static bool _lowers(const struct want *w, uint64_t cpu, uint64_t mem,
		    const uint64_t *gpus)
{
	if (!w)
		return false;
	if (cpu < w->cnt[0] || mem < w->cnt[1])
		return true;
	for (int i = 0; i < PYK8SRES_GPU_WORDS; i++)
		if (w->gpus[i] & ~(gpus ? gpus[i] : 0))
			return true;
	return false;
}

extern void gres_carry_share(const char *name, uint64_t cpu, uint64_t mem,
			     const uint64_t *gpus)
{
	node_record_t *node_ptr;

	freed |= _lowers(_want_find(name), cpu, mem, gpus);
	_want_set(name, cpu, mem, gpus);
	if ((node_ptr = find_node_record((char *) name))) {
		_carry_node(node_ptr);
		last_node_update = time(NULL);
	}
}

extern bool gres_carry_take_freed(void)
{
	bool was = freed;

	freed = false;
	return was;
}

extern void gres_carry_stats(uint64_t *out)
{
	out[0] = __atomic_load_n(&checks, __ATOMIC_RELAXED);
	out[1] = __atomic_load_n(&check_ns, __ATOMIC_RELAXED);
	out[2] = resyncs;
}

/* A journal load: remember only; the caller carries every node after. */
extern void gres_carry_remember(const char *name, uint64_t cpu, uint64_t mem,
				const uint64_t *gpus)
{
	_want_set(name, cpu, mem, gpus);
}

/*
 * Set one count-only GRES's total on the node to `count` (capacity).
 * gres_node_feature() does the bookkeeping (record, gres string, the
 * node_feature flag that stops registration from comparing counts), but it
 * stores avail = count - allocated; we set avail = count.  Never below what
 * running jobs hold: when slurmctld rebuilds allocations it drops the GRES of
 * every job that does not fit the node's count ("overallocated resources":
 * GresUsed falls to what fits), after which Slurm would hand them out twice.
 */
static int _set_gres(node_record_t *node_ptr, int g, uint64_t count)
{
	gres_node_state_t *ns = _gres_ns(node_ptr, g);
	uint64_t size = count;

	if (ns && _jobs(ns) > count) {
		size = _jobs(ns);
		verbose("%s: %s: node %s: %s=%" PRIu64 " is below the %" PRIu64
			" running jobs hold; keeping %" PRIu64 " until they end",
			LOG_PREFIX, __func__, node_ptr->name, gres_names[g], count,
			size, size);
	}
	gres_node_feature(node_ptr->name, (char *) gres_names[g], size,
			  &node_ptr->gres, &node_ptr->gres_list);
	if (!(ns = _gres_ns(node_ptr, g))) {
		error("%s: %s: node %s has no %s record after setting it",
		      LOG_PREFIX, __func__, node_ptr->name, gres_names[g]);
		return SLURM_ERROR;
	}
	ns->gres_cnt_avail = size;
	return SLURM_SUCCESS;
}


extern int gres_carry_set_capacity(node_record_t *node_ptr, const uint64_t *cnt)
{
	slurm_mutex_lock(&sync_lock);
	for (int g = 0; g < 2; g++)
		if (_set_gres(node_ptr, g, cnt[g])) {
			slurm_mutex_unlock(&sync_lock);
			return SLURM_ERROR;
		}
	_carry_node(node_ptr);
	slurm_mutex_unlock(&sync_lock);
	last_node_update = time(NULL);
	return SLURM_SUCCESS;
}

extern void gres_carry_check(void)
{
	struct timespec t0, t1;

	clock_gettime(CLOCK_MONOTONIC, &t0);
	gres_carry_resync();
	clock_gettime(CLOCK_MONOTONIC, &t1);
	__atomic_add_fetch(&checks, 1, __ATOMIC_RELAXED);
	__atomic_add_fetch(&check_ns, (uint64_t) ((t1.tv_sec - t0.tv_sec) * 1000000000L +
						 (t1.tv_nsec - t0.tv_nsec)),
			   __ATOMIC_RELAXED);
}
