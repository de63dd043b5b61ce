/*
 * The ledger's request socket, served inside slurmctld by
 * node_features/k8s_resources (ledger_server.c).  The plugin owns the shares
 * and how they are carried in Slurm's GRES records; the server owns the
 * socket and its callers.
 */
#ifndef PYK8SRES_LEDGER_SERVER_H
#define PYK8SRES_LEDGER_SERVER_H
#include <stdbool.h>

#include "pyk8sres_core.h"

struct pyk8sres_core;

/* What the plugin lends the server.  facts/share/node_name/stats go to
 * Python under slurmctld's job+node write locks (pyk8sres_core.h); remember
 * records a node's share without carrying it (a journal load); resync puts
 * shares back after Slurm rebuilt allocations (node lock held). */
struct ledger_plugin_ops {
	pyk8sres_facts_fn facts;
	pyk8sres_share_fn share;
	pyk8sres_share_fn remember;
	pyk8sres_node_name_fn node_name;
	pyk8sres_stats_fn stats;
	void (*resync)(void);
};

/* init(): load the journal and start the thread.  SLURM_ERROR if the ledger
 * cannot be trusted. */
extern int ledger_server_start(const struct pyk8sres_core *core,
			       const struct ledger_plugin_ops *ops);
extern bool ledger_server_running(void);
extern void ledger_server_stop(void);
#endif
