/*
 * The C half of libpyk8sres_core.so, compiled together with the code cffi
 * generates (pyk8sres/slurmctld/_core_build.py includes this file in set_source):
 *  - the interpreter started isolated (no PYTHONPATH/PYTHONHOME/user site
 *    from slurmctld's environment), with the PYTHONHOME it was built with;
 *  - slurmctld's log for Python's log lines;
 *  - pyk8sres_job_submit, the hot path: a memo of Python's answers and one
 *    shared thread state (see the comment above it).
 * Nothing here decides policy: that is pyk8sres/slurmctld/completion.py.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <Python.h>
#include "pyk8sres_core.h"

static char core_path[PATH_MAX];

/* Start the interpreter isolated, before cffi would start it from the
 * daemon's environment: PYTHONPATH, PYTHONHOME, PYTHONSTARTUP and every
 * other PYTHON* variable, the user site directory (~/.local, so also its
 * usercustomize.py) and the current directory are ignored; only the
 * installation's own paths are used (its stdlib and site-packages; the init
 * code in _core_build.py adds the package next to this library).  cffi then
 * finds Python running and only runs its init code, which refuses to go on
 * in an interpreter that is not isolated. */
static void _start_isolated_python(void)
{
	PyConfig config;
	PyStatus status;

	PyConfig_InitIsolatedConfig(&config);
	config.install_signal_handlers = 0; /* slurmctld owns its signals */
	/* Inside slurmctld, Python would guess its stdlib from the slurmctld
	 * binary's location: pin the home it was built with. */
	status = PyConfig_SetBytesString(&config, &config.home,
					 PYK8SRES_PYTHONHOME);
	if (!PyStatus_Exception(status))
		status = Py_InitializeFromConfig(&config);
	PyConfig_Clear(&config);
	if (PyStatus_Exception(status)) {
		fprintf(stderr, "pyk8sres: cannot start Python (%s): %s\n",
			PYK8SRES_PYTHONHOME,
			status.err_msg ? status.err_msg : "unknown error");
		return;
	}
	PyEval_SaveThread(); /* release the GIL: every call takes it again */
}

__attribute__((constructor)) static void _preinit(void)
{
	Dl_info info;

	if (dladdr((void *) _preinit, &info) && info.dli_fname)
		if (!realpath(info.dli_fname, core_path))
			core_path[0] = '\0';
	if (!Py_IsInitialized())
		_start_isolated_python();
}

/* Python's log lines go to slurmctld's log when we run inside it. */
static void pyk8sres_log(int level, const char *msg)
{
	static const char *names[] = { "slurm_error", "slurm_info",
				       "slurm_verbose", "slurm_debug" };
	void (*fn)(const char *, ...);

	if (level < 0 || level > 3)
		level = 0;
	fn = (void (*)(const char *, ...)) dlsym(RTLD_DEFAULT, names[level]);
	if (fn)
		fn("%s", msg);
	else
		fprintf(stderr, "pyk8sres: %s\n", msg);
}

/* --- pyk8sres_job_submit: the hot path ---------------------------------
 * Inside slurmctld a cffi entry point is costly for every job: slurmctld
 * runs each RPC on a new thread (a new Python thread state each time), and
 * the interpreter's code and data are cold by the time the next job arrives
 * (docs/performance.md, "How the plugin is built", has the figures).  So:
 *  1. Memo: the completion is a pure function of the job fields in
 *     struct memo_key and of the configuration, so an identical submission
 *     reuses Python's earlier answer without entering Python.  Python
 *     empties the memo whenever it reloads the configuration.
 *  2. Misses: one Python thread state, made once and lent to the calling
 *     thread under hot_lock (calls are serialized anyway), and a direct
 *     call of pyk8sres.slurmctld.submit.job_submit_values with the memo key's
 *     fields as plain arguments (so Python reads exactly what the memo
 *     keys on), rather than Python reading them from the struct through
 *     cffi, which costs a large part of a miss.
 *     job_modify (rare, and it needs the job as it stands) and Python >=
 *     3.12 (which ties thread states to OS threads) use the plain cffi
 *     entry point.
 */
#include <pthread.h>

#define MEMO_SLOTS 1024
#define MEMO_STRINGS 8

struct memo_key {  /* every field the policy reads for a submission */
	uint64_t pn_min_memory, def_mem_per_cpu, max_mem_per_cpu;
	uint32_t slurm_version, num_tasks, min_cpus, min_nodes, max_nodes, task_dist;
	uint16_t cpus_per_task, ntasks_per_node, pn_min_cpus, shared;
	uint16_t ntasks_per_core, threads_per_core, overcommit, select_type_param;
	uint16_t spread_job, ntasks_per_tres;
};

struct memo_entry {
	unsigned generation;  /* 0 = empty */
	struct memo_key key;
	char *strings[MEMO_STRINGS];
	int rc, changed;
	char *node, *task, *err;
};

static pthread_mutex_t hot_lock = PTHREAD_MUTEX_INITIALIZER;
static PyThreadState *hot_ts;
static PyObject *hot_fn;
static struct memo_entry memo[MEMO_SLOTS];
static volatile unsigned memo_generation = 1;

/* Called from Python (GIL held): never take hot_lock here. */
static void pyk8sres_memo_clear(void)
{
	__atomic_add_fetch(&memo_generation, 1, __ATOMIC_SEQ_CST);
}

static void _memo_fill(const struct pyk8sres_job *j, struct memo_key *k,
		       const char **strings)
{
	memset(k, 0, sizeof(*k));  /* padding too: keys are compared by memcmp */
	k->pn_min_memory = j->pn_min_memory;
	k->def_mem_per_cpu = j->def_mem_per_cpu;
	k->slurm_version = j->slurm_version;
	k->num_tasks = j->num_tasks;
	k->min_cpus = j->min_cpus;
	k->min_nodes = j->min_nodes;
	k->max_nodes = j->max_nodes;
	k->cpus_per_task = j->cpus_per_task;
	k->ntasks_per_node = j->ntasks_per_node;
	k->pn_min_cpus = j->pn_min_cpus;
	k->shared = j->shared;
	k->max_mem_per_cpu = j->max_mem_per_cpu;
	k->ntasks_per_core = j->ntasks_per_core;
	k->threads_per_core = j->threads_per_core;
	k->overcommit = j->overcommit;
	k->select_type_param = j->select_type_param;
	k->spread_job = j->spread_job;
	k->task_dist = j->task_dist;
	k->ntasks_per_tres = j->ntasks_per_tres;
	strings[0] = j->partition;
	strings[1] = j->tres_per_node;
	strings[2] = j->tres_per_task;
	strings[3] = j->tres_per_job;
	strings[4] = j->tres_per_socket;
	strings[5] = j->cpus_per_tres;
	strings[6] = j->mem_per_tres;
	strings[7] = j->part_mem;
}

static uint64_t _memo_hash(const struct memo_key *k, const char **strings)
{
	uint64_t h = 1469598103934665603ULL;  /* FNV-1a */
	const unsigned char *p = (const unsigned char *) k;

	for (size_t i = 0; i < sizeof(*k); i++)
		h = (h ^ p[i]) * 1099511628211ULL;
	for (int s = 0; s < MEMO_STRINGS; s++) {
		for (p = (const unsigned char *) (strings[s] ? strings[s] : ""); *p; p++)
			h = (h ^ *p) * 1099511628211ULL;
		h = (h ^ (strings[s] ? 0xff : 0xfe)) * 1099511628211ULL;
	}
	return h;
}

static int _same_string(const char *a, const char *b)
{
	return (!a || !b) ? a == b : !strcmp(a, b);
}

static struct memo_entry *_memo_find(struct memo_entry *e, const struct memo_key *k,
				     const char **strings)
{
	if (e->generation != memo_generation || memcmp(&e->key, k, sizeof(*k)))
		return NULL;
	for (int s = 0; s < MEMO_STRINGS; s++)
		if (!_same_string(e->strings[s], strings[s]))
			return NULL;
	return e;
}

static char *_dup_or_null(const char *s)
{
	return s ? strdup(s) : NULL;
}

static void _memo_store(struct memo_entry *e, unsigned generation,
			const struct memo_key *k, const char **strings, int rc,
			int changed, const char *node, const char *task,
			const char *err)
{
	for (int s = 0; s < MEMO_STRINGS; s++)
		free(e->strings[s]);
	free(e->node);
	free(e->task);
	free(e->err);
	memset(e, 0, sizeof(*e));
	e->key = *k;
	for (int s = 0; s < MEMO_STRINGS; s++)
		e->strings[s] = _dup_or_null(strings[s]);
	e->node = strdup(node);
	e->task = strdup(task);
	e->err = strdup(err);
	e->rc = rc;
	e->changed = changed;
	for (int s = 0; s < MEMO_STRINGS; s++)
		if (strings[s] && !e->strings[s])
			return;  /* out of memory: leave the slot empty */
	if (e->node && e->task && e->err)
		e->generation = generation;
}

static int _hot_init(void)
{
	static int tried;
	PyGILState_STATE gil;
	PyObject *mod;

	if (tried++)
		return -1;  /* it failed before: the cffi entry point serves */
	gil = PyGILState_Ensure();
	mod = PyImport_ImportModule("pyk8sres.slurmctld.submit");
	hot_fn = mod ? PyObject_GetAttrString(mod, "job_submit_values") : NULL;
	Py_XDECREF(mod);
	if (!hot_fn)
		PyErr_Clear();
	else
		hot_ts = PyThreadState_New(PyThreadState_Get()->interp);
	PyGILState_Release(gil);
	pyk8sres_log(hot_ts ? 2 : 0, hot_ts ?
		     "job_submit/k8s_resource_completion: new job shapes call "
		     "Python directly, on one shared thread state" :
		     "job_submit/k8s_resource_completion: cannot call Python "
		     "directly; every new job shape goes through cffi (slower)");
	return hot_ts ? 0 : -1;
}

static void _copy_out(char *dst, size_t len, PyObject *text)
{
	Py_ssize_t n = 0;
	const char *src = text ? PyUnicode_AsUTF8AndSize(text, &n) : NULL;

	if (!len)
		return;
	if (!src) {
		PyErr_Clear();
		dst[0] = '\0';
		return;
	}
	if ((size_t) n >= len)
		n = len - 1;
	memcpy(dst, src, n);
	dst[n] = '\0';
}

#define HOT_ARGS 27

/* The memo key as Python values, in the order of the parameters of
 * pyk8sres.slurmctld.submit.job_submit_values (tests/unit/test_embed.py checks
 * it): raw numbers (Python decodes Slurm's NO_VAL family), str or None. */
static int _hot_args(const struct memo_key *k, const char **strings,
		     PyObject **args)
{
	const uint64_t numbers[] = {
		k->slurm_version, k->def_mem_per_cpu, k->select_type_param,
		k->max_mem_per_cpu, k->cpus_per_task, k->num_tasks,
		k->ntasks_per_node, k->min_cpus, k->min_nodes, k->max_nodes,
		k->pn_min_cpus, k->ntasks_per_core, k->threads_per_core,
		k->overcommit, k->pn_min_memory, k->spread_job, k->task_dist,
		k->ntasks_per_tres, k->shared,
	};
	const size_t n = sizeof(numbers) / sizeof(numbers[0]);

	_Static_assert(sizeof(numbers) / sizeof(numbers[0]) + MEMO_STRINGS ==
		       HOT_ARGS, "job_submit_values takes HOT_ARGS arguments");

	for (size_t i = 0; i < n; i++)
		args[i] = PyLong_FromUnsignedLongLong(numbers[i]);
	for (size_t s = 0; s < MEMO_STRINGS; s++)
		args[n + s] = strings[s] ?
			PyUnicode_DecodeUTF8(strings[s], strlen(strings[s]),
					     "replace") : Py_NewRef(Py_None);
	for (size_t i = 0; i < HOT_ARGS; i++)
		if (!args[i])
			return -1;
	return 0;
}

/* One Python call on the shared thread state; caller holds hot_lock. */
static int _call_python(const struct pyk8sres_job *job,
			const struct memo_key *key, const char **strings,
			int *changed, char *node_out, size_t node_len,
			char *task_out, size_t task_len, char *err, size_t errlen)
{
	PyObject *res = NULL, *args[HOT_ARGS] = { NULL };
	int rc = PYK8SRES_INTERNAL_ERROR;

#if PY_VERSION_HEX < 0x030C0000
	if (!job->is_modify && Py_IsInitialized() && (hot_ts || !_hot_init())) {
		PyEval_RestoreThread(hot_ts);
		/* -> (rc, changed, tres_per_node, tres_per_task, err) */
		if (!_hot_args(key, strings, args))
			res = PyObject_Vectorcall(hot_fn, args, HOT_ARGS, NULL);
		for (size_t i = 0; i < HOT_ARGS; i++)
			Py_XDECREF(args[i]);
		if (res && PyTuple_Check(res) && PyTuple_GET_SIZE(res) == 5) {
			rc = (int) PyLong_AsLong(PyTuple_GET_ITEM(res, 0));
			*changed = (int) PyLong_AsLong(PyTuple_GET_ITEM(res, 1));
			_copy_out(node_out, node_len, PyTuple_GET_ITEM(res, 2));
			_copy_out(task_out, task_len, PyTuple_GET_ITEM(res, 3));
			_copy_out(err, errlen, PyTuple_GET_ITEM(res, 4));
			if (PyErr_Occurred())
				rc = PYK8SRES_INTERNAL_ERROR;
		} else {
			*changed = 0;
			snprintf(err, errlen, "internal error in the Python core");
		}
		PyErr_Clear();
		Py_XDECREF(res);
		PyEval_SaveThread();
		return rc;
	}
#endif
	return pyk8sres_job_submit_py(job, changed, node_out, node_len,
				      task_out, task_len, err, errlen);
}

int pyk8sres_job_submit(const struct pyk8sres_job *job, int *changed,
			char *node_out, size_t node_len,
			char *task_out, size_t task_len, char *err, size_t errlen)
{
	struct memo_key key;
	const char *strings[MEMO_STRINGS];
	struct memo_entry *slot = NULL, *hit;
	unsigned generation;
	int rc;

	pthread_mutex_lock(&hot_lock);
	_memo_fill(job, &key, strings);
	if (!job->is_modify) {
		slot = &memo[_memo_hash(&key, strings) % MEMO_SLOTS];
		hit = _memo_find(slot, &key, strings);
		if (hit) {
			*changed = hit->changed;
			snprintf(node_out, node_len, "%s", hit->node);
			snprintf(task_out, task_len, "%s", hit->task);
			snprintf(err, errlen, "%s", hit->err);
			rc = hit->rc;
			pthread_mutex_unlock(&hot_lock);
			return rc;
		}
	}
	generation = memo_generation;  /* before the call: a reload wins */
	rc = _call_python(job, &key, strings, changed, node_out, node_len,
			  task_out, task_len, err, errlen);
	if (slot && rc != PYK8SRES_INTERNAL_ERROR)
		_memo_store(slot, generation, &key, strings, rc, *changed,
			    node_out, task_out, err);
	pthread_mutex_unlock(&hot_lock);
	return rc;
}

/* Absolute path of this library: Python finds the pyk8sres package from it. */
static const char *pyk8sres_core_path(void)
{
	return core_path;
}
