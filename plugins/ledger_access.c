/*
 * node_features/k8s_resources: who may connect to the ledger's socket.
 *
 * The kernel says who connects (SO_PEERCRED, as munged does), checked at
 * accept, before a byte of the request is read: root, SlurmUser and
 * LedgerUsers= only.  The socket file is 0600, or 0660 with LedgerGroup=
 * (k8s_resources.conf), so nobody else can even connect.
 * LedgerConnectionsPerUser= bounds what one uid can hold, so root always
 * gets in.  A reconfigure changes all of it while the server's thread
 * runs: the settings sit behind a mutex.
 */
#define _GNU_SOURCE /* dladdr in core_loader.h */
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "slurm/slurm.h"
#include "slurm/slurm_errno.h"

#include "src/common/slurm_xlator.h"
#include "src/common/log.h"
#include "src/common/macros.h"
#include "src/common/xmalloc.h"
#include "src/common/xstring.h"

#include "core_loader.h"
#include "ledger_access.h"

#define LOG_PREFIX "node_features/k8s_resources ledger"
#define SOCKET_NAME "k8s_resources.socket"
#define MAX_USERS 64			/* LedgerUsers= */

static const struct pyk8sres_core *core;
static const char *state_dir;
static char *socket_path;
static uint32_t base_uids[2];	/* root, SlurmUser */

/* Who may connect (reconfigure changes it while the thread runs). */
static pthread_mutex_t access_lock = PTHREAD_MUTEX_INITIALIZER;
static uint32_t users[MAX_USERS];
static size_t n_users;
static int64_t group = -1;	/* LedgerGroup=, -1: none */
static uint32_t conn_per_uid = 32;	/* LedgerConnectionsPerUser= */
static volatile bool access_changed;

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

extern void ledger_access_start(const struct pyk8sres_core *loaded,
				const char *dir, const uint32_t *base)
{
	core = loaded;
	state_dir = dir;
	base_uids[0] = base[0];
	base_uids[1] = base[1];
	_read_access(true);
}

extern void ledger_access_reread(void)
{
	_read_access(false);
}

extern bool ledger_access_allowed(uid_t uid)
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

extern int ledger_access_per_uid(void)
{
	int per_uid;

	slurm_mutex_lock(&access_lock);
	per_uid = conn_per_uid;
	slurm_mutex_unlock(&access_lock);
	return per_uid;
}

extern const char *ledger_access_socket_path(void)
{
	return socket_path;
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

extern bool ledger_access_take_change(bool listening)
{
	if (!access_changed)
		return false;
	access_changed = false;
	if (listening)
		_apply_mode();
	return true;
}

extern int ledger_access_listen(void)
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
