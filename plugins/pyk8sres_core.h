/*
 * The C ABI of the embedded Python core (libpyk8sres_core.so, built by cffi).
 *
 * This file is the single contract between the Slurm plugins and Python:
 * pyk8sres/slurmctld/_core_build.py feeds the text between the CFFI markers to
 * ffi.embedding_api(), and pyk8sres/slurmctld/embed.py implements every function.
 * Keep it flat: fixed-size integers, NUL-terminated strings, caller-owned
 * output buffers (Slurm memory must come from xmalloc, Python's from Python).
 * Every function returns 0 on success; non-zero with a message in `err`.
 */
#ifndef PYK8SRES_CORE_H
#define PYK8SRES_CORE_H
#include <stddef.h>
#include <stdint.h>

#define PYK8SRES_PING_SENTINEL 0x6b38 /* "k8": proves Python really ran */
#define PYK8SRES_OUT_LEN 1024
#define PYK8SRES_USER_ERROR 1     /* bad job options: tell the user */
#define PYK8SRES_INTERNAL_ERROR 2 /* a bug: OnInternalError decides */

#define PYK8SRES_GPU_WORDS 16	/* gpu indices 0..1023 (policy.ledger.MAX_GPUS) */
#define PYK8SRES_FACTS_WORDS (6 + PYK8SRES_GPU_WORDS)
#define PYK8SRES_GPU_OK 0
#define PYK8SRES_GPU_NO_FILES 1	/* its gpu GRES has no bitmap: no File= */
#define PYK8SRES_GPU_TOO_MANY 2	/* more indices than the masks hold */
#define PYK8SRES_GPU_SHARED 3	/* shard or MPS GRES split its GPUs */
#define PYK8SRES_GPU_NO_CONSUME 4	/* Slurm does not track its allocations */
/* CFFI-BEGIN */
/* A job as the job_submit plugin sees it: Slurm's NO_VAL/NO_VAL16/NO_VAL64
 * for unset numbers, NULL for unset strings. */
struct pyk8sres_job {
	uint32_t slurm_version;    /* SLURM_VERSION_NUMBER the plugin was built for */
	uint32_t is_modify;        /* 1 from job_modify(): only changed fields set */
	uint32_t uid;
	uint16_t cpus_per_task;
	uint32_t num_tasks;
	uint16_t ntasks_per_node;
	uint32_t min_cpus;
	uint32_t max_cpus;
	uint32_t min_nodes;
	uint32_t max_nodes;
	uint16_t pn_min_cpus;
	uint64_t pn_min_memory;    /* MB per node, or per CPU with MEM_PER_CPU bit */
	uint64_t bitflags;
	uint16_t shared;           /* 0 = --exclusive */
	uint16_t contiguous;
	uint32_t het_job_offset;   /* NO_VAL if not a heterogeneous component */
	uint64_t def_mem_per_cpu;  /* slurm.conf DefMemPerCPU/DefMemPerNode */
	const char *partition;
	const char *tres_per_node;
	const char *tres_per_task;
	const char *tres_per_job;
	const char *tres_per_socket;
	const char *cpus_per_tres;
	const char *mem_per_tres;
	const char *array_inx;
	const char *script_name;   /* unused by policy: kept for messages */
	/* job_modify only: the job as it stands, when the plugin was built
	 * with the Slurm source (has_current = 1); NO_VAL/NULL otherwise. */
	uint32_t has_current;
	uint32_t cur_num_tasks;
	uint16_t cur_cpus_per_task;
	uint32_t cur_min_cpus;
	uint32_t cur_min_nodes;
	uint32_t cur_max_nodes;
	uint32_t cur_pn_min_cpus;
	uint64_t cur_pn_min_memory;
	uint16_t cur_ntasks_per_node;
	uint16_t cur_whole_node;
	const char *cur_tres_per_node;
	const char *cur_tres_per_task;
	const char *cur_tres_per_job;
	const char *cur_tres_per_socket;
	const char *cur_cpus_per_tres;
	const char *cur_mem_per_tres;
	const char *cur_partition;
	/* Added for SMT, -O and partition limits (appended: the order above is
	 * what older builds used). */
	uint16_t ntasks_per_core;  /* NO_VAL16/INFINITE16 = not given */
	uint16_t threads_per_core; /* NO_VAL16 = not given */
	uint16_t overcommit;       /* 1 = -O/--overcommit; 0 or NO_VAL8 = not */
	uint16_t select_type_param; /* slurm.conf SelectTypeParameters (CR_* bits) */
	uint64_t max_mem_per_cpu;  /* slurm.conf MaxMemPerCPU (MEM_PER_CPU bit) / MaxMemPerNode */
	/* slurmctld's live memory settings of the job's partitions (the default
	 * partition if none given), "name=DefMem:MaxMem:DefCpuPerGPU:DefMemPerGPU,..."
	 * in Slurm's encoding, NO_VAL64 for an unset GPU default (`scontrol
	 * update PartitionName=` takes effect at once); NULL when built without
	 * the Slurm source (slurm.conf is read instead). */
	const char *part_mem;
	uint16_t cur_ntasks_per_core;
	uint16_t cur_threads_per_core;
	uint16_t cur_overcommit;
	uint16_t spread_job;       /* 1 = --spread-job (bitflags SPREAD_JOB); 0 = not */
	uint16_t cur_spread_job;
	uint32_t task_dist;        /* --distribution (task_dist_states_t); NO_VAL = not given */
	uint32_t cur_task_dist;
	uint16_t ntasks_per_tres;  /* --ntasks-per-gpu; NO_VAL16 = not given */
	uint16_t cur_ntasks_per_tres;
};

/* Returns PYK8SRES_PING_SENTINEL once Python is up and the core imported. */
int pyk8sres_ping(char *err, size_t errlen);

/* Completion policy, in Python; called through pyk8sres_job_submit below.
 * On return 0, `changed` bit 1/2 says to replace the job's tres_per_node /
 * tres_per_task with the output (empty string = clear the field); bit 4
 * (job_modify only) says to clear tres_per_job.
 * Non-zero: reject with `err`. */
int pyk8sres_job_submit_py(const struct pyk8sres_job *job,
			int *changed,
			char *tres_per_node_out, size_t tres_per_node_len,
			char *tres_per_task_out, size_t tres_per_task_len,
			char *err, size_t errlen);

/* job_submit: the partitions and nodes slurmctld has now (read under its
 * locks; runtime partition updates and dynamic nodes included), as lines
 * "N <index> <cpus: effective, less the specialized ones> <memory MB: RealMemory
 * - MemSpecLimit> <threads_per_core>
 * <cores_per_socket> <gpus>", "P <partition> <index> ..." and "D <default partition>".
 * Python rebuilds its view of the partitions' nodes from it and empties the
 * job_submit memo.  It stays in force across a reload of slurm.conf until
 * the next description. */
int pyk8sres_topology(const char *description, char *err, size_t errlen);

/* Reload configuration (slurm.conf dir) after init/reconfigure.
 * `accept_on_error` gets 1 when OnInternalError=accept. */
int pyk8sres_reconfigure(const char *slurm_conf_path, int *accept_on_error,
			 char *err, size_t errlen);

/* node_features: the k8scpu/k8smemory counts a node should carry when it
 * registers, from what Slurm schedules there: its CPUs and the effective
 * ones (less CoreSpecCount/CpuSpecList), RealMemory and MemSpecLimit. */
int pyk8sres_node_capacity(const char *node_name, uint32_t cpus,
			   uint32_t cpus_effective, uint64_t real_memory_mb,
			   uint64_t mem_spec_limit_mb,
			   uint64_t *k8scpu, uint64_t *k8smemory,
			   char *err, size_t errlen);
/* The ledger (node_features/k8s_resources serves it inside slurmctld;
 * policy in pyk8sres/slurmctld/ledger.py).  Callbacks from Python into the
 * plugin, valid only while the plugin holds slurmctld's job+node write locks:
 * facts (PYK8SRES_FACTS_WORDS): k8scpu total, k8smemory total, what jobs
 * hold of each, the node's gpu GRES count (0: none), why its GPUs cannot
 * be reserved (PYK8SRES_GPU_OK, _NO_FILES, _TOO_MANY), then a bitmask of
 * PYK8SRES_GPU_WORDS words of the gpu indices jobs hold (bit i of word
 * i / 64); -1 if the node is unknown or has no k8s GRES yet.  share: the
 * node's new Kubernetes share, in CPUs and MB, and the bitmask of the gpu
 * indices it holds (PYK8SRES_GPU_WORDS words).  pyk8sres/slurmctld/embed.py
 * has the same sizes. */
typedef int (*pyk8sres_facts_fn)(const char *node, uint64_t *facts);
typedef void (*pyk8sres_share_fn)(const char *node, uint64_t cpu, uint64_t mem,
				  const uint64_t *gpus);
/* The name of node `index` in slurmctld's table, "" for an empty slot, NULL
 * past the end (a `show` of every node). */
typedef const char *(*pyk8sres_node_name_fn)(int index);
/* The plugin's counters: scheduling-attempt checks, ns spent in them,
 * rebuilds of allocations seen (for `show` and bench/bench_ledger.py). */
typedef void (*pyk8sres_stats_fn)(uint64_t *stats3);
/* A `show` since a token: the indices (for node_name) of the nodes whose
 * facts changed after generation `since` of node-table layout `layout`, at
 * most `max`; -1 if that cannot be said (the table changed, or too many).
 * now2 gets the current layout and generation. */
typedef int (*pyk8sres_changes_fn)(uint64_t layout, uint64_t since,
				   uint64_t *now2, int *indices, int max);

/* (Re)load the journal under `state_dir`: every node whose share is new or
 * changed since the last load goes to `share` (0, 0 for one that left).
 * `owner` = 1 only while this process holds the journal's lock: the journal
 * is then compacted and appended to; 0 reads it and nothing else.
 * `allowed_uids` (n_allowed) may call the ledger besides LedgerUsers.
 * On failure the reason goes to `err`. */
int pyk8sres_ledger_open(const char *state_dir, const uint32_t *allowed_uids,
			 size_t n_allowed, int owner, pyk8sres_share_fn share,
			 char *err, size_t errlen);
/* Who may call and where (k8s_resources.conf as last read): LedgerUsers=
 * into `uids` (at most max_uids; *n_uids of them), LedgerGroup= into
 * *group (-1: none), LedgerConnectionsPerUser= into *conn_per_uid,
 * LedgerSocket= into `socket_path` ("" = the default).
 * On failure the reason goes to `socket_path`. */
int pyk8sres_ledger_settings(uint32_t *uids, size_t max_uids, size_t *n_uids,
			     int64_t *group, uint32_t *conn_per_uid,
			     char *socket_path, size_t pathlen);
/* Outside slurmctld's locks: authorize, parse, journal (fsync) if it changes
 * anything.  Returns 0 with *ticket > 0 to go on to ..._apply (*read_only:
 * a `show`, which needs no slurmctld lock while it runs), or 0 with
 * *ticket == 0 and the reply line in `reply`. */
int pyk8sres_ledger_prepare(uint32_t uid, const char *line, int *ticket,
			    int *read_only, char *reply, size_t replylen);
/* Under slurmctld's job+node write locks (a read-only request: on a copy
 * of the facts, without locks; `share` is then never called): decide and
 * apply; the reply line goes to `reply`. */
int pyk8sres_ledger_apply(int ticket, pyk8sres_facts_fn facts,
			  pyk8sres_share_fn share, pyk8sres_node_name_fn node_name,
			  pyk8sres_stats_fn stats, pyk8sres_changes_fn changes,
			  char *reply, size_t replylen);
/* Once this process is in control with the journal loaded (under slurmctld's
 * node lock): the nodes it has now, by index (node_name), are not new. */
int pyk8sres_ledger_meet(pyk8sres_node_name_fn node_name, char *err, size_t errlen);
/* Under slurmctld's node write lock, a node registering with its
 * k8scpu/k8smemory capacity: a node not met before is held whole
 * (HoldNewNodes= in k8s_resources.conf), journaled, then handed to `share`;
 * one still held is re-sized. */
int pyk8sres_ledger_registered(const char *node, uint64_t k8scpu, uint64_t k8smemory,
			       pyk8sres_share_fn share, char *err, size_t errlen);
/* CFFI-END */

/* Plain C in the core library: same contract as pyk8sres_job_submit_py,
 * minus the per-thread cost of a cffi entry point (see pyk8sres_core.c). */
int pyk8sres_job_submit(const struct pyk8sres_job *job,
			int *changed,
			char *tres_per_node_out, size_t tres_per_node_len,
			char *tres_per_task_out, size_t tres_per_task_len,
			char *err, size_t errlen);

#endif
