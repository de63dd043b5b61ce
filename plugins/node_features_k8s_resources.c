/*
 * node_features/k8s_resources: give every node its k8scpu/k8smemory GRES.
 *
 * slurmd side: node_state() reports one marker feature, so that slurmctld
 * calls node_xlate() for the node each time it registers.
 * slurmctld side: node_xlate() (registration) and get_node() (startup,
 * reconfigure, reboot) set the node's counts to what the Python core says
 * (pyk8sres.slurmctld.nodefeatures.node_counts: capacity minus reserve, lowered by the
 * sync daemon's state file).  The GRES are marked node_feature, so slurmctld
 * never checks them against slurmd's report: no DRAIN/INVALID_REG when
 * Kubernetes lowers a count.  All policy is in Python; this file only moves
 * numbers between Slurm's structures and the core.
 *
 * Needs Slurm internals (node_record_t, gres_node_feature()): build against
 * the configured source of the exact installed Slurm (tools/slurm-source.sh).
 */
#define _GNU_SOURCE /* dladdr in core_loader.h */
#include <inttypes.h>
#include <stdbool.h>
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
#else
#include "src/common/gres.h"
#endif

#include "core_loader.h"

const char plugin_name[] = "node_features k8s_resources plugin";
const char plugin_type[] = "node_features/k8s_resources";
const uint32_t plugin_version = SLURM_VERSION_NUMBER;

/* What slurmd reports so that slurmctld calls node_xlate() at registration;
 * node_xlate() removes it again, so node features stay as configured. */
#define MARKER "k8s_resources_managed"
#define GRES_CPU "k8scpu"
#define GRES_MEM "k8smemory"

/*
 * Layout we rely on.  The structures come from the source headers, but the
 * shipped slurmctld was built from a configure run we only imitate: pin the
 * field types (always) and, for the Debian versions we verified (22.05.8 on
 * bookworm; 24.11.5 on trixie, compiled against its source), the offsets,
 * so a drift fails the build instead of corrupting slurmctld's memory.
 */
#define FIELD_SIZE(t, f) sizeof(((t *) 0)->f)
_Static_assert(FIELD_SIZE(node_record_t, cpus) == sizeof(uint16_t), "cpus");
_Static_assert(FIELD_SIZE(node_record_t, real_memory) == sizeof(uint64_t), "real_memory");
_Static_assert(FIELD_SIZE(node_record_t, gres) == sizeof(char *), "gres");
_Static_assert(FIELD_SIZE(gres_state_t, plugin_id) == sizeof(uint32_t), "plugin_id");
_Static_assert(FIELD_SIZE(gres_node_state_t, gres_cnt_avail) == sizeof(uint64_t), "avail");
_Static_assert(FIELD_SIZE(gres_node_state_t, gres_cnt_alloc) == sizeof(uint64_t), "alloc");
_Static_assert(FIELD_SIZE(gres_node_state_t, node_feature) == sizeof(bool), "node_feature");
#define AT(t, f, off) _Static_assert(offsetof(t, f) == (off), #t "." #f)
#if SLURM_VERSION_NUMBER == SLURM_VERSION_NUM(22,5,8)
AT(node_record_t, cpus, 104);
AT(node_record_t, gres, 168);
AT(node_record_t, gres_list, 176);
AT(node_record_t, name, 232);
AT(node_record_t, real_memory, 344);
AT(gres_state_t, plugin_id, 4);
AT(gres_state_t, gres_data, 8);
AT(gres_node_state_t, node_feature, 25);
AT(gres_node_state_t, gres_cnt_avail, 32);
AT(gres_node_state_t, gres_cnt_alloc, 48);
#elif SLURM_VERSION_NUMBER == SLURM_VERSION_NUM(24,11,5)
AT(node_record_t, cpus, 112);
AT(node_record_t, gres, 192);
AT(node_record_t, gres_list, 200);
AT(node_record_t, name, 272);
AT(node_record_t, real_memory, 376);
AT(gres_state_t, plugin_id, 4);
AT(gres_state_t, gres_data, 8);
AT(gres_node_state_t, node_feature, 25);
AT(gres_node_state_t, gres_cnt_avail, 32);
AT(gres_node_state_t, gres_cnt_alloc, 48);
#endif

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

/* Re-read k8s_resources.conf (state file path, reserve). */
static void _core_reconfigure(void)
{
	char err[PYK8SRES_OUT_LEN] = "";
	int accept_on_error = 0; /* job_submit's setting: not ours */

	if (core.reconfigure(slurm_conf.slurm_conf, &accept_on_error, err,
			     sizeof(err)))
		error("%s: %s: %s", plugin_type, __func__, err);
}

/* The node's GRES record for `plugin_id`, or NULL. */
static gres_node_state_t *_gres_ns(node_record_t *node_ptr, uint32_t plugin_id)
{
	gres_state_t *gres_state;

	if (!node_ptr->gres_list ||
	    !(gres_state = list_find_first(node_ptr->gres_list, gres_find_id,
					   &plugin_id)))
		return NULL;
	return gres_state->gres_data;
}

/*
 * Set one count-only GRES on the node to `count` (the total Slurm may use).
 * gres_node_feature() does the bookkeeping (record, gres string, the
 * node_feature flag that stops registration from comparing counts), but it
 * stores avail = count - allocated: on a busy node that subtracts the running
 * jobs twice, since the scheduler subtracts them again.  We set avail = count.
 *
 * Never below what running jobs hold: when slurmctld rebuilds allocations
 * (startup, reconfigure, a dynamic node joining) it drops the GRES of every
 * job that does not fit the node's count (seen: GresUsed k8scpu 2 -> 0,
 * "overallocated resources"), after which Slurm would hand them out twice.
 * Kept at the held amount, nothing new fits until the jobs end.
 */
static int _set_gres(node_record_t *node_ptr, char *name, uint64_t count)
{
	uint32_t plugin_id = gres_build_id(name);
	gres_node_state_t *gres_ns;
	uint64_t size = count;

	if ((gres_ns = _gres_ns(node_ptr, plugin_id)) &&
	    (gres_ns->gres_cnt_alloc > count)) {
		size = gres_ns->gres_cnt_alloc;
		verbose("%s: %s: node %s: %s=%" PRIu64 " is below the %" PRIu64
			" running jobs hold; keeping %" PRIu64 " until they end",
			plugin_type, __func__, node_ptr->name, name, count,
			size, size);
	}
	gres_node_feature(node_ptr->name, name, size, &node_ptr->gres,
			  &node_ptr->gres_list);
	if (!(gres_ns = _gres_ns(node_ptr, plugin_id))) {
		error("%s: %s: node %s has no %s record after setting it",
		      plugin_type, __func__, node_ptr->name, name);
		return SLURM_ERROR;
	}
	gres_ns->gres_cnt_avail = size;
	return SLURM_SUCCESS;
}

/* Ask the core for the node's counts and apply them. */
static int _apply(node_record_t *node_ptr)
{
	char err[PYK8SRES_OUT_LEN] = "";
	uint64_t cpu = 0, mem = 0;
	int rv = SLURM_ERROR;

	if (!node_ptr || !node_ptr->name)
		goto fail;
	if (!core_ok ||
	    core.node_counts(node_ptr->name, node_ptr->cpus,
			     node_ptr->real_memory, &cpu, &mem, err,
			     sizeof(err))) {
		/* Fail closed: capacity Kubernetes may hold must not go to
		 * Slurm.  The sync daemon's next update lifts the hold. */
		error("%s: %s: node %s: %s; holding k8scpu/k8smemory at 0",
		      plugin_type, __func__, node_ptr->name,
		      core_ok ? err : "Python core not loaded");
		cpu = mem = 0;
	}
	if (_set_gres(node_ptr, GRES_CPU, cpu) ||
	    _set_gres(node_ptr, GRES_MEM, mem))
		goto fail;
	last_node_update = time(NULL);
	debug("%s: %s: node %s: %s=%" PRIu64 " %s=%" PRIu64, plugin_type,
	      __func__, node_ptr->name, GRES_CPU, cpu, GRES_MEM, mem);
	rv = SLURM_SUCCESS;
fail:
	return rv;
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
	verbose("%s: %s: loaded", plugin_type, __func__);
	rv = SLURM_SUCCESS;
fail:
	return rv;
}

/* Never dlclose the core: Python cannot be restarted in a process. */
extern int fini(void)
{
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
 * any scheduling, so capacity Kubernetes holds is never offered. */
extern int node_features_p_get_node(char *node_list)
{
	node_record_t *node_ptr;
	char *name;
	int i, rc = SLURM_SUCCESS;

	if (!running_in_slurmctld())
		return SLURM_SUCCESS;
	if (!node_list) {
		if (core_ok)
			_core_reconfigure();
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

/* true is neutral: results of several plugins are ANDed. */
extern bool node_features_p_user_update(uid_t uid)
{
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
