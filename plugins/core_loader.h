/*
 * Shared by both plugins: load the embedded Python core that sits next to
 * the plugin (install-plugins puts a libpyk8sres_core.so link there).
 *
 * Why dlopen with RTLD_GLOBAL: slurmctld opens plugins RTLD_LOCAL, and a
 * libpython loaded locally makes every Python C extension fail to import,
 * after which cffi entry points silently return 0.  Loading the core (and
 * with it libpython) globally, then pinging for a non-zero sentinel, turns
 * that failure into one clear log line and a refused plugin.
 */
#ifndef PYK8SRES_CORE_LOADER_H
#define PYK8SRES_CORE_LOADER_H
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dladdr */
#endif
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "pyk8sres_core.h"

/* Slurm's log functions, exported by libslurmfull (log.h is not public).
 * A plugin built against Slurm's source has log.h's own declarations
 * (22.05's error() returns int): keep those. */
#ifndef _LOG_H
extern void slurm_error(const char *fmt, ...)
	__attribute__((format(printf, 1, 2)));
extern void slurm_info(const char *fmt, ...)
	__attribute__((format(printf, 1, 2)));
extern void slurm_verbose(const char *fmt, ...)
	__attribute__((format(printf, 1, 2)));
extern void slurm_debug(const char *fmt, ...)
	__attribute__((format(printf, 1, 2)));
#endif

#define PYK8SRES_CORE_NAME "libpyk8sres_core.so"

struct pyk8sres_core {
	void *handle;
	int (*ping)(char *, size_t);
	int (*job_submit)(const struct pyk8sres_job *, int *, char *, size_t,
			  char *, size_t, char *, size_t);
	int (*reconfigure)(const char *, int *, char *, size_t);
	int (*topology)(const char *, char *, size_t);  /* may be NULL */
	int (*node_counts)(const char *, uint32_t, uint32_t, uint64_t,
			   uint64_t, uint64_t *, uint64_t *, char *, size_t);
	int (*ledger_open)(const char *, const uint32_t *, size_t, int,
			   pyk8sres_share_fn, char *, size_t);
	int (*ledger_settings)(uint32_t *, size_t, size_t *, int64_t *,
			       uint32_t *, char *, size_t);
	int (*ledger_prepare)(uint32_t, const char *, int *, int *, char *, size_t);
	int (*ledger_apply)(int, pyk8sres_facts_fn, pyk8sres_share_fn,
			    pyk8sres_node_name_fn, pyk8sres_stats_fn,
			    pyk8sres_changes_fn, char *, size_t);
	int (*ledger_meet)(pyk8sres_node_name_fn, char *, size_t);
	int (*ledger_registered)(const char *, uint64_t, uint64_t,
				 pyk8sres_share_fn, char *, size_t);
};

/* Fills `core`; returns 0, or -1 after logging why (prefixed by `who`). */
static inline int pyk8sres_core_load(struct pyk8sres_core *core, const char *who,
			      void *self)
{
	char path[PATH_MAX], err[PYK8SRES_OUT_LEN] = "";
	Dl_info info;
	char *slash;
	int rc;

	if (!dladdr(self, &info) || !info.dli_fname ||
	    strlen(info.dli_fname) >= sizeof(path)) {
		slurm_error("%s: cannot find the plugin's own directory", who);
		return -1;
	}
	strcpy(path, info.dli_fname);
	slash = strrchr(path, '/');
	if (!slash || (size_t) (slash - path) + sizeof(PYK8SRES_CORE_NAME) + 1 >
			      sizeof(path)) {
		slurm_error("%s: plugin path %s has no directory", who, path);
		return -1;
	}
	strcpy(slash + 1, PYK8SRES_CORE_NAME);

	core->handle = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
	if (!core->handle) {
		slurm_error("%s: cannot load the Python core %s: %s (run `pyk8sres install-plugins`)",
			    who, path, dlerror());
		return -1;
	}
	core->ping = dlsym(core->handle, "pyk8sres_ping");
	core->job_submit = dlsym(core->handle, "pyk8sres_job_submit");
	core->reconfigure = dlsym(core->handle, "pyk8sres_reconfigure");
	core->topology = dlsym(core->handle, "pyk8sres_topology");
	/* Renamed when its arguments changed: a core from another build
	 * then fails to load rather than read the wrong arguments. */
	core->node_counts = dlsym(core->handle, "pyk8sres_node_capacity");
	core->ledger_open = dlsym(core->handle, "pyk8sres_ledger_open");
	core->ledger_prepare = dlsym(core->handle, "pyk8sres_ledger_prepare");
	core->ledger_apply = dlsym(core->handle, "pyk8sres_ledger_apply");
	core->ledger_settings = dlsym(core->handle, "pyk8sres_ledger_settings");
	core->ledger_meet = dlsym(core->handle, "pyk8sres_ledger_meet");
	core->ledger_registered = dlsym(core->handle, "pyk8sres_ledger_registered");
	if (!core->ping || !core->job_submit || !core->reconfigure ||
	    !core->node_counts || !core->ledger_open || !core->ledger_settings ||
	    !core->ledger_prepare || !core->ledger_apply ||
	    !core->ledger_meet || !core->ledger_registered) {
		slurm_error("%s: %s lacks an entry point (version mismatch?): %s",
			    who, path, dlerror());
		return -1;
	}
	rc = core->ping(err, sizeof(err));
	if (rc != PYK8SRES_PING_SENTINEL) {
		slurm_error("%s: embedded Python did not start (ping=%d): %s",
			    who, rc, err[0] ? err : "no message; see stderr of slurmctld");
		return -1;
	}
	return 0;
}
#endif
