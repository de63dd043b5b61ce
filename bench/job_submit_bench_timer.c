/*
 * job_submit/bench_timer: listed on both sides of the plugin under test
 * (JobSubmitPlugins=bench_timer,<plugin>,bench_timer), it records the time
 * between its two calls for each submission, i.e. the plugin's exact cost
 * inside slurmctld.  Calls are serialized by slurmctld's job_submit lock, so
 * a toggle is enough.  Each figure (ns) is appended to $BENCH_TIMER_FILE
 * after the second timestamp, outside the measured interval.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <slurm/slurm.h>
#include <slurm/slurm_errno.h>

const char plugin_name[] = "pyk8sres benchmark timer";
const char plugin_type[] = "job_submit/bench_timer";
const uint32_t plugin_version = SLURM_VERSION_NUMBER;

static int out_fd = -1;
static int started;
static struct timespec begin;

int init(void)
{
	const char *path = getenv("BENCH_TIMER_FILE");

	if (out_fd < 0 && path)
		out_fd = open(path, O_WRONLY | O_APPEND | O_CREAT, 0644);
	return SLURM_SUCCESS;
}

int fini(void)
{
	return SLURM_SUCCESS;
}

static void toggle(void)
{
	struct timespec now;
	char line[32];
	long long ns;
	int len;

	clock_gettime(CLOCK_MONOTONIC, &now);
	if (!started) {
		begin = now;
		started = 1;
		return;
	}
	started = 0;
	ns = (now.tv_sec - begin.tv_sec) * 1000000000LL + (now.tv_nsec - begin.tv_nsec);
	len = snprintf(line, sizeof(line), "%lld\n", ns);
	if (out_fd >= 0 && write(out_fd, line, len) < 0)
		return;
}

int job_submit(job_desc_msg_t *job_desc, uint32_t submit_uid, char **err_msg)
{
	toggle();
	return SLURM_SUCCESS;
}

int job_modify(job_desc_msg_t *job_desc, void *job_ptr, uint32_t submit_uid)
{
	return SLURM_SUCCESS;
}
