"""Emit the C source of libpyk8sres_core.so (cffi embedding API).

Build-time only: `python _core_build.py pyk8sres_core.h OUT.c PYTHONHOME`.
meson compiles OUT.c into a shared library that links libpython; the Slurm
plugins dlopen it.  The entry points are declared once, in pyk8sres_core.h,
and implemented in pyk8sres/embed.py.
"""
import re
import sys

import cffi

# Plain C compiled into the library (not exposed through cffi's embedding).
# Why PYTHONHOME: inside slurmctld, Python would guess its stdlib from the
# slurmctld binary's location (and may pick a different Python).  We pin
# the one we were built against, before cffi starts the interpreter.
C_SOURCE = r"""
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <Python.h>
#include "pyk8sres_core.h"

static char core_path[PATH_MAX];

__attribute__((constructor)) static void pyk8sres_core_preinit(void)
{
	static wchar_t *home;
	Dl_info info;

	if (dladdr((void *) pyk8sres_core_preinit, &info) && info.dli_fname)
		if (!realpath(info.dli_fname, core_path))
			core_path[0] = '\0';
	if (!Py_IsInitialized() && !getenv("PYTHONHOME") && !home) {
		home = Py_DecodeLocale(PYK8SRES_PYTHONHOME, NULL);
		if (home)
			Py_SetPythonHome(home);
	}
}

/* Python's log lines go to slurmctld's log when we run inside it. */
static void pyk8sres_log(int level, const char *msg)
{
	static const char *names[] = { "slurm_error", "slurm_info",
				       "slurm_verbose", "slurm_debug" };
	void (*fn)(const char *, ...);

	if (level < 0 || level > 3)
		level = 0;
	fn = (void (*)(const char *, ...)) dlsym(RTLD_DEFAULT, names[level]);
	if (fn)
		fn("%s", msg);
	else
		fprintf(stderr, "pyk8sres: %s\n", msg);
}

/* Absolute path of this library: Python finds the pyk8sres package from it. */
static const char *pyk8sres_core_path(void)
{
	return core_path;
}
"""

# Runs once, in the embedded interpreter, before the first entry point.
INIT_CODE = r"""
import os, sys
from _pyk8sres_core import ffi, lib
# .../site-packages/pyk8sres/_lib/libpyk8sres_core.so -> .../site-packages
_site = os.path.dirname(os.path.dirname(os.path.dirname(
    ffi.string(lib.pyk8sres_core_path()).decode())))
if _site and _site not in sys.path:
    sys.path.insert(0, _site)
import pyk8sres.embed
pyk8sres.embed.bind(ffi, lib)
"""


def embedding_declarations(header_text: str) -> str:
    match = re.search(r"/\* CFFI-BEGIN \*/(.*)/\* CFFI-END \*/", header_text, re.S)
    if not match:
        raise SystemExit("pyk8sres_core.h: CFFI-BEGIN/CFFI-END markers not found")
    return match.group(1)


def main(header: str, out_c: str, python_home: str) -> None:
    with open(header, encoding="utf-8") as f:
        declarations = embedding_declarations(f.read())
    ffi = cffi.FFI()
    ffi.embedding_api(declarations)
    ffi.cdef("#define PYK8SRES_PING_SENTINEL 0x6b38\n"
             "const char *pyk8sres_core_path(void);\n"
             "void pyk8sres_log(int level, const char *msg);")
    source = f'#define PYK8SRES_PYTHONHOME "{python_home}"\n' + C_SOURCE
    ffi.set_source("_pyk8sres_core", source)
    ffi.embedding_init_code(INIT_CODE)
    ffi.emit_c_code(out_c)


if __name__ == "__main__":
    main(*sys.argv[1:4])
