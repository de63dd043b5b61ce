"""Emit the C source of libpyk8sres_core.so (cffi embedding API).

Build-time only: `python _core_build.py pyk8sres_core.h pyk8sres_core.c OUT.c PYTHONHOME`.
meson compiles OUT.c into a shared library that links libpython; the Slurm
plugins dlopen it.  The entry points are declared once, in pyk8sres_core.h,
and implemented in pyk8sres/embed.py.
"""
import re
import sys

import cffi

# The plain C half of the library (PYTHONHOME, logging, the hot path) lives in
# plugins/pyk8sres_core.c; set_source() includes it ahead of cffi's code.

# Runs once, in the embedded interpreter, before the first entry point.
INIT_CODE = r"""
import os, sys
# pyk8sres_core.c starts Python isolated; if anything else started it, the
# daemon's PYTHONPATH/user site may have run code inside slurmctld: refuse
# (the plugin's ping then fails and it does not load).
if not sys.flags.isolated:
    raise RuntimeError("pyk8sres: the embedded interpreter is not isolated")
from _pyk8sres_core import ffi, lib
# .../site-packages/pyk8sres/_lib/libpyk8sres_core.so -> .../site-packages
_site = os.path.dirname(os.path.dirname(os.path.dirname(
    ffi.string(lib.pyk8sres_core_path()).decode())))
if _site and _site not in sys.path:
    sys.path.insert(0, _site)
import pyk8sres.slurmctld.embed
pyk8sres.slurmctld.embed.bind(ffi, lib)
"""


def embedding_declarations(header_text: str) -> str:
    match = re.search(r"/\* CFFI-BEGIN \*/(.*)/\* CFFI-END \*/", header_text, re.S)
    if not match:
        raise SystemExit("pyk8sres_core.h: CFFI-BEGIN/CFFI-END markers not found")
    return match.group(1)


def main(header: str, c_half: str, out_c: str, python_home: str) -> None:
    with open(header, encoding="utf-8") as f:
        declarations = embedding_declarations(f.read())
    with open(c_half, encoding="utf-8") as f:
        c_source = f.read()
    ffi = cffi.FFI()
    ffi.embedding_api(declarations)
    ffi.cdef("#define PYK8SRES_PING_SENTINEL 0x6b38\n"
             "const char *pyk8sres_core_path(void);\n"
             "void pyk8sres_log(int level, const char *msg);\n"
             "void pyk8sres_memo_clear(void);")
    source = f'#define PYK8SRES_PYTHONHOME "{python_home}"\n' + c_source
    ffi.set_source("_pyk8sres_core", source)
    ffi.embedding_init_code(INIT_CODE)
    ffi.emit_c_code(out_c)


if __name__ == "__main__":
    main(*sys.argv[1:5])
