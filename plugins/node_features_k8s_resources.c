/*
 * node_features/k8s_resources: every node's k8scpu/k8smemory, and the ledger.
 *
 * Capacity: when a node registers (node_xlate), at startup and reconfigure
 * (get_node), its total k8scpu/k8smemory is set to CPUs/RealMemory minus the
 * admin's reserve (pyk8sres.slurmctld.nodefeatures).  The GRES are marked
 * node_feature, so slurmctld never drains a node over them.
 *
 * The ledger: what Kubernetes holds on a node is *allocated* in Slurm's own
 * GRES accounting next to what jobs hold (gres_cnt_alloc = jobs + share), so
 * a job that fits the node queues with reason Resources until pods leave,
 * and nothing is granted twice.  ledger_server.c serves the request socket
 * (reserve/release/set/show, pyk8sres.policy.ledger) on its own thread; each
 * request is decided and applied under slurmctld's job+node write locks,
 * atomically with job starts.  This file carries the shares: the share each
 * record carries is kept inside that record, in
 * topo_gres_cnt_alloc[0]: for a count-only GRES (topo_cnt == 0) Slurm reads
 * that array nowhere, and gres_node_state_dealloc_all() -- the start of every
 * rebuild of allocations from jobs (startup, reconfigure, partition changes,
 * setdebugflags, dynamic nodes) -- frees it.  So "no array" means exactly
 * "alloc holds jobs only", checked in O(1) before every scheduling attempt
 * (user_update, called at the top of select_nodes) and every request; the
 * share is then added back before any job can be allocated onto it.
 *
 * Needs Slurm internals (node_record_t, gres_node_state_t): build against
 * the configured source of the exact installed Slurm (tools/slurm-source.sh).
 */
#define _GNU_SOURCE /* dladdr in core_loader.h */
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <time.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>

#include "slurm/slurm.h"
#include "slurm/slurm_errno.h"

#include "src/common/slurm_xlator.h"
#include "src/common/hostlist.h"
#include "src/common/list.h"
#include "src/common/log.h"
#include "src/common/node_conf.h"
#include "src/common/read_config.h"
#include "src/common/run_in_daemon.h"
#include "src/common/xmalloc.h"
#include "src/common/xstring.h"
#if PYK8SRES_INTERFACES_DIR /* detected by meson: src/interfaces/ (23.02+) */
#include "src/interfaces/gres.h"
#include "src/interfaces/select.h"
#else
#include "src/common/gres.h"
#endif

#include "core_loader.h"
#include "ledger_server.h"

const char plugin_name[] = "node_features k8s_resources plugin";
const char plugin_type[] = "node_features/k8s_resources";
const uint32_t plugin_version = SLURM_VERSION_NUMBER;

/* What slurmd reports so that slurmctld calls node_xlate() at registration;
 * node_xlate() removes it again, so node features stay as configured. */
#define MARKER "k8s_resources_managed"
#define GRES_CPU "k8scpu"
#define GRES_MEM "k8smemory"

/* The layout we rely on: pinned per verified release, or the tree the running
 * slurmctld was compiled from; any other release fails the build. */
#include "slurm_layout.h"

static struct pyk8sres_core core;
static bool core_ok;

/* --- The ledger's side in C: shares wanted per node ---------------------
 * Python decides and persists (pyk8sres/slurmctld/ledger.py); C keeps the
 * wanted share of every node to re-apply it after a rebuild without
 * entering Python on the scheduling path. */
struct want {
	char *name;
	uint64_t cnt[2];	/* k8scpu CPUs, k8smemory MB */
	bool clamped;		/* carries less: jobs leave less than pods hold */
};
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

static const char *gres_names[2] = { GRES_CPU, GRES_MEM };

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

static void _want_set(const char *name, uint64_t cpu, uint64_t mem)
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
}

/* Both GRES must be in GresTypes, or gres_node_feature() makes records that
 * no GRES plugin owns. */
static int _check_gres_types(void)
{
	char *types = slurm_conf.gres_plugins, *copy, *tok, *save = NULL;
	int found = 0;

	copy = xstrdup(types);
	for (tok = strtok_r(copy, ",", &save); tok;
	     tok = strtok_r(NULL, ",", &save)) {
		if (!xstrcmp(tok, GRES_CPU))
			found |= 1;
		else if (!xstrcmp(tok, GRES_MEM))
			found |= 2;
	}
	xfree(copy);
	if (found != 3) {
		error("%s: %s: GresTypes=%s lacks %s and/or %s",
		      plugin_type, __func__, types ? types : "", GRES_CPU,
		      GRES_MEM);
		return SLURM_ERROR;
	}
	return SLURM_SUCCESS;
}

/* Re-read k8s_resources.conf (reserve, ledger users). */
static void _core_reconfigure(void)
{
	char err[PYK8SRES_OUT_LEN] = "";
	int accept_on_error = 0; /* job_submit's setting: not ours */

	if (core.reconfigure(slurm_conf.slurm_conf, &accept_on_error, err,
			     sizeof(err)))
		error("%s: %s: %s", plugin_type, __func__, err);
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
		      plugin_type, __func__, node_ptr->name, gres_names[g]);
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
	if (!w || clamped == w->clamped)
		return;
	w->clamped = clamped;
	clamped_nodes += clamped ? 1 : -1;
	if (clamped)
		error("%s: %s: node %s: pods hold %" PRIu64 " k8scpu/%" PRIu64 " k8smemory, more "
		      "than Slurm jobs leave; carrying what fits, and what jobs free goes to the "
		      "pods first: no new job starts there until they leave", plugin_type,
		      __func__, node_ptr->name, w->cnt[0], w->cnt[1]);
	else
		info("%s: %s: node %s: its pods fit next to Slurm's jobs again", plugin_type,
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
static bool _resync_due(void)
{
	return !_intact() || clamped_nodes;
}

/* Put every node's share back if Slurm rebuilt allocations from jobs, and
 * top up nodes whose pods hold more than jobs left them. */
static void _resync_if_rebuilt(void)
{
	node_record_t *node_ptr;

	if (!_resync_due())
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
			      plugin_type, __func__, ++resyncs);
	}
	slurm_mutex_unlock(&sync_lock);
}

/* After the journal was (re)loaded: slurmctld's job+node write locks held. */
static void _carry_all(void)
{
	slurm_mutex_lock(&sync_lock);
	(void) _carry_every_node();
	slurm_mutex_unlock(&sync_lock);
}

/* Ledger callbacks (pyk8sres_core.h), called from Python under our locks. */
static int _node_facts(node_record_t *node_ptr, uint64_t *out)
{
	gres_node_state_t *cpu, *mem;

	if (!(cpu = _gres_ns(node_ptr, 0)) ||
	    !(mem = _gres_ns(node_ptr, 1)))
		return -1;
	out[0] = cpu->gres_cnt_avail;
	out[1] = mem->gres_cnt_avail;
	out[2] = _jobs(cpu);
	out[3] = _jobs(mem);
	return 0;
}

static int _facts(const char *name, uint64_t *out)
{
	return _node_facts(find_node_record((char *) name), out);
}

/* A `show` runs without slurmctld's locks on a copy of every node's facts,
 * taken under the node lock (server thread only): the lock is held for a C
 * loop, not for building the reply in Python. */
struct fact_copy {
	char *name;		/* first: _slot() reads it */
	bool ok;		/* has k8s GRES */
	uint64_t facts[4];
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

static void _copy_facts(void)
{
	node_record_t *node_ptr;
	uint64_t layout = copy_layout;
	int count = 0;

	for (int i = 0; (node_ptr = next_node(&i)); i++) {
		struct fact_copy *c;
		uint64_t facts[4] = { 0 };
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
static int _copied_changes(uint64_t layout, uint64_t since, uint64_t *now,
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

static int _copied_facts(const char *name, uint64_t *out)
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

static const char *_copied_node_name(int index)
{
	return index >= 0 && index < copy_count ? copies[index].name : NULL;
}

static void _share(const char *name, uint64_t cpu, uint64_t mem)
{
	node_record_t *node_ptr;

	_want_set(name, cpu, mem);
	if ((node_ptr = find_node_record((char *) name))) {
		_carry_node(node_ptr);
		last_node_update = time(NULL);
	}
}

static void _stats(uint64_t *out)
{
	out[0] = __atomic_load_n(&checks, __ATOMIC_RELAXED);
	out[1] = __atomic_load_n(&check_ns, __ATOMIC_RELAXED);
	out[2] = resyncs;
}

static const char *_node_name(int index)
{
	if (index < 0 || index >= node_record_count)
		return NULL;
	return node_record_table_ptr[index] ? node_record_table_ptr[index]->name : "";
}

/* A journal load: remember only; the caller carries every node after. */
static void _remember(const char *name, uint64_t cpu, uint64_t mem)
{
	_want_set(name, cpu, mem);
}

#if !PYK8SRES_NF_GET_NODE
static int _apply(node_record_t *node_ptr);

/*
 * 25.11+ calls no get_node(NULL) at startup: give every node its capacity
 * here (job and node write locks, partition read lock held), as
 * registration would; a node that never registers keeps it, as on older
 * releases.  Slurm rebuilt allocations from the jobs before this, and
 * dropped the k8scpu/k8smemory of every job that did not fit a node's count
 * then ("overallocated resources": a node whose state file was lost or
 * half rewritten comes back with none); rebuild once more now that every
 * node has its count, or pods would be admitted onto those jobs' CPUs.
 */
static void _give_capacity(void)
{
	node_record_t *node_ptr;

	for (int i = 0; (node_ptr = next_node(&i)); i++)
		(void) _apply(node_ptr);
	select_g_reconfigure();
	_carry_all();
}
#endif

static const struct ledger_plugin_ops ledger_ops = {
	.facts = _facts,
	.share = _share,
	.remember = _remember,
	.node_name = _node_name,
	.stats = _stats,
	.resync = _resync_if_rebuilt,
	.resync_due = _resync_due,
	.carry_all = _carry_all,
#if !PYK8SRES_NF_GET_NODE
	.give_capacity = _give_capacity,
#endif
	.copy_facts = _copy_facts,
	.copied_facts = _copied_facts,
	.copied_node_name = _copied_node_name,
	.copied_changes = _copied_changes,
};

/*
 * Set one count-only GRES's total on the node to `count` (capacity).
 * gres_node_feature() does the bookkeeping (record, gres string, the
 * node_feature flag that stops registration from comparing counts), but it
 * stores avail = count - allocated; we set avail = count.  Never below what
 * running jobs hold: when slurmctld rebuilds allocations it drops the GRES of
 * every job that does not fit the node's count (seen: GresUsed k8scpu 2 -> 0,
 * "overallocated resources"), after which Slurm would hand them out twice.
 */
static int _set_gres(node_record_t *node_ptr, int g, uint64_t count)
{
	gres_node_state_t *ns = _gres_ns(node_ptr, g);
	uint64_t size = count;

	if (ns && _jobs(ns) > count) {
		size = _jobs(ns);
		verbose("%s: %s: node %s: %s=%" PRIu64 " is below the %" PRIu64
			" running jobs hold; keeping %" PRIu64 " until they end",
			plugin_type, __func__, node_ptr->name, gres_names[g], count,
			size, size);
	}
	gres_node_feature(node_ptr->name, (char *) gres_names[g], size,
			  &node_ptr->gres, &node_ptr->gres_list);
	if (!(ns = _gres_ns(node_ptr, g))) {
		error("%s: %s: node %s has no %s record after setting it",
		      plugin_type, __func__, node_ptr->name, gres_names[g]);
		return SLURM_ERROR;
	}
	ns->gres_cnt_avail = size;
	return SLURM_SUCCESS;
}

/* Give the node its capacity, then its share (clamped to what fits). */
static int _apply(node_record_t *node_ptr)
{
	char err[PYK8SRES_OUT_LEN] = "";
	uint64_t cnt[2] = { 0, 0 };
	int rv = SLURM_ERROR;

	if (!node_ptr || !node_ptr->name)
		goto fail;
	if (!core_ok ||
	    core.node_counts(node_ptr->name, node_ptr->cpus,
			     node_ptr->real_memory, &cnt[0], &cnt[1], err,
			     sizeof(err))) {
		/* Fail closed: never offer capacity we cannot account for. */
		error("%s: %s: node %s: %s; holding k8scpu/k8smemory at 0",
		      plugin_type, __func__, node_ptr->name,
		      core_ok ? err : "Python core not loaded");
		cnt[0] = cnt[1] = 0;
	}
	slurm_mutex_lock(&sync_lock);
	for (int g = 0; g < 2; g++)
		if (_set_gres(node_ptr, g, cnt[g])) {
			slurm_mutex_unlock(&sync_lock);
			goto fail;
		}
	_carry_node(node_ptr);
	slurm_mutex_unlock(&sync_lock);
	last_node_update = time(NULL);
	debug("%s: %s: node %s: %s=%" PRIu64 " %s=%" PRIu64, plugin_type,
	      __func__, node_ptr->name, GRES_CPU, cnt[0], GRES_MEM, cnt[1]);
	rv = SLURM_SUCCESS;
fail:
	return rv;
}

extern int init(void)
{
	int rv = SLURM_ERROR;

	/* slurmd only reports the marker: no Python there. */
	if (!running_in_slurmctld())
		return SLURM_SUCCESS;
	if (_check_gres_types())
		goto fail;
	if (pyk8sres_core_load(&core, plugin_type, (void *) init))
		goto fail;
	core_ok = true;
	_core_reconfigure();
	if (ledger_server_start(&core, &ledger_ops))
		goto fail;
	verbose("%s: %s: loaded", plugin_type, __func__);
	rv = SLURM_SUCCESS;
fail:
	return rv;
}

/* Never dlclose the core: Python cannot be restarted in a process. */
extern int fini(void)
{
	ledger_server_stop();
	return SLURM_SUCCESS;
}

/* slurmd: report the marker so slurmctld calls node_xlate() for this node. */
extern void node_features_p_node_state(char **avail_modes, char **current_mode)
{
	if (!avail_modes)
		return;
	if (*avail_modes && (*avail_modes)[0])
		xstrfmtcat(*avail_modes, ",%s", MARKER);
	else {
		xfree(*avail_modes);
		*avail_modes = xstrdup(MARKER);
	}
}

/* `features` without the marker; xfree the result. */
static char *_strip_marker(const char *features)
{
	char *copy, *tok, *save = NULL, *out = NULL;
	const char *sep = "";

	if (!features)
		return NULL;
	copy = xstrdup(features);
	for (tok = strtok_r(copy, ",", &save); tok;
	     tok = strtok_r(NULL, ",", &save)) {
		if (!xstrcmp(tok, MARKER))
			continue;
		xstrfmtcat(out, "%s%s", sep, tok);
		sep = ",";
	}
	xfree(copy);
	return out;
}

static bool _has_marker(const char *features)
{
	char *stripped = _strip_marker(features);
	bool has = xstrcmp(stripped, features) != 0;

	xfree(stripped);
	return has;
}

/*
 * slurmctld, node registration (new_features carries the marker), right
 * before the node's GRES are validated: set the counts, return the features
 * unchanged.  Other callers (scontrol update ActiveFeatures, reboots) get the
 * behaviour of having no plugin.
 */
extern char *node_features_p_node_xlate(char *new_features, char *orig_features,
					char *avail_features, int node_inx)
{
	if (!_has_marker(new_features))
		return xstrdup(new_features);
	if ((node_inx >= 0) && (node_inx < node_record_count))
		(void) _apply(node_record_table_ptr[node_inx]);
	else
		error("%s: %s: bad node index %d", plugin_type, __func__,
		      node_inx);
	return _strip_marker(orig_features);
}

#if PYK8SRES_NF_GET_NODE /* slurmctld no longer calls it from 25.11 on */
/* Startup, reconfigure (node_list NULL) and node reboots: set counts before
 * any scheduling. */
extern int node_features_p_get_node(char *node_list)
{
	node_record_t *node_ptr;
	char *name;
	int i, rc = SLURM_SUCCESS;

	if (!running_in_slurmctld())
		return SLURM_SUCCESS;
	if (!node_list) {
		if (core_ok) {
			_core_reconfigure();
			ledger_server_reconfigure();
		}
		for (i = 0; (node_ptr = next_node(&i)); i++)
			if (_apply(node_ptr))
				rc = SLURM_ERROR;
		return rc;
	}
	/* hostlist_t became a pointer type in 23.11: let the compiler say. */
	__auto_type hl = hostlist_create(node_list);
	if (!hl)
		return SLURM_ERROR;
	while ((name = hostlist_shift(hl))) {
		if ((node_ptr = find_node_record(name)) && _apply(node_ptr))
			rc = SLURM_ERROR;
		free(name);
	}
	hostlist_destroy(hl);
	return rc;
}
#endif

extern char *node_features_p_node_xlate2(char *new_features)
{
	return xstrdup(new_features);
}

/* The rest: this plugin manages no changeable features. */
extern uint32_t node_features_p_boot_time(void)
{
	return 0;
}

extern bool node_features_p_changeable_feature(char *feature)
{
	return false;
}

extern bitstr_t *node_features_p_get_node_bitmap(void)
{
	return NULL;
}

extern int node_features_p_overlap(bitstr_t *active_bitmap)
{
	return 0;
}

/* Removed from slurmctld's lookup in 25.11: defined only where looked up. */
#if PYK8SRES_NF_NODE_POWER
extern bool node_features_p_node_power(void)
{
	return false;
}
#endif

#if PYK8SRES_NF_NODE_UPDATE
extern int node_features_p_node_update(char *active_features,
				       bitstr_t *node_bitmap)
{
	return SLURM_SUCCESS;
}
#endif

#if PYK8SRES_NF_NODE_UPDATE_VALID
extern bool node_features_p_node_update_valid(void *node_ptr,
					      update_node_msg_t *update_node_msg)
{
	return true;
}
#endif

#if PYK8SRES_NF_STEP_CONFIG
extern void node_features_p_step_config(bool mem_sort, bitstr_t *numa_bitmap)
{
}
#endif

#if PYK8SRES_NF_JOB_FEATURES_NEED_REBOOT /* looked up from 26.05 on */
/* No changeable features here, so none needs a reboot. */
extern bool node_features_p_job_features_need_reboot(char *features)
{
	return false;
}
#endif

/*
 * Called at the top of select_nodes() before every allocation (main
 * scheduler and backfill), and at submit: the place to put Kubernetes'
 * share back after a rebuild.  O(1) unless a rebuild happened.  Most
 * callers hold the node write lock; those at submit hold it for reading,
 * under which nothing rebuilds and sync_lock keeps two readers from
 * re-applying at once.  true is neutral: results of plugins are ANDed.
 */
extern bool node_features_p_user_update(uid_t uid)
{
	struct timespec t0, t1;

	if (!ledger_server_running())
		return true;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	_resync_if_rebuilt();
	clock_gettime(CLOCK_MONOTONIC, &t1);
	__atomic_add_fetch(&checks, 1, __ATOMIC_RELAXED);
	__atomic_add_fetch(&check_ns, (uint64_t) ((t1.tv_sec - t0.tv_sec) * 1000000000L +
						 (t1.tv_nsec - t0.tv_nsec)),
			   __ATOMIC_RELAXED);
	return true;
}

extern void node_features_p_get_config(config_plugin_params_t *p)
{
	xstrcat(p->name, plugin_type);
}

/*
 * Hooks whose signatures changed (SchedMD git tags): 23.02 gave job_valid and
 * job_xlate the parsed feature list and dropped reboot_weight; 24.05 gave
 * node_set need_reboot and dropped reconfig.  22.05: 19 symbols, 23.x: 18,
 * 24.05-25.05: 17.
 */
/* PYK8SRES_NF_*: detected by meson from the release's node_features ops
 * table and the symbol names it looks up (src/interfaces/node_features.c). */
#if PYK8SRES_NF_JOB_VALID_FEATURE_LIST
extern int node_features_p_job_valid(char *job_features, list_t *feature_list)
{
	return SLURM_SUCCESS;
}

extern char *node_features_p_job_xlate(char *job_features,
				       list_t *feature_list,
				       bitstr_t *job_node_bitmap)
{
	return NULL;
}
#else
extern int node_features_p_job_valid(char *job_features)
{
	return SLURM_SUCCESS;
}

extern char *node_features_p_job_xlate(char *job_features)
{
	return NULL;
}
#endif

#if PYK8SRES_NF_REBOOT_WEIGHT
extern uint32_t node_features_p_reboot_weight(void)
{
	return INFINITE - 1;
}
#endif

#if PYK8SRES_NF_NODE_SET_NEED_REBOOT
extern int node_features_p_node_set(char *active_features, bool *need_reboot)
{
	return SLURM_SUCCESS;
}
#else
extern int node_features_p_node_set(char *active_features)
{
	return SLURM_SUCCESS;
}
#endif

#if PYK8SRES_NF_RECONFIG
/* `scontrol reconfigure` also calls get_node(NULL), which re-reads the
 * configuration before setting counts: nothing more to do here. */
extern int node_features_p_reconfig(void)
{
	return SLURM_SUCCESS;
}
#endif
