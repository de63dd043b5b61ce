/*
 * node_features/k8s_resources: the ledger's request socket.
 *
 * One thread inside slurmctld, one poll() loop: one JSON request line in,
 * one reply line out (pyk8sres/policy/ledger.py).  Python parses, journals
 * and decides (pyk8sres/slurmctld/ledger.py); ledger_access.c says who is
 * heard, ledger_clients.c in which order, and this file when to answer at
 * all.
 *
 * When: only the slurmctld in control owns the journal -- an exclusive flock
 * on StateSaveLocation/k8s_resources.ledger.lock -- and only the owner
 * compacts the journal or (re)binds the socket.  It answers "notready" until
 * slurmctld has recovered its node and job state, and gives journal and
 * socket up as soon as slurmctld shuts down or hands over (shutdown,
 * takeover, 24.11+'s re-exec on reconfigure), after its last request: the
 * next owner loads every grant this one acknowledged.
 */
#define _GNU_SOURCE /* dladdr in core_loader.h */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

#include "slurm/slurm.h"
#include "slurm/slurm_errno.h"

#include "src/common/slurm_xlator.h"
#include "src/common/log.h"
#include "src/common/macros.h"
#include "src/common/read_config.h"
#include "src/common/xmalloc.h"
#include "src/common/xstring.h"
#include "src/slurmctld/job_scheduler.h"
#include "src/slurmctld/locks.h"
#include "src/slurmctld/slurmctld.h"

#include "core_loader.h"
#include "ledger_access.h"
#include "ledger_clients.h"
#include "ledger_server.h"

/* slurmctld-only symbols: slurmd loads the plugin too (and never starts us). */
#pragma weak lock_slurmctld
#pragma weak unlock_slurmctld
#pragma weak slurmctld_config
#pragma weak slurmctld_primary
#pragma weak control_time
#pragma weak queue_job_scheduler
#pragma weak schedule
/* controller.c: when this slurmctld last took control, after recovering its
 * state (0 before that, and while a backup stands by); no header has it. */
extern time_t control_time;

/* Where slurmctld_config.shutdown_time sits in the slurmctld we verified
 * (objdump of slurmctld_shutdown: 22.05.8 on bookworm, 24.11.5 built from
 * Debian's source): drift fails the build. */
#if SLURM_VERSION_NUMBER == SLURM_VERSION_NUM(22,5,8)
_Static_assert(offsetof(slurmctld_config_t, shutdown_time) == 200, "shutdown_time");
#elif SLURM_VERSION_NUMBER == SLURM_VERSION_NUM(24,11,5)
_Static_assert(offsetof(slurmctld_config_t, shutdown_time) == 328, "shutdown_time");
#endif

#define LOG_PREFIX "node_features/k8s_resources ledger"
#define LOCK_NAME "k8s_resources.ledger.lock"
#define REPLY_BYTES (4 << 20)
#define POLL_MS 100			/* how soon a change of control is seen */
#define WATCH_MS 500			/* idle re-carry after a rebuild */
#define SCHED_GAP_MS 500		/* between the scheduling passes we run */
#define RETRY_LOAD_S 10			/* a journal or socket that failed */

static const struct pyk8sres_core *core;
static struct ledger_plugin_ops ops;
static char *state_dir, *lock_path;
static uint32_t base_uids[2];	/* root, SlurmUser */

/* Ownership of the journal: the flock, and the journal loaded under it. */
static pthread_mutex_t own_lock = PTHREAD_MUTEX_INITIALIZER;
static int lock_fd = -1;
static volatile bool owner;
static bool capacity_given;	/* since in control (the thread's; read atomically by registrations) */
static time_t retry_load_at;
static bool told_waiting;

static volatile bool seen_control, stop, running;
static pthread_t tid;
static int listen_fd = -1;
static time_t listen_retry_at;
static char *reply;

/* --- Control: is this slurmctld the one that answers? ------------------ */

/* In control and done recovering node and job state. */
static bool _in_control(void)
{
	if (__atomic_load_n(&slurmctld_config.shutdown_time, __ATOMIC_RELAXED))
		return false;	/* shutting down, handing over, re-exec */
	if (__atomic_load_n(&control_time, __ATOMIC_RELAXED)) {
		seen_control = true;
		return true;
	}
	/* 24.11+: a reconfigure whose re-exec failed resumes in this process
	 * without setting control_time again. */
	return seen_control && slurmctld_primary;
}

/* Should this process own the journal: the primary from its start (so it
 * can answer "notready" while recovering), a backup once in control. */
static bool _should_own(void)
{
	if (__atomic_load_n(&slurmctld_config.shutdown_time, __ATOMIC_RELAXED))
		return false;
	return slurmctld_primary ||
	       __atomic_load_n(&control_time, __ATOMIC_RELAXED);
}

static bool _ready(void)
{
	return owner && _in_control() && capacity_given;
}

/* --- The journal lock ------------------------------------------------------ */

static int _lock_journal(void)
{
	char text[32] = "";
	int fd, len;

	fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
	if (fd < 0 || flock(fd, LOCK_EX | LOCK_NB)) {
		if (fd < 0 || errno != EWOULDBLOCK) {
			error("%s: %s: cannot lock %s: %m (retrying in %d s)",
			      LOG_PREFIX, __func__, lock_path, RETRY_LOAD_S);
			retry_load_at = time(NULL) + RETRY_LOAD_S;
		} else if (!told_waiting) {
			(void) !pread(fd, text, sizeof(text) - 1, 0);
			text[strcspn(text, "\n")] = '\0';
			info("%s: %s: another live slurmctld (pid %s) owns the ledger's journal; not serving until it lets go",
			     LOG_PREFIX, __func__, text[0] ? text : "?");
			told_waiting = true;
		}
		if (fd >= 0)
			close(fd);
		return -1;
	}
	len = snprintf(text, sizeof(text), "%d\n", (int) getpid());
	/* Write, then cut: a reader never sees it empty. */
	if (pwrite(fd, text, len, 0) != len || ftruncate(fd, len))
		debug("%s: %s: cannot record our pid in %s: %m", LOG_PREFIX,
		      __func__, lock_path);
	lock_fd = fd;
	told_waiting = false;
	return 0;
}

static void _unlock_journal(void)
{
	if (lock_fd < 0)
		return;
	/* LOCK_UN, not only close: a forked child may share the open file. */
	(void) flock(lock_fd, LOCK_UN);
	close(lock_fd);
	lock_fd = -1;
}

/* own_lock held.  Take the journal if this process should have it: lock,
 * then load it (shares go to ops.remember; the caller carries them). */
static bool _claim_locked(bool *load_failed)
{
	char err[PYK8SRES_OUT_LEN] = "";

	if (owner)
		return true;
	if (!_should_own() || time(NULL) < retry_load_at ||
	    (lock_fd < 0 && _lock_journal()))
		return false;
	if (core->ledger_open(state_dir, base_uids, 2, 1, ops.remember, err,
			      sizeof(err))) {
		error("%s: %s: cannot load the journal in %s: %s (retrying in %d s; nothing is granted meanwhile)",
		      LOG_PREFIX, __func__, state_dir, err, RETRY_LOAD_S);
		if (load_failed)
			*load_failed = true;
		retry_load_at = time(NULL) + RETRY_LOAD_S;
		_unlock_journal();
		return false;
	}
	owner = true;
	info("%s: %s: this slurmctld (pid %d) owns the ledger's journal", LOG_PREFIX,
	     __func__, (int) getpid());
	return true;
}

extern bool ledger_server_claim(void)
{
	bool own;

	if (!running)
		return false;
	if (owner)
		return true;
	slurm_mutex_lock(&own_lock);
	own = _claim_locked(NULL);
	slurm_mutex_unlock(&own_lock);
	return own;
}

/* --- Requests: decided under slurmctld's locks ------------------------------ */

/* Put the shares back if Slurm rebuilt allocations: checked in O(1) under
 * the node read lock (it reads the node table), done under the write locks
 * so that no other reader is packing a record while it changes. */
static void _resync_if_due(void)
{
	slurmctld_lock_t read_lock = { .node = READ_LOCK };
	slurmctld_lock_t write_lock = { .job = WRITE_LOCK, .node = WRITE_LOCK };
	bool due;

	lock_slurmctld(read_lock);
	due = ops.resync_due();
	unlock_slurmctld(read_lock);
	if (due) {
		lock_slurmctld(write_lock);
		ops.resync();
		unlock_slurmctld(write_lock);
	}
}

/* A lowered share since the last scheduling pass we ran (this thread only). */
static bool sched_due, sched_defer;
static struct timespec sched_last;

/* Pending jobs may fit in room a lowered share freed.  As slurmctld does when
 * an epilog frees a node (proc_req.c): a scheduling pass now (schedule() only
 * wakes its thread), or with SchedulerParameters=defer one once
 * batch_sched_delay has passed; not at sched_interval or backfill.  At most
 * one pass per SCHED_GAP_MS: a flood of releases must not keep slurmctld's
 * scheduler (and its write locks) busy back to back; the rest wait for the
 * next round of this thread. */
static void _schedule_if_due(void)
{
	if (!sched_due || ledger_ms_since(&sched_last) < SCHED_GAP_MS)
		return;
	sched_due = false;
	clock_gettime(CLOCK_MONOTONIC, &sched_last);
	if (!sched_defer && schedule)
		schedule(false);
	else if (queue_job_scheduler)
		queue_job_scheduler();
}

/* Decide one request: Python parses and journals outside slurmctld's locks,
 * then decides and applies under them.  Its reply line, in `reply`. */
static const char *_handle(uid_t uid, const char *line)
{
	/* A change is decided and applied atomically with job starts (job and
	 * node write locks); a `show` reads a copy of the facts, taken under
	 * the node read lock, and builds its reply after letting go. */
	slurmctld_lock_t write_lock = { .conf = READ_LOCK, .job = WRITE_LOCK,
					.node = WRITE_LOCK };
	slurmctld_lock_t read_lock = { .node = READ_LOCK };
	struct timespec start, prepared;
	int ticket = 0, read_only = 0;

	reply[0] = '\0';
	clock_gettime(CLOCK_MONOTONIC, &start);
	core->ledger_prepare(uid, line, &ticket, &read_only, reply, REPLY_BYTES);
	if (ticket > 0) {
		long to_lock, took;

		clock_gettime(CLOCK_MONOTONIC, &prepared);
		if (read_only) {
			_resync_if_due();	/* so scontrol agrees with this answer */
			lock_slurmctld(read_lock);
			to_lock = ledger_ms_since(&prepared);
			ops.copy_facts();
			unlock_slurmctld(read_lock);
			core->ledger_apply(ticket, ops.copied_facts, ops.share,
					   ops.copied_node_name, ops.stats,
					   ops.copied_changes, reply, REPLY_BYTES);
		} else {
			lock_slurmctld(write_lock);
			to_lock = ledger_ms_since(&prepared);
			ops.resync();
			core->ledger_apply(ticket, ops.facts, ops.share,
					   ops.node_name, ops.stats,
					   ops.copied_changes, reply, REPLY_BYTES);
			if (ops.take_freed()) {
				sched_due = true;
				sched_defer = xstrcasestr(slurm_conf.sched_params,
							  "defer");
			}
			unlock_slurmctld(write_lock);
			_schedule_if_due();
		}
		/* Callers time out after 2 s: say where a slow answer waited. */
		if ((took = ledger_ms_since(&start)) >= 1000)
			info("%s: %s: a request took %ld ms, %ld of them waiting for slurmctld's locks",
			     LOG_PREFIX, __func__, took, to_lock);
	}
	if (!reply[0])
		strcpy(reply, "{\"ok\":false,\"code\":\"internal\",\"error\":\"no reply\"}\n");
	return reply;
}

/* --- The thread ------------------------------------------------------------------ */

/* Own journal and socket when this process should, let go when not. */
static void _follow_control(void)
{
	slurmctld_lock_t write_lock = { .job = WRITE_LOCK, .node = WRITE_LOCK };

	if (!owner && _should_own() && time(NULL) >= retry_load_at) {
		bool own;

		/* The flock first: while another process holds it, no need
		 * for slurmctld's locks ten times a second. */
		slurm_mutex_lock(&own_lock);
		own = lock_fd >= 0 || !_lock_journal();
		slurm_mutex_unlock(&own_lock);
		if (!own)
			return;
		lock_slurmctld(write_lock);
		slurm_mutex_lock(&own_lock);
		own = _claim_locked(NULL);
		slurm_mutex_unlock(&own_lock);
		if (own)
			ops.carry_all();
		unlock_slurmctld(write_lock);
	}
	/* Before the first answer: a node that has not registered yet must
	 * not be shown, or reserved on, as empty. */
	if (owner && !capacity_given && _in_control()) {
		slurmctld_lock_t rebuild_lock = { .job = WRITE_LOCK, .node = WRITE_LOCK,
						  .part = READ_LOCK };
		char err[PYK8SRES_OUT_LEN] = "";

		lock_slurmctld(rebuild_lock);
		if (ops.give_capacity)
			ops.give_capacity();
		/* The nodes slurmctld has now are not new (ledger_server_registered). */
		if (core->ledger_meet(ops.node_name, err, sizeof(err)))
			error("%s: %s: %s", LOG_PREFIX, __func__, err);
		__atomic_store_n(&capacity_given, true, __ATOMIC_RELEASE);
		unlock_slurmctld(rebuild_lock);
	}
	if (owner && listen_fd < 0 && _should_own() &&
	    time(NULL) >= listen_retry_at && (listen_fd = ledger_access_listen()) < 0)
		listen_retry_at = time(NULL) + RETRY_LOAD_S;
	if ((owner || lock_fd >= 0) && !_should_own()) {
		/* After our last request: what we acknowledged is journaled. */
		ledger_clients_drop_all(LEDGER_REPLY_NOT_READY);
		if (listen_fd >= 0)
			close(listen_fd);	/* the next owner rebinds the path */
		listen_fd = -1;
		slurm_mutex_lock(&own_lock);
		_unlock_journal();
		owner = false;
		capacity_given = false;	/* the next control rebuilds the nodes */
		slurm_mutex_unlock(&own_lock);
		info("%s: %s: slurmctld is shutting down or handing over: let go of the journal and the socket",
		     LOG_PREFIX, __func__);
	}
}

/* Idle: re-apply the share soon after a rebuild even when nothing is being
 * scheduled (slurmctld startup, a reconfigure), so `scontrol show node`
 * shows it.  Allocations never wait for this: user_update comes first. */
static void _watch_rebuilds(void)
{
	struct timespec start;
	long took;

	clock_gettime(CLOCK_MONOTONIC, &start);
	_resync_if_due();
	if ((took = ledger_ms_since(&start)) >= 1000) /* requests waited as long */
		info("%s: %s: waited %ld ms for slurmctld's node lock", LOG_PREFIX,
		     __func__, took);
}

static void *_thread(void *arg)
{
	struct timespec watched;

	clock_gettime(CLOCK_MONOTONIC, &watched);
	while (!stop) {
		_follow_control();
		if (!ledger_clients_round(listen_fd, POLL_MS)) {
			sleep(1);
			continue;
		}
		_schedule_if_due();
		if (_in_control() && ledger_ms_since(&watched) >= WATCH_MS) {
			_watch_rebuilds();
			clock_gettime(CLOCK_MONOTONIC, &watched);
		}
	}
	ledger_clients_stop();
	return NULL;
}

extern int ledger_server_start(const struct pyk8sres_core *loaded,
			       const struct ledger_plugin_ops *plugin_ops)
{
	char err[PYK8SRES_OUT_LEN] = "";
	bool load_failed = false;
	Dl_info info;

	if (!lock_slurmctld || !&slurmctld_config || !&control_time ||
	    !slurm_conf.state_save_location) {
		error("%s: %s: not inside slurmctld", LOG_PREFIX, __func__);
		return SLURM_ERROR;
	}
	core = loaded;
	ops = *plugin_ops;
	state_dir = xstrdup(slurm_conf.state_save_location);
	lock_path = xstrdup_printf("%s/%s", state_dir, LOCK_NAME);
	base_uids[0] = 0;
	base_uids[1] = slurm_conf.slurm_user_id;
	ledger_access_start(core, state_dir, base_uids);
	ledger_clients_start(_ready, _handle);
	reply = xmalloc(REPLY_BYTES);

	slurm_mutex_lock(&own_lock);
	running = true;	/* claims may come from the scheduler from now on */
	if (!_claim_locked(&load_failed) && !load_failed &&
	    core->ledger_open(state_dir, base_uids, 2, 0, ops.remember, err,
			      sizeof(err))) {
		/* Someone else owns it, or this is a standby backup: read it
		 * anyway, so jobs respect the shares until we own it. */
		error("%s: %s: cannot read the journal in %s: %s", LOG_PREFIX,
		      __func__, state_dir, err);
		load_failed = true;
	}
	slurm_mutex_unlock(&own_lock);
	if (load_failed) {
		/* A ledger that cannot be read would double-book: slurmctld
		 * does not start. */
		running = false;
		return SLURM_ERROR;
	}
	/* Our thread runs code of this .so: never unmap it under the thread. */
	if (dladdr((void *) _thread, &info) && info.dli_fname)
		(void) dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
	if (pthread_create(&tid, NULL, _thread, NULL)) {
		error("%s: %s: cannot start the ledger thread: %m", LOG_PREFIX,
		      __func__);
		running = false;
		return SLURM_ERROR;
	}
	verbose("%s: %s: %s (socket %s)", LOG_PREFIX, __func__,
		owner ? "owns the journal" :
			"standing by: another slurmctld owns the journal, or this is a backup",
		ledger_access_socket_path());
	return SLURM_SUCCESS;
}

/* Under slurmctld's node write lock, `name` registering with capacity
 * `cnt`: a node this process has not met is held whole until the
 * coordinator's first `set` there (HoldNewNodes=, Ledger.registered).  Only
 * once in control with the journal loaded: before that, every node in the
 * table is met then. */
extern void ledger_server_registered(const char *name, const uint64_t *cnt)
{
	char err[PYK8SRES_OUT_LEN] = "";

	if (!running || !owner || !_in_control() ||
	    !__atomic_load_n(&capacity_given, __ATOMIC_ACQUIRE))
		return;
	if (core->ledger_registered(name, cnt[0], cnt[1], ops.share, err,
				    sizeof(err)))
		error("%s: %s: node %s: %s", LOG_PREFIX, __func__, name, err);
}

extern void ledger_server_reconfigure(void)
{
	if (running)
		ledger_access_reread();
}

extern bool ledger_server_running(void)
{
	return running;
}

/* The thread is told to stop; it is not joined, as fini may run under the
 * very locks the thread waits for.  Its journal lock goes with the process. */
extern void ledger_server_stop(void)
{
	stop = true;
}
