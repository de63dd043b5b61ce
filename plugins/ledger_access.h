/*
 * Who may use the ledger's socket (ledger_access.c), for the ledger server:
 * root, SlurmUser and LedgerUsers=, at most LedgerConnectionsPerUser=
 * connections each, and the socket file's group and mode (LedgerGroup=).
 * The settings come from k8s_resources.conf through the core; a
 * reconfigure re-reads them while the server's thread runs.
 */
#ifndef PYK8SRES_LEDGER_ACCESS_H
#define PYK8SRES_LEDGER_ACCESS_H
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

struct pyk8sres_core;

/* At start: read the settings (root and SlurmUser only if they cannot be
 * read).  base_uids: root and SlurmUser, always allowed; state_dir holds
 * the socket unless LedgerSocket= says where. */
extern void ledger_access_start(const struct pyk8sres_core *core,
				const char *state_dir, const uint32_t *base_uids);
/* After a reconfigure: read them again (keeping the previous ones if they
 * cannot be read).  LedgerSocket= is not moved until the next start. */
extern void ledger_access_reread(void);

extern bool ledger_access_allowed(uid_t uid);
extern int ledger_access_per_uid(void);
extern const char *ledger_access_socket_path(void);

/* True once after the settings changed: the caller re-checks the clients it
 * holds.  If listening, the socket's mode follows the new LedgerGroup=
 * first. */
extern bool ledger_access_take_change(bool listening);

/* Bind and listen on the socket, in the mode its settings give, replacing
 * a dead owner's socket file: the caller owns the journal's lock.  The
 * listening fd (non-blocking), or -1 (logged). */
extern int ledger_access_listen(void);
#endif
