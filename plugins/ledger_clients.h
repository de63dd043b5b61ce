/*
 * The ledger socket's connections (ledger_clients.c), for the ledger
 * server's thread: accepting callers ledger_access.c lets in, reading
 * request lines, sending replies, and dropping whoever stalls the others.
 * Only the server's thread calls these.
 */
#ifndef PYK8SRES_LEDGER_CLIENTS_H
#define PYK8SRES_LEDGER_CLIENTS_H
#include <stdbool.h>
#include <sys/types.h>
#include <time.h>

#define LEDGER_REPLY_NOT_READY "{\"ok\":false,\"code\":\"notready\",\"error\":\"slurmctld has " \
	"not recovered its node and job state yet (starting, or taking over as " \
	"backup): retry shortly\"}\n"

/* Milliseconds since t on the monotonic clock. */
static inline long ledger_ms_since(const struct timespec *t)
{
	struct timespec now;

	clock_gettime(CLOCK_MONOTONIC, &now);
	return (now.tv_sec - t->tv_sec) * 1000 +
	       (now.tv_nsec - t->tv_nsec) / 1000000;
}

/* What the server decides: ready says whether requests may be answered
 * now (else LEDGER_REPLY_NOT_READY); answer decides one request line
 * (newline cut, no NUL inside) of a caller uid and returns its reply line,
 * valid until the next call. */
extern void ledger_clients_start(bool (*ready)(void),
				 const char *(*answer)(uid_t uid, const char *line));

/* One round: wait up to wait_ms (not at all if a request is already
 * buffered) on listen_fd (-1: not listening) and every client, then
 * every client's events and one request each, then new connections.
 * False if poll failed (logged). */
extern bool ledger_clients_round(int listen_fd, int wait_ms);

/* Close every connection, first sending `line` (if any) to each one that
 * is not in the middle of a reply. */
extern void ledger_clients_drop_all(const char *line);
/* The thread ends: every connection closed, the poll set freed. */
extern void ledger_clients_stop(void);
#endif
