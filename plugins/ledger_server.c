/*
 * node_features/k8s_resources: the ledger's request socket.
 *
 * One thread, poll()ing the listening socket and its clients; one request
 * line in, one reply line out (pyk8sres/policy/ledger.py).  Python parses,
 * journals and decides (pyk8sres/slurmctld/ledger.py); the plugin carries
 * the shares (node_features_k8s_resources.c).
 */
#define _GNU_SOURCE /* dladdr in core_loader.h, struct ucred */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "slurm/slurm.h"
#include "slurm/slurm_errno.h"

#include "src/common/slurm_xlator.h"
#include "src/common/log.h"
#include "src/common/read_config.h"
#include "src/common/xmalloc.h"
#include "src/common/xstring.h"
#include "src/slurmctld/locks.h"

#include "core_loader.h"
#include "ledger_server.h"

/* slurmctld-only: slurmd loads this plugin too and must still dlopen it. */
#pragma weak lock_slurmctld
#pragma weak unlock_slurmctld

#define LOG_PREFIX "node_features/k8s_resources ledger"

static const struct pyk8sres_core *core;
static struct ledger_plugin_ops ops;

/* --- The request socket ---------------------------------------------------
 * One thread, poll()ing the listening socket and its clients; one request
 * line in, one reply line out.  Callers are authenticated by the kernel
 * (SO_PEERCRED), as munged authenticates its own; Python decides who may. */
#define MAX_CLIENTS 32
#define LINE_MAX_BYTES (1 << 20)
#define REPLY_BYTES (4 << 20)

struct client {
	int fd;
	uid_t uid;
	char *buf;
	size_t len;
};

static char *socket_path;
static int listen_fd = -1;
static volatile bool ledger_stop;
static pthread_t ledger_tid;
static bool ledger_running;

static int _listen(const char *path)
{
	struct sockaddr_un addr = { .sun_family = AF_UNIX };
	int fd;

	if (strlen(path) >= sizeof(addr.sun_path)) {
		error("%s: %s: socket path %s is too long", LOG_PREFIX, __func__,
		      path);
		return -1;
	}
	strcpy(addr.sun_path, path);
	(void) unlink(path);
	if ((fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0 ||
	    bind(fd, (struct sockaddr *) &addr, sizeof(addr)) ||
	    chmod(path, 0666) || /* anyone may ask; SO_PEERCRED decides */
	    listen(fd, 64)) {
		error("%s: %s: cannot listen on %s: %m", LOG_PREFIX, __func__,
		      path);
		if (fd >= 0)
			close(fd);
		return -1;
	}
	return fd;
}

static void _send_all(int fd, const char *data, size_t len)
{
	while (len) {
		ssize_t n = send(fd, data, len, MSG_NOSIGNAL);

		if (n <= 0) {
			if (n < 0 && errno == EINTR)
				continue;
			return; /* the client went away or stalled 1 s: drop it */
		}
		data += n;
		len -= n;
	}
}

static void _send_str(int fd, const char *text)
{
	_send_all(fd, text, strlen(text));
}

static long _ms_since(const struct timespec *t)
{
	struct timespec now;

	clock_gettime(CLOCK_MONOTONIC, &now);
	return (now.tv_sec - t->tv_sec) * 1000 +
	       (now.tv_nsec - t->tv_nsec) / 1000000;
}

static void _serve(struct client *c, char *line, char *reply)
{
	slurmctld_lock_t write_lock = { .job = WRITE_LOCK, .node = WRITE_LOCK };
	struct timespec start, prepared;
	int ticket = 0;

	reply[0] = '\0';
	clock_gettime(CLOCK_MONOTONIC, &start);
	core->ledger_prepare(c->uid, line, &ticket, reply, REPLY_BYTES);
	if (ticket > 0) {
		long to_lock, took;

		clock_gettime(CLOCK_MONOTONIC, &prepared);
		lock_slurmctld(write_lock);
		to_lock = _ms_since(&prepared);
		ops.resync();
		core->ledger_apply(ticket, ops.facts, ops.share, ops.node_name,
				   ops.stats, reply, REPLY_BYTES);
		unlock_slurmctld(write_lock);
		/* Callers time out after 2 s: say where a slow answer waited. */
		if ((took = _ms_since(&start)) >= 1000)
			info("%s: %s: a request took %ld ms, %ld of them waiting for slurmctld's job and node locks",
			     LOG_PREFIX, __func__, took, to_lock);
	}
	if (!reply[0])
		strcpy(reply, "{\"ok\":false,\"code\":\"internal\",\"error\":\"no reply\"}\n");
	_send_str(c->fd, reply);
}

static void _drop(struct client *c)
{
	close(c->fd);
	xfree(c->buf);
	c->fd = -1;
	c->len = 0;
}

/* Read what is there; serve every complete line.  False: drop the client. */
static bool _read(struct client *c, char *reply)
{
	char *nl;
	ssize_t n;

	if (!c->buf)
		c->buf = xmalloc(LINE_MAX_BYTES + 1);
	n = recv(c->fd, c->buf + c->len, LINE_MAX_BYTES - c->len, MSG_DONTWAIT);
	if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
		return false;
	if (n < 0)
		return true;
	c->len += n;
	c->buf[c->len] = '\0';
	while ((nl = memchr(c->buf, '\n', c->len))) {
		size_t used = nl - c->buf + 1;

		*nl = '\0';
		if (memchr(c->buf, '\0', used - 1)) {
			_send_str(c->fd, "{\"ok\":false,\"code\":\"badrequest\",\"error\":\"NUL byte in request\"}\n");
		} else
			_serve(c, c->buf, reply);
		memmove(c->buf, c->buf + used, c->len - used);
		c->len -= used;
		c->buf[c->len] = '\0';
	}
	if (c->len == LINE_MAX_BYTES) {
		_send_str(c->fd, "{\"ok\":false,\"code\":\"badrequest\",\"error\":\"request line longer than 1 MiB\"}\n");
		return false;
	}
	return true;
}

static void _accept(struct client *clients)
{
	struct timeval send_timeout = { .tv_sec = 1 };
	struct ucred cred;
	socklen_t len = sizeof(cred);
	int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);

	if (fd < 0)
		return;
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len)) {
		close(fd);
		return;
	}
	(void) setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &send_timeout,
			  sizeof(send_timeout));
	for (int i = 0; i < MAX_CLIENTS; i++)
		if (clients[i].fd < 0) {
			clients[i].fd = fd;
			clients[i].uid = cred.uid;
			return;
		}
	_send_str(fd, "{\"ok\":false,\"code\":\"internal\",\"error\":\"too many clients\"}\n");
	close(fd);
}

/* Idle: re-apply the share soon after a rebuild even when nothing is being
 * scheduled (slurmctld startup, a reconfigure), so `scontrol show node`
 * shows it.  Allocations never wait for this: user_update comes first. */
static void _watch_rebuilds(void)
{
	slurmctld_lock_t read_lock = { .node = READ_LOCK };
	struct timespec start;
	long took;

	clock_gettime(CLOCK_MONOTONIC, &start);
	lock_slurmctld(read_lock);
	ops.resync();
	unlock_slurmctld(read_lock);
	if ((took = _ms_since(&start)) >= 1000) /* requests waited as long */
		info("%s: %s: waited %ld ms for slurmctld's node lock",
		     LOG_PREFIX, __func__, took);
}

static void *_ledger_thread(void *arg)
{
	struct client clients[MAX_CLIENTS];
	struct pollfd fds[MAX_CLIENTS + 1];
	char *reply = xmalloc(REPLY_BYTES);

	for (int i = 0; i < MAX_CLIENTS; i++)
		clients[i] = (struct client) { .fd = -1 };
	while (!ledger_stop) {
		int n = 0;

		fds[n++] = (struct pollfd) { .fd = listen_fd, .events = POLLIN };
		for (int i = 0; i < MAX_CLIENTS; i++)
			fds[n++] = (struct pollfd) { .fd = clients[i].fd,
						     .events = POLLIN };
		if (poll(fds, n, 500) <= 0) {
			_watch_rebuilds();
			continue;
		}
		if (fds[0].revents & POLLIN)
			_accept(clients);
		for (int i = 0; i < MAX_CLIENTS; i++)
			if (clients[i].fd >= 0 &&
			    (fds[i + 1].revents & (POLLIN | POLLHUP | POLLERR)) &&
			    !_read(&clients[i], reply))
				_drop(&clients[i]);
	}
	for (int i = 0; i < MAX_CLIENTS; i++)
		if (clients[i].fd >= 0)
			_drop(&clients[i]);
	xfree(reply);
	return NULL;
}

/* Load the journal and start serving; slurmctld does not start if the
 * ledger cannot be trusted (a half-read ledger would double-book). */
extern int ledger_server_start(const struct pyk8sres_core *loaded,
			       const struct ledger_plugin_ops *plugin_ops)
{
	char path[PATH_MAX] = "";
	uint32_t slurm_user = slurm_conf.slurm_user_id;
	Dl_info info;

	if (!lock_slurmctld || !slurm_conf.state_save_location) {
		error("%s: %s: not inside slurmctld", LOG_PREFIX, __func__);
		return SLURM_ERROR;
	}
	core = loaded;
	ops = *plugin_ops;
	if (core->ledger_open(slurm_conf.state_save_location, &slurm_user, 1,
			      ops.remember, path, sizeof(path))) {
		error("%s: %s: cannot load the ledger: %s", LOG_PREFIX,
		      __func__, path);
		return SLURM_ERROR;
	}
	socket_path = xstrdup(path);
	if ((listen_fd = _listen(socket_path)) < 0)
		return SLURM_ERROR;
	/* Our thread runs code of this .so: never unmap it under the thread. */
	if (dladdr((void *) _ledger_thread, &info) && info.dli_fname)
		(void) dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
	if (pthread_create(&ledger_tid, NULL, _ledger_thread, NULL)) {
		error("%s: %s: cannot start the ledger thread: %m", LOG_PREFIX,
		      __func__);
		return SLURM_ERROR;
	}
	ledger_running = true;
	verbose("%s: %s: ledger serving %s", LOG_PREFIX, __func__, socket_path);
	return SLURM_SUCCESS;
}

extern bool ledger_server_running(void)
{
	return ledger_running;
}

/* The thread is told to stop; it is not joined, as fini may run under the
 * very locks the thread waits for. */
extern void ledger_server_stop(void)
{
	ledger_stop = true;
}

