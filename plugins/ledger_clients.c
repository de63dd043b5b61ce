/*
 * node_features/k8s_resources: the ledger socket's connections.
 *
 * Every socket non-blocking, one poll() per round: one JSON request line
 * in, one reply line out (pyk8sres/policy/ledger.py).  Who connects is
 * checked at accept (ledger_access.c); what a request does is the server's
 * (ledger_server.c).
 *
 * Nobody delays anybody: one request per client per round; a client's next
 * request is read only once its last reply has left; a client that takes
 * none of its reply for STALL_MS is dropped; LedgerConnectionsPerUser=
 * connections per uid, so what a uid can hold is bounded.  Refusals and
 * drops are logged at most once per LOG_EVERY_S per kind, so hostile
 * callers cannot flood the log.
 */
#define _GNU_SOURCE /* struct ucred, accept4 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "slurm/slurm.h"
#include "slurm/slurm_errno.h"

#include "src/common/slurm_xlator.h"
#include "src/common/log.h"
#include "src/common/macros.h"
#include "src/common/xmalloc.h"

#include "ledger_access.h"
#include "ledger_clients.h"

#define LOG_PREFIX "node_features/k8s_resources ledger"
#define LINE_MAX_BYTES (1 << 20)	/* policy.ledger.MAX_REQUEST_BYTES */
#define STALL_MS 1000			/* no reply byte taken this long: dropped */
#define LOG_EVERY_S 10			/* hostile callers cannot flood the log */

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

static bool (*ready)(void);
static const char *(*answer_line)(uid_t uid, const char *line);
static struct client *clients;
static int n_clients, clients_size;
static struct pollfd *fds;
static int fds_size;
static struct timespec accept_resumes;

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

extern void ledger_clients_start(bool (*ready_fn)(void),
				 const char *(*answer_fn)(uid_t uid, const char *line))
{
	ready = ready_fn;
	answer_line = answer_fn;
}

/* --- Accepting ------------------------------------------------------------- */

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

static void _accept_all(int listen_fd)
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
		if (!ledger_access_allowed(cred.uid)) {
			snprintf(line, sizeof(line), "{\"ok\":false,\"code\":\"denied\",\"error\":\"uid %u may not use the ledger (root, SlurmUser and LedgerUsers= in k8s_resources.conf may)\"}\n",
				 (unsigned) cred.uid);
			_refuse(fd, line);
			if (_log_ok(LOG_DENIED, &skipped))
				info("%s: %s: refused uid %u (pid %d): not root, SlurmUser or in LedgerUsers (%d more refusals not logged)",
				     LOG_PREFIX, __func__, (unsigned) cred.uid,
				     (int) cred.pid, skipped);
			continue;
		}
		per_uid = ledger_access_per_uid();
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

/* --- Reading and writing ----------------------------------------------------- */

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
	const char *answer;
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
	if (!ready())
		answer = LEDGER_REPLY_NOT_READY;
	else if (memchr(c->in, '\0', used - 1))
		answer = "{\"ok\":false,\"code\":\"badrequest\",\"error\":\"NUL byte in request\"}\n";
	else
		answer = answer_line(c->uid, c->in);
	if (!strncmp(answer, "{\"ok\":false,\"code\":\"badrequest\"", 31) &&
	    _log_ok(LOG_REFUSED, &skipped))
		info("%s: %s: refused a request of uid %u: %.300s (%d more refusals not logged)",
		     LOG_PREFIX, __func__, (unsigned) c->uid, answer, skipped);
	memmove(c->in, c->in + used, c->in_len - used);
	c->in_len -= used;
	c->served++;
	_queue(c, answer);
}

/* --- Rounds ---------------------------------------------------------------- */

/* Drops leave holes: close them up, keeping the order. */
static void _compact_clients(void)
{
	int kept = 0;

	for (int i = 0; i < n_clients; i++)
		if (clients[i].fd >= 0)
			clients[kept++] = clients[i];
	n_clients = kept;
}

extern void ledger_clients_drop_all(const char *line)
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

extern void ledger_clients_stop(void)
{
	ledger_clients_drop_all(NULL);
	xfree(fds);
	fds_size = 0;
}

/* Drop clients whose uid was removed from LedgerUsers by a reconfigure. */
static void _recheck_access(void)
{
	int skipped;

	for (int i = 0; i < n_clients; i++)
		if (clients[i].fd >= 0 && !ledger_access_allowed(clients[i].uid)) {
			if (_log_ok(LOG_DROPPED, &skipped))
				info("%s: %s: dropped a client of uid %u: no longer in LedgerUsers",
				     LOG_PREFIX, __func__, (unsigned) clients[i].uid);
			_drop(&clients[i]);
		}
}

/* What to wait for: the listening socket first (fd -1 while not accepting),
 * then each client.  *work: a request is buffered already, so no waiting.
 * Returns how many entries. */
static int _poll_set(int listen_fd, bool *work)
{
	int n = 0;

	if (fds_size < n_clients + 1) {
		fds_size = n_clients + 16;
		xrecalloc(fds, fds_size, sizeof(*fds));
	}
	fds[n++] = (struct pollfd) { .fd = listen_fd, .events = POLLIN };
	for (int i = 0; i < n_clients; i++) {
		struct client *c = &clients[i];
		short events = 0;

		if (c->out_len)
			events |= POLLOUT;
		else if (_has_line(c) || (c->eof && c->in_len))
			*work = true;	/* served below, no waiting */
		if (_wants_input(c))
			events |= POLLIN;
		fds[n++] = (struct pollfd) { .fd = c->fd, .events = events };
	}
	return n;
}

/* One client's turn in a round: its events, then at most one request. */
static void _turn(struct client *c, short rev)
{
	int skipped;

	if ((rev & POLLOUT) && !_flush(c)) {
		_drop(c);
		return;
	}
	if ((rev & (POLLIN | POLLHUP | POLLERR)) && _wants_input(c) && !_fill(c)) {
		_drop(c);
		return;
	}
	if (!c->out_len && _has_line(c))
		_serve_one(c);
	else if (!c->out_len && c->in_len >= LINE_MAX_BYTES)
		_serve_one(c);	/* refuses it */
	if (c->out_len && !_flush(c)) {
		_drop(c);
		return;
	}
	if (c->out_len && ledger_ms_since(&c->out_moved) >= STALL_MS) {
		if (_log_ok(LOG_DROPPED, &skipped))
			info("%s: %s: dropped a client of uid %u: it took no reply for %d ms (%" PRIu64 " requests served; %d more drops not logged)",
			     LOG_PREFIX, __func__, (unsigned) c->uid,
			     STALL_MS, c->served, skipped);
		_drop(c);
		return;
	}
	if (c->eof && !c->out_len && !_has_line(c))
		_drop(c);	/* said all, got all its answers */
}

extern bool ledger_clients_round(int listen_fd, int wait_ms)
{
	bool work = false;
	bool listening;
	int n;

	if (ledger_access_take_change(listen_fd >= 0))
		_recheck_access();
	listening = listen_fd >= 0 && ledger_ms_since(&accept_resumes) >= 0;
	n = _poll_set(listening ? listen_fd : -1, &work);
	if (poll(fds, n, work ? 0 : wait_ms) < 0 && errno != EINTR) {
		error("%s: %s: poll: %m", LOG_PREFIX, __func__);
		return false;
	}
	/* One round: every client's events, then one request each. */
	for (int i = 0; i < n_clients; i++)
		if (clients[i].fd >= 0)
			_turn(&clients[i], fds[i + 1].revents);
	if (listening && (fds[0].revents & POLLIN))
		_accept_all(listen_fd);
	_compact_clients();
	return true;
}
