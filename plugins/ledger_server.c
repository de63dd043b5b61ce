/*
 * node_features/k8s_resources: the ledger's request socket.
 *
 * One thread inside slurmctld, one poll() loop, every socket non-blocking:
 * one JSON request line in, one reply line out (pyk8sres/policy/ledger.py).
 * Python parses, journals and decides (pyk8sres/slurmctld/ledger.py); this
 * file decides who is heard, in which order, and when to answer at all.
 *
 * Who: the kernel says who connects (SO_PEERCRED, as munged does), checked
 * at accept, before a byte of the request is read: root, SlurmUser and
 * LedgerUsers= only.  The socket file is 0600, or 0660 with LedgerGroup=
 * (k8s_resources.conf), so nobody else can even connect.
 *
 * Nobody delays anybody: one request per client per round; a client's next
 * request is read only once its last reply has left; a client that takes
 * none of its reply for STALL_MS is dropped; LedgerConnectionsPerUser=
 * connections per uid (k8s_resources.conf), so what a uid can hold is
 * bounded and root always gets in.
 *
 * When: only the slurmctld in control owns the journal -- an exclusive flock
 * on StateSaveLocation/k8s_resources.ledger.lock -- and only the owner
 * compacts the journal or (re)binds the socket.  It answers "notready" until
 * slurmctld has recovered its node and job state, and gives journal and
 * socket up as soon as slurmctld shuts down or hands over (shutdown,
 * takeover, 24.11+'s re-exec on reconfigure), after its last request: the
 * next owner loads every grant this one acknowledged.
 */
#define _GNU_SOURCE /* dladdr in core_loader.h, struct ucred */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
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
#include "src/slurmctld/locks.h"
#include "src/slurmctld/slurmctld.h"

#include "core_loader.h"
#include "ledger_server.h"

/* slurmctld-only symbols: slurmd loads the plugin too (and never starts us). */
#pragma weak lock_slurmctld
#pragma weak unlock_slurmctld
#pragma weak slurmctld_config
#pragma weak slurmctld_primary
#pragma weak control_time
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
#define SOCKET_NAME "k8s_resources.socket"
#define LINE_MAX_BYTES (1 << 20)	/* policy.ledger.MAX_REQUEST_BYTES */
#define REPLY_BYTES (4 << 20)
#define MAX_USERS 64			/* LedgerUsers= */
#define STALL_MS 1000			/* no reply byte taken this long: dropped */
#define POLL_MS 100			/* how soon a change of control is seen */
#define WATCH_MS 500			/* idle re-carry after a rebuild */
#define RETRY_LOAD_S 10			/* a journal or socket that failed */
#define LOG_EVERY_S 10			/* hostile callers cannot flood the log */

#define REPLY_NOT_READY "{\"ok\":false,\"code\":\"notready\",\"error\":\"slurmctld has " \
	"not recovered its node and job state yet (starting, or taking over as " \
	"backup): retry shortly\"}\n"

struct client {
	int fd;
	uid_t uid;
	char *in;		/* request bytes not served yet */
	size_t in_len, in_size;
	char *out;		/* the one reply not taken yet */
	size_t out_len, out_sent;
	struct timespec out_moved;	/* the reply last made progress */
	bool eof;		/* the client sent all it will send */
	bool close_after;	/* drop once `out` has left (a refusal) */
	uint64_t served;
};

static const struct pyk8sres_core *core;
static struct ledger_plugin_ops ops;
static char *state_dir, *lock_path, *socket_path;
static uint32_t base_uids[2];	/* root, SlurmUser */

/* Who may connect (reconfigure changes it while the thread runs). */
static pthread_mutex_t access_lock = PTHREAD_MUTEX_INITIALIZER;
static uint32_t users[MAX_USERS];
static size_t n_users;
static int64_t group = -1;	/* LedgerGroup=, -1: none */
static uint32_t conn_per_uid = 32;	/* LedgerConnectionsPerUser= */
static volatile bool access_changed;

/* Ownership of the journal: the flock, and the journal loaded under it. */
static pthread_mutex_t own_lock = PTHREAD_MUTEX_INITIALIZER;
static int lock_fd = -1;
static volatile bool owner;
static bool capacity_given;	/* since in control (the thread's own) */
static time_t retry_load_at;
static bool told_waiting;

static volatile bool seen_control, stop, running;
static pthread_t tid;
static int listen_fd = -1;
static time_t listen_retry_at;
static struct timespec accept_resumes;
static struct client *clients;
static int n_clients, clients_size;
static char *reply;

enum { LOG_DENIED, LOG_BUSY, LOG_DROPPED, LOG_REFUSED, LOG_ACCEPT, LOG_KINDS };
static time_t log_last[LOG_KINDS];
static int log_skipped[LOG_KINDS];

/* Rate-limited logging: true if this line may go out now; *skipped says how
 * many of its kind were held back since the last one. */
static bool _log_ok(int kind, int *skipped)
{
	time_t now = time(NULL);

	if (now - log_last[kind] < LOG_EVERY_S) {
		log_skipped[kind]++;
		return false;
	}
	log_last[kind] = now;
	*skipped = log_skipped[kind];
	log_skipped[kind] = 0;
	return true;
}

static long _ms_since(const struct timespec *t)
{
	struct timespec now;

	clock_gettime(CLOCK_MONOTONIC, &now);
	return (now.tv_sec - t->tv_sec) * 1000 +
	       (now.tv_nsec - t->tv_nsec) / 1000000;
}

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

/* --- Who may connect --------------------------------------------------------- */

static void _read_access(bool at_start)
{
	uint32_t got[MAX_USERS];
	size_t n = 0;
	int64_t gid = -1;
	uint32_t per_uid = 32;
	char path[PATH_MAX] = "";

	if (core->ledger_settings(got, MAX_USERS, &n, &gid, &per_uid, path,
				  sizeof(path))) {
		error("%s: %s: cannot read LedgerUsers/LedgerGroup: %s; %s",
		      LOG_PREFIX, __func__, path,
		      at_start ? "root and SlurmUser only" : "keeping the previous ones");
		if (!at_start)
			return;
		n = 0;
		gid = -1;
		per_uid = 32;
		path[0] = '\0';
	}
	n = MIN(n, (size_t) MAX_USERS);
	if (!path[0])
		snprintf(path, sizeof(path), "%s/%s", state_dir, SOCKET_NAME);
	if (at_start)
		socket_path = xstrdup(path);
	else if (xstrcmp(path, socket_path))
		info("%s: %s: LedgerSocket= takes effect at the next slurmctld start; serving %s meanwhile",
		     LOG_PREFIX, __func__, socket_path);
	if (n && gid < 0)
		error("%s: %s: LedgerUsers= is set but LedgerGroup= is not: the socket is 0600 and only root and SlurmUser can open it",
		      LOG_PREFIX, __func__);
	slurm_mutex_lock(&access_lock);
	memcpy(users, got, n * sizeof(got[0]));
	n_users = n;
	group = gid;
	conn_per_uid = MAX(per_uid, 1);
	slurm_mutex_unlock(&access_lock);
	access_changed = true;
}

extern void ledger_server_reconfigure(void)
{
	if (running)
		_read_access(false);
}

static bool _allowed(uid_t uid)
{
	bool ok = false;

	if (uid == base_uids[0] || uid == base_uids[1])
		return true;
	slurm_mutex_lock(&access_lock);
	for (size_t i = 0; !ok && i < n_users; i++)
		ok = users[i] == uid;
	slurm_mutex_unlock(&access_lock);
	return ok;
}

/* The socket's group and mode: 0660 with LedgerGroup, else 0600 (root and
 * SlurmUser, its owner).  Never wider. */
static void _apply_mode(void)
{
	int64_t gid;
	mode_t mode = 0600;

	slurm_mutex_lock(&access_lock);
	gid = group;
	slurm_mutex_unlock(&access_lock);
	if (gid >= 0) {
		if (chown(socket_path, (uid_t) -1, (gid_t) gid))
			error("%s: %s: cannot give %s to LedgerGroup=%" PRId64 " (%m): SlurmUser must be a member; only root and SlurmUser can connect",
			      LOG_PREFIX, __func__, socket_path, gid);
		else
			mode = 0660;
	}
	if (chmod(socket_path, mode))
		error("%s: %s: chmod %s: %m", LOG_PREFIX, __func__, socket_path);
}

static int _listen(void)
{
	struct sockaddr_un addr = { .sun_family = AF_UNIX };
	struct stat st;
	int fd;

	if (strlen(socket_path) >= sizeof(addr.sun_path)) {
		error("%s: %s: socket path %s is too long", LOG_PREFIX, __func__,
		      socket_path);
		return -1;
	}
	strcpy(addr.sun_path, socket_path);
	/* We own the journal lock: a socket left here is a dead owner's. */
	if (!lstat(socket_path, &st)) {
		if (!S_ISSOCK(st.st_mode)) {
			error("%s: %s: %s exists and is not a socket: not replacing it",
			      LOG_PREFIX, __func__, socket_path);
			return -1;
		}
		(void) unlink(socket_path);
	}
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0 || bind(fd, (struct sockaddr *) &addr, sizeof(addr))) {
		error("%s: %s: cannot bind %s: %m", LOG_PREFIX, __func__, socket_path);
		if (fd >= 0)
			close(fd);
		return -1;
	}
	/* Nobody can connect before listen(): set the mode first. */
	_apply_mode();
	if (listen(fd, 128)) {
		error("%s: %s: cannot listen on %s: %m", LOG_PREFIX, __func__,
		      socket_path);
		close(fd);
		return -1;
	}
	access_changed = false;
	verbose("%s: %s: serving %s", LOG_PREFIX, __func__, socket_path);
	return fd;
}

/* --- Clients ------------------------------------------------------------------ */

/* A refusal before the client is heard: one line, best effort, then close. */
static void _refuse(int fd, const char *line)
{
	(void) !send(fd, line, strlen(line), MSG_NOSIGNAL | MSG_DONTWAIT);
	close(fd);
}

static void _drop(struct client *c)
{
	if (c->fd >= 0)
		close(c->fd);
	xfree(c->in);
	xfree(c->out);
	*c = (struct client) { .fd = -1 };
}

static int _count_uid(uid_t uid)
{
	int n = 0;

	for (int i = 0; i < n_clients; i++)
		n += clients[i].fd >= 0 && clients[i].uid == uid;
	return n;
}

static void _accept_all(void)
{
	char line[320];
	int skipped, per_uid;

	for (int i = 0; i < 64; i++) {
		struct ucred cred;
		socklen_t len = sizeof(cred);
		int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);

		if (fd < 0) {
			if (errno == EMFILE || errno == ENFILE || errno == ENOMEM ||
			    errno == ENOBUFS) {
				/* The backlog stays readable: pause, do not spin. */
				clock_gettime(CLOCK_MONOTONIC, &accept_resumes);
				accept_resumes.tv_sec += 1;
				if (_log_ok(LOG_ACCEPT, &skipped))
					error("%s: %s: accept: %m; pausing 1 s", LOG_PREFIX,
					      __func__);
			}
			return;
		}
		if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len)) {
			close(fd);
			continue;
		}
		if (!_allowed(cred.uid)) {
			snprintf(line, sizeof(line), "{\"ok\":false,\"code\":\"denied\",\"error\":\"uid %u may not use the ledger (root, SlurmUser and LedgerUsers= in k8s_resources.conf may)\"}\n",
				 (unsigned) cred.uid);
			_refuse(fd, line);
			if (_log_ok(LOG_DENIED, &skipped))
				info("%s: %s: refused uid %u (pid %d): not root, SlurmUser or in LedgerUsers (%d more refusals not logged)",
				     LOG_PREFIX, __func__, (unsigned) cred.uid,
				     (int) cred.pid, skipped);
			continue;
		}
		slurm_mutex_lock(&access_lock);
		per_uid = conn_per_uid;
		slurm_mutex_unlock(&access_lock);
		if (_count_uid(cred.uid) >= per_uid) {
			snprintf(line, sizeof(line), "{\"ok\":false,\"code\":\"busy\",\"error\":\"uid %u already has %d connections to the ledger (the limit: LedgerConnectionsPerUser= in k8s_resources.conf)\"}\n",
				 (unsigned) cred.uid, per_uid);
			_refuse(fd, line);
			if (_log_ok(LOG_BUSY, &skipped))
				info("%s: %s: refused a connection of uid %u (pid %d): it has %d already (%d more not logged)",
				     LOG_PREFIX, __func__, (unsigned) cred.uid,
				     (int) cred.pid, per_uid, skipped);
			continue;
		}
		if (n_clients == clients_size) {
			clients_size = clients_size ? clients_size * 2 : 16;
			xrecalloc(clients, clients_size, sizeof(*clients));
		}
		clients[n_clients++] = (struct client) { .fd = fd, .uid = cred.uid };
	}
}

/* Send what the client takes now.  False: drop it. */
static bool _flush(struct client *c)
{
	while (c->out_sent < c->out_len) {
		ssize_t n = send(c->fd, c->out + c->out_sent,
				 c->out_len - c->out_sent,
				 MSG_NOSIGNAL | MSG_DONTWAIT);

		if (n > 0) {
			c->out_sent += n;
			clock_gettime(CLOCK_MONOTONIC, &c->out_moved);
		} else if (n < 0 && errno == EINTR) {
			continue;
		} else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
			return true;
		} else {
			return false;
		}
	}
	xfree(c->out);
	c->out_len = c->out_sent = 0;
	return !c->close_after;
}

static bool _has_line(struct client *c)
{
	return c->in_len && memchr(c->in, '\n', c->in_len);
}

/* Does the client want reading: no reply pending, no whole line buffered. */
static bool _wants_input(struct client *c)
{
	return !c->out_len && !c->eof && !c->close_after && !_has_line(c) &&
	       c->in_len < LINE_MAX_BYTES;
}

/* Read what is there, into a buffer of at most LINE_MAX_BYTES.  False:
 * the connection failed. */
static bool _fill(struct client *c)
{
	while (c->in_len < LINE_MAX_BYTES) {
		ssize_t n;

		if (c->in_len + 1 >= c->in_size) {
			c->in_size = MIN(MAX(c->in_size * 2, 4096),
					 (size_t) LINE_MAX_BYTES + 1);
			xrecalloc(c->in, 1, c->in_size);
		}
		n = recv(c->fd, c->in + c->in_len, c->in_size - 1 - c->in_len,
			 MSG_DONTWAIT);
		if (n > 0) {
			bool line = memchr(c->in + c->in_len, '\n', n);

			c->in_len += n;
			if (line)
				return true;
		} else if (n == 0) {
			c->eof = true;
			return true;
		} else if (errno == EINTR) {
			continue;
		} else {
			return errno == EAGAIN || errno == EWOULDBLOCK;
		}
	}
	return true;
}

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

/* Decide one request: Python parses and journals outside slurmctld's locks,
 * then decides and applies under them. */
static void _handle(uid_t uid, const char *line)
{
	/* A change is decided and applied atomically with job starts (job and
	 * node write locks); a `show` reads a copy of the facts, taken under
	 * the node read lock, and builds its reply after letting go. */
	slurmctld_lock_t write_lock = { .job = WRITE_LOCK, .node = WRITE_LOCK };
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
			to_lock = _ms_since(&prepared);
			ops.copy_facts();
			unlock_slurmctld(read_lock);
			core->ledger_apply(ticket, ops.copied_facts, ops.share,
					   ops.copied_node_name, ops.stats,
					   ops.copied_changes, reply, REPLY_BYTES);
		} else {
			lock_slurmctld(write_lock);
			to_lock = _ms_since(&prepared);
			ops.resync();
			core->ledger_apply(ticket, ops.facts, ops.share,
					   ops.node_name, ops.stats,
					   ops.copied_changes, reply, REPLY_BYTES);
			unlock_slurmctld(write_lock);
		}
		/* Callers time out after 2 s: say where a slow answer waited. */
		if ((took = _ms_since(&start)) >= 1000)
			info("%s: %s: a request took %ld ms, %ld of them waiting for slurmctld's locks",
			     LOG_PREFIX, __func__, took, to_lock);
	}
	if (!reply[0])
		strcpy(reply, "{\"ok\":false,\"code\":\"internal\",\"error\":\"no reply\"}\n");
}

static void _queue(struct client *c, const char *text)
{
	c->out_len = strlen(text);
	c->out_sent = 0;
	c->out = xmalloc(c->out_len);
	memcpy(c->out, text, c->out_len);
	clock_gettime(CLOCK_MONOTONIC, &c->out_moved);
}

/* Serve the client's next whole line (or refuse an overlong one). */
static void _serve_one(struct client *c)
{
	char *nl = c->in_len ? memchr(c->in, '\n', c->in_len) : NULL;
	const char *answer = reply;
	size_t used;
	int skipped;

	if (!nl) {
		if (c->in_len < LINE_MAX_BYTES)
			return;
		_queue(c, "{\"ok\":false,\"code\":\"badrequest\",\"error\":\"request line longer than 1 MiB\"}\n");
		c->close_after = true;
		if (_log_ok(LOG_REFUSED, &skipped))
			info("%s: %s: dropped a client of uid %u: request line longer than 1 MiB (%d more refusals not logged)",
			     LOG_PREFIX, __func__, (unsigned) c->uid, skipped);
		return;
	}
	used = nl - c->in + 1;
	*nl = '\0';
	if (!_ready())
		answer = REPLY_NOT_READY;
	else if (memchr(c->in, '\0', used - 1))
		answer = "{\"ok\":false,\"code\":\"badrequest\",\"error\":\"NUL byte in request\"}\n";
	else
		_handle(c->uid, c->in);
	if (!strncmp(answer, "{\"ok\":false,\"code\":\"badrequest\"", 31) &&
	    _log_ok(LOG_REFUSED, &skipped))
		info("%s: %s: refused a request of uid %u: %.300s (%d more refusals not logged)",
		     LOG_PREFIX, __func__, (unsigned) c->uid, answer, skipped);
	memmove(c->in, c->in + used, c->in_len - used);
	c->in_len -= used;
	c->served++;
	_queue(c, answer);
}

/* Drops leave holes: close them up, keeping the order. */
static void _compact_clients(void)
{
	int kept = 0;

	for (int i = 0; i < n_clients; i++)
		if (clients[i].fd >= 0)
			clients[kept++] = clients[i];
	n_clients = kept;
}

static void _drop_all(const char *line)
{
	for (int i = 0; i < n_clients; i++)
		if (clients[i].fd >= 0) {
			if (line && !clients[i].out_len)	/* never mid-reply */
				(void) !send(clients[i].fd, line, strlen(line),
					     MSG_NOSIGNAL | MSG_DONTWAIT);
			_drop(&clients[i]);
		}
	n_clients = 0;
}

/* Drop clients whose uid was removed from LedgerUsers by a reconfigure. */
static void _recheck_access(void)
{
	int skipped;

	access_changed = false;
	if (listen_fd >= 0)
		_apply_mode();
	for (int i = 0; i < n_clients; i++)
		if (clients[i].fd >= 0 && !_allowed(clients[i].uid)) {
			if (_log_ok(LOG_DROPPED, &skipped))
				info("%s: %s: dropped a client of uid %u: no longer in LedgerUsers",
				     LOG_PREFIX, __func__, (unsigned) clients[i].uid);
			_drop(&clients[i]);
		}
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
		if (ops.give_capacity) {
			slurmctld_lock_t rebuild_lock = { .job = WRITE_LOCK, .node = WRITE_LOCK,
							  .part = READ_LOCK };

			lock_slurmctld(rebuild_lock);
			ops.give_capacity();
			unlock_slurmctld(rebuild_lock);
		}
		capacity_given = true;
	}
	if (owner && listen_fd < 0 && _should_own() &&
	    time(NULL) >= listen_retry_at && (listen_fd = _listen()) < 0)
		listen_retry_at = time(NULL) + RETRY_LOAD_S;
	if ((owner || lock_fd >= 0) && !_should_own()) {
		/* After our last request: what we acknowledged is journaled. */
		_drop_all(REPLY_NOT_READY);
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
	if ((took = _ms_since(&start)) >= 1000) /* requests waited as long */
		info("%s: %s: waited %ld ms for slurmctld's node lock", LOG_PREFIX,
		     __func__, took);
}

static void *_thread(void *arg)
{
	struct pollfd *fds = NULL;
	int fds_size = 0, skipped;
	struct timespec watched;

	clock_gettime(CLOCK_MONOTONIC, &watched);
	while (!stop) {
		bool work = false, listening;
		int n = 0;

		_follow_control();
		if (access_changed)
			_recheck_access();
		if (fds_size < n_clients + 1) {
			fds_size = n_clients + 16;
			xrecalloc(fds, fds_size, sizeof(*fds));
		}
		listening = listen_fd >= 0 && _ms_since(&accept_resumes) >= 0;
		fds[n++] = (struct pollfd) { .fd = listening ? listen_fd : -1,
					     .events = POLLIN };
		for (int i = 0; i < n_clients; i++) {
			struct client *c = &clients[i];
			short events = 0;

			if (c->out_len)
				events |= POLLOUT;
			else if (_has_line(c) || (c->eof && c->in_len))
				work = true;	/* served below, no waiting */
			if (_wants_input(c))
				events |= POLLIN;
			fds[n++] = (struct pollfd) { .fd = c->fd, .events = events };
		}
		if (poll(fds, n, work ? 0 : POLL_MS) < 0 && errno != EINTR) {
			error("%s: %s: poll: %m", LOG_PREFIX, __func__);
			sleep(1);
			continue;
		}
		/* One round: every client's events, then one request each. */
		for (int i = 0; i < n_clients; i++) {
			struct client *c = &clients[i];
			short rev = fds[i + 1].revents;

			if (c->fd < 0)
				continue;
			if ((rev & POLLOUT) && !_flush(c)) {
				_drop(c);
				continue;
			}
			if ((rev & (POLLIN | POLLHUP | POLLERR)) && _wants_input(c) &&
			    !_fill(c)) {
				_drop(c);
				continue;
			}
			if (!c->out_len && _has_line(c))
				_serve_one(c);
			else if (!c->out_len && c->in_len >= LINE_MAX_BYTES)
				_serve_one(c);	/* refuses it */
			if (c->out_len && !_flush(c)) {
				_drop(c);
				continue;
			}
			if (c->out_len && _ms_since(&c->out_moved) >= STALL_MS) {
				if (_log_ok(LOG_DROPPED, &skipped))
					info("%s: %s: dropped a client of uid %u: it took no reply for %d ms (%" PRIu64 " requests served; %d more drops not logged)",
					     LOG_PREFIX, __func__, (unsigned) c->uid,
					     STALL_MS, c->served, skipped);
				_drop(c);
				continue;
			}
			if (c->eof && !c->out_len && !_has_line(c))
				_drop(c);	/* said all, got all its answers */
		}
		if (listening && (fds[0].revents & POLLIN))
			_accept_all();
		_compact_clients();
		if (_in_control() && _ms_since(&watched) >= WATCH_MS) {
			_watch_rebuilds();
			clock_gettime(CLOCK_MONOTONIC, &watched);
		}
	}
	_drop_all(NULL);
	xfree(fds);
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
	_read_access(true);
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
		socket_path);
	return SLURM_SUCCESS;
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
