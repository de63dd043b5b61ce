"""Compile the job_submit path (submit.py, completion.py and what it imports) with mypyc.

Build-time only: `python _policy_build.py OUTDIR SRCROOT` (meson.build runs
it when -Dcompile_policy allows and mypyc is installed).  It writes
<module><EXT_SUFFIX> for each and pyk8sres_policy__mypyc<EXT_SUFFIX> (their
shared runtime) into OUTDIR.  They are installed next to
the .py files, which stay the source: Python imports an extension module
ahead of a .py of the same name.

Why: a submission of a shape the plugin's C memo has not seen runs the
policy with the CPU caches cold (slurmctld's own work evicts them between
submissions); compiled, with no interpreted code left on that path, it
costs less than job_submit/lua doing the same work, where interpreted it
cost more (docs/performance.md).  Same source, same table tests.
"""
import os
import shutil
import sys
import sysconfig
import tempfile

MODULES = ("completion", "gres", "jobspec", "nodefigures", "plans", "submit")
GROUP = "pyk8sres_policy"  # the shared runtime's module: pyk8sres_policy__mypyc


def main(out_dir: str, src_root: str) -> None:
    from mypyc.build import mypycify
    from setuptools import Distribution

    out_dir = os.path.abspath(out_dir)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    with tempfile.TemporaryDirectory(prefix="pyk8sres-mypyc-") as work:
        # A copy of just what the modules import, so mypy reads nothing else
        # and writes its cache outside the source tree.
        package = os.path.join(work, "pyk8sres", "slurmctld")
        os.makedirs(package)
        shutil.copy(os.path.join(src_root, "pyk8sres", "__init__.py"), os.path.dirname(package))
        for name in ("__init__",) + MODULES:
            shutil.copy(os.path.join(src_root, "pyk8sres", "slurmctld", name + ".py"), package)
        paths = [f"pyk8sres/slurmctld/{name}.py" for name in MODULES]
        cwd = os.getcwd()
        os.chdir(work)
        try:
            extensions = mypycify(["--follow-imports=silent", *paths],
                                  separate=[(paths, GROUP)], target_dir="build")
            dist = Distribution({"ext_modules": extensions, "script_name": "_policy_build.py"})
            build = dist.get_command_obj("build_ext")
            build.build_lib = os.path.join(work, "lib")
            dist.run_command("build_ext")
        finally:
            os.chdir(cwd)
        built = [os.path.join("pyk8sres", "slurmctld", name + suffix) for name in MODULES]
        for path in built + [GROUP + "__mypyc" + suffix]:
            shutil.copy(os.path.join(work, "lib", path), out_dir)


if __name__ == "__main__":
    main(*sys.argv[1:3])
