"""Pure policy shared by both sides (slurmctld and the coordinator).

Standard library only, no I/O: anything here may be imported inside
slurmctld.
"""
