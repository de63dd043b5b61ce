/*
 * node_features/k8s_resources: every node's k8scpu/k8smemory, and the ledger.
 *
 * Capacity: when a node registers (node_xlate), at startup and reconfigure
 * (get_node), its total k8scpu/k8smemory is set to what Slurm schedules
 * there, CPUs less specialized CPUs and RealMemory less MemSpecLimit, minus
 * the admin's reserve (pyk8sres.slurmctld.nodefeatures).  The GRES are marked
 * node_feature, so slurmctld never drains a node over them.
 *
 * The ledger: what Kubernetes holds on a node is *allocated* in Slurm's own
 * GRES accounting next to what jobs hold, so nothing is granted twice.
 * ledger_server.c serves the request socket (reserve/release/set/show,
 * pyk8sres.policy.ledger) on its own thread; each request is decided and
 * applied under slurmctld's job+node write locks, atomically with job
 * starts.  gres_carry.c keeps the shares in Slurm's GRES records and puts
 * them back after Slurm rebuilds allocations from jobs.  This file is the
 * plugin's hooks: they say when.
 *
 * Needs Slurm internals (node_record_t, gres_node_state_t): build against
 * the configured source of the exact installed Slurm (tools/slurm-source.sh).
 */
#define _GNU_SOURCE /* dladdr in core_loader.h */
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
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
#include "gres_carry.h"
#include "ledger_server.h"

const char plugin_name[] = "node_features k8s_resources plugin";
const char plugin_type[] = "node_features/k8s_resources";
const uint32_t plugin_version = SLURM_VERSION_NUMBER;

/* What slurmd reports so that slurmctld calls node_xlate() at registration;
 * node_xlate() removes it again, so node features stay as configured. */
#define MARKER "k8s_resources_managed"

/* The layout we rely on: pinned per verified release, or the tree the running
 * slurmctld was compiled from; any other release fails the build. */
#include "slurm_layout.h"

static struct pyk8sres_core core;
static bool core_ok;

/* Both GRES must be in GresTypes, or gres_node_feature() makes records that
 * no GRES plugin owns. */
static int _check_gres_types(void)
{
	char *types = slurm_conf.gres_plugins, *copy, *tok, *save = NULL;
	int found = 0;

	copy = xstrdup(types);
	for (tok = strtok_r(copy, ",", &save); tok;
	     tok = strtok_r(NULL, ",", &save)) {
		if (!xstrcmp(tok, GRES_CARRY_CPU))
			found |= 1;
		else if (!xstrcmp(tok, GRES_CARRY_MEM))
			found |= 2;
	}
	xfree(copy);
	if (found != 3) {
		error("%s: %s: GresTypes=%s lacks %s and/or %s",
		      plugin_type, __func__, types ? types : "", GRES_CARRY_CPU,
		      GRES_CARRY_MEM);
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

/* The name of node `index` in slurmctld's table (the ledger's node_name). */
static const char *_node_name(int index)
{
	if (index < 0 || index >= node_record_count)
		return NULL;
	return node_record_table_ptr[index] ? node_record_table_ptr[index]->name : "";
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
	gres_carry_all();
}
#endif

static const struct ledger_plugin_ops ledger_ops = {
	.facts = gres_carry_facts,
	.share = gres_carry_share,
	.take_freed = gres_carry_take_freed,
	.remember = gres_carry_remember,
	.node_name = _node_name,
	.stats = gres_carry_stats,
	.resync = gres_carry_resync,
	.resync_due = gres_carry_resync_due,
	.carry_all = gres_carry_all,
#if !PYK8SRES_NF_GET_NODE
	.give_capacity = _give_capacity,
#endif
	.copy_facts = gres_carry_copy_facts,
	.copied_facts = gres_carry_copied_facts,
	.copied_node_name = gres_carry_copied_node_name,
	.copied_changes = gres_carry_copied_changes,
};

/* Give the node its capacity, then its share (clamped to what fits);
 * `registering`: slurmd's registration, where a node the ledger has not
 * met is held whole (ledger_server_registered). */
static int _apply_as(node_record_t *node_ptr, bool registering)
{
	char err[PYK8SRES_OUT_LEN] = "";
	uint64_t cnt[2] = { 0, 0 };
	int rv = SLURM_ERROR;

	if (!node_ptr || !node_ptr->name)
		goto fail;
	if (!core_ok ||
	    core.node_counts(node_ptr->name, node_ptr->cpus,
			     node_ptr->cpus_efctv, node_ptr->real_memory,
			     node_ptr->mem_spec_limit, &cnt[0], &cnt[1], err,
			     sizeof(err))) {
		/* Fail closed: never offer capacity we cannot account for. */
		error("%s: %s: node %s: %s; holding k8scpu/k8smemory at 0",
		      plugin_type, __func__, node_ptr->name,
		      core_ok ? err : "Python core not loaded");
		cnt[0] = cnt[1] = 0;
	}
	if (gres_carry_set_capacity(node_ptr, cnt))
		goto fail;
	if (registering)
		ledger_server_registered(node_ptr->name, cnt);
	debug("%s: %s: node %s: %s=%" PRIu64 " %s=%" PRIu64, plugin_type,
	      __func__, node_ptr->name, GRES_CARRY_CPU, cnt[0], GRES_CARRY_MEM, cnt[1]);
	rv = SLURM_SUCCESS;
fail:
	return rv;
}

static int _apply(node_record_t *node_ptr)
{
	return _apply_as(node_ptr, false);
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
		(void) _apply_as(node_record_table_ptr[node_inx], true);
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
 * under which nothing rebuilds and gres_carry.c's lock keeps two readers
 * from re-applying at once.  true is neutral: results of plugins are ANDed.
 */
extern bool node_features_p_user_update(uid_t uid)
{
	if (ledger_server_running())
		gres_carry_check();
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
