/*
 * The ledger's request socket, served inside slurmctld by
 * node_features/k8s_resources (ledger_server.c).  gres_carry.c owns the
 * shares and how they are carried in Slurm's GRES records; the server owns
 * the journal lock and when to answer at all, ledger_access.c who may
 * connect, ledger_clients.c the connections.
 */
#ifndef PYK8SRES_LEDGER_SERVER_H
#define PYK8SRES_LEDGER_SERVER_H
#include <stdbool.h>

#include "pyk8sres_core.h"

struct pyk8sres_core;

/* What the plugin lends the server.  facts/share/node_name/stats go to
 * Python under slurmctld's job+node write locks (pyk8sres_core.h); remember
 * records a node's share without carrying it (a journal load: carry_all or
 * resync follows); resync puts shares back after Slurm rebuilt allocations
 * (write locks, or user_update's), resync_due says whether one is needed
 * (O(1)); carry_all carries every node's share (write locks);
 * give_capacity, where slurmctld does not (25.11+), gives every node its
 * capacity once in control and rebuilds allocations from the jobs (job and
 * node write locks, partition read lock), NULL elsewhere.
 * A read-only request (`show`) runs without slurmctld's locks on a copy:
 * copy_facts takes it (node lock held), copied_facts, copied_node_name
 * and copied_changes (which nodes' facts changed since a `show` token) read
 * it. */
struct ledger_plugin_ops {
	pyk8sres_facts_fn facts;
	pyk8sres_share_fn share;
	pyk8sres_share_fn remember;
	pyk8sres_node_name_fn node_name;
	pyk8sres_stats_fn stats;
	void (*resync)(void);
	bool (*resync_due)(void);
	void (*carry_all)(void);
	void (*give_capacity)(void);
	void (*copy_facts)(void);
	pyk8sres_facts_fn copied_facts;
	pyk8sres_node_name_fn copied_node_name;
	pyk8sres_changes_fn copied_changes;
	/* True once after a share was lowered (something freed for jobs). */
	bool (*take_freed)(void);
};

/* init(): read the journal (owning it if this process should), start the
 * thread.  SLURM_ERROR if the ledger cannot be trusted. */
extern int ledger_server_start(const struct pyk8sres_core *core,
			       const struct ledger_plugin_ops *ops);
/* After `scontrol reconfigure` re-read k8s_resources.conf: who may call. */
extern void ledger_server_reconfigure(void);
/* Under slurmctld's locks, before shares are carried after a rebuild: if
 * this process is in control but does not own the journal yet (a backup
 * that just took over), take it now and load it, so no job is placed on
 * what a pod was granted a moment ago.  True if this process owns it. */
extern bool ledger_server_claim(void);
/* Under slurmctld's node write lock, a node registering with its
 * k8scpu/k8smemory capacity `cnt`: held whole if new (HoldNewNodes=). */
extern void ledger_server_registered(const char *name, const uint64_t *cnt);
extern bool ledger_server_running(void);
extern void ledger_server_stop(void);
#endif
