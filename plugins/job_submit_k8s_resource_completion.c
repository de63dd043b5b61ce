/*
 * job_submit/k8s_resource_completion: every job requests the count-only GRES
 * k8scpu/k8smemory matching the CPUs and memory it will use on each node.
 *
 * Thin shim: copy the job's options into a flat struct, ask the Python core
 * (pyk8sres.slurmctld.completion via libpyk8sres_core.so), apply its answer.
 * No I/O, no allocation on the Python side that Slurm must free.
 */
#define _GNU_SOURCE /* dladdr */
#include <errno.h>
#include <inttypes.h>
#include <time.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <slurm/slurm.h>
#include <slurm/slurm_errno.h>

#include "core_loader.h"

#ifdef PYK8SRES_SLURM_SOURCE
/* Built with the installed Slurm's own source: job_modify can see the job. */
#include "src/slurmctld/slurmctld.h"
#endif

const char plugin_name[] = "k8scpu/k8smemory completion for shared Slurm/Kubernetes nodes";
const char plugin_type[] = "job_submit/k8s_resource_completion";
const uint32_t plugin_version = SLURM_VERSION_NUMBER;

/* Exported by libslurmfull (xmalloc.h and read_config.h are not public). */
extern char *slurm_xstrdup(const char *str);
extern void slurm_xfree(void **ptr);
extern slurm_conf_t slurm_conf;

static struct pyk8sres_core core;
static int accept_on_error; /* OnInternalError=accept in k8s_resources.conf */
/* Jobs accepted uncounted under OnInternalError=accept: all of them, and
 * those not yet named in the log (one line per ACCEPT_LOG_SECONDS at most,
 * so a bug that hits every job cannot flood the log). */
#define ACCEPT_LOG_SECONDS 10
static uint64_t accepted_total, accepted_unlogged;
static time_t accepted_logged;
/* The slurm.conf we configured Python for: its load time (whole seconds)
 * and its hash, so that a reconfigure within the second of the previous
 * load is not missed when slurm.conf changed. */
static time_t conf_seen;
static uint32_t conf_hash_seen;

/* OnInternalError=accept bypasses the invariant for the jobs it lets
 * through: say so whenever it is switched on. */
static void _warn_accept(int was_on)
{
	if (!accept_on_error || was_on)
		return;
	slurm_error("%s: OnInternalError=accept in k8s_resources.conf: a job this plugin fails on (a bug) is accepted WITHOUT k8scpu/k8smemory, so Kubernetes pods may be placed on the CPUs and memory it uses; every such job is logged as \"OnInternalError=accept: job ... accepted UNCOUNTED\". Set OnInternalError=reject (the default) unless you must keep jobs flowing while a plugin bug is fixed",
		    plugin_type);
}

/* The job is accepted unchanged after an internal error: log it, at most
 * one line per ACCEPT_LOG_SECONDS, each counting the jobs since the last. */
static void _log_accepted(uint32_t uid, const char *err)
{
	time_t now = time(NULL);

	accepted_total++;
	accepted_unlogged++;
	if (accepted_logged && now - accepted_logged < ACCEPT_LOG_SECONDS)
		return;
	slurm_error("%s: OnInternalError=accept: job from uid %u accepted UNCOUNTED (no k8scpu/k8smemory: pods may use its CPUs and memory) after an internal error (%s) [%" PRIu64 " such job(s) since the last such line, %" PRIu64 " since slurmctld started]",
		    plugin_type, uid, err, accepted_unlogged, accepted_total);
	accepted_logged = now;
	accepted_unlogged = 0;
}

int init(void)
{
	char err[PYK8SRES_OUT_LEN] = "";

	if (pyk8sres_core_load(&core, plugin_type, (void *) init))
		return SLURM_ERROR;
	if (core.reconfigure(slurm_conf.slurm_conf, &accept_on_error, err,
			     sizeof(err))) {
		slurm_error("%s: %s: %s", plugin_type, __func__, err);
		return SLURM_ERROR;
	}
	_warn_accept(0);
	conf_seen = slurm_conf.last_update;
	conf_hash_seen = slurm_conf.hash_val;
	slurm_verbose("%s: %s: loaded (Slurm %d.%d.%d)", plugin_type, __func__,
		      SLURM_VERSION_MAJOR(SLURM_VERSION_NUMBER),
		      SLURM_VERSION_MINOR(SLURM_VERSION_NUMBER),
		      SLURM_VERSION_MICRO(SLURM_VERSION_NUMBER));
	return SLURM_SUCCESS;
}

/* Python stays loaded: an interpreter cannot be unloaded and started again. */
int fini(void)
{
	return SLURM_SUCCESS;
}

static void _fill_request(struct pyk8sres_job *req, const job_desc_msg_t *d,
			  uint32_t uid, int is_modify)
{
	memset(req, 0, sizeof(*req));
	req->slurm_version = SLURM_VERSION_NUMBER;
	req->is_modify = is_modify;
	req->uid = uid;
	req->cpus_per_task = d->cpus_per_task;
	req->num_tasks = d->num_tasks;
	req->ntasks_per_node = d->ntasks_per_node;
	req->min_cpus = d->min_cpus;
	req->max_cpus = d->max_cpus;
	req->min_nodes = d->min_nodes;
	req->max_nodes = d->max_nodes;
	req->pn_min_cpus = d->pn_min_cpus;
	req->pn_min_memory = d->pn_min_memory;
	req->bitflags = d->bitflags;
	req->shared = d->shared;
	req->contiguous = d->contiguous;
	req->het_job_offset = d->het_job_offset;
	req->def_mem_per_cpu = slurm_conf.def_mem_per_cpu;
	req->partition = d->partition;
	req->tres_per_node = d->tres_per_node;
	req->tres_per_task = d->tres_per_task;
	req->tres_per_job = d->tres_per_job;
	req->tres_per_socket = d->tres_per_socket;
	req->cpus_per_tres = d->cpus_per_tres;
	req->mem_per_tres = d->mem_per_tres;
	req->array_inx = d->array_inx;
	req->cur_num_tasks = NO_VAL;
	req->cur_cpus_per_task = NO_VAL16;
	req->cur_min_cpus = NO_VAL;
	req->cur_min_nodes = NO_VAL;
	req->cur_max_nodes = NO_VAL;
	req->cur_pn_min_cpus = NO_VAL;
	req->cur_pn_min_memory = NO_VAL64;
	req->cur_ntasks_per_node = NO_VAL16;
	req->cur_whole_node = NO_VAL16;
	req->ntasks_per_core = d->ntasks_per_core;
	req->threads_per_core = d->threads_per_core;
	req->overcommit = d->overcommit;
	req->select_type_param = slurm_conf.select_type_param;
	req->max_mem_per_cpu = slurm_conf.max_mem_per_cpu;
	req->cur_ntasks_per_core = NO_VAL16;
	req->cur_threads_per_core = NO_VAL16;
	req->cur_overcommit = NO_VAL16;
	req->spread_job = (d->bitflags & SPREAD_JOB) ? 1 : 0;
	req->cur_spread_job = NO_VAL16;
	req->task_dist = d->task_dist;
	req->cur_task_dist = NO_VAL;
	req->ntasks_per_tres = d->ntasks_per_tres;
	req->cur_ntasks_per_tres = NO_VAL16;
}

#ifdef PYK8SRES_SLURM_SOURCE
struct gpu_defaults {
	uint64_t cpus, mem;  /* DefCpuPerGPU, DefMemPerGPU; NO_VAL64 = not set */
};

/* list_for_each callback: the first entry of each type counts, as in
 * cons_tres common_get_def_cpu_per_gpu(). */
static int _gpu_default(void *item, void *arg)
{
	job_defaults_t *def = item;
	struct gpu_defaults *out = arg;

	if (def->type == JOB_DEF_CPU_PER_GPU && out->cpus == NO_VAL64)
		out->cpus = def->value;
	else if (def->type == JOB_DEF_MEM_PER_GPU && out->mem == NO_VAL64)
		out->mem = def->value;
	return 0;
}
#endif

/* The live memory settings of the partitions the job may run in, for the
 * policy: "name=DefMemPerCPU:MaxMemPerCPU:DefCpuPerGPU:DefMemPerGPU,..."
 * (Slurm's encodings).  Read here because `scontrol update PartitionName=...`
 * (JobDefaults= too) changes them without any reconfigure; slurmctld holds
 * the partition read lock around job_submit. */
static const char *_partition_memory(const char *names, char *out, size_t len)
{
#ifdef PYK8SRES_SLURM_SOURCE
	char list[PYK8SRES_OUT_LEN], *save = NULL, *name;
	size_t used = 0;

	out[0] = '\0';
	if (!names || !names[0]) {
		if (!default_part_loc || !default_part_loc->name)
			return NULL;
		names = default_part_loc->name;
	}
	snprintf(list, sizeof(list), "%s", names);
	for (name = strtok_r(list, ",", &save); name;
	     name = strtok_r(NULL, ",", &save)) {
		part_record_t *part = find_part_record(name);
		struct gpu_defaults gpu = { NO_VAL64, NO_VAL64 };
		int n;

		if (!part)
			continue;
		if (part->job_defaults_list)
			list_for_each(part->job_defaults_list, _gpu_default, &gpu);
		n = snprintf(out + used, len - used,
			     "%s%s=%" PRIu64 ":%" PRIu64 ":%" PRIu64 ":%" PRIu64,
			     used ? "," : "", part->name, part->def_mem_per_cpu,
			     part->max_mem_per_cpu, gpu.cpus, gpu.mem);
		if (n < 0 || (size_t) n >= len - used) {
			out[used] = '\0';
			break;
		}
		used += n;
	}
	return out;
#else
	(void) names;
	(void) out;
	(void) len;
	return NULL;
#endif
}

/* --- What slurmctld really has: partitions and nodes ------------------
 * Completion caps per-node counts with the nodes of the job's partitions.
 * slurm.conf is not enough: `scontrol update PartitionName=p Nodes=...`,
 * dynamic nodes (`slurmd -Z`, `scontrol create node`) and nodes a
 * reconfigure added change them at run time.  job_submit runs under
 * slurmctld's read locks on config, job, node and partition, so the tables
 * can be read here.  Cheap when nothing changed: the walk runs only when
 * last_part_update / last_node_update / the table size moved (or in the
 * second of the last walk: those are whole seconds), and Python (which then
 * flushes its memo) hears of it only when the facts it uses changed. */
#if defined(PYK8SRES_SLURM_SOURCE) && PYK8SRES_TOPOLOGY
static struct {
	int sent;              /* Python has the view of `hash` */
	int failed_logged;
	time_t part_seen, node_seen, walked_at;
	int count_seen;
	uint64_t hash;
} topo;

/* One multiply per value: the walk runs whenever a node changed state. */
static uint64_t _fnv(uint64_t h, uint64_t v)
{
	return (h ^ v) * 0x100000001b3ULL;
}

/* GPUs in a node's Gres= ("gpu:2,gpu:a100:1(S:0),k8scpu:8"), as slurm.conf
 * names them (what the slurm.conf reader counts too). */
static uint64_t _gres_gpus(const char *gres)
{
	uint64_t total = 0;

	if (!gres || !strstr(gres, "gpu"))
		return 0;
	while (*gres) {
		const char *end = strchr(gres, ','), *colon;
		size_t len = end ? (size_t) (end - gres) : strlen(gres);
		char item[128];

		if (len < sizeof(item)) {
			memcpy(item, gres, len);
			item[len] = '\0';
			item[strcspn(item, "(")] = '\0';
			if (!strncmp(item, "gpu", 3) &&
			    (item[3] == ':' || item[3] == '\0')) {
				/* gpu, gpu:TYPE: one; gpu:N, gpu:TYPE:N[KM]: N */
				colon = strrchr(item, ':');
				if (colon && colon[1] >= '0' && colon[1] <= '9') {
					char *unit;
					uint64_t n = strtoull(colon + 1, &unit, 10);

					if (*unit == 'k' || *unit == 'K')
						n *= 1024;
					else if (*unit == 'm' || *unit == 'M')
						n *= 1024 * 1024;
					total += n;
				} else {
					total += 1;
				}
			}
		}
		if (!end)
			break;
		gres = end + 1;
	}
	return total;
}

static const char *_node_gres(node_record_t *node)
{
	if (node->gres)
		return node->gres;
	return node->config_ptr ? node->config_ptr->gres : NULL;
}

/* A growable text buffer (plain malloc: ours, freed here). */
struct text {
	char *buf;
	size_t len, cap;
	int failed;
};

static void _put(struct text *t, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));
static void _put(struct text *t, const char *fmt, ...)
{
	va_list ap;
	int n;

	while (!t->failed) {
		va_start(ap, fmt);
		n = vsnprintf(t->buf ? t->buf + t->len : NULL,
			      t->buf ? t->cap - t->len : 0, fmt, ap);
		va_end(ap);
		if (n < 0) {
			t->failed = 1;
			return;
		}
		if (t->buf && t->len + n < t->cap) {
			t->len += n;
			return;
		}
		size_t cap = (t->cap ? t->cap * 2 : 65536) + n;
		char *grown = realloc(t->buf, cap);
		if (!grown) {
			t->failed = 1;
			return;
		}
		t->buf = grown;
		t->cap = cap;
	}
}

struct walk {
	uint64_t hash;
	struct text *out;  /* NULL: hash only */
};

static int _walk_part(void *item, void *arg)
{
	part_record_t *part = item;
	struct walk *w = arg;
	int64_t size;

	if (!part || !part->name)
		return 0;
	for (const char *c = part->name; *c; c++)
		w->hash = _fnv(w->hash, (unsigned char) *c);
	if (w->out)
		_put(w->out, "P %s", part->name);
	size = part->node_bitmap ? bit_size(part->node_bitmap) : 0;
	for (int64_t i = 0; i < size && i < node_record_count; i++) {
		if (!bit_test(part->node_bitmap, i) || !node_record_table_ptr[i])
			continue;
		w->hash = _fnv(w->hash, (uint64_t) i);
		if (w->out)
			_put(w->out, " %" PRId64, i);
	}
	w->hash = _fnv(w->hash, UINT64_MAX);
	if (w->out)
		_put(w->out, "\n");
	return 0;
}

/* One pass over the node table and the partitions: the hash of what the
 * policy uses, and with `out` the flat description Python reads
 * (pyk8sres/slurmctld/topology.py):
 *   N <index> <cpus: effective (less specialized)> <memory MB: RealMemory -
 *     MemSpecLimit> <threads_per_core>
 *     <cores_per_socket> <gpus>
 *   P <partition> <index> <index> ...
 *   D <default partition> */
static uint64_t _walk(struct text *out)
{
	struct walk w = { 0xcbf29ce484222325ULL, out };
	node_record_t *node;

	w.hash = _fnv(w.hash, (uint64_t) node_record_count);
	for (int i = 0; (node = next_node(&i)); i++) {
		uint64_t gpus = _gres_gpus(_node_gres(node));
		/* What Slurm gives a job asking for all of the node's memory
		 * (--mem=0): RealMemory less MemSpecLimit, as node_features
		 * sizes k8smemory. */
		uint64_t memory = node->mem_spec_limit < node->real_memory ?
			node->real_memory - node->mem_spec_limit : 0;
		/* Likewise its CPUs: all Slurm allocates there, a whole node
		 * included, are the effective ones (CPUs less CoreSpecCount x
		 * threads per core, or CpuSpecList: cons_tres never gives a job
		 * the specialized cores unless it asks --core-spec). */
		uint16_t cpus = node->cpus_efctv < node->cpus ?
			node->cpus_efctv : node->cpus;

		w.hash = _fnv(w.hash, (uint64_t) i);
		w.hash = _fnv(w.hash, cpus);
		w.hash = _fnv(w.hash, memory);
		w.hash = _fnv(w.hash, node->threads);
		w.hash = _fnv(w.hash, node->cores);
		w.hash = _fnv(w.hash, gpus);
		if (out)
			_put(out, "N %d %u %" PRIu64 " %u %u %" PRIu64 "\n", i,
			     (unsigned) cpus, memory,
			     (unsigned) node->threads, (unsigned) node->cores,
			     gpus);
	}
	if (part_list)
		list_for_each(part_list, _walk_part, &w);
	if (default_part_loc && default_part_loc->name) {
		for (const char *c = default_part_loc->name; *c; c++)
			w.hash = _fnv(w.hash, (unsigned char) *c);
		if (out)
			_put(out, "D %s\n", default_part_loc->name);
	}
	return w.hash;
}

/* Give Python slurmctld's current partitions and nodes if they changed. */
static void _topology_refresh(void)
{
	struct text text = { 0 };
	char err[PYK8SRES_OUT_LEN] = "";
	uint64_t hash;

	if (!core.topology)
		return;
	if (topo.sent && last_part_update == topo.part_seen &&
	    last_node_update == topo.node_seen &&
	    node_record_count == topo.count_seen &&
	    last_part_update < topo.walked_at &&
	    last_node_update < topo.walked_at)
		return;
	topo.part_seen = last_part_update;
	topo.node_seen = last_node_update;
	topo.count_seen = node_record_count;
	topo.walked_at = time(NULL);
	hash = _walk(NULL);
	if (topo.sent && hash == topo.hash)
		return;
	(void) _walk(&text);
	if (text.failed || !text.buf || core.topology(text.buf, err, sizeof(err))) {
		if (!topo.failed_logged)
			slurm_error("%s: %s: cannot pass slurmctld's partitions and nodes to the policy (%s): per-node counts follow the last view it had (slurm.conf's at first); tried again with each job",
				    plugin_type, __func__,
				    text.failed || !text.buf ? "out of memory" : err);
		topo.failed_logged = 1;
		topo.sent = 0;  /* try again with the next job */
	} else {
		topo.sent = 1;
		topo.hash = hash;
		topo.failed_logged = 0;
	}
	free(text.buf);
}
#else
static void _topology_refresh(void)
{
	static int logged;

	if (!logged)
		slurm_info("%s: built without the Slurm source (or this release's node table is not known): per-node counts follow the partitions and nodes of slurm.conf, not changes made at run time",
			   plugin_type);
	logged = 1;
}
#endif

/* job_modify: the current job, so a partial update can be completed. */
static void _fill_current(struct pyk8sres_job *req, void *job)
{
#ifdef PYK8SRES_SLURM_SOURCE
	job_record_t *job_ptr = job;
	/* struct job_details in 22.05, job_details_t from 23.x on */
	__typeof__(job_ptr->details) details = job_ptr ? job_ptr->details : NULL;

	if (!details)
		return;
	req->has_current = 1;
	/* What the user asked (orig_*), not what slurmctld derived from it:
	 * a default memory or a MaxMemPerCPU adjustment is redone by the policy
	 * for the partition the job now names. */
	req->cur_num_tasks = details->num_tasks;
	req->cur_cpus_per_task = details->orig_cpus_per_task;
	req->cur_min_cpus = details->orig_min_cpus;
	req->cur_min_nodes = details->min_nodes;
	req->cur_max_nodes = details->max_nodes;
	req->cur_pn_min_cpus = details->orig_pn_min_cpus;
	req->cur_pn_min_memory = (job_ptr->bit_flags & JOB_MEM_SET) ?
		details->orig_pn_min_memory : NO_VAL64;
	req->cur_ntasks_per_node = details->ntasks_per_node;
	req->cur_whole_node = details->whole_node;
	req->cur_tres_per_node = job_ptr->tres_per_node;
	req->cur_tres_per_task = job_ptr->tres_per_task;
	req->cur_tres_per_job = job_ptr->tres_per_job;
	req->cur_tres_per_socket = job_ptr->tres_per_socket;
	req->cur_cpus_per_tres = job_ptr->cpus_per_tres;
	req->cur_mem_per_tres = job_ptr->mem_per_tres;
	req->cur_partition = job_ptr->partition;
	req->cur_overcommit = details->overcommit;
	req->cur_spread_job = (job_ptr->bit_flags & SPREAD_JOB) ? 1 : 0;
	req->cur_task_dist = details->task_dist;
	req->cur_ntasks_per_tres = details->ntasks_per_tres;
	if (details->mc_ptr) {
		req->cur_ntasks_per_core = details->mc_ptr->ntasks_per_core;
		req->cur_threads_per_core = details->mc_ptr->threads_per_core;
	}
#else
	(void) req;
	(void) job;
#endif
}

/* An empty answer clears the field: NULL at submission; "" in job_modify,
 * where NULL would mean "unchanged" and "" is Slurm's "clear it"
 * (gres.c gres_job_state_validate). */
static void _replace(char **field, const char *value, int is_modify)
{
	slurm_xfree((void **) field);
	*field = (value[0] || is_modify) ? slurm_xstrdup(value) : NULL;
}

/* Returns SLURM_SUCCESS, or an error with *err_msg set for the user. */
static int _complete(job_desc_msg_t *d, void *job_ptr, uint32_t uid,
		     int is_modify, char **err_msg)
{
	struct pyk8sres_job req;
	char node_tres[PYK8SRES_OUT_LEN], task_tres[PYK8SRES_OUT_LEN];
	char part_mem[PYK8SRES_OUT_LEN];
	char err[PYK8SRES_OUT_LEN] = "";
	int changed = 0, rc;

	/* slurmctld re-inits job_submit plugins only when their list changes:
	 * follow `scontrol reconfigure` (partition defaults, our conf) here. */
	if (slurm_conf.last_update != conf_seen ||
	    slurm_conf.hash_val != conf_hash_seen) {
		int was_on = accept_on_error;

		conf_seen = slurm_conf.last_update;
		conf_hash_seen = slurm_conf.hash_val;
		if (core.reconfigure(slurm_conf.slurm_conf, &accept_on_error,
				     err, sizeof(err)))
			slurm_error("%s: %s: reconfigure: %s (keeping the previous settings)",
				    plugin_type, __func__, err);
		_warn_accept(was_on);
		err[0] = '\0';
#if defined(PYK8SRES_SLURM_SOURCE) && PYK8SRES_TOPOLOGY
		topo.sent = 0;  /* Python re-read slurm.conf: send the live view again */
#endif
	}
	_topology_refresh();
	_fill_request(&req, d, uid, is_modify);
	if (is_modify)
		_fill_current(&req, job_ptr);
	req.part_mem = _partition_memory(d->partition ? d->partition :
					 req.cur_partition, part_mem,
					 sizeof(part_mem));
	rc = core.job_submit(&req, &changed, node_tres, sizeof(node_tres),
			     task_tres, sizeof(task_tres), err, sizeof(err));
	if (rc == PYK8SRES_INTERNAL_ERROR && accept_on_error) {
		_log_accepted(uid, err);
		return SLURM_SUCCESS;
	}
	if (rc) {
		slurm_debug("%s: %s: rejected job from uid %u: %s", plugin_type,
			    __func__, uid, err);
		if (err_msg)
			*err_msg = slurm_xstrdup(err);
		return ESLURM_INVALID_GRES;
	}
	if (changed & 1)
		_replace(&d->tres_per_node, node_tres, is_modify);
	if (changed & 2)
		_replace(&d->tres_per_task, task_tres, is_modify);
	if ((changed & 4) && is_modify)
		_replace(&d->tres_per_job, "", 1);
	slurm_debug("%s: %s: uid %u tres_per_node=%s tres_per_task=%s",
		    plugin_type, __func__, uid,
		    d->tres_per_node ? d->tres_per_node : "",
		    d->tres_per_task ? d->tres_per_task : "");
	return SLURM_SUCCESS;
}

/* errno is 0 when we accept: slurmctld's RPC code leaves stale values in it
 * (EAGAIN from its sockets, and the embedded Python sets it freely), and
 * 24.11's _update_job returns errno as the error when a partition change
 * finds no association (no accounting): "Resource temporarily unavailable"
 * for one partition update in a few, with or without this plugin. */
static int _complete_clearing_errno(job_desc_msg_t *d, void *job_ptr,
				    uint32_t uid, int is_modify, char **err_msg)
{
	int rc = _complete(d, job_ptr, uid, is_modify, err_msg);

	if (rc == SLURM_SUCCESS)
		errno = 0;
	return rc;
}

int job_submit(job_desc_msg_t *job_desc, uint32_t submit_uid, char **err_msg)
{
	return _complete_clearing_errno(job_desc, NULL, submit_uid, 0, err_msg);
}

/* PYK8SRES_JOB_MODIFY_ERR_MSG: meson read the release's job_submit ops table
 * (22.05: no err_msg; 23.02 on: char **err_msg). */
#if PYK8SRES_JOB_MODIFY_ERR_MSG
int job_modify(job_desc_msg_t *job_desc, void *job_ptr, uint32_t submit_uid,
	       char **err_msg)
#else
int job_modify(job_desc_msg_t *job_desc, void *job_ptr, uint32_t submit_uid)
#endif
{
#if !PYK8SRES_JOB_MODIFY_ERR_MSG
	char **err_msg = NULL;
#endif
	return _complete_clearing_errno(job_desc, job_ptr, submit_uid, 1, err_msg);
}
